"""A draft vocabulary: heads that score only some target tokens (the most frequent target-written ones), not all V.

This module owns it: choosing the tokens (`most_frequent_tokens`), and the maps between target and draft ids. A
draft vocabulary is its token map [Vd]: draft id -> target id, increasing. Its inverse [V] gives each target id's
draft id (-1: none). EAGLE-3 stores the same map as vLLM's `d2t` offsets (token map - arange) and `t2d` mask
(heads/eagle.py, `d2t_offsets` / `t2d_mask` here). Medusa and DFlash heads (`DraftVocabHeads`) save the `token_map`
buffer itself (vLLM's name for Medusa; their exports write `d2t`) and keep the inverse as a non-persistent buffer.
Logits index the draft vocabulary; `to_target_ids` maps them back.
"""

from __future__ import annotations

import torch

from headstart.heads.directory import HeadsModule


def check_token_ids(ids: torch.Tensor, vocab_size: int, name: str) -> None:
    """ValueError unless `ids` (a loaded draft vocabulary: draft id -> target id) are integers, strictly increasing,
    in 0..vocab_size - 1."""
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer token ids, not {ids.dtype}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"{name} holds token ids {int(ids.min())}..{int(ids.max())}, outside the vocabulary "
                         f"0..{vocab_size - 1}")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError(f"{name} must list distinct token ids in increasing order")


def most_frequent_tokens(counts: torch.Tensor, k: int) -> torch.Tensor:
    """The k target ids with the highest counts [V] (ties: lower id first), in increasing id order."""
    order = torch.sort(-counts.double(), stable=True).indices  # most frequent first, ties by id
    return torch.sort(order[:k]).values


def token_map_of(target_ids: torch.Tensor, size: int) -> torch.Tensor:
    """A draft vocabulary of these target ids (`size` distinct ones; ValueError otherwise) -> its token map [size],
    increasing."""
    ids = torch.unique(target_ids.long())  # sorted
    if ids.numel() != size:
        raise ValueError(f"need {size} distinct target ids, got {ids.numel()}")
    return ids


def target_to_draft(token_map: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """token map [Vd] -> its inverse [V]: each target id's draft id, -1 for those outside the draft vocabulary."""
    inverse = torch.full((vocab_size,), -1, dtype=torch.long, device=token_map.device)
    inverse[token_map] = torch.arange(token_map.numel(), device=token_map.device)
    return inverse


def draft_labels(inverse: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Target ids -> (draft ids, in-vocabulary mask) through the inverse map [V]; out-of-vocabulary labels become 0."""
    draft = inverse[labels]
    return draft.clamp(min=0), draft >= 0


def d2t_offsets(token_map: torch.Tensor) -> torch.Tensor:
    """EAGLE-3's `d2t` [Vd]: draft id i is target id i + d2t[i]."""
    return token_map - torch.arange(token_map.numel(), device=token_map.device)


def token_map_from_d2t(d2t: torch.Tensor) -> torch.Tensor:
    """`d2t` offsets [Vd] -> the token map [Vd]."""
    return d2t.long() + torch.arange(d2t.numel(), device=d2t.device)


def t2d_mask(token_map: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """EAGLE-3's `t2d` [V] bool: the target ids that have a draft id."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=token_map.device)
    mask[token_map] = True
    return mask


def coverage(counts: torch.Tensor, token_map: torch.Tensor) -> float:
    """The share of the token counts [V] that falls inside the draft vocabulary."""
    return int(counts[token_map].sum()) / max(int(counts.sum()), 1)


class DraftVocabHeads(HeadsModule):
    """Base of heads with an optional draft vocabulary of `config.draft_vocab_size` tokens (0: the whole vocabulary).
    Call `init_draft_vocab()` in __init__."""

    def init_draft_vocab(self) -> None:
        size, vocab = self.config.draft_vocab_size, self.config.vocab_size
        if not 0 <= size <= vocab:
            raise ValueError(f"draft_vocab_size {size} must be in [0, vocab_size {vocab}]")
        if size:
            self.register_buffer("token_map", torch.arange(size))  # draft id -> target id
            self.register_buffer("target_to_draft", target_to_draft(self.token_map, vocab), persistent=False)
        else:
            self.token_map = None

    def check_state(self, state: dict) -> None:
        if self.token_map is not None:
            check_token_ids(state["token_map"], self.config.vocab_size, "token_map")

    @torch.no_grad()
    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Score only these target ids (draft_vocab_size distinct ones), in increasing order."""
        ids = token_map_of(target_ids, self.config.draft_vocab_size).to(self.token_map.device)
        self.token_map.copy_(ids)
        self.target_to_draft.copy_(target_to_draft(ids, self.config.vocab_size))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.token_map is not None:  # the non-persistent inverse map follows the loaded token_map
            self.set_draft_vocab(self.token_map)

    def draft_lm_head_weight(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """The target's lm_head [V, h] -> the rows these heads score: [Vd, h] (or [V, h])."""
        return lm_head_weight if self.token_map is None else lm_head_weight[self.token_map]

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Indices into these heads' logits -> target token ids."""
        return draft_ids if self.token_map is None else self.token_map[draft_ids]

    def to_draft_labels(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target ids -> (indices into the logits, in-vocabulary mask); out-of-vocabulary labels become 0."""
        if self.token_map is None:
            return labels, torch.ones_like(labels, dtype=torch.bool)
        return draft_labels(self.target_to_draft, labels)
