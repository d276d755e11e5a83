"""The benchmark's inputs (inference/bench/run.py): the heads directories, loaded once each, their common target, and
the prompts encoded with the target's chat template."""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from transformers import PreTrainedModel

from headstart.heads.chat import prompt_ids
from headstart.heads.directory import CONFIG_NAME, HeadsLoadError, resolve_heads_dir
from headstart.heads.load import load_heads
from headstart.heads.prompt_rows import PromptRow, pick_per_category
from headstart.heads.prompts import PromptSourceError, load_prompts
from headstart.inference.decode import SpeculatorError, check_context

RESERVED_NAMES = ("vanilla", "prompt_lookup")


class BenchError(ValueError):
    """Bad benchmark input; the message names the problem and the fix."""


@dataclass
class HeadsEntry:
    path: Path  # the heads directory (config.json inside)
    label: str  # short unique name used in tables and the plot
    heads: torch.nn.Module  # the loaded heads: Medusa, EAGLE or DFlash (headstart.heads.load), on the CPU in float32

    @property
    def target(self) -> dict:
        """config.json's "target": name, fingerprint, dims."""
        return dict(self.heads.config.target or {})

    @property
    def adapter(self) -> bool:
        """Medusa-2: the heads need the target with their LoRA adapter merged."""
        return getattr(self.heads.config, "adapter", False)


@dataclass
class Prompt:
    row: PromptRow  # the prompt source's row (id, category, turns, system)
    ids: list[int]  # its first user turn (with the row's system message) through the target's chat template


def _expand(patterns: Sequence[str]) -> list[str]:
    found: list[str] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        for m in matches:
            if m not in found:
                found.append(m)
    return found


def _unique_labels(paths: Sequence[Path]) -> list[str]:
    """Shortest path suffixes that tell the directories apart (runs/a/heads, runs/b/heads -> a/heads, b/heads)."""
    parts = [p.resolve().parts for p in paths]
    for n in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-n:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]


def find_heads(patterns: Sequence[str]) -> list[HeadsEntry]:
    """Resolve --heads arguments (dirs, globs, a training output_dir holding heads/, Hub ids) and load each
    directory through headstart.heads.load (strict: a broken directory fails here, before the target loads)."""
    names = _expand(patterns)
    if not names:
        raise BenchError(f"no heads directories found for --heads {' '.join(patterns)}: the pattern(s) matched "
                         "nothing. Pass the heads directory written by train/medusa.py (OUTPUT_DIR/heads)")
    dirs: list[Path] = []
    loaded: list[torch.nn.Module] = []
    for name in names:
        path = Path(name).expanduser()
        if path.is_dir() and not (path / CONFIG_NAME).is_file() and (path / "heads" / CONFIG_NAME).is_file():
            path = path / "heads"  # the output_dir of train/medusa.py or train/eagle.py
        try:
            path = resolve_heads_dir(path if path.is_dir() else name)
            if path.resolve() not in [d.resolve() for d in dirs]:
                loaded.append(load_heads(path))
                dirs.append(path)
        except HeadsLoadError as err:
            raise BenchError(str(err)) from err
    entries = []
    for path, label, heads in zip(dirs, _unique_labels(dirs), loaded):
        label = f"heads:{label}" if label in RESERVED_NAMES else label
        entries.append(HeadsEntry(path=path, label=label, heads=heads))
    return entries


def common_target(entries: Sequence[HeadsEntry], target_override: str | None) -> str:
    """The one target all heads were trained on (name to load); raise when they disagree."""
    keyed: dict[str, list[str]] = {}
    for e in entries:
        key = e.target.get("fingerprint") or f"name:{e.target.get('name')}"
        keyed.setdefault(key, []).append(f"{e.path} (target {e.target.get('name')!r})")
    if len(keyed) > 1:
        listing = "; ".join(f"fingerprint {k}: {', '.join(v)}" for k, v in keyed.items())
        raise BenchError(f"the heads directories were trained for different targets ({listing}). A benchmark "
                         "compares heads on one target: run it once per target")
    if any(e.adapter for e in entries) and len(entries) > 1:
        raise BenchError("Medusa-2 heads (with adapter/) each need their own adapter-merged target: benchmark "
                         f"them one directory at a time ({', '.join(str(e.path) for e in entries if e.adapter)})")
    name = target_override or entries[0].target.get("name")
    if not name:
        raise BenchError(f"{entries[0].path}/config.json names no target: pass --target NAME_OR_PATH")
    return name


def read_prompt_rows(spec: str, num_prompts: int, per_category: int | None = None) -> list[PromptRow]:
    """The first `num_prompts` usable rows of the prompt source `spec` (heads/prompts.py), or with per_category the
    first that many of each category (task family)."""
    try:
        source = load_prompts(spec, limit=None if per_category else num_prompts)
    except PromptSourceError as err:
        raise BenchError(str(err)) from err
    if not source.rows:
        raise BenchError(f"prompt source {spec!r} gave no usable rows (skipped: {dict(source.skipped)})")
    return pick_per_category(source.rows, per_category) if per_category else source.rows


def encode_prompts(rows: Sequence[PromptRow], tokenizer, model: PreTrainedModel,
                   max_new_tokens: int) -> tuple[list[Prompt], list[dict]]:
    """Each row's first user turn through the chat template -> (prompts that fit the target's context with
    max_new_tokens more, [{"id", "reason"}] for the rows skipped)."""
    prompts, skipped = [], []
    for row in rows:
        ids = prompt_ids(tokenizer, row.turns[0], row.system)
        try:
            check_context(model, len(ids), max_new_tokens)
        except SpeculatorError as err:
            skipped.append({"id": row.id, "reason": str(err)})
            continue
        prompts.append(Prompt(row=row, ids=ids))
    if not prompts:
        raise BenchError(f"every prompt was skipped: {skipped[0]['reason']}")
    return prompts, skipped
