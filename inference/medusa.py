"""Medusa drafting at inference: the heads' per-depth top-k tokens fill the tree.

Head k reads the target's final-norm hidden state at the last cache position and scores the token k + 1 steps
after the root; the node at depth d and rank r of the tree gets head d - 1's rank-r token (inference/tree.py
SlotProposer: a fixed tree, or under the adaptive policy one shaped by each step's probabilities).
"""

from __future__ import annotations

from typing import Callable

import torch

from headstart.inference.adapt import medusa_draft_prior
from headstart.inference.tree import DraftInput, SlotProposer, Tree


class MedusaProposer(SlotProposer):
    """Proposer (inference/tree.py) for Medusa heads."""

    what = "the Medusa heads"

    def __init__(self, heads: torch.nn.Module, tree: Tree, project: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.heads = heads
        self.project = project  # heads sharing the target's lm_head: see medusa_logits
        self.max_depth = heads.config.num_heads
        self.use_tree(tree)

    @torch.no_grad()
    def __call__(self, draft: DraftInput) -> tuple[Tree, torch.Tensor]:
        if self.tree.max_depth == 0:  # a root-only tree: plain decoding (what `auto` picks when drafting never pays)
            return self.tree, torch.tensor([draft.root], dtype=torch.long)
        return self.fill(draft.root, lambda depth: medusa_logits(self.heads, draft.hidden, depth, self.project),
                         self.heads.to_target_ids)


def medusa_logits(heads: torch.nn.Module, hidden: torch.Tensor, depth: int,
                  project: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """hidden [h] -> logits [depth, V] of the first `depth` heads only (a full-vocabulary head is costly).

    project: for heads that share the target's lm_head, features [depth, h] -> logits over the rows they score
    (`projection(heads.draft_lm_head_weight(lm_head_weight))`: [Vd, h] with a draft vocabulary); the logits index
    those rows.
    """
    feats = torch.stack([heads.blocks[k](hidden) for k in range(depth)])  # [depth, h]
    if heads.lm_heads is None:
        if project is None:
            raise ValueError("these Medusa heads share the target's lm_head: pass its projection")
        return project(feats)  # one matmul for all heads
    return torch.stack([heads.lm_heads[k](feats[k]) for k in range(depth)])


def medusa_proposer(heads: torch.nn.Module, model, tree: Tree,
                    project: Callable[[torch.Tensor], torch.Tensor] | None) -> MedusaProposer:
    """The Medusa declaration's proposer factory (heads/medusa.py MEDUSA)."""
    return MedusaProposer(heads, tree, project)


def draft_prior(config, draft_vocab_fraction: float) -> dict[int, float]:
    """The Medusa declaration's draft-cost prior (inference/adapt.py)."""
    return medusa_draft_prior(draft_vocab_fraction)
