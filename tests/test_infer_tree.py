"""Tree construction: static trees from choices, masks/positions/paths, the greedy best tree, dynamic trees, the
per-step trees of drafts that score each depth on its own."""

from __future__ import annotations

import itertools

import pytest
import torch

from headstart.inference.tree import (DEFAULT_ACCURACY, DynamicTreeConfig, default_choices, best_choices, build_dynamic_tree,
                            expected_accept_length, path_value, spine_choices, static_tree_tokens, tree_choices,
                            tree_from_choices)

CHOICES = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def test_static_tree_structure():
    tree = tree_from_choices([[0, 0, 0], [1], [0, 1], [0], [1, 0], [0, 0]])  # any order in
    # breadth-first: root, [0], [1], [0,0], [0,1], [1,0], [0,0,0]
    assert tree.parents == [-1, 0, 0, 1, 1, 2, 3]
    assert tree.depths == [0, 1, 1, 2, 2, 2, 3]
    assert tree.ranks == [0, 0, 1, 0, 1, 0, 0]
    assert tree.children[0] == [1, 2] and tree.children[1] == [3, 4] and tree.children[3] == [6]
    assert sorted(tree.paths) == sorted([[0, 1, 3, 6], [0, 1, 4], [0, 2, 5]])  # one root-to-leaf path per leaf
    assert tree_choices(tree) == CHOICES


def test_mask_and_positions():
    tree = tree_from_choices(CHOICES)
    n, prefix = tree.size, 5
    mask = tree.attention_mask(prefix)
    assert mask.shape == (1, 1, n, prefix + n) and mask.dtype == torch.float32
    allowed = mask[0, 0] == 0
    assert allowed[:, :prefix].all()  # every node sees the whole prefix
    for i, j in itertools.product(range(n), range(n)):
        assert bool(allowed[i, prefix + j]) == (j in tree.path_to(i)), (i, j)  # ancestors and itself only
    assert (mask[0, 0][~allowed] == torch.finfo(torch.float32).min).all()
    assert tree.position_ids(prefix).tolist() == [[5, 6, 6, 7, 7, 7, 8]]
    assert tree.attention_mask(0, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_bad_choices():
    with pytest.raises(ValueError, match="no parent"):
        tree_from_choices([[0], [0, 1, 0]])
    with pytest.raises(ValueError, match="empty path"):
        tree_from_choices([[]])


def test_static_tree_tokens():
    tree = tree_from_choices(CHOICES)
    topk = torch.tensor([[10, 11], [20, 21], [30, 31]])  # [depth, k]
    assert static_tree_tokens(tree, 7, topk).tolist() == [7, 10, 11, 20, 21, 20, 30]
    with pytest.raises(ValueError, match="depth"):
        static_tree_tokens(tree, 7, topk[:2])


def _connected_trees(num_nodes: int, depth: int, ranks: int):
    """Every connected set of `num_nodes` rank paths (each path's prefixes included)."""
    universe = [list(p) for d in range(1, depth + 1) for p in itertools.product(range(ranks), repeat=d)]
    for subset in itertools.combinations(universe, num_nodes):
        keys = {tuple(p) for p in subset}
        if all(tuple(p[:-1]) in keys or len(p) == 1 for p in subset):
            yield [list(p) for p in subset]


def test_best_choices_is_optimal_on_small_cases():
    accuracy = [[0.6, 0.2, 0.1], [0.5, 0.3, 0.05], [0.45, 0.1, 0.1]]
    for n in range(1, 6):
        greedy = best_choices(accuracy, n)
        assert len(greedy) == n
        tree_from_choices(greedy)  # connected
        best = max(expected_accept_length(t, accuracy) for t in _connected_trees(n, 3, 3))
        assert expected_accept_length(greedy, accuracy) == pytest.approx(best)


def test_best_choices_expected_length_and_default():
    assert path_value([0, 1], [[0.5, 0.2], [0.4, 0.3]]) == pytest.approx(0.15)
    assert expected_accept_length([[0], [0, 1]], [[0.5, 0.2], [0.4, 0.3]]) == pytest.approx(1 + 0.5 + 0.15)
    assert max(len(c) for c in best_choices(DEFAULT_ACCURACY, 60, max_depth=2)) == 2


def test_default_trees():
    """The default Medusa trees (8 nodes with the root, the size the CPU timings favour), written out: under the
    prior the top-1 chain goes deepest, second ranks branch near the root; the depth never exceeds the heads."""
    assert default_choices(5) == [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]
    assert default_choices(3) == [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    assert default_choices(2) == [[0], [1], [2], [0, 0], [0, 1], [0, 2], [1, 0]]
    assert default_choices(1) == [[r] for r in range(7)]
    for heads in range(1, 6):
        tree = tree_from_choices(default_choices(heads))  # connected: every prefix of a path is a node
        assert tree.size == 8 and tree.max_depth == min(heads, 4)  # a 5th head adds nothing worth a node
        assert tree_choices(tree) == default_choices(heads)


def test_dynamic_tree_keeps_the_best_connected_nodes():
    vocab = 6
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(vocab, vocab, generator=gen).log_softmax(-1)  # next-token log-probs given the last token
    calls = []

    def draft(tokens, parents, frontier):
        calls.append(list(frontier))
        return table[tokens[frontier]]  # [F, V]

    cfg = DynamicTreeConfig(topk=2, depth=3, total_tokens=7)
    tree, tokens = build_dynamic_tree(4, draft, cfg)
    assert tokens[0] == 4 and tree.size == 7 and len(calls) == cfg.depth
    assert all(len(f) <= cfg.topk for f in calls)

    def score(i):  # cumulative log-prob of node i's path
        path = tree.path_to(i)
        return sum(float(table[tokens[a], tokens[b]]) for a, b in zip(path, path[1:]))

    # brute force the same expansion: every expanded candidate with its score
    cands = []  # (score, token path)
    frontier = [((4,), 0.0)]
    for _ in range(cfg.depth):
        new = []
        for path, s in frontier:
            lp, tok = table[path[-1]].topk(cfg.topk)
            for l, t in zip(lp.tolist(), tok.tolist()):
                new.append((path + (t,), s + l))
        cands += new
        frontier = sorted(new, key=lambda c: -c[1])[: cfg.topk]
    best = sorted(s for _, s in cands)[::-1][: cfg.total_tokens - 1]
    kept = sorted((score(i) for i in range(1, tree.size)), reverse=True)
    assert kept == pytest.approx(best)
    for i in range(1, tree.size):  # children are the draft's top-k of their parent, siblings best first
        assert int(tokens[i]) in table[tokens[tree.parents[i]]].topk(cfg.topk).indices.tolist()
        kids = tree.children[tree.parents[i]]
        assert [score(k) for k in kids] == sorted((score(k) for k in kids), reverse=True)
    assert all(0 <= p < i for i, p in enumerate(tree.parents) if i)  # breadth-first: parents first


def test_spine_choices_take_the_most_probable_paths_and_nothing_below_a_runner_up():
    """Spine depth d is worth p_1[0] .. p_d[0]; the rank-r guess at depth d the spine to d - 1 times p_d[r]."""
    probs = torch.tensor([[0.9, 0.05, 0.03],  # spine 1: .9; [1] .05, [2] .03
                          [0.5, 0.4, 0.05],  # spine 2: .45; [0, 1] .36, [0, 2] .045
                          [0.7, 0.2, 0.05]])  # spine 3: .315; [0, 0, 1] .09
    assert spine_choices(probs, 1) == [[0]]
    assert spine_choices(probs, 4) == [[0], [0, 0], [0, 1], [0, 0, 0]]
    assert spine_choices(probs, 6) == [[0], [1], [0, 0], [0, 1], [0, 0, 0], [0, 0, 1]]  # [0, 0, 1] .09 before [1]
    hesitant_first = torch.tensor([[0.3, 0.29, 0.2], [0.5, 0.1, 0.05], [0.99, 0.005, 0.001]])
    assert spine_choices(hesitant_first, 3) == [[0], [1], [2]]  # breadth where the first slot hesitates
    for nodes in range(1, 10):  # always a tree: every node's parent chosen, ranks contiguous under a parent
        chosen = spine_choices(probs, nodes)
        assert len(chosen) == min(nodes, 9)
        tree_from_choices(chosen)
        assert all(path[:-1] in chosen or len(path) == 1 for path in chosen)
        assert all(path[-1] == 0 or path[:-1] + [path[-1] - 1] in chosen for path in chosen)
