"""EAGLE drafting at inference: the draft model grows a dynamic tree (EAGLE-2 style) from the target's features.

The draft keeps its own KV cache over *committed* entries only: the pair (target feature f_s, token x_{s+1}) at
position s for every target cache position s < n. Each proposal
  1. appends the pairs for the target cache entries new since the last call (the prompt after the prefill, the
     accepted path after a verification), computed from the target's true features;
  2. grows the tree: the root's children come from the last committed pair; a node at depth d >= 1 is the pair
     (its parent's draft output, its token) at position n - 1 + d, attending to the committed entries, its
     ancestors and itself;
  3. drops the tree's entries again, so the cache holds only pairs built from true target features.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from headstart.inference.adapt import PRIOR_EAGLE_DRAFT_RATIO
from headstart.inference.forward import compact_cache
from headstart.inference.tree import DynamicTreeConfig, Proposer, Tree, build_dynamic_tree


class EagleProposer(Proposer):
    """Proposer (inference/tree.py) for an EAGLE-1/3 draft; one per generated sequence (it is stateful)."""

    resizable = True

    def __init__(self, draft, model, config: DynamicTreeConfig):
        self.draft = draft
        self.embed = model.get_input_embeddings()
        self.lm_head_weight = None if draft.is_eagle3 else model.get_output_embeddings().weight
        self.config = config
        self.feature_layers = list(draft.config.feature_layers)  # the decode loop hands over these target taps
        self.target_ids = draft.to_target_ids(torch.arange(draft.config.draft_vocab_size, device=draft.d2t.device)) \
            if draft.is_eagle3 else None
        self.reset()

    def resize(self, choices: list[list[int]]) -> None:
        """Grow dynamic trees of these choices' node count, depth and width from now on (inference/adapt.py)."""
        self.config = dynamic_config_from_choices(choices)

    def reset(self) -> None:
        self.cache = DynamicCache()
        self.committed = 0  # target cache positions whose pairs are in the draft cache
        self.pending: list[torch.Tensor] = []  # taps [k, n*h] of target positions committed.. not yet paired
        self.last_out: torch.Tensor | None = None  # the last committed pair's output [h]

    @torch.no_grad()
    def __call__(self, inp) -> tuple[Tree, torch.Tensor]:
        if inp.features is not None:
            self.pending.append(inp.features)
        if self.config.total_tokens <= 1 or self.config.depth == 0:  # plain decoding: nothing to draft
            return build_dynamic_tree(inp.root, None, DynamicTreeConfig(depth=0, total_tokens=1))
        root_out = self._commit(inp.context)  # [h]
        n = self.committed
        parameters = next(self.draft.parameters())
        dtype, device = parameters.dtype, parameters.device
        blocked = torch.finfo(dtype).min
        node_out: dict[int, torch.Tensor] = {0: root_out}
        node_slot: dict[int, int] = {}  # tree node (depth >= 1) -> its entry's index in the draft cache
        depth_of = [0]

        def draft_step(tokens: torch.Tensor, parents: list[int], frontier: list[int]) -> torch.Tensor:
            self.node_tokens, self.node_parents = tokens.tolist(), list(parents)  # build order, for inspection
            while len(depth_of) < len(parents):
                depth_of.append(depth_of[parents[len(depth_of)]] + 1)
            if frontier == [0]:
                outs = root_out[None]  # [1, h]
            else:
                past = self.cache.get_seq_length()
                width = len(frontier)
                mask = torch.full((width, past + width), blocked, dtype=dtype, device=device)
                mask[:, :n] = 0  # every node sees the committed pairs
                for row, node in enumerate(frontier):
                    mask[row, past + row] = 0
                    parent = parents[node]
                    while parent > 0:  # ancestors at depth >= 1 (the root's pair is committed)
                        mask[row, node_slot[parent]] = 0
                        parent = parents[parent]
                feats = torch.stack([node_out[parents[node]] for node in frontier])  # [F, h]
                embeds = self.embed(tokens[frontier].to(device))  # [F, h]
                positions = torch.tensor([n - 1 + depth_of[node] for node in frontier], device=device)
                outs = self.draft(embeds[None], feats[None], positions[None], mask[None, None], self.cache)[0]  # [F, h]
                for row, node in enumerate(frontier):
                    node_out[node] = outs[row]
                    node_slot[node] = past + row
            logp = torch.log_softmax(self.draft.logits(outs, self.lm_head_weight).float(), dim=-1)  # [F, Vd]
            if self.target_ids is None:
                return logp
            full = torch.full((logp.shape[0], self.draft.config.vocab_size), -torch.inf, device=logp.device)
            full[:, self.target_ids] = logp  # draft vocabulary -> target ids
            return full

        tree, tokens = build_dynamic_tree(inp.root, draft_step, self.config)
        self.node_outputs = node_out  # draft output per expanded node (build order, see node_tokens), for tests
        compact_cache(self.cache, n, [])  # forget the tree's entries: only true-feature pairs stay
        return tree, tokens

    def _commit(self, context: list[int]) -> torch.Tensor:
        """Append the pairs (f_s, x_{s+1}) for the pending target positions; returns the last pair's output [h]."""
        if not self.pending:
            if self.last_out is None:
                raise RuntimeError("EAGLE draft called before any target features were handed over")
            return self.last_out
        taps = torch.cat(self.pending)  # [k, n*h]
        self.pending = []
        start, k = self.committed, taps.shape[0]
        device = taps.device
        feats = self.draft.fuse(taps)  # [k, h]
        tokens = torch.tensor(context[start + 1: start + k + 1], device=device)  # x_{s+1}
        if tokens.numel() != k:
            raise RuntimeError(f"EAGLE draft out of step: {k} new target features but {tokens.numel()} tokens")
        embeds = self.embed(tokens)  # [k, h]
        mask = torch.zeros(k, start + k, dtype=feats.dtype, device=device)
        mask[:, start:] = torch.full((k, k), torch.finfo(feats.dtype).min, dtype=feats.dtype, device=device).triu(1)
        positions = torch.arange(start, start + k, device=device)
        out = self.draft(embeds[None], feats[None], positions[None], mask[None, None], self.cache)[0]  # [k, h]
        self.committed = start + k
        self.last_out = out[-1]
        return self.last_out


def dynamic_config_from_choices(choices: list[list[int]]) -> DynamicTreeConfig:
    """The dynamic tree with the same node count, depth and width as a static tree's choices."""
    if not choices:
        return DynamicTreeConfig(topk=1, depth=0, total_tokens=1)
    return DynamicTreeConfig(topk=max(max(c) for c in choices) + 1, depth=max(len(c) for c in choices),
                             total_tokens=len(choices) + 1)


def eagle_proposer(draft, model, config: DynamicTreeConfig, project=None) -> EagleProposer:
    """The EAGLE declarations' proposer factory (heads/eagle.py EAGLE, EAGLE3): the draft scores with its own lm_head."""
    return EagleProposer(draft, model, config)


def draft_prior(config, draft_vocab_fraction: float) -> dict[int, float]:
    """The EAGLE declarations' draft-cost prior (inference/adapt.py), by tree nodes."""
    return PRIOR_EAGLE_DRAFT_RATIO
