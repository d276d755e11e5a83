"""DSpark drafting at inference: DFlash's block forward (inference/dflash.py: the context cache, one draft forward
over [root, mask x (block_size - 1)]), then the Markov head fills the tree parent by parent and the confidence head
says how deep to verify.

1. base logits [depth, Vd] of slots 1..depth from the one block forward (DFlash's `block_logits`);
2. a node at depth d whose parent holds token t scores base[d - 1] + markov_bias(t) (heads/dspark.py; with
   markov_context also of slot d's normed output, d >= 2); its rank-r child takes rank r of those. A chain is
   vLLM's DSpark loop exactly: argmax, then prev = that token. The drafted tokens are a function of the context
   alone, so verification (inference/verify.py) stays lossless;
3. along the tree's rank-0 chain, c_d = sigmoid(confidence_logit(norm(out_d), parent token)); the chance that the
   first n drafted tokens are all accepted is S_n = c_1 ... c_n, so verifying down to depth n is expected to give
   1 + S_1 + ... + S_n tokens. When the adaptive policy drives the proposer (`resize`, inference/adapt.py), the
   tree is cut at the depth n (0 = a plain step) with the most expected tokens per unit of step cost (StepCost: the
   verify of the kept nodes plus the draft already run), as vLLM's adaptive verification does for a batch of one.
   A fixed tree (an engine's chain, `acceptance --chain`) is verified whole, as vLLM does without that option.
"""

from __future__ import annotations

from typing import Callable

import torch

from headstart.inference.adapt import StepCost
from headstart.inference.dflash import DFlashProposer, draft_prior
from headstart.inference.tree import DraftInput, Tree, tree_from_parents


class DSparkProposer(DFlashProposer):
    """Proposer (inference/tree.py) for a DSpark draft over a static tree; one per generated sequence (stateful)."""

    def __init__(self, draft: torch.nn.Module, model, tree: Tree, project: Callable[[torch.Tensor], torch.Tensor],
                 step_cost: StepCost | None = None):
        self._project = project
        super().__init__(draft, model, tree, self._scores)
        cfg = draft.config
        self.step_cost = step_cost or StepCost(None, draft_prior(cfg, (cfg.draft_vocab_size or cfg.vocab_size)
                                                                 / cfg.vocab_size))
        self.cut = False  # cut by confidence: on once the adaptive policy resizes the tree
        self.confidence: list[float] = []  # c_1.. along the last draft's rank-0 chain
        self._cuts: dict[tuple, Tree] = {}

    def _scores(self, normed: torch.Tensor) -> torch.Tensor:
        """DFlash's projection of the normed slot outputs [D, h], which are kept for the confidence head."""
        self._normed = normed
        return self._project(normed)

    def resize(self, choices: list[list[int]]) -> None:
        """The policy's tree, filled parent by parent and cut by the confidence (not DFlash's per-step shapes: a
        node's children here are guesses made for its own token)."""
        self.tree = self.tree_of(choices)
        self.cut = True

    @torch.no_grad()
    def __call__(self, inp: DraftInput) -> tuple[Tree, torch.Tensor]:
        if inp.features is not None:
            self.pending.append(inp.features)
        tree = self.tree
        if tree.max_depth == 0:  # plain decoding: nothing to draft (the features wait for the next draft)
            return tree, torch.tensor([inp.root], dtype=torch.long)
        self._commit()
        base = self.block_logits(inp.root, tree.max_depth)  # [depth, Vd]
        tokens = self.markov_fill(tree, inp.root, base)
        self.confidence = self.chain_confidence(tree, tokens)
        if self.cut:
            tree, tokens = self.cut_tree(tree, tokens, self.cut_depth(tree, self.confidence))
        return tree, torch.tensor(tokens, dtype=torch.long)

    def markov_fill(self, tree: Tree, root: int, base: torch.Tensor) -> list[int]:
        """Tokens [N] of the tree: each parent's children are its Markov-corrected slot's ranks."""
        tokens = [root] + [0] * (tree.size - 1)
        device = base.device
        for parent in range(tree.size):
            children = tree.children[parent]
            if not children:
                continue
            prev, slot = torch.tensor(tokens[parent], device=device), tree.depths[parent]
            # markov_context: the child's slot output [h], from slot 2 on (heads/dspark.py)
            normed = self._normed[slot] if self.draft.config.markov_context and slot > 0 else None
            scores = base[slot] + self.draft.markov_bias(prev, normed).to(base.dtype)  # [Vd]
            ranked = self.draft.to_target_ids(scores.topk(max(tree.ranks[c] for c in children) + 1).indices).tolist()
            for child in children:
                tokens[child] = ranked[tree.ranks[child]]
        return tokens

    def chain_confidence(self, tree: Tree, tokens: list[int]) -> list[float]:
        """c_d for d = 1.. along the rank-0 chain from the root (as deep as the tree has one)."""
        chain, node = [], 0
        while tree.children[node] and tree.ranks[tree.children[node][0]] == 0:
            chain.append(node)  # the parent of the chain's next node
            node = tree.children[node][0]
        if not chain:
            return []
        prev = torch.tensor([tokens[p] for p in chain], device=self._normed.device)
        normed = self._normed[: len(chain)].to(next(self.draft.parameters()).dtype)
        return torch.sigmoid(self.draft.confidence_logit(normed, prev).float()).tolist()

    def cut_depth(self, tree: Tree, confidence: list[float]) -> int:
        """The depth n (0 .. len(confidence)) with the most expected tokens, 1 + S_1 + .. + S_n, per step cost."""
        drafted = self.step_cost.draft_cost(tree.size)  # already spent, whatever is verified
        nodes_to = [sum(1 for d in tree.depths if d <= n) for n in range(len(confidence) + 1)]
        best, best_rate, expected, survival = 0, 1.0 / (self.step_cost.ratio(1) + drafted), 1.0, 1.0
        for n, c in enumerate(confidence, start=1):
            survival *= c
            expected += survival
            rate = expected / (self.step_cost.ratio(nodes_to[n]) + drafted)
            if rate > best_rate:
                best, best_rate = n, rate
        return best

    def cut_tree(self, tree: Tree, tokens: list[int], depth: int) -> tuple[Tree, list[int]]:
        """The tree's nodes down to `depth` (their order kept) and their tokens."""
        kept = [i for i in range(tree.size) if tree.depths[i] <= depth]
        if len(kept) == tree.size:
            return tree, tokens
        key = (tuple(tree.parents), depth)
        if key not in self._cuts:
            index = {old: new for new, old in enumerate(kept)}
            self._cuts[key] = tree_from_parents([-1] + [index[tree.parents[i]] for i in kept[1:]],
                                                [tree.ranks[i] for i in kept])
        return self._cuts[key], [tokens[i] for i in kept]


def dspark_proposer(draft: torch.nn.Module, model, tree: Tree,
                    project: Callable[[torch.Tensor], torch.Tensor]) -> DSparkProposer:
    """The DSpark declaration's proposer factory (heads/dspark.py DSPARK)."""
    return DSparkProposer(draft, model, tree, project)
