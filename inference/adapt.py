"""Online adaptation: each decode step chooses what to verify (a plain step, a heads tree, lookup branches, or the
two merged) by the most expected tokens per millisecond, from what this generation has accepted so far.

Every node of a verified tree carries the keys of the proposers that drafted it: ("heads", depth - 1, rank) for
the heads' tree, ("lookup", n, branch, position) for a continuation found after an n-token match in the context
(branch 0 = the latest match, 1 = any other), ("ngram", n, 0, position) for the chain the heads' n-gram table of
the target's own answers drafts after an n-token key (inference/ngram.py; with lookup on, where the heads directory
has one). After each verification every node whose parent was accepted is one trial for its keys, a hit when it was
accepted too: the policy keeps P(accepted | parent accepted) per key as exponentially decayed counts (`decay` per
trial) over a prior worth `prior_weight` trials: the heads' held-out accuracy per depth from training, taken as it is
(on prompts unlike the training ones a head is right after a right parent about as often as its accuracy alone says,
docs/generation.md), else inference/tree.py's DEFAULT_ACCURACY; LOOKUP_PRIOR and NGRAM_PRIOR for lookup and the
n-gram table. Lookup's and the table's priors decay with the counts; the heads' does not (RateTable), so where a
one-node draft costs next to nothing the heads keep drafting through a streak of misses. A tree's
expected tokens is 1 + the sum over its nodes of the product of the rates along the node's path, as
inference/tree.py sizes trees. The plan sizes the heads' tree and the lookup trie before the heads draft, as if
their nodes were distinct; once both are merged (a token both drafted is one node) a tree with lookup's branches in
it is cut to the nodes that pay (`prune`, AdaptivePolicy._prune): a merged node is right when either source is,
siblings share their parent's chance, and nodes are kept by path value up to the count with the most expected
tokens per step cost. A heads-only tree is left as drafted (Medusa's and DFlash's take their shape from the step's
own probabilities, which the rates do not see).

A step of n nodes costs ratio(n) one-token steps (the step-cost curve `--tree auto` measured, inference/calibrate.py,
else PRIOR_STEP_RATIO) plus the heads' draft when they draft (measured the same way, else the priors): never this
generation's wall clock, so choices follow acceptance only and seeded sampling repeats. A source that could draft
but was not verified for `probe_every` steps is verified once at its smallest (the heads: their top-1 guess;
lookup: two tokens), so a draft that stopped paying is looked at again and comes back when it pays; each failed
probe doubles the wait for the next, up to the wait over which a probe's extra cost over a plain step is PROBE_BUDGET
of a step (at most MAX_PROBE_GAP x probe_every): a draft useless for a whole generation costs a few probes, and where
a one-node probe costs next to nothing (a flat step-cost curve) the draft is looked at every probe_every steps, so a
draft right now and then is not left unverified for long. Lossless by
construction: whatever tree is chosen, the target verifies it exactly (inference/verify.py).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import torch

from headstart.inference.lookup import ContextIndex
from headstart.inference.ngram import NgramTable
from headstart.inference.tree import DEFAULT_ACCURACY, Tree, greedy_paths, tree_from_parents

Key = tuple
# Target step cost by tokens verified over a one-token step, docs/measured.md (SmolLM2-135M, oneDNN
# linears, 2 CPU cores): the curve used until `--tree auto` has measured this device's.
PRIOR_STEP_RATIO = {1: 1.0, 2: 1.13, 3: 1.16, 4: 1.18, 8: 1.29, 16: 1.53}
# The heads' draft over a one-token step, by tree nodes (0: any size), the same table: an EAGLE-3 draft growing 8
# nodes 4 deep took 17.9 ms of an 81 ms step; Medusa heads 1.3 ms with an 8192-token draft vocabulary and 5.4 ms
# with all 49152 tokens, of a 36 ms step (medusa_draft_prior).
PRIOR_EAGLE_DRAFT_RATIO = {2: 0.06, 4: 0.12, 8: 0.22, 16: 0.3}
# One DFlash draft layer over an 8-token block, in one-token steps of the same target: an estimate (a 30-layer
# target step runs 30 layers over one token); `--tree auto` measures the draft on the device.
DFLASH_LAYER_RATIO = 0.05


def medusa_draft_prior(draft_vocab_fraction: float) -> dict[int, float]:
    """Prior Medusa draft cost in one-token steps: the heads' blocks plus their share of the lm_head's rows."""
    return {0: 0.012 + 0.14 * draft_vocab_fraction}


def dflash_draft_prior(num_layers: int, draft_vocab_fraction: float) -> dict[int, float]:
    """Prior DFlash draft cost in one-token steps: its layers over the block and the lm_head's rows it scores."""
    return {0: DFLASH_LAYER_RATIO * num_layers + 0.14 * draft_vocab_fraction}
# Prior P(accepted | parent accepted) of a lookup node: its first token by match length n, later tokens alike.
LOOKUP_PRIOR_FIRST = {1: 0.3, 2: 0.5, 3: 0.6}
LOOKUP_PRIOR_NEXT = 0.7
# ... and of an n-gram table node (a guess below lookup's: a key seen in other conversations is a weaker match than
# one repeated in this context; the observed rates take over within a few trials)
NGRAM_PRIOR_FIRST = {1: 0.2, 2: 0.3, 3: 0.4, 4: 0.5}
NGRAM_PRIOR_NEXT = 0.6
LOOKUP_SOURCES = {"lookup": "lookup", "ngram": "lookup"}  # key source -> the plan's source (the trie holds both)
HEADS_RANKS = 4  # ranks per depth the heads' trees may use
MAX_PROBE_GAP = 8  # failed probes stretch the wait for the next one up to this many times probe_every
PROBE_BUDGET = 0.02  # ... and only while a probe's extra cost, spread over the wait, is above this share of a step


@dataclass
class AdaptConfig:
    heads_sizes: tuple[int, ...] = (2, 3, 4, 6, 8, 12, 16)  # nodes (root included) of the heads trees considered
    max_lookup: int = 16  # longest lookup branch, in drafted tokens
    max_matches: int = 3  # distinct continuations from the context verified as branches of one tree
    min_ngram: int = 1
    max_ngram: int = 3
    decay: float = 0.7  # per trial: an estimate follows about the last 1 / (1 - decay) trials
    prior_weight: float = 0.5  # the prior counts as this many trials
    probe_every: int = 4  # steps a source can go unverified before it is verified once at its smallest
    lasting_prior: tuple[str, ...] = ("heads",)  # sources whose prior never decays (RateTable)
    prune: bool = True  # a tree with lookup's branches in it: verify only the nodes that pay (AdaptivePolicy._prune)


class RateTable:
    """P(accepted | parent accepted) per key: (prior weight x prior + decayed hits) / (prior weight + decayed trials).

    The observations decay, so a draft that stopped paying falls towards its observed rate within a few trials. The
    prior's weight decays with them for most sources (lookup's prior is a guess), but not for the sources in
    `lasting` (the heads: their prior is their measured held-out accuracy), whose rates a streak of misses leaves
    at weight / (weight + 1 / (1 - decay)) of the prior or above."""

    def __init__(self, prior, decay: float, weight: float, lasting: tuple[str, ...] = ()):
        self.prior = prior  # key -> prior rate
        self.decay = decay
        self.weight = weight
        self.lasting = lasting
        self.counts: dict[Key, list[float]] = {}  # key -> [decayed hits, decayed trials, prior weight, prior rate]

    def rate(self, key: Key) -> float:
        counts = self.counts.get(key)
        if counts is None:
            return self.prior(key)
        hits, trials, weight, prior = counts
        return (weight * prior + hits) / (weight + trials)

    def observe(self, key: Key, hit: bool) -> None:
        counts = self.counts.get(key)
        if counts is None:
            counts = self.counts[key] = [0.0, 0.0, self.weight, self.prior(key)]
        counts[0] = counts[0] * self.decay + float(hit)
        counts[1] = counts[1] * self.decay + 1.0
        if key[0] not in self.lasting:
            counts[2] *= self.decay


class StepCost:
    """Cost of a step verifying n nodes, in one-token steps: ratio(n), plus the heads' draft when they draft.

    Fixed for the generation (measured by `--tree auto`, else the priors), never read from this generation's wall
    clock: the policy's choices then depend only on what was accepted, so a seeded sampling run repeats exactly."""

    def __init__(self, ratio: dict[int, float] | None = None, draft: dict[int, float] | None = None):
        points = sorted((int(n), float(r)) for n, r in (ratio or PRIOR_STEP_RATIO).items())
        base = dict(points).get(1, points[0][1])
        self.points = [(n, r / base) for n, r in points]  # relative to the one-token step
        self._ratios = [self._interpolate(n) for n in range(128)]  # looked up for the sizes a step can have
        self.draft = dict(draft if draft is not None else medusa_draft_prior(1.0))  # heads tree nodes (0: any) -> cost

    def ratio(self, n: int) -> float:
        """Piecewise-linear through the curve's points, extended along its last segment."""
        if n < len(self._ratios):
            return self._ratios[n]
        return self._interpolate(n)

    def _interpolate(self, n: int) -> float:
        points = self.points
        if n <= points[0][0] or len(points) == 1:
            return points[0][1]
        for (n0, r0), (n1, r1) in zip(points, points[1:]):
            if n <= n1:
                return r0 + (r1 - r0) * (n - n0) / (n1 - n0)
        (n0, r0), (n1, r1) = points[-2], points[-1]
        return r1 + (r1 - r0) * (n - n1) / (n1 - n0)

    def draft_cost(self, heads_nodes: int) -> float:
        """The heads' draft of a tree of heads_nodes nodes: its own entry, else the nearest size's."""
        if not heads_nodes or not self.draft:
            return 0.0
        if heads_nodes in self.draft:
            return self.draft[heads_nodes]
        return self.draft[min(self.draft, key=lambda size: abs(size - heads_nodes))]

    def cost(self, nodes: int, heads_nodes: int) -> float:
        return self.ratio(nodes) + self.draft_cost(heads_nodes)


@dataclass
class Plan:
    """What one step verifies: the heads' tree (choices; [] = the heads do not draft) and the lookup trie's nodes
    up to depth lookup_depth (0 = none)."""
    heads_choices: list[list[int]]
    lookup_depth: int
    trie: list[tuple[int, int, list[Key], int]] = field(default_factory=list)  # AdaptivePolicy._lookup_trie's
    probes: list[str] = field(default_factory=list)  # sources verified only as a probe ("heads", "lookup")
    possible: tuple[str, ...] = ()  # sources that had something to draft this step
    pruned: list[str] = field(default_factory=list)  # sources planned whose every node the merged tree's cut dropped

    @property
    def kind(self) -> str:
        """What the step verified: "both", "heads", "lookup" or "plain"."""
        heads = bool(self.heads_choices) and "heads" not in self.pruned
        lookup = bool(self.lookup_depth) and "lookup" not in self.pruned
        if heads and lookup:
            return "both"
        return "heads" if heads else "lookup" if lookup else "plain"


class AdaptivePolicy:
    """Chooses each step's Plan and learns from each verification; one per generated sequence."""

    def __init__(self, config: AdaptConfig | None = None, heads_accuracy: Sequence[Sequence[float]] | None = None,
                 heads_depth: int = 0, lookup: bool = True, cost: StepCost | None = None,
                 ngram: NgramTable | None = None):
        self.config = config or AdaptConfig()
        accuracy = [list(row) for row in (heads_accuracy or DEFAULT_ACCURACY)][:heads_depth]
        self.heads_depth = len(accuracy)  # 0: no heads (lookup only)
        self.lookup = lookup
        self.ngram = ngram if lookup else None  # drafts beside the context's lookup, as one more branch
        self.cost = cost or StepCost()

        def prior(key: Key) -> float:
            if key[0] == "heads":
                row = accuracy[key[1]]
                rank = key[2]
                return row[rank] if rank < len(row) else row[-1] * 0.5 ** (rank - len(row) + 1)
            source, n, _, position = key
            first, later = (NGRAM_PRIOR_FIRST, NGRAM_PRIOR_NEXT) if source == "ngram" else \
                (LOOKUP_PRIOR_FIRST, LOOKUP_PRIOR_NEXT)
            return first.get(n, max(first.values())) if position == 1 else later

        self.rates = RateTable(prior, self.config.decay, self.config.prior_weight, self.config.lasting_prior)
        self.unverified = {"heads": 0, "lookup": 0}  # steps since each source could draft and was verified
        # steps a source may go unverified before a probe: probe_every, doubled after each failed probe (up to
        # max_probe_gap), back to probe_every once it is chosen on its merits
        self.probe_gap = {"heads": self.config.probe_every, "lookup": self.config.probe_every}
        self.max_probe_gap = {"heads": self._max_probe_gap(self.cost.cost(2, 2) - self.cost.cost(1, 0)),
                              "lookup": self._max_probe_gap(self.cost.cost(3, 0) - self.cost.cost(1, 0))}
        self.kinds: Counter = Counter()  # plan kind -> steps
        self.sizes: Counter = Counter()  # tree nodes -> steps
        self.index: ContextIndex | None = None  # the generation's context, indexed for lookup as it grows
        self.trees: dict[tuple[int, ...], Tree] = {}  # parents -> tree: a generation meets the same few shapes again

    def _max_probe_gap(self, probe_extra_cost: float) -> int:
        """The longest wait between probes of a source whose probe costs `probe_extra_cost` steps over a plain one:
        where the probe's cost spread over the wait is PROBE_BUDGET, within [probe_every, MAX_PROBE_GAP x it]."""
        every = self.config.probe_every
        return min(MAX_PROBE_GAP * every, max(every, math.ceil(probe_extra_cost / PROBE_BUDGET)))

    def _heads_options(self) -> list[tuple[list[list[int]], float]]:
        """(choices, expected extra tokens) of the best heads tree of each allowed size, under the current rates."""
        if not self.heads_depth:
            return []
        table = [[self.rates.rate(("heads", d, r)) for r in range(HEADS_RANKS)] for d in range(self.heads_depth)]
        order = greedy_paths(table, max(self.config.heads_sizes) - 1)
        options, gain = [], 0.0
        for count, (_, value) in enumerate(order, start=1):
            gain += value
            if count + 1 in self.config.heads_sizes or count == len(order):
                options.append(([path for path, _ in order[:count]], gain))
        return options

    def _lookup_trie(self, branches: list[tuple[Key, list[int]]]) -> list[tuple[int, int, list[Key], int]]:
        """The branches ((source, n, branch), tokens) as a trie: nodes (parent, token, keys, depth), parent -1 = the
        root, parents first; a node's keys are (source, n, branch, position) of every branch through it."""
        nodes: list[tuple[int, int, list[Key], int]] = []
        index: dict[tuple[int, int], int] = {}
        for prefix, branch in branches:
            parent = -1
            for position, token in enumerate(branch, start=1):
                key = (*prefix, position)
                node = index.get((parent, token))
                if node is None:
                    node = index[(parent, token)] = len(nodes)
                    nodes.append((parent, token, [key], position))
                elif key not in nodes[node][2]:
                    nodes[node][2].append(key)
                parent = node
        return nodes

    def _lookup_options(self, trie) -> list[tuple[int, float, int]]:
        """(depth, expected extra tokens, drafted nodes) for every cut depth of the trie."""
        value: list[float] = []
        by_depth: dict[int, list[float]] = {}
        for parent, _, keys, depth in trie:
            v = (value[parent] if parent >= 0 else 1.0) * max(self.rates.rate(k) for k in keys)
            value.append(v)
            by_depth.setdefault(depth, []).append(v)
        options, gain, nodes = [], 0.0, 0
        for depth in sorted(by_depth):
            gain += sum(by_depth[depth])
            nodes += len(by_depth[depth])
            options.append((depth, gain, nodes))
        return options

    def plan(self, context: list[int]) -> Plan:
        cfg = self.config
        if self.lookup and (self.index is None or self.index.context is not context):
            self.index = ContextIndex(context)
        n, found = (self.index.branches(cfg.max_lookup, cfg.min_ngram, cfg.max_ngram, cfg.max_matches)
                    if self.lookup else (0, []))
        branches = [(("lookup", n, min(b, 1)), branch) for b, branch in enumerate(found)]
        if self.ngram is not None:
            n, chain = self.ngram.draft(context, cfg.max_lookup)
            if chain:
                branches.append((("ngram", n, 0), chain))
        heads = [([], 0.0)] + self._heads_options()
        trie = self._lookup_trie(branches)
        lookups = [(0, 0.0, 0)] + self._lookup_options(trie)
        best, best_rate = (heads[0], lookups[0]), 0.0
        for h in heads:
            heads_nodes = len(h[0]) + 1 if h[0] else 0
            for lk in lookups:
                rate = (1.0 + h[1] + lk[1]) / self.cost.cost(1 + len(h[0]) + lk[2], heads_nodes)
                if rate > best_rate:
                    best, best_rate = (h, lk), rate
        (choices, _), (depth, _, _) = best
        probes = []
        if len(heads) > 1 and not choices and self.unverified["heads"] >= self.probe_gap["heads"]:
            choices = [[0]]  # the heads' top-1 guess decides
            probes.append("heads")
        if len(lookups) > 1 and not depth and self.unverified["lookup"] >= self.probe_gap["lookup"]:
            depth = lookups[min(2, len(lookups) - 1)][0]
            probes.append("lookup")
        possible = tuple(source for source, options in (("heads", heads), ("lookup", lookups)) if len(options) > 1)
        return Plan(heads_choices=choices, lookup_depth=depth, trie=trie, probes=probes, possible=possible)

    def _count_unverified(self, plan: Plan) -> None:
        """After the step's tree is final: a source that could draft and was not verified waits one step longer
        for its probe; one verified on its merits (not as a probe) is probed at the shortest wait again."""
        for source in ("heads", "lookup"):
            used = source not in plan.pruned and bool(plan.heads_choices if source == "heads" else plan.lookup_depth)
            self.unverified[source] = 0 if used or source not in plan.possible else self.unverified[source] + 1
            if used and source not in plan.probes:
                self.probe_gap[source] = self.config.probe_every

    def build(self, plan: Plan, root: int, heads_tree: Tree | None = None,
              heads_tokens: torch.Tensor | None = None) -> tuple[Tree, torch.Tensor, list[list[Key]]]:
        """The tree to verify: the heads' tree (when they drafted) with the lookup trie cut at plan.lookup_depth
        merged in (a node both drafted is one node with both keys). -> (tree, tokens [N], keys per node)."""
        if heads_tree is not None:
            parents, tokens = list(heads_tree.parents), heads_tokens.tolist()
            keys: list[list[Key]] = [[]] + [[("heads", heads_tree.depths[i] - 1, heads_tree.ranks[i])]
                                            for i in range(1, heads_tree.size)]
        else:
            parents, tokens, keys = [-1], [root], [[]]
        child = {(parents[i], tokens[i]): i for i in range(1, len(parents))}
        trie_node: list[int] = []  # trie node -> tree node
        for parent, token, node_keys, depth in (plan.trie if plan.lookup_depth else []):
            if depth > plan.lookup_depth:
                trie_node.append(-1)
                continue
            at = 0 if parent < 0 else trie_node[parent]
            node = child.get((at, token))
            if node is None:
                node = child[(at, token)] = len(parents)
                parents.append(at)
                tokens.append(token)
                keys.append([])
            keys[node].extend(node_keys)
            trie_node.append(node)
        if self.config.prune and plan.lookup_depth and not plan.probes and len(parents) > 2:
            parents, tokens, keys = self._prune(parents, tokens, keys)
            kept = {LOOKUP_SOURCES.get(key[0], key[0]) for node_keys in keys for key in node_keys}
            planned = [source for source, drafted in (("heads", plan.heads_choices), ("lookup", plan.lookup_depth))
                       if drafted]
            plan.pruned = [source for source in planned if source not in kept]
        self._count_unverified(plan)
        if heads_tree is not None and parents == list(heads_tree.parents):
            tree = heads_tree
        else:
            tree = self.trees.get(tuple(parents))
            if tree is None:
                tree = self.trees[tuple(parents)] = tree_from_parents(parents)
        return tree, torch.tensor(tokens, dtype=torch.long), keys

    def _node_rate(self, keys: list[Key]) -> float:
        """P(a node is accepted | its parent was): its proposer's rate, or where several proposers drafted the same
        token, the chance that at least one is right (noisy-or; the plan counted each of them as its own node)."""
        miss = 1.0
        for key in keys:
            miss *= 1.0 - self.rates.rate(key)
        return 1.0 - miss

    def _prune(self, parents: list[int], tokens: list[int], keys: list[list[Key]]
               ) -> tuple[list[int], list[int], list[list[Key]]]:
        """The merged tree cut to the nodes worth verifying: the plan sized the heads' tree and the lookup trie
        before the heads drafted, as if their nodes were distinct; once merged, a token both drafted is one node
        (noisy-or of their rates) and siblings are exclusive (at most one is the target's token: their rates are
        scaled to sum to at most 1). A node's value is the product of the rates on its path; the nodes are taken by
        value (a parent before its children) up to the count with the most expected tokens per step cost (the draft
        is paid already). -> parents, tokens, keys of the kept nodes, in their order."""
        n = len(parents)
        rates = [1.0] + [self._node_rate(keys[i]) for i in range(1, n)]
        children: dict[int, list[int]] = {}
        for node in range(1, n):
            children.setdefault(parents[node], []).append(node)
        for siblings in children.values():
            mass = sum(rates[c] for c in siblings)
            if mass > 1.0:
                for c in siblings:
                    rates[c] /= mass
        value = [1.0] * n
        for node in range(1, n):  # parents come first
            value[node] = value[parents[node]] * rates[node]
        order = sorted(range(1, n), key=lambda node: (-value[node], node))  # a parent is never after its child
        best_count, best_rate, gain = 0, 1.0 / self.cost.ratio(1), 0.0
        for count, node in enumerate(order, start=1):
            gain += value[node]
            rate = (1.0 + gain) / self.cost.ratio(count + 1)
            if rate > best_rate:
                best_count, best_rate = count, rate
        if best_count == n - 1:
            return parents, tokens, keys
        kept = sorted([0] + order[:best_count])
        new_index = {old: new for new, old in enumerate(kept)}
        return ([-1] + [new_index[parents[node]] for node in kept[1:]], [tokens[node] for node in kept],
                [keys[node] for node in kept])

    def observe(self, plan: Plan, tree: Tree, keys: list[list[Key]], path: list[int]) -> None:
        """Learn from one verification: every node whose parent was accepted is a trial for its keys."""
        accepted = set(path)
        hit_sources = set()
        for node in range(1, tree.size):
            if tree.parents[node] in accepted:
                for key in keys[node]:
                    self.rates.observe(key, node in accepted)
                    if node in accepted:
                        hit_sources.add(key[0])
        for source in plan.probes:  # a failed probe: wait twice as long for the next
            gap = self.config.probe_every if source in hit_sources else 2 * self.probe_gap[source]
            self.probe_gap[source] = min(gap, self.max_probe_gap[source])
        self.kinds[plan.kind] += 1
        self.sizes[tree.size] += 1
