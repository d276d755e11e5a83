"""A draft vocabulary: heads that score only some target tokens (the most frequent target-written ones), not all V.

The `token_map` buffer [Vd] lists their target ids in increasing order (saved with the heads; vLLM calls the same
tensor `token_map` for Medusa, and `d2t` = token_map - arange for EAGLE-3 / DFlash); a non-persistent inverse map
turns target ids into draft ids. Logits index the draft vocabulary; `to_target_ids` maps them back.
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


class DraftVocabHeads(HeadsModule):
    """Base of heads with an optional draft vocabulary of `config.draft_vocab_size` tokens (0: the whole vocabulary).
    Call `init_draft_vocab()` in __init__."""

    def init_draft_vocab(self) -> None:
        size, vocab = self.config.draft_vocab_size, self.config.vocab_size
        if not 0 <= size <= vocab:
            raise ValueError(f"draft_vocab_size {size} must be in [0, vocab_size {vocab}]")
        if size:
            self.register_buffer("token_map", torch.arange(size))  # draft id -> target id
            self.register_buffer("target_to_draft", torch.full((vocab,), -1), persistent=False)
            self.target_to_draft[:size] = torch.arange(size)  # the identity map (also on the meta device)
        else:
            self.token_map = None

    def check_state(self, state: dict) -> None:
        if self.token_map is not None:
            check_token_ids(state["token_map"], self.config.vocab_size, "token_map")

    @torch.no_grad()
    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Score only these target ids (draft_vocab_size distinct ones), in increasing order."""
        ids = torch.unique(target_ids.long()).to(self.token_map.device)  # sorted
        if ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"need {self.config.draft_vocab_size} distinct target ids, got {ids.numel()}")
        self.token_map.copy_(ids)
        self.target_to_draft.fill_(-1)
        self.target_to_draft[ids] = torch.arange(ids.numel(), device=ids.device)

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
        draft = self.target_to_draft[labels]
        return draft.clamp(min=0), draft >= 0
