"""DFlash drafting at inference: one draft forward over the block [root, mask, ...] scores every depth at once.

The draft keeps, per layer, the keys and values of the fused target features of every committed target cache
position (heads/dflash.py). Each proposal
  1. appends those of the positions new since the last call (the prompt after the prefill, the accepted path after
     a verification), from the target's true features; with a sliding window W it keeps only the last W - 1 (all
     that any slot of the next block can see);
  2. runs the block [root, mask x (block_size - 1)] at positions n .. n + block_size - 1 (n = the root's position,
     the first one without target features) over them, the block bidirectional (or causal: `block_causal`),
     nothing of it kept;
  3. fills a tree: the node at depth d and rank r gets slot d's rank-r token (slots are scored independently, as
     Medusa heads are, so the same trees, tree sizing and adaptive drafting apply: inference/tree.py SlotProposer,
     whose adaptive trees take their shape from each step's probabilities).
A chain (the tree [[0], [0, 0], ...]) is what an engine verifies.
"""

from __future__ import annotations

from typing import Callable

import torch

from headstart.inference.adapt import dflash_draft_prior
from headstart.inference.tree import DraftInput, SlotProposer, Tree


class DFlashProposer(SlotProposer):
    """Proposer (inference/tree.py) for a DFlash draft; one per generated sequence (stateful)."""

    what = "the DFlash block"

    def __init__(self, draft: torch.nn.Module, model, tree: Tree, project: Callable[[torch.Tensor], torch.Tensor]):
        self.draft = draft
        self.embed = model.get_input_embeddings()
        self.project = project  # normed slot outputs [D, h] -> logits over the scored rows (draft_lm_head_weight)
        self.max_depth = draft.config.block_size - 1
        self.feature_layers = list(draft.config.feature_layers)  # the decode loop hands over these target taps
        self.use_tree(tree)
        self.reset()

    def reset(self) -> None:
        self.cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer: keys, values [1, kvh, n, d]
        self.committed = 0  # target cache positions whose features are in the cache
        self.first = 0  # the first position the cache holds (sliding window: committed - (W - 1) once that is > 0)
        self.pending: list[torch.Tensor] = []  # taps [k, n*h] of positions committed.. not yet appended

    @torch.no_grad()
    def __call__(self, inp: DraftInput) -> tuple[Tree, torch.Tensor]:
        if inp.features is not None:
            self.pending.append(inp.features)
        depth = self.tree.max_depth
        if depth == 0:  # plain decoding: nothing to draft (the features wait for the next draft)
            return self.tree, torch.tensor([inp.root], dtype=torch.long)
        self._commit()
        return self.fill(inp.root, lambda depth: self.block_logits(inp.root, depth), self.draft.to_target_ids)

    def block_logits(self, root: int, depth: int) -> torch.Tensor:
        """Logits [depth, Vd] of slots 1..depth of the block after the committed context."""
        cfg = self.draft.config
        device = next(self.draft.parameters()).device
        tokens = torch.full((1, cfg.block_size), cfg.mask_token_id, dtype=torch.long, device=device)
        tokens[0, 0] = root
        positions = torch.arange(self.committed, self.committed + cfg.block_size, device=device)[None]
        mask = self.draft.decode_mask(self.committed, device, self.first)
        out = self.draft(self.draft.embed_block(tokens, self.embed(tokens)), positions, self.cache, mask)[0]  # [Bk, h]
        return self.project(self.draft.norm(out[1 : depth + 1]))

    def _commit(self) -> None:
        """Append the keys and values of the pending target positions."""
        if not self.pending:
            if self.cache is None:
                raise RuntimeError("DFlash draft called before any target features were handed over")
            return
        taps = torch.cat(self.pending)  # [k, n*h]
        self.pending = []
        k = taps.shape[0]
        positions = torch.arange(self.committed, self.committed + k, device=taps.device)[None]
        new = self.draft.context_kv(self.draft.fuse(taps)[None], positions)
        self.cache = new if self.cache is None else [
            (torch.cat([old_k, new_k], dim=2), torch.cat([old_v, new_v], dim=2))
            for (old_k, old_v), (new_k, new_v) in zip(self.cache, new)]
        self.committed += k
        window = self.draft.config.sliding_window
        if window and self.committed - self.first > window - 1:  # positions no slot of the next block sees
            self.first = self.committed - (window - 1)
            self.cache = [(keys[:, :, 1 - window:], values[:, :, 1 - window:]) for keys, values in self.cache]


def dflash_proposer(draft: torch.nn.Module, model, tree: Tree,
                    project: Callable[[torch.Tensor], torch.Tensor]) -> DFlashProposer:
    """The DFlash declaration's proposer factory (heads/dflash.py DFLASH)."""
    return DFlashProposer(draft, model, tree, project)


def draft_prior(config, draft_vocab_fraction: float) -> dict[int, float]:
    """The DFlash declaration's draft-cost prior (inference/adapt.py): its layers and the rows it scores."""
    return dflash_draft_prior(config.num_layers, draft_vocab_fraction)
