"""Adaptive drafting (inference/adapt.py): scripted proposers and a scripted step cost drive the policy; the real
decode loop under adaptation stays greedy-exact and keeps the target's sampling distribution."""

from __future__ import annotations


import pytest
import torch
from conftest import chi_square_pvalue, exact_first_three, tiny_model

from headstart.heads.medusa import MedusaConfig, MedusaHeads
from headstart.inference.adapt import (LOOKUP_PRIOR_FIRST, LOOKUP_PRIOR_NEXT, MAX_PROBE_GAP, AdaptConfig,
                                       AdaptivePolicy, StepCost)
from headstart.inference.decode import SamplingConfig, speculative_generate
from headstart.inference.speculator import Speculator
from headstart.inference.tree import tree_from_choices

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

REPEATING = list(range(40)) * 3  # a context whose tail always occurred before: lookup always has branches


def simulate(policy: AdaptivePolicy, steps: int, heads_right, lookup_right=lambda step, branch, pos: False,
             context=(1, 2, 3)) -> list:
    """Run `steps` plan -> build -> verify -> observe rounds without a model.

    heads_right(step, depth, rank) and lookup_right(step, branch, position) say which drafted nodes the "target"
    accepts (a node is right when any of its keys says so; the first right child is taken). The step costs
    policy's prior cost curve. Returns each step's (plan, accepted drafted tokens)."""
    history = []
    for step in range(steps):
        plan = policy.plan(list(context))
        heads_tree = heads_tokens = None
        if plan.heads_choices:
            heads_tree = tree_from_choices(plan.heads_choices)
            heads_tokens = torch.arange(heads_tree.size) + 10_000  # never equal to a lookup token
        tree, tokens, keys = policy.build(plan, context[-1], heads_tree, heads_tokens)

        def right(node: int) -> bool:
            for key in keys[node]:
                if key[0] == "heads" and heads_right(step, key[1], key[2]):
                    return True
                if key[0] == "lookup" and lookup_right(step, key[2], key[3]):
                    return True
            return False

        path, node = [0], 0
        while True:
            nxt = next((c for c in tree.children[node] if right(c)), None)
            if nxt is None:
                break
            path.append(nxt)
            node = nxt
        policy.observe(plan, tree, keys, path)
        history.append((plan, len(path) - 1))
    return history


def perfect(step, depth, rank):
    return rank == 0


def useless(step, depth, rank):
    return False


def test_a_perfect_draft_reaches_the_deepest_tree():
    policy = AdaptivePolicy(AdaptConfig(), heads_accuracy=[[0.3, 0.1]] * 5, heads_depth=5, lookup=False)
    history = simulate(policy, 30, perfect)
    late = [plan for plan, _ in history[10:]]
    assert all([0] * 5 in plan.heads_choices for plan in late)  # the whole rank-0 chain, 5 heads deep
    assert all(accepted == 5 for _, accepted in history[10:])


def test_a_useless_draft_costs_a_few_steps_then_probes_only():
    cfg = AdaptConfig()
    policy = AdaptivePolicy(cfg, heads_accuracy=[[0.6, 0.2]] * 3, heads_depth=3, lookup=False)
    history = simulate(policy, 64, useless)
    heads_steps = [i for i, (plan, _) in enumerate(history) if plan.heads_choices]
    assert len([i for i in heads_steps if i < 8]) <= 3  # a few steps to learn the heads are wrong
    later = [i for i in heads_steps if i >= 8]
    assert policy.max_probe_gap["heads"] > cfg.probe_every  # a probe costs something on the prior curve: waits grow
    assert len(later) <= 64 // policy.max_probe_gap["heads"] + 2  # failed probes: the longest wait between
    assert all(len(history[i][0].heads_choices) == 1 for i in later)  # probes verify one node
    assert policy.kinds["plain"] >= 50


def test_a_draft_that_collapses_is_dropped_and_comes_back():
    """Right for 30 steps, useless for 40, right again: dropped within 8 steps, back at the next probe."""
    cfg = AdaptConfig()

    def changing(step, depth, rank):
        return rank == 0 and not 30 <= step < 70

    policy = AdaptivePolicy(cfg, heads_accuracy=[[0.5, 0.2]] * 3, heads_depth=3, lookup=False)
    history = simulate(policy, 110, changing)
    uses = [bool(plan.heads_choices) and len(plan.heads_choices) > 1 for plan, _ in history]
    assert all(uses[5:30])
    assert not any(uses[38:70])  # after 8 wasted steps at most, only one-node probes
    back = next(i for i in range(70, 110) if all(uses[i: i + 10]))
    assert back <= 70 + policy.max_probe_gap["heads"] + 2  # the next probe, at the longest wait


def test_probes_that_cost_next_to_nothing_keep_their_first_wait():
    """On a flat step-cost curve (a two-token step costs a one-token step's) a one-node probe costs only the draft:
    the heads are probed every probe_every steps however often probes fail; on a steep curve the wait grows, up to
    MAX_PROBE_GAP x."""
    cfg = AdaptConfig()
    flat = StepCost({1: 1.0, 2: 1.0, 4: 1.2, 16: 1.6}, {0: 0.01})
    policy = AdaptivePolicy(cfg, heads_accuracy=[[0.6, 0.2]] * 3, heads_depth=3, lookup=False, cost=flat)
    assert policy.max_probe_gap["heads"] == cfg.probe_every
    history = simulate(policy, 64, useless)
    probes = [i for i, (plan, _) in enumerate(history) if plan.heads_choices and i >= 8]
    assert all(b - a <= cfg.probe_every + 1 for a, b in zip(probes, probes[1:])) and len(probes) >= 64 // 5 - 2
    steep = StepCost({1: 1.0, 2: 2.0, 16: 4.0}, {0: 0.2})
    assert AdaptivePolicy(cfg, heads_depth=3, cost=steep).max_probe_gap["heads"] == MAX_PROBE_GAP * cfg.probe_every


def test_heads_right_now_and_then_keep_drafting_through_misses_where_a_node_costs_next_to_nothing():
    """Heads right one step in fifteen, on a flat step-cost curve: a one-node draft pays (0.067 tokens for 2% of a step),
    and the heads' lasting prior keeps their rate above that through any streak of misses, so no step is plain. With
    the prior decaying like the observations, a streak of misses takes the rate to nothing and steps go plain."""
    flat = StepCost({1: 1.0, 2: 1.0, 4: 1.2, 16: 1.6}, {0: 0.02})

    def now_and_then(step, depth, rank):
        return rank == 0 and depth == 0 and step % 15 == 0

    lasting = AdaptivePolicy(AdaptConfig(), heads_accuracy=[[0.4, 0.1]] * 3, heads_depth=3, lookup=False, cost=flat)
    simulate(lasting, 90, now_and_then)
    assert lasting.kinds["plain"] == 0 and lasting.kinds["heads"] == 90
    fading = AdaptivePolicy(AdaptConfig(lasting_prior=()), heads_accuracy=[[0.4, 0.1]] * 3, heads_depth=3,
                            lookup=False, cost=flat)
    simulate(fading, 90, now_and_then)
    assert fading.kinds["plain"] >= 15


def test_lookup_chains_grow_as_long_as_they_are_accepted():
    cfg = AdaptConfig()
    policy = AdaptivePolicy(cfg, heads_depth=0, lookup=True)  # lookup only
    history = simulate(policy, 20, useless, lambda step, branch, pos: branch == 0, context=REPEATING)
    assert [plan.lookup_depth for plan, _ in history[-5:]] == [cfg.max_lookup] * 5
    assert all(accepted == cfg.max_lookup for _, accepted in history[-5:])


def test_useless_lookup_is_dropped_for_the_heads():
    policy = AdaptivePolicy(AdaptConfig(), heads_accuracy=[[0.5, 0.2]] * 3, heads_depth=3, lookup=True)
    history = simulate(policy, 40, perfect, context=REPEATING)
    kinds = [plan.kind for plan, _ in history[8:]]
    assert kinds.count("heads") >= len(kinds) - 5 and "plain" not in kinds


def test_two_sources_right_half_the_time_each_are_verified_together():
    policy = AdaptivePolicy(AdaptConfig(), heads_accuracy=[[0.5, 0.2]] * 3, heads_depth=3, lookup=True,
                            cost=StepCost(None, {0: 0.04}))  # a draft-vocabulary Medusa draft's cost
    history = simulate(policy, 40, lambda step, depth, rank: rank == 0 and step % 2 == 0,
                       lambda step, branch, pos: branch == 0 and step % 2 == 1, context=REPEATING)
    late = [plan.kind for plan, _ in history[10:]]
    assert late.count("both") >= len(late) - 2
    assert sum(accepted for _, accepted in history[10:]) >= 30 // 2 * (3 + 8)  # each source's whole draft, in turn


def test_merged_tree_shares_nodes_both_drafted():
    policy = AdaptivePolicy(AdaptConfig(prune=False), heads_depth=2, lookup=True)  # the merge alone (cut: below)
    context = [7, 8, 9, 4, 5, 7, 8]  # tail 7 8 occurred: branch [9, 4, 5, 7, 8]
    plan = policy.plan(context)
    plan.heads_choices, plan.lookup_depth = [[0], [1], [0, 0]], 3
    heads_tree = tree_from_choices(plan.heads_choices)
    tree, tokens, keys = policy.build(plan, 8, heads_tree, torch.tensor([8, 9, 6, 4]))  # heads: 9 then 4, or 6
    assert tokens.tolist() == [8, 9, 6, 4, 5]  # lookup's 9 and 4 are the heads' nodes; its 5 is new
    assert tree.parents == [-1, 0, 0, 1, 3]
    assert {k[0] for k in keys[1]} == {"heads", "lookup"} and [k[0] for k in keys[4]] == ["lookup"]


def _merged_step(policy: AdaptivePolicy):
    """The merge test's step: heads [[0], [1], [0, 0]] drafting 9 then 4, or 6; lookup 3 deep (9, 4, 5)."""
    plan = policy.plan([7, 8, 9, 4, 5, 7, 8])  # tail 7 8 occurred: the branch [9, 4, 5, 7, 8] after a 2-token match
    plan.heads_choices, plan.lookup_depth, plan.probes = [[0], [1], [0, 0]], 3, []
    tree, tokens, keys = policy.build(plan, 8, tree_from_choices(plan.heads_choices), torch.tensor([8, 9, 6, 4]))
    return plan, tree, tokens, keys


def test_the_merged_tree_keeps_the_nodes_that_pay():
    """Heads rates .6 / .1 at depth 1 and .5 at depth 2, lookup's prior .5 then .7 (a 2-token match): the merged
    nodes 9 and 4 are right when either source is (noisy-or .8 and .85), so the path values are 9: .8, 4: .68, 5: .476
    and the heads' runner-up 6: .1. At a tenth of a step a node, the best count is 3 (2.956 tokens for 1.3 steps,
    against 3.056 for 1.4 with the runner-up): the runner-up is cut, the lookup node under the merged ones kept."""
    assert (LOOKUP_PRIOR_FIRST[2], LOOKUP_PRIOR_NEXT) == (0.5, 0.7)
    linear = StepCost({1: 1.0, 5: 1.4}, {0: 0.0})
    policy = AdaptivePolicy(AdaptConfig(), heads_accuracy=[[0.6, 0.1], [0.5, 0.1]], heads_depth=2, lookup=True,
                            cost=linear)
    plan, tree, tokens, keys = _merged_step(policy)
    assert tokens.tolist() == [8, 9, 4, 5] and tree.parents == [-1, 0, 1, 2]
    assert policy._node_rate(keys[1]) == pytest.approx(0.8) and policy._node_rate(keys[2]) == pytest.approx(0.85)
    assert plan.kind == "both" and plan.pruned == []
    uncut = AdaptivePolicy(AdaptConfig(prune=False), heads_accuracy=[[0.6, 0.1], [0.5, 0.1]], heads_depth=2,
                           lookup=True, cost=linear)
    assert _merged_step(uncut)[2].tolist() == [8, 9, 6, 4, 5]
    plan = policy.plan([1, 2, 3])  # nothing to look up: a heads-only tree is verified as drafted
    plan.heads_choices, plan.probes = [[0], [1], [0, 0]], []
    tree, tokens, _ = policy.build(plan, 8, tree_from_choices(plan.heads_choices), torch.tensor([8, 9, 6, 4]))
    assert tokens.tolist() == [8, 9, 6, 4] and plan.kind == "heads"


def test_a_source_whose_nodes_are_all_cut_was_not_verified():
    """Heads rates .9 / .05 at depth 1, .9 at depth 2; lookup drafts 3, 4, 5 beside the heads' 9 and 6 (siblings:
    their rates .9 + .05 + .5 scaled to sum to 1). At half a step a node the best tree is the heads' 9 -> 4 (2.18
    tokens for 2 steps, against 2.52 for 2.5 with lookup's 3): every lookup node is cut, so the step verified the
    heads only and lookup waits a step longer for its probe."""
    steep = StepCost({1: 1.0, 5: 3.0}, {0: 0.0})
    policy = AdaptivePolicy(AdaptConfig(), heads_accuracy=[[0.9, 0.05], [0.9, 0.05]], heads_depth=2, lookup=True,
                            cost=steep)
    plan = policy.plan([7, 8, 3, 4, 5, 7, 8])  # the branch [3, 4, 5, 7, 8] after a 2-token match
    plan.heads_choices, plan.lookup_depth, plan.probes = [[0], [1], [0, 0]], 3, []
    policy.unverified["lookup"] = 2
    tree, tokens, keys = policy.build(plan, 8, tree_from_choices(plan.heads_choices), torch.tensor([8, 9, 6, 4]))
    assert tokens.tolist() == [8, 9, 4] and tree.parents == [-1, 0, 1]
    assert plan.pruned == ["lookup"] and plan.kind == "heads" and policy.unverified["lookup"] == 3
    assert policy.unverified["heads"] == 0


def test_step_cost_interpolates_and_takes_the_nearest_draft_size():
    cost = StepCost({1: 10.0, 2: 11.0, 4: 12.0}, {2: 0.1, 8: 0.3})
    assert cost.ratio(3) == pytest.approx(1.15) and cost.ratio(6) == pytest.approx(1.3)
    assert cost.cost(4, 0) == pytest.approx(1.2) and cost.cost(4, 3) == pytest.approx(1.3)
    assert cost.cost(9, 7) == pytest.approx(1.45 + 0.3)


def _lm_heads(model, num_heads=3):
    heads = MedusaHeads(MedusaConfig(hidden_size=model.config.hidden_size, vocab_size=model.config.vocab_size,
                                     num_heads=num_heads)).eval()
    heads.init_lm_heads_from(model.lm_head.weight)  # every head guesses the target's next token: some accepted
    return heads


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_adaptive_greedy_is_plain_greedy(model_type):
    from test_infer_generate import _first_diff, reference

    model = tiny_model(model_type, vocab_size=128, seed=1)
    spec = Speculator(model, _lm_heads(model))
    spec.adapt_config = AdaptConfig(probe_every=2)  # both sources verified often, every plan kind taken
    prompts = torch.cat([torch.randint(3, 128, (4, 6), generator=torch.Generator().manual_seed(3))] * 2, 1)
    refs = reference(model, prompts, 48)
    kinds = set()
    for i in range(4):
        out = spec.generate(prompts[i], 48, stop_token_ids=[])
        assert out.tokens == refs[i], f"prompt {i}: first diff at {_first_diff(out.tokens, refs[i])}"
        kinds |= set(out.stats.proposals)
        assert sum(out.stats.proposals.values()) == out.stats.decode_forwards
    assert {"heads", "lookup"} <= kinds or {"both"} <= kinds


def test_adaptive_sampling_keeps_the_target_distribution():
    """Temperature 1 on a vocab-8 model, the policy probing every step (heads and lookup trees of every kind):
    the first three tokens follow the target's exact joint distribution (chi-square)."""
    model = tiny_model("llama", vocab_size=8, seed=3, hidden_size=32, intermediate_size=64)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)  # peaked distributions: a wrong rule shows up quickly
    spec = Speculator(model, _lm_heads(model))
    prompt = torch.tensor([1, 5, 3, 6, 1, 5])
    exact = exact_first_three(model, prompt)
    n = 2000
    counts = torch.zeros(8, 8, 8)
    kinds = set()
    for s in range(n):
        policy = AdaptivePolicy(AdaptConfig(probe_every=1), heads_depth=3, lookup=True)
        out = speculative_generate(model, spec.make_proposer(), prompt, 3, SamplingConfig(temperature=1.0), [],
                                   torch.Generator().manual_seed(s), policy=policy)
        counts[tuple(out.tokens)] += 1
        kinds |= set(out.stats.proposals)
    assert {"both", "heads"} <= kinds
    pvalue = chi_square_pvalue(counts, exact)
    assert pvalue > 1e-3, f"chi-square p = {pvalue:.3g}"
