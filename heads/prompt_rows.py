"""What every prompt source is made of: rows of user turns, the held-out split by prompt text, package files."""

from __future__ import annotations

import collections
import hashlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

HELDOUT_EVERY = 20  # a prompt is held out when hash(prompt_key) % 20 == 0 (about 5%)


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


def prompt_key(turns: list[str]) -> str:
    """What a prompt is split and deduplicated by: its user turns with white space and case folded, so the same text
    under two ids (a greeting many conversations open with, a function two modules define) lands on one side."""
    return " ".join("\n".join(turns).split()).lower()


def is_heldout(key: str) -> bool:
    return int(hashlib.sha1(key.encode()).hexdigest(), 16) % HELDOUT_EVERY == 0


def package_file(package: str, relative: str, install: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise PromptSourceError(f"prompt source needs the `{install}` package: pip install {install}")
    return Path(list(spec.submodule_search_locations)[0]) / relative


def pick_per_category(rows: list[PromptRow], per_category: int) -> list[PromptRow]:
    """The first `per_category` rows of each category (task family), in the source's order."""
    taken: collections.Counter = collections.Counter()
    picked = []
    for row in rows:
        if taken[row.category] < per_category:
            taken[row.category] += 1
            picked.append(row)
    return picked
