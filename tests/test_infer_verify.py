"""Acceptance rules on stub targets: greedy, lossless sampling (a statistical test that catches biased
rules), typical acceptance, temperature / top-p processing."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chi2

from headstart.inference.tree import DynamicTreeConfig, build_dynamic_tree, static_tree_tokens, tree_from_choices
from headstart.inference.verify import greedy_accept, sample_accept, target_probs, typical_accept

V = 8  # stub vocabulary


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ---------------------------------------------------------------------------------------------
# Greedy


def test_greedy_accepts_longest_matching_path_plus_bonus():
    #        0 (root)
    #      /   \
    #   1:a5   2:a6
    #    |       |
    #   3:a7    4:a1
    tree = tree_from_choices([[0], [1], [0, 0], [1, 0]])
    tokens = [9, 5, 6, 7, 1]
    logits = torch.full((5, 10), -1.0)
    logits[0, 6] = 1.0  # the target wants 6 after the root: node 2 (rank 1) matches
    logits[2, 1] = 1.0  # then 1: node 4 matches
    logits[4, 3] = 1.0  # bonus 3
    logits[1, 7] = 1.0  # (node 1's branch would also match, but node 1 was not accepted)
    assert greedy_accept(tree.children, tokens, logits) == ([0, 2, 4], 3)
    logits[0, 6] = -5.0
    logits[0, 0] = 1.0  # no child matches: only the bonus
    assert greedy_accept(tree.children, tokens, logits) == ([0], 0)


# ---------------------------------------------------------------------------------------------
# Lossless sampling: a stub target over V = 8 tokens whose distribution depends on the last two tokens,
# and a deterministic draft (a function of the context). The first three emitted tokens are compared with
# the target's exact joint probabilities (512 cells) by a chi-square test.


def _stub_tables(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    target_logits = 1.5 * torch.randn(V, V, V, generator=gen)  # [prev2, prev1, V]
    draft_rank = torch.stack([torch.stack([torch.randperm(V, generator=gen) for _ in range(4)]) for _ in range(V)])
    return target_logits, draft_rank  # draft_rank [prev1, depth, V]: ranked guesses per depth


def _exact_joint(target_logits, prompt, temperature, top_p) -> torch.Tensor:
    """[V, V, V] exact probability of the first three tokens after `prompt`."""
    probs = target_probs(target_logits, temperature, top_p).double()  # [V, V, V]
    joint = torch.zeros(V, V, V, dtype=torch.float64)
    a, b = prompt[-2], prompt[-1]
    for t1, t2 in itertools.product(range(V), range(V)):
        joint[t1, t2] = probs[a, b, t1] * probs[b, t1, t2] * probs[t1, t2]
    return joint


def _simulate(rule, n: int, tree_kind: str, temperature: float, top_p: float, seed: int) -> torch.Tensor:
    """Counts [V, V, V] of the first three tokens over n speculative runs using acceptance `rule`."""
    target_logits, draft_rank = _stub_tables()
    probs_table = target_probs(target_logits, temperature, top_p)  # [V, V, V]
    static = tree_from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    gen = torch.Generator().manual_seed(seed)
    prompt = [3, 4]

    def dynamic_draft(tokens, parents, frontier):  # deterministic: log-probs from the draft ranking
        out = torch.full((len(frontier), V), -30.0)
        for f, node in enumerate(frontier):
            depth = 0
            j = node
            while parents[j] >= 0:
                depth, j = depth + 1, parents[j]
            ranked = draft_rank[int(tokens[node]), depth % 4]
            out[f, ranked] = -torch.arange(V, dtype=torch.float32) * 0.7
        return out

    dynamic_trees: dict[int, tuple] = {}
    counts = torch.zeros(V * V * V, dtype=torch.long)
    for _ in range(n):
        seq = list(prompt)
        root = int(torch.multinomial(probs_table[seq[-2], seq[-1]], 1, generator=gen))  # the prefill's token
        seq.append(root)
        while len(seq) < len(prompt) + 3:
            if tree_kind == "static":
                tree = static
                tokens = static_tree_tokens(tree, root, draft_rank[root, :3]).tolist()
            else:  # the draft is a function of the context (here: of the root only), so cache its trees
                if root not in dynamic_trees:
                    tree, tok = build_dynamic_tree(root, dynamic_draft, DynamicTreeConfig(topk=3, depth=3, total_tokens=8))
                    dynamic_trees[root] = (tree, tok.tolist())
                tree, tokens = dynamic_trees[root]
            # the target's distribution after every node: context = seq + the node's path tokens
            node_ctx = []
            for i in range(tree.size):
                path_tokens = seq + [tokens[j] for j in tree.path_to(i)[1:]]
                node_ctx.append((path_tokens[-2], path_tokens[-1]))
            idx = torch.tensor(node_ctx)
            node_probs = probs_table[idx[:, 0], idx[:, 1]]  # [N, V]
            path, bonus = rule(tree.children, tokens, node_probs, gen)
            seq.extend([tokens[j] for j in path[1:]] + [bonus])
            root = bonus
        t1, t2, t3 = seq[len(prompt): len(prompt) + 3]
        counts[t1 * V * V + t2 * V + t3] += 1
    return counts.reshape(V, V, V)


def _chi_square_pvalue(counts: torch.Tensor, exact: torch.Tensor) -> float:
    """Pearson chi-square of counts against exact probabilities; cells expecting < 5 are pooled."""
    n = counts.sum().item()
    expected = (exact.reshape(-1) * n).double()
    observed = counts.reshape(-1).double()
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return float(chi2.sf(stat, int(keep.sum()) - 1))


def _biased_rule(accept_probability):
    """A tree walk like sample_accept but WRONG on purpose: child x of a node is accepted with
    accept_probability(p_now(x), p_orig(x)), p_now being the renormalised remainder after rejections."""

    def accept(children, tokens, probs, generator=None):
        path, node = [0], 0
        while True:
            p = probs[node].double().clone()
            accepted = None
            for child in children[node]:
                x = tokens[child]
                chance = accept_probability(float(p[x] / p.sum()), float(probs[node, x]))
                if float(torch.rand((), generator=generator, dtype=torch.float64)) < chance:
                    accepted = child
                    break
                p[x] = 0.0
            if accepted is None:
                return path, int(torch.multinomial(p, 1, generator=generator))
            path.append(accepted)
            node = accepted

    return accept


_biased_overaccept = _biased_rule(lambda p_now, p_orig: min(1.0, 1.5 * p_now))  # accepts with min(1, 1.5 p(x))
_biased_no_renormalise = _biased_rule(lambda p_now, p_orig: p_orig)  # ignores earlier rejections


N_SAMPLES = 8000


@pytest.mark.parametrize("tree_kind,temperature,top_p", [("static", 1.0, 1.0), ("dynamic", 0.7, 0.85)])
def test_sampling_acceptance_keeps_the_target_distribution(tree_kind, temperature, top_p):
    target_logits, _ = _stub_tables()
    exact = _exact_joint(target_logits, [3, 4], temperature, top_p)
    counts = _simulate(sample_accept, N_SAMPLES, tree_kind, temperature, top_p, seed=1)
    pvalue = _chi_square_pvalue(counts, exact)
    print(f"lossless {tree_kind}: chi-square p = {pvalue:.3g}")
    assert pvalue > 1e-3
    # total variation as a second, readable check (sampling noise at 8k samples is about 0.07 here)
    assert 0.5 * (counts.double() / N_SAMPLES - exact).abs().sum() < 0.1


@pytest.mark.parametrize("rule", [_biased_overaccept, _biased_no_renormalise])
def test_the_distribution_test_detects_biased_acceptance(rule):
    """The same test, same sample size, must reject a deliberately biased acceptance rule."""
    target_logits, _ = _stub_tables()
    exact = _exact_joint(target_logits, [3, 4], 1.0, 1.0)
    counts = _simulate(rule, N_SAMPLES, "static", 1.0, 1.0, seed=1)
    pvalue = _chi_square_pvalue(counts, exact)
    print(f"{rule.__name__}: chi-square p = {pvalue:.3g}")
    assert pvalue < 1e-6


def test_sample_accept_edge_cases():
    tree = tree_from_choices([[0], [1]])
    gen = torch.Generator().manual_seed(0)
    probs = torch.zeros(3, V)
    probs[:, 5] = 1.0  # the target is certain of token 5
    # a drafted 5 is always accepted; the bonus then comes from that node's distribution
    assert sample_accept(tree.children, [0, 5, 6], probs, gen) == ([0, 1], 5)
    assert sample_accept(tree.children, [0, 6, 5], probs, gen) == ([0, 2], 5)
    # neither drafted token possible: the bonus is sampled from the residual, never a rejected token
    probs = torch.zeros(3, V)
    probs[0, 1], probs[0, 2], probs[0, 3] = 0.5, 0.25, 0.25
    probs[1:, 0] = 1.0
    seen = [sample_accept(tree.children, [0, 6, 7], probs, gen) for _ in range(50)]
    assert all(path == [0] for path, _ in seen)
    assert {b for _, b in seen} == {1, 2, 3}
    # token 1 drafted at node 1: accepted about half the time; once rejected it never comes back as the bonus
    results = [sample_accept(tree.children, [0, 1, 7], probs, gen) for _ in range(400)]
    accepted = sum(path == [0, 1] for path, _ in results)
    assert 150 < accepted < 250
    assert {b for path, b in results if path == [0]} == {2, 3}


# ---------------------------------------------------------------------------------------------
# Temperature, top-p, typical acceptance


def test_target_probs_matches_transformers_top_p():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    for t, p in [(1.0, 1.0), (0.7, 0.9), (1.3, 0.5), (0.5, 0.05)]:
        scores = TemperatureLogitsWarper(t)(None, logits.clone())
        if p < 1.0:
            scores = TopPLogitsWarper(p)(None, scores)
        torch.testing.assert_close(target_probs(logits, t, p), scores.softmax(-1))
    with pytest.raises(ValueError, match="temperature"):
        target_probs(logits, 0.0)


def test_typical_acceptance_follows_the_threshold():
    tree = tree_from_choices([[0], [1], [0, 0]])
    tokens = [0, 3, 4, 5]
    logits = torch.full((4, V), -10.0)
    logits[0, 3] = 5.0  # root: very confident in 3 (node 1); node 2's token 4 is improbable
    logits[1, 5] = 5.0  # node 1: confident in 5 (node 3)
    logits[3, 2] = 5.0
    path, bonus = typical_accept(tree.children, tokens, logits, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert path == [0, 1, 3] and bonus == 2
    # a flat distribution at the root: p = 1/8 > min(0.09, 0.3 * exp(-log 8)) = 0.0375, so drafts are accepted
    flat = torch.zeros(4, V)
    path, _ = typical_accept(tree.children, tokens, flat, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert path == [0, 1, 3]  # typical acceptance accepts what sampling would often reject: it is lossy
    # a peaked distribution on another token: rejected
    peaked = torch.full((4, V), -10.0)
    peaked[:, 7] = 5.0
    path, bonus = typical_accept(tree.children, tokens, peaked, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert path == [0] and bonus == 7
