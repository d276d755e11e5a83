"""Prompt sources: one spec string each, yielding conversations as lists of user turns.

Specs:
  mix[:train|:heldout]        the broad default: chat, passages, translation, math and code (MIX below)
  chitchat[:train|:heldout]   embedded human conversations (`chitchat-dataset`), fixed split
  pycode[:train|:heldout]     functions from the Python standard library on this machine:
                              signature + docstring -> "complete this function"
  passages / translate / math [:train|:heldout]
                              task families built from text on this machine (heads/prompt_families.py)
  writing                     the family left out of every training mix (evaluation only)
  hf:NAME[:SPLIT]             a Hugging Face dataset (through `datasets`; needs the network or its cache)
  PATH.json / PATH.jsonl      a local file
  A+B[+C...]                  several sources mixed, rows taken in turn (A1, B1, A2, B2, ...)
  A*2+B                       weighted: two rows of A for each row of B

Row schemas understood (hf and local files): ShareGPT `conversations: [{from, value}]`,
OpenAI-style `messages: [{role, content}]`, Alpaca `instruction` (+ `input`), plain `prompt`, and
Spec-Bench `{"question_id", "category", "turns": [...]}`. A malformed row is skipped and counted by
reason, never fatal.
"""

from __future__ import annotations

import ast
import collections
import functools
import gzip
import hashlib
import json
import sysconfig
from pathlib import Path

from headstart.heads.prompt_families import EVAL_ONLY, FAMILIES, chitchat_conversations
from headstart.heads.prompt_rows import PromptRow, PromptSource, PromptSourceError, is_heldout, prompt_key

# the broad default mix (`mix:train`, `mix:heldout`): every task family but `writing`, which stays out of training;
# chat and passages weigh double (multi-turn chat, summaries, questions over passages and long contexts)
MIX = ("chitchat:{split}*2", "passages:{split}*2", "translate:{split}", "math:{split}", "pycode:{split}")


def _split(rows: list[PromptRow], split: str, spec: str) -> list[PromptRow]:
    """The rows of one split, by prompt text, each text once (the first row that has it)."""
    if split not in ("", "all", "train", "heldout"):
        raise PromptSourceError(f"unknown split {split!r} in prompt source {spec!r}; use train, heldout or all")
    kept, seen = [], set()
    for row in rows:
        key = prompt_key(row.turns)
        if key in seen or (split in ("train", "heldout") and is_heldout(key) != (split == "heldout")):
            continue
        seen.add(key)
        kept.append(row)
    return kept


def parse_row(row: object, index: int) -> tuple[PromptRow | None, str]:
    """One row in any understood schema -> (PromptRow, "") or (None, reason it was skipped)."""
    if not isinstance(row, dict):
        return None, "not_an_object"
    row_id = str(row.get("question_id", row.get("id", index)))
    category = str(row.get("category", ""))
    system = None
    if "turns" in row:
        turns = row["turns"]
    elif "conversations" in row or "messages" in row:
        messages = row.get("conversations", row.get("messages"))
        if not isinstance(messages, list):
            return None, "messages_not_a_list"
        turns = []
        for message in messages:
            if not isinstance(message, dict):
                return None, "message_not_an_object"
            role = message.get("from", message.get("role"))
            content = message.get("value", message.get("content"))
            if role in ("human", "user"):
                turns.append(content)
            elif role == "system" and isinstance(content, str):
                system = content
    elif "instruction" in row:
        extra = row.get("input") or ""
        turns = [row["instruction"] + (f"\n\n{extra}" if isinstance(extra, str) and extra else "")] \
            if isinstance(row["instruction"], str) else [None]
    elif "prompt" in row:
        turns = [row["prompt"]]
    else:
        return None, "no_known_fields"
    if not isinstance(turns, list) or not turns:
        return None, "no_user_turns"
    if not all(isinstance(t, str) and t.strip() for t in turns):
        return None, "empty_or_non_text_turn"
    return PromptRow(id=row_id, turns=list(turns), category=category, system=system), ""


def _parse_rows(raw_rows, spec: str) -> PromptSource:
    source = PromptSource(spec=spec, rows=[])
    for index, raw in enumerate(raw_rows):
        row, reason = parse_row(raw, index)
        if row is None:
            source.skipped[reason] += 1
        else:
            source.rows.append(row)
    return source


def _read_local(path: Path, spec: str) -> PromptSource:
    if not path.is_file():
        raise PromptSourceError(f"prompt file {path} does not exist")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as err:
        raise PromptSourceError(f"prompt file {path} is not UTF-8 text (byte {err.start}: {err.reason}): save it as "
                                "UTF-8, e.g. `iconv -f latin1 -t utf-8`") from err
    except (OSError, EOFError) as err:  # a cut or non-gzip .gz
        raise PromptSourceError(f"prompt file {path} cannot be read ({err})") from err
    if ".jsonl" in path.suffixes:
        raw_rows, bad = [], 0
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                raw_rows.append(json.loads(line))
            except json.JSONDecodeError:
                bad += 1
        source = _parse_rows(raw_rows, spec)
        if bad:
            source.skipped["invalid_json_line"] += bad
        return source
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise PromptSourceError(f"{path} is not valid JSON ({err}); for one JSON object per line name it .jsonl") from err
    if isinstance(data, dict):
        data = list(data.values())
    if not isinstance(data, list):
        raise PromptSourceError(f"{path} must hold a JSON list of rows (or an object of rows)")
    return _parse_rows(data, spec)


def _chitchat(split: str, spec: str) -> PromptSource:
    """Chitchat conversations: the first speaker's message groups are the user turns."""
    source = PromptSource(spec=spec, rows=[])
    for conv_id, groups in chitchat_conversations():
        turns = [t for t in groups[0::2] if t]
        if not turns:
            source.skipped["no_user_turns"] += 1
            continue
        source.rows.append(PromptRow(id=conv_id, turns=turns, category="chitchat"))
    source.rows = _split(source.rows, split, spec)
    return source


def _pycode(split: str, spec: str) -> PromptSource:
    """'Complete this function' prompts from documented functions in the standard library's source."""
    return PromptSource(spec=spec, rows=_split(list(_stdlib_function_rows()), split, spec))


@functools.lru_cache(maxsize=1)
def _stdlib_function_rows() -> tuple[PromptRow, ...]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    rows = []
    for file in sorted(stdlib.glob("*.py")):  # top-level modules only: stable, a few thousand functions
        try:
            tree = ast.parse(file.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < 40 or len(doc) > 800:
                continue
            signature = f"def {node.name}({ast.unparse(node.args)}):"
            body = "\n".join("    " + line if line else "" for line in doc.splitlines())
            prompt = f'Complete this Python function:\n```python\n{signature}\n    """{body.lstrip()}\n    """\n```'
            rows.append(PromptRow(id=f"pycode-{file.stem}.{node.name}-{node.lineno}", turns=[prompt], category="code"))
    rows.sort(key=lambda r: hashlib.sha1(r.id.encode()).hexdigest())  # spread the first N rows over many modules
    return tuple(rows)


def _huggingface(name: str, split: str, spec: str) -> PromptSource:
    import datasets

    try:
        dataset = datasets.load_dataset(name, split=split or "train")
    except Exception as err:  # datasets raises many types: missing, offline, bad split
        raise PromptSourceError(
            f"could not load Hugging Face dataset {name!r} (split {split or 'train'!r}): "
            f"{err.__class__.__name__}: {str(err).splitlines()[0][:300]}. Check the name and split; without "
            "network, export it to a local .jsonl file elsewhere and pass that path, or use an embedded "
            "source: mix, chitchat, pycode, passages, translate, math, writing"
        ) from err
    return _parse_rows(dataset, spec)


def _mix(sources: list[tuple[PromptSource, int]], spec: str, limit: int | None) -> PromptSource:
    """Rows of several (source, weight) taken in turn, `weight` rows of a source per round, until `limit` rows
    (or all sources run out)."""
    rows: list[PromptRow] = []
    skipped: collections.Counter = collections.Counter()
    cursors = [0] * len(sources)
    for source, _ in sources:
        skipped.update(source.skipped)
    while any(cursors[i] < len(s.rows) for i, (s, _) in enumerate(sources)) and (limit is None or len(rows) < limit):
        for i, (source, weight) in enumerate(sources):
            take = source.rows[cursors[i]: cursors[i] + weight]
            cursors[i] += weight
            rows.extend(take[: None if limit is None else max(0, limit - len(rows))])
    return PromptSource(spec=spec, rows=rows, skipped=skipped)


def _weighted(part: str) -> tuple[str, int]:
    """'SPEC*W' -> (SPEC, W); a plain SPEC has weight 1."""
    name, star, weight = part.rpartition("*")
    if not star:
        return part, 1
    if not weight.isdigit() or int(weight) < 1:
        raise PromptSourceError(f"weight {weight!r} in prompt source {part!r} must be a whole number >= 1 (SPEC*W)")
    return name, int(weight)


def load_prompts(spec: str, limit: int | None = None) -> PromptSource:
    """Read a prompt source by its spec string (see module docstring); keep the first `limit` rows."""
    if "+" in spec and not Path(spec).expanduser().exists():
        parts = [_weighted(part) for part in spec.split("+")]
        return _mix([(load_prompts(part), weight) for part, weight in parts], spec, limit)
    if "*" in spec and not Path(spec).expanduser().exists():
        return _mix([(load_prompts(_weighted(spec)[0]), 1)], spec, limit)
    name, _, split = spec.partition(":")
    if name == "mix":
        if split not in ("train", "heldout"):
            raise PromptSourceError(f"use mix:train or mix:heldout, not {spec!r}")
        return load_prompts("+".join(part.format(split=split) for part in MIX), limit)
    if name == "chitchat":
        source = _chitchat(split, spec)
    elif name == "pycode":
        source = _pycode(split, spec)
    elif name in FAMILIES:
        if name in EVAL_ONLY and split not in ("", "all", "heldout"):
            raise PromptSourceError(f"{name} is the family left out of training: use `{name}` to evaluate, never to train")
        if split not in ("", "all", "train", "heldout"):
            raise PromptSourceError(f"unknown split {split!r} in prompt source {spec!r}; use train, heldout or all")
        source = PromptSource(spec=spec, rows=FAMILIES[name](split))
    elif name == "hf":
        hf_name, _, hf_split = split.partition(":")
        if not hf_name:
            raise PromptSourceError("hf source needs a dataset name: hf:NAME[:SPLIT]")
        source = _huggingface(hf_name, hf_split, spec)
    elif spec.endswith((".json", ".jsonl", ".json.gz", ".jsonl.gz")):
        source = _read_local(Path(spec).expanduser(), spec)
    else:
        raise PromptSourceError(
            f"unknown prompt source {spec!r}: use mix:train|heldout, chitchat[:train|:heldout], pycode[:train|:heldout], "
            "passages / translate / math [:train|:heldout], writing, hf:NAME[:SPLIT], or a path ending in "
            ".json/.jsonl; join sources with + and weight them with *W"
        )
    if limit is not None:
        source.rows = source.rows[:limit]
    return source
