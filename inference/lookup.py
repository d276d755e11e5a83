"""Drafting from the context itself (prompt lookup, Saxena 2023) as a second source beside the heads.

When the last n tokens of the context (prompt + output so far; n from max_ngram down to min_ngram) occurred
earlier, the tokens that followed their latest occurrence are a cheap and often right guess: code repeats names
and signatures from the prompt, answers repeat their own phrases. The decode loop then verifies that chain instead
of the heads' tree, with the same node count, so a step costs the same; without a match the heads draft as usual.
Lossless like any other draft: a chain is a deterministic tree.

min_ngram 2 was chosen over 1 and 3 by replaying heads + lookup chains on the target's greedy outputs of headstart's
own tuning prompts (`mix:train` rows the heads never saw; docs/measured.md, "Lookup's shortest match").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from headstart.inference.tree import Tree, tree_from_parents


@dataclass
class LookupConfig:
    num_tokens: int  # chain length (drafted nodes); the decode loop uses the heads' tree size - 1
    min_ngram: int = 2
    max_ngram: int = 3


def lookup_continuation(context: list[int], config: LookupConfig) -> list[int]:
    """Up to num_tokens tokens that followed the latest earlier occurrence of the context's last n tokens, for the
    largest n in [min_ngram, max_ngram] that occurs; [] when none does."""
    _, branches = lookup_branches(context, config.num_tokens, config.min_ngram, config.max_ngram, 1)
    return branches[0] if branches else []


def lookup_branches(context: list[int], num_tokens: int, min_ngram: int, max_ngram: int,
                    max_matches: int) -> tuple[int, list[list[int]]]:
    """(n, continuations): for the largest n in [min_ngram, max_ngram] whose last-n-token tail occurred earlier, up
    to `max_matches` distinct continuations of up to num_tokens tokens that followed its occurrences, latest first;
    (0, []) when no tail occurs."""
    return ContextIndex(context).branches(num_tokens, min_ngram, max_ngram, max_matches)


class ContextIndex:
    """Where each token occurs in a context that only grows (the decode loop appends to it), so a lookup step reads
    the occurrences of the context's last token instead of rescanning the whole context."""

    def __init__(self, context: list[int]):
        self.context = context  # read only; its owner appends
        self.positions: dict[int, list[int]] = {}  # token -> positions in the context, ascending
        self.indexed = 0  # context[:indexed] is in `positions`

    def branches(self, num_tokens: int, min_ngram: int, max_ngram: int,
                 max_matches: int) -> tuple[int, list[list[int]]]:
        """lookup_branches over the context as it is now."""
        context = self.context
        for i in range(self.indexed, len(context)):
            self.positions.setdefault(context[i], []).append(i)
        self.indexed = length = len(context)
        for n in range(max_ngram, min_ngram - 1, -1):
            if n <= 0 or length <= n:
                continue
            tail = context[length - n:]
            found: list[list[int]] = []
            for end in reversed(self.positions[tail[-1]]):  # latest first; the tail itself (end = length - 1) excluded
                if end > length - 2:
                    continue
                if end < n - 1:
                    break
                if context[end - n + 1: end + 1] == tail:
                    follow = context[end + 1: end + 1 + num_tokens]
                    if follow not in found:
                        found.append(follow)
                        if len(found) >= max_matches:
                            break
            if found:
                return n, found
        return 0, []


@functools.lru_cache(maxsize=64)
def chain_tree(size: int) -> Tree:
    """A chain of `size` nodes (root included): node i's parent is i - 1."""
    return tree_from_parents([-1] + list(range(size - 1)))


def chain_draft(root: int, chain: list[int]) -> tuple[Tree, torch.Tensor]:
    """(tree, tokens [1 + len(chain)]) for verifying `chain` after `root`."""
    return chain_tree(1 + len(chain)), torch.tensor([root] + chain, dtype=torch.long)
