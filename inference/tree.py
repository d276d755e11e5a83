"""Candidate trees for speculative decoding: static (Medusa `choices`, DFlash) and dynamic (EAGLE-2 style).

A tree has N nodes in breadth-first order. Node 0 is the root: the token the target already chose at
the previous step (it is not in the KV cache yet). Every other node is a drafted token, child of
`parents[i] < i`. The target verifies all N nodes in one forward pass where node i attends to the
prefix and to its ancestors (itself included), at position `prefix_len + depth[i]`.

Static trees are written as `choices`: the path of per-depth top-k ranks from the root to each
node, e.g. [[0], [1], [0, 0]] = the top-1 and top-2 guesses at depth 1, and the top-1 guess at
depth 2 under the top-1 guess at depth 1. Every prefix of a path must itself be a node.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

# Prior per-(depth, rank) acceptance rates, used when the heads directory records none. Row d is
# depth d + 1 (head d), column r is rank r; each entry is P(right | parent right). Built from the top-1
# accuracies reported for Medusa-1 on Vicuna-7B (.56/.32/.20/.15/.12, unconditional): the conditional
# rate of head k is a_k / a_(k-1); rank r gets the top-1 rate times 0.5**r (an assumed fall-off).
DEFAULT_TOP1 = [0.56, 0.32, 0.20, 0.15, 0.12]
DEFAULT_ACCURACY: list[list[float]] = [
    [(DEFAULT_TOP1[d] / (DEFAULT_TOP1[d - 1] if d else 1.0)) * 0.5**r for r in range(8)] for d in range(len(DEFAULT_TOP1))
]
DEFAULT_TREE_NODES = 7  # drafted nodes of the default tree: small, since on a CPU a wide verify costs several steps
# drafted nodes a given tree may have: far above a useful tree, small enough that its [N, N] masks stay a few MB
MAX_TREE_NODES = 1024


def default_choices(num_heads: int, num_nodes: int = DEFAULT_TREE_NODES) -> list[list[int]]:
    """The best tree of `num_nodes` drafted nodes under the prior DEFAULT_ACCURACY, depth <= num_heads."""
    return best_choices(DEFAULT_ACCURACY, num_nodes, max_depth=num_heads)


@dataclass
class Tree:
    """Topology of a candidate tree (no tokens). Lists are indexed by node, node 0 is the root."""

    parents: list[int]  # parents[0] == -1, parents[i] < i
    depths: list[int]  # depths[0] == 0
    ranks: list[int]  # rank of node i among its parent's children (0 for the root)
    children: list[list[int]]  # children in rank order
    paths: list[list[int]]  # one per leaf: node indices from the root to that leaf

    @property
    def size(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def ancestor_mask(self) -> torch.Tensor:
        """bool [N, N]: entry (i, j) is True when j is i or an ancestor of i (computed once per tree)."""
        cached = self.__dict__.get("_ancestor_mask")
        if cached is None:
            n = self.size
            rows = [[False] * n for _ in range(n)]
            for i in range(n):
                j = i
                while j >= 0:
                    rows[i][j] = True
                    j = self.parents[j]
            cached = self.__dict__["_ancestor_mask"] = torch.tensor(rows, dtype=torch.bool)
        return cached

    def attention_mask(self, prefix_len: int, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu") -> torch.Tensor:
        """Additive float mask [1, 1, N, prefix_len + N]: 0 where node i may attend, dtype-min elsewhere.

        Every node sees the whole prefix (the KV cache) and its own ancestors inside the tree.
        """
        mask = torch.zeros(self.size, prefix_len + self.size, dtype=dtype, device=device)  # built where it is used:
        blocked = ~self.ancestor_mask().to(device)  # only the [N, N] tree part crosses to the device
        mask[:, prefix_len:].masked_fill_(blocked, torch.finfo(dtype).min)
        return mask[None, None]  # [1, 1, N, prefix_len + N]

    def position_ids(self, prefix_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """[1, N]: prefix_len + depth of every node."""
        return (torch.tensor(self.depths, dtype=torch.long) + prefix_len)[None].to(device)

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to `node`, both included."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


def tree_from_parents(parents: Sequence[int], ranks: Sequence[int] | None = None) -> Tree:
    """Build a Tree from a parent list (parents[0] == -1, parents[i] < i); ranks order the siblings."""
    n = len(parents)
    if n == 0 or parents[0] != -1:
        raise ValueError("a tree needs a root: parents[0] must be -1")
    for i in range(1, n):
        if not 0 <= parents[i] < i:
            raise ValueError(f"node {i} has parent {parents[i]}; parents must come before their children")
    if ranks is None:
        ranks = [0] * n
        seen: dict[int, int] = {}
        for i in range(1, n):
            ranks[i] = seen.get(parents[i], 0)
            seen[parents[i]] = ranks[i] + 1
    depths = [0] * n
    children: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
        children[parents[i]].append(i)
    for kids in children:
        kids.sort(key=lambda c: ranks[c])
    tree = Tree(parents=list(parents), depths=depths, ranks=list(ranks), children=children, paths=[])
    tree.paths = [tree.path_to(i) for i in range(n) if not children[i]]
    return tree


def check_choices(choices, max_depth: int | None, num_candidates: int) -> list[list[int]]:
    """User-given `choices` (a --tree JSON, a tree file, a Python list) checked and returned as lists of ints.

    Each path: a non-empty list of non-negative integer ranks, each below `num_candidates` (the tokens a head or draft
    scores), at most `max_depth` long (Medusa: its number of heads; None: any depth); every prefix of a path must be a
    path too. ValueError names the first path that breaks a rule and how to write it.
    """
    example = "e.g. [[0], [1], [0, 0]]"
    if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence):
        raise ValueError(f"choices must be a list of rank paths ({example}), got {choices!r:.80}")
    if len(choices) > MAX_TREE_NODES:
        raise ValueError(f"{len(choices)} nodes, more than the {MAX_TREE_NODES} drafted nodes a tree may have: use a "
                         "smaller tree (--tree auto measures the best size)")
    paths = []
    for path in choices:
        if isinstance(path, (str, bytes)) or not isinstance(path, Sequence) or not path:
            raise ValueError(f"choice {path!r} is not a non-empty list of ranks: write every node as its path of "
                             f"per-depth ranks, {example}")
        if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path):
            raise ValueError(f"choice {list(path)!r} must hold non-negative integer ranks only ({example})")
        if max(path) >= num_candidates:
            raise ValueError(f"choice {list(path)} has rank {max(path)}, but the heads score only {num_candidates} "
                             f"tokens per depth (ranks 0..{num_candidates - 1})")
        if len(path) > (MAX_TREE_NODES if max_depth is None else max_depth):
            raise ValueError(f"choice {list(path)[:8]} is {len(path)} deep, but the heads draft only "
                             f"{max_depth or MAX_TREE_NODES} tokens ahead: use paths of at most that many ranks")
        paths.append([int(r) for r in path])
    known = {tuple(p) for p in paths}
    for path in paths:
        if len(path) > 1 and tuple(path[:-1]) not in known:
            raise ValueError(f"choice {path} has no parent {path[:-1]} in the choices: add every prefix of a path")
    return paths


def tree_from_choices(choices: Sequence[Sequence[int]]) -> Tree:
    """Static tree from Medusa-style `choices` (paths of per-depth top-k ranks; the root is implicit).

    Nodes are ordered by depth, then lexicographically by path, so node i's parent precedes it.
    """
    paths = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda p: (len(p), p))
    for p in paths:
        if len(p) == 0:
            raise ValueError("choices must not contain the empty path (the root is implicit)")
        if min(p) < 0:
            raise ValueError(f"choice {list(p)} has a negative rank")
    index = {(): 0}
    parents, ranks = [-1], [0]
    for p in paths:
        if p[:-1] not in index:
            raise ValueError(f"choice {list(p)} has no parent {list(p[:-1])} in choices; add every prefix of a path")
        index[p] = len(parents)
        parents.append(index[p[:-1]])
        ranks.append(p[-1])
    return tree_from_parents(parents, ranks)


def tree_choices(tree: Tree) -> list[list[int]]:
    """Inverse of `tree_from_choices`: the rank path of every non-root node."""
    return [[tree.ranks[j] for j in tree.path_to(i)[1:]] for i in range(1, tree.size)]


def static_tree_tokens(tree: Tree, root_token: int, topk_tokens: torch.Tensor) -> torch.Tensor:
    """Tokens [N] of a static Medusa tree: node at depth d with rank r gets topk_tokens[d - 1, r].

    topk_tokens: [depth, k] token ids ranked per depth (row d - 1 from head d - 1).
    """
    if tree.max_depth > topk_tokens.shape[0]:
        raise ValueError(f"tree depth {tree.max_depth} exceeds the {topk_tokens.shape[0]} draft depths available")
    tokens = torch.empty(tree.size, dtype=torch.long)
    tokens[0] = root_token
    depth_idx = torch.tensor(tree.depths[1:], dtype=torch.long) - 1
    rank_idx = torch.tensor(tree.ranks[1:], dtype=torch.long)
    tokens[1:] = topk_tokens.cpu()[depth_idx, rank_idx]
    return tokens


# ---------------------------------------------------------------------------------------------
# Choosing a static tree from measured accuracies


def path_value(path: Sequence[int], accuracy: Sequence[Sequence[float]]) -> float:
    """Probability that the whole rank path is accepted: product of accuracy[depth][rank] along it."""
    value = 1.0
    for d, r in enumerate(path):
        if d >= len(accuracy) or r >= len(accuracy[d]):
            return 0.0
        value *= accuracy[d][r]
    return value


def expected_accept_length(choices: Sequence[Sequence[int]], accuracy: Sequence[Sequence[float]]) -> float:
    """Expected tokens per verify step: 1 (the target's own token) + sum over nodes of path values."""
    return 1.0 + sum(path_value(c, accuracy) for c in choices)


def greedy_paths(accuracy: Sequence[Sequence[float]], num_nodes: int,
                 max_depth: int | None = None) -> list[tuple[list[int], float]]:
    """(rank path, path value) of up to `num_nodes` nodes in the order the greedy sparse tree adds them: each time
    the frontier node with the largest path value. Every prefix of the order is itself a connected tree, the best
    of its size (see best_choices)."""
    max_depth = len(accuracy) if max_depth is None else min(max_depth, len(accuracy))
    chosen: list[tuple[list[int], float]] = []
    # heap of (-value, path); start with the root's children
    frontier = [(-path_value([r], accuracy), [r]) for r in range(len(accuracy[0]))] if max_depth > 0 else []
    heapq.heapify(frontier)
    while frontier and len(chosen) < num_nodes:
        neg_value, path = heapq.heappop(frontier)
        if -neg_value <= 0.0:
            break
        chosen.append((path, -neg_value))
        if len(path) < max_depth:
            for r in range(len(accuracy[len(path)])):
                child = path + [r]
                heapq.heappush(frontier, (-path_value(child, accuracy), child))
    return chosen


def best_choices(accuracy: Sequence[Sequence[float]], num_nodes: int, max_depth: int | None = None) -> list[list[int]]:
    """Greedy sparse tree: add, `num_nodes` times, the frontier node with the largest path value.

    accuracy[d][r] = P(rank-r token of depth d+1 is right | its parent is right). A child's value is
    at most its parent's, so the greedy frontier choice maximises the expected accepted length
    (sum of path values) over connected trees of `num_nodes` drafted nodes (the root not counted).
    """
    return sorted((path for path, _ in greedy_paths(accuracy, num_nodes, max_depth)), key=lambda p: (len(p), p))


# ---------------------------------------------------------------------------------------------
# Dynamic tree (EAGLE-2 style), driven by any draft callable

# draft(tokens [n], parents [n], frontier [F]) -> log-probs [F, V] of the next token after each
# frontier node, given the partial tree so far (node 0 = root).
DraftFn = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]


@dataclass(frozen=True)  # shared defaults (speculator.py DEFAULT_DYNAMIC_TREE) are never changed in place
class DynamicTreeConfig:
    topk: int = 4  # children per expanded node, and frontier width
    depth: int = 4  # expansion steps
    total_tokens: int = 16  # nodes kept, root included


def build_dynamic_tree(root_token: int, draft: DraftFn, config: DynamicTreeConfig) -> tuple[Tree, torch.Tensor]:
    """Expand the top-k frontier by cumulative log-prob for `depth` steps, keep the best nodes.

    Returns (tree, tokens [N]) with N <= total_tokens. The kept set is connected: a node enters only
    after its parent (scores fall along a path, and ties go to the shallower node).
    """
    tokens = [root_token]
    parents = [-1]
    scores = [0.0]
    frontier = [0]
    for _ in range(config.depth):
        logp = draft(torch.tensor(tokens, dtype=torch.long), parents, frontier)  # [F, V]
        top_lp, top_tok = logp.float().topk(config.topk, dim=-1)  # [F, topk]
        top_lp, top_tok = top_lp.tolist(), top_tok.tolist()  # one device-to-host copy each per depth
        new_nodes: list[int] = []
        for f, node in enumerate(frontier):
            for j in range(config.topk):
                tokens.append(top_tok[f][j])
                parents.append(node)
                scores.append(scores[node] + top_lp[f][j])
                new_nodes.append(len(tokens) - 1)
        # the next frontier: the best `topk` of the new nodes by cumulative score
        new_nodes.sort(key=lambda i: -scores[i])
        frontier = [i for i in new_nodes[: config.topk] if scores[i] > -math.inf]
        if not frontier:
            break
    depth_of = [0] * len(tokens)
    for i in range(1, len(tokens)):
        depth_of[i] = depth_of[parents[i]] + 1
    order = sorted(range(1, len(tokens)), key=lambda i: (-scores[i], depth_of[i], i))
    kept = {0}
    for i in order:
        if len(kept) >= config.total_tokens:
            break
        if parents[i] in kept and scores[i] > -math.inf:
            kept.add(i)
    # relabel in breadth-first order; siblings ordered by score (best first)
    old = sorted(kept, key=lambda i: (depth_of[i], -scores[i], i))
    new_index = {o: n for n, o in enumerate(old)}
    new_parents = [-1] + [new_index[parents[o]] for o in old[1:]]
    tree = tree_from_parents(new_parents)
    new_tokens = torch.tensor([tokens[o] for o in old], dtype=torch.long)
    return tree, new_tokens


# ---------------------------------------------------------------------------------------------
# What a proposer (inference/medusa.py, inference/eagle.py) gets each step; it returns (tree, tokens [N])


@dataclass
class DraftInput:
    hidden: torch.Tensor  # [h] target's final-norm hidden state at the last token in the cache
    root: int  # the token the target chose after it (node 0 of the tree; not in the cache yet)
    context: list[int]  # every token so far (prompt + emitted), the root included
    features: torch.Tensor | None = None  # [k, n*h] the proposer's feature_layers taps of the k target cache
    # entries added since its last call (the prompt, then each accepted path); None unless it has feature_layers


class Proposer:
    """Everything the decode loop (inference/decode.py) calls on a draft; a method's proposer subclasses it.

    One proposer drafts one sequence at a time: `reset` before each prompt, then a call per step. With
    `feature_layers` the loop computes those target taps (HF hidden_states indices) and hands each call the ones of
    the cache entries added since the last (DraftInput.features). A `resizable` proposer drafts the tree `resize`
    names from then on, so the adaptive policy (inference/adapt.py) can drive it; the loop runs a fixed tree
    otherwise.
    """

    feature_layers: list[int] | None = None  # the target taps it reads; None: the final hidden state only
    resizable: bool = False  # resize(choices) is implemented
    # a draft with a confidence head (DSpark): after each call, c_1 .. along the drafted tree's rank-0 chain (each the
    # chance that node is accepted when the ones before it were); empty for the others
    confidence: Sequence[float] = ()

    def reset(self) -> None:
        """Forget the previous sequence (before each prefill): a stateless proposer has nothing to forget."""

    def resize(self, choices: list[list[int]]) -> None:
        """Draft the tree of these choices (static) or of their size, depth and width (dynamic) from now on."""
        raise NotImplementedError(f"{type(self).__name__} drafts one tree: it cannot resize (resizable is False)")

    def __call__(self, draft: DraftInput) -> tuple[Tree, torch.Tensor]:
        """-> (tree, tokens [N]) with tokens[0] == draft.root."""
        raise NotImplementedError


def spine_choices(probs: torch.Tensor, nodes: int) -> list[list[int]]:
    """probs [D, R] (depth d's probabilities of its top-R tokens, best first) -> the `nodes` rank paths worth most:
    the spine node at depth d ([0] * d) is worth S_d = p_1[0] ... p_d[0], the rank-r guess hung off the spine at depth
    d ([0] * (d - 1) + [r]) S_{d-1} p_d[r]. No node is worth more than its parent, so the most valuable ones form a
    tree. Each depth guesses without the tokens before it, so nothing hangs below a runner-up: its children would be
    guesses made for the spine's token."""
    D, R = probs.shape
    values = probs.double().tolist()
    candidates = []  # (-value, depth, rank)
    survival = 1.0
    for d in range(D):
        candidates += [(-survival * values[d][r], d + 1, r) for r in range(R)]
        survival *= values[d][0]
    chosen = sorted(candidates)[:nodes]
    return sorted(([0] * (d - 1) + [r] for _, d, r in chosen), key=lambda path: (len(path), path))


class SlotProposer(Proposer):
    """A proposer whose draft scores each depth on its own, without the tokens drafted before it (Medusa's heads, a
    block drafter's slots). A fixed tree (`--tree`, an engine's chain) is filled as it is: the node at depth d and
    rank r gets depth d's rank-r token. Once the adaptive policy resizes it (inference/adapt.py), the policy sets the
    node count and each step's own probabilities choose the nodes (spine_choices): the top-1 spine as deep as the
    depths stay confident, runner-up guesses where a depth hesitates. Shape and tokens are a function of the context
    alone, so verification (inference/verify.py) stays lossless."""

    resizable = True
    max_depth: int = 0  # the depths the draft scores
    what: str = "the draft"  # what scores them, for the error a too-deep tree gets

    def use_tree(self, tree: Tree) -> None:
        """The fixed tree to draft (before any resize)."""
        self._trees: dict[tuple, Tree] = {}
        self.per_step = False  # each step's probabilities shape the tree: on once the adaptive policy resizes it
        self.tree = self._checked(tree)

    def _checked(self, tree: Tree) -> Tree:
        if tree.max_depth > self.max_depth:
            raise ValueError(f"the tree is {tree.max_depth} deep but {self.what} drafts {self.max_depth} tokens; "
                             f"use a tree of depth <= {self.max_depth}")
        return tree

    def tree_of(self, choices: list[list[int]]) -> Tree:
        key = tuple(tuple(c) for c in choices)
        if key not in self._trees:
            self._trees[key] = self._checked(tree_from_choices(choices))
        return self._trees[key]

    def resize(self, choices: list[list[int]]) -> None:
        """Draft trees of as many nodes as these choices from now on, shaped by each step's probabilities."""
        self.tree = self.tree_of(choices)
        self.per_step = True

    def fill(self, root: int, slot_logits: Callable[[int], torch.Tensor],
             to_target_ids: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Tree, torch.Tensor]:
        """The step's tree and tokens [N] from slot_logits(depth) -> logits [depth, Vd] of depths 1..depth (and
        to_target_ids: draft-vocabulary indices -> target ids). The tree is not a plain step's (max_depth > 0)."""
        if not self.per_step:
            logits = slot_logits(self.tree.max_depth)  # [depth, Vd]
            topk = to_target_ids(logits.topk(max(self.tree.ranks) + 1, dim=-1).indices)  # [depth, k]
            return self.tree, static_tree_tokens(self.tree, root, topk)
        nodes = self.tree.size - 1
        logits = slot_logits(min(self.max_depth, nodes))  # [D, Vd]: n nodes reach at most n deep
        top = torch.softmax(logits.float(), -1).topk(min(nodes, logits.shape[-1]), dim=-1)  # [D, R]
        tree = self.tree_of(spine_choices(top.values, nodes))
        return tree, static_tree_tokens(tree, root, to_target_ids(top.indices))
