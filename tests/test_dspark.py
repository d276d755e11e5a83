"""DSpark (heads/dspark.py, train/dspark.py, inference/dspark.py) on tiny random targets: training and inference
compute the same logits and confidences, the chain is vLLM's sequential loop, greedy output equals plain decoding
(fixed trees, chains, adaptive with the confidence cut), sampling is lossless (chi-square), the cut's choice, the
trainer learns and writes metrics, and the vLLM `method: dspark` and llama.cpp `draft-dspark` exports meet their
loaders' contracts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from accelerate import Accelerator
from conftest import chi_square_pvalue, exact_first_three, tiny_model
from test_eagle_train import llama_dir, sd_dir  # noqa: F401 (fixtures: a 4-layer target, its rows)
from test_infer_dflash import greedy_accepted_tokens
from transformers import DynamicCache

from headstart.heads.dspark import (DSPARK, DSparkConfig, DSparkDraft, calibration, chain_confidence_sums,
                                    dspark_config_for, dspark_export)
from headstart.heads.export_formats import ExportRequest
from headstart.heads.load import load_heads
from headstart.heads.methods import method_of
from headstart.heads.target import load_target, target_info
from headstart.inference import decode
from headstart.inference.acceptance import main as acceptance_main
from headstart.inference.adapt import StepCost
from headstart.inference.dspark import DSparkProposer
from headstart.inference.forward import target_forward
from headstart.inference.speculator import Speculator
from headstart.inference.tree import tree_from_choices
from headstart.train.config import ConfigError, parse_config
from headstart.train.dflash import BlockDraft
from headstart.train.dspark import (LOGIT_BINS, LOGIT_MAX, LOGIT_STEP, DSparkTrainConfig, check_config, dspark_loss,
                                    evaluate, fit_platt, main, previous_tokens)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CHAIN3 = [[0], [0, 0], [0, 0, 0]]
TREE = [[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]]


def make_draft(model, block_size: int = 4, seed: int = 0, draft_vocab: int = 0, rank: int = 8,
               confidence_bias: float | None = None, markov_context: bool = False) -> DSparkDraft:
    """A random DSpark draft whose Markov bias is large enough to change rankings (with markov_context, a context
    projection large enough to change it by slot)."""
    torch.manual_seed(seed)
    vocab = model.config.vocab_size
    draft = DSparkDraft(dspark_config_for(model, markov_rank=rank, num_layers=2, block_size=block_size,
                                          mask_token_id=vocab - 1, feature_layers=[1, 3], draft_vocab_size=draft_vocab,
                                          target_info=target_info("tiny", model), markov_context=markov_context))
    if draft_vocab:
        draft.set_draft_vocab(torch.arange(0, vocab, vocab // draft_vocab))
    with torch.no_grad():
        draft.norm.weight.copy_(model.model.norm.weight)
        draft.mask_embedding.copy_(model.get_input_embeddings().weight[3])
        draft.markov_head.markov_w1.weight.normal_(0, 1.0)
        if markov_context:
            draft.markov_head.context_proj.weight.normal_(0, 1.0)
        if confidence_bias is not None:  # a constant confidence sigmoid(confidence_bias)
            draft.confidence_head.proj.weight.zero_()
            draft.confidence_head.proj.bias.fill_(confidence_bias)
    return draft.eval()


def no_eos(model):
    model.generation_config.eos_token_id = None
    return model


def project_of(model, draft):
    rows = draft.draft_lm_head_weight(model.lm_head.weight)
    return lambda x: x @ rows.t()


def chain_proposal(model, draft, prompt: torch.Tensor, depth: int):
    """The proposer's chain after `prompt` (its last token the root) and the target's taps of the positions before."""
    proposer = DSparkProposer(draft, model, tree_from_choices([[0] * d for d in range(1, depth + 1)]),
                              project_of(model, draft))
    _, _, taps = target_forward(model, prompt[None, :-1], DynamicCache(), feature_layers=[1, 3])
    from headstart.inference.tree import DraftInput
    tree, tokens = proposer(DraftInput(hidden=torch.zeros(1), root=int(prompt[-1]), context=prompt.tolist(),
                                       features=taps))
    return proposer, tokens, taps


# ----------------------------------------------------------------------------------------------------
# the heads and the method


def test_config_checks_and_registration():
    model = tiny_model("llama", num_hidden_layers=4, vocab_size=16)
    cfg = dspark_config_for(model, markov_rank=4, mask_token_id=15, feature_layers=[1, 3])
    assert cfg.method == "dspark" and method_of(cfg) is DSPARK and method_of("dflash").names == ("dflash",)
    with pytest.raises(ValueError, match="markov_rank"):
        DSparkConfig(**dict(cfg.__dict__, markov_rank=0))
    with pytest.raises(ValueError, match="mask_token_id"):  # DFlash's own checks still apply
        DSparkConfig(**dict(cfg.__dict__, mask_token_id=16))
    draft = DSparkDraft(dspark_config_for(model, markov_rank=4, mask_token_id=15, feature_layers=[1, 3],
                                          draft_vocab_size=8))
    shapes = {n: tuple(t.shape) for n, t in draft.state_dict().items() if n.startswith(("markov", "confidence"))}
    assert shapes == {"markov_head.markov_w1.weight": (16, 4), "markov_head.markov_w2.weight": (8, 4),
                      "confidence_head.proj.weight": (1, 64 + 4), "confidence_head.proj.bias": (1,)}
    assert DSPARK.max_depth(cfg) == DSPARK.engine_chain(cfg) == 7 and DSPARK.formats == ("vllm", "llamacpp")
    assert "sglang" in DSPARK.refusal("sglang") and DSPARK.llamacpp_spec_type == "draft-dspark"


def test_previous_tokens_are_the_anchor_then_the_labels():
    prep = {"tokens": torch.tensor([[7, 1, 1, 1, 8, 1, 1, 1]]), "labels": torch.tensor([[[2, 3, 4], [5, 6, 0]]])}
    assert previous_tokens(prep).tolist() == [[[7, 2, 3], [8, 5, 6]]]


def test_confidence_target_off_the_answers_is_the_target_s_greedy_token():
    """With supervise_prompt, a slot the target did not write verifies when the draft's argmax is the target's
    greedy token there (greedy_labels), not the data token; a target-written slot still against the data token."""
    model = tiny_model("llama", num_hidden_layers=4, vocab_size=32, seed=3)
    draft = make_draft(model, block_size=3)
    scored = draft.draft_lm_head_weight(model.lm_head.weight)
    out = torch.randn(1, 1, 2, 64, generator=torch.Generator().manual_seed(0))
    prev = torch.tensor([7, 9])
    with torch.no_grad():
        argmax = draft.corrected_logits(out[0, 0], scored, prev).argmax(-1)  # [2]
    other = (argmax + 1) % 32
    selected = torch.ones(1, 1, 2, dtype=torch.bool)
    prep = {"selected": selected, "supervised": selected, "weights": torch.ones(1, 1, 2),
            "tokens": torch.tensor([[7, 31, 31]]), "labels": torch.tensor([[[9, 4]]]),
            "target_labels": argmax, "probs": None, "in_vocab": selected,
            "draft_labels": torch.stack([argmax[0], other[1]])[None, None],  # slot 1 = the argmax, slot 2 not
            "written": torch.tensor([[[True, False]]]), "greedy_labels": argmax}  # slot 2: a prompt slot
    cfg = DSparkTrainConfig(block_size=3, labels="target_argmax", supervise_prompt=True)
    with torch.no_grad():
        _, sums = dspark_loss(draft, out[0, 0], prep, scored, torch.tensor(2.0), cfg)
        assert float(sums["accepted"]) == 2.0  # both verify: slot 2 against the target's greedy token
        _, answers_only = dspark_loss(draft, out[0, 0], {**prep, "greedy_labels": None}, scored, torch.tensor(2.0), cfg)
        assert float(answers_only["accepted"]) == 1.0  # without supervise_prompt the data token (not the argmax) counts


def test_training_logits_equal_the_proposer_chain_and_vllm_loop():
    """The teacher-forced training path (BlockDraft, Markov-corrected logits, confidence) with prev = the drafted
    tokens gives the proposer's chain and confidences; a re-implementation of vLLM's sequential DSpark loop (argmax,
    d2t, prev = the drafted target id) over the exported tensors gives the same chain."""
    model = tiny_model("llama", num_hidden_layers=4, vocab_size=32, seed=3)
    draft = make_draft(model, block_size=5, draft_vocab=16)
    prompt = torch.randint(0, 31, (9,), generator=torch.Generator().manual_seed(4))
    proposer, tokens, taps = chain_proposal(model, draft, prompt, 4)
    drafted = tokens[1:].tolist()
    n = prompt.numel() - 1  # the root's position: the context is 0..n-1
    block = torch.tensor([[int(prompt[-1])] + [31] * 4])
    with torch.no_grad():
        out = BlockDraft(draft)(taps[None], block, model.get_input_embeddings()(block), torch.arange(n, n + 5)[None],
                                None)[0, 1:]  # [4, h]
        prev = torch.tensor([int(prompt[-1])] + drafted[:-1])
        scored = draft.draft_lm_head_weight(model.lm_head.weight)
        logits = draft.corrected_logits(out, scored, prev)
        conf = torch.sigmoid(draft.confidence_logit(draft.norm(out), prev))
    assert draft.to_target_ids(logits.argmax(-1)).tolist() == drafted
    torch.testing.assert_close(conf, torch.tensor(proposer.confidence), rtol=1e-5, atol=1e-6)
    # vLLM's loop (spec_decode/dspark/speculator.py _sample_sequential) over the export's tensors
    _, tensors, _ = dspark_export(draft, ExportRequest("vllm", model, 4))
    w1, w2, d2t = (tensors[k] for k in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "d2t"))
    base = draft.norm(out) @ tensors["lm_head.weight"].t()
    vllm_prev, vllm_tokens = int(prompt[-1]), []
    for i in range(4):
        d = int((base[i] + w2 @ w1[vllm_prev]).argmax())
        vllm_prev = d + int(d2t[d])
        vllm_tokens.append(vllm_prev)
    assert vllm_tokens == drafted


def test_markov_context_starts_vanilla_and_training_equals_the_proposer_chain():
    """markov_context: a fresh head's bias is the vanilla one (context_proj zero); with a trained-like projection the
    bias depends on the slot from slot 2 on, the teacher-forced training logits with prev = the drafted tokens give
    the proposer's chain, and the vLLM export refuses the head it has no loader for."""
    model = tiny_model("llama", num_hidden_layers=4, vocab_size=32, seed=3)
    fresh = DSparkDraft(dspark_config_for(model, markov_rank=8, mask_token_id=31, feature_layers=[1, 3],
                                          markov_context=True))
    prev, normed = torch.tensor([3, 5]), torch.randn(2, 64)
    with torch.no_grad():
        vanilla = fresh.markov_head.markov_w2(fresh.markov_head.markov_w1(prev))
        assert torch.equal(fresh.markov_bias(prev, normed), vanilla)
    draft = make_draft(model, block_size=5, draft_vocab=16, markov_context=True)
    with torch.no_grad():
        assert not torch.allclose(draft.markov_bias(prev, normed), draft.markov_bias(prev, normed.flip(0)))
    prompt = torch.randint(0, 31, (9,), generator=torch.Generator().manual_seed(4))
    _, tokens, taps = chain_proposal(model, draft, prompt, 4)
    drafted = tokens[1:].tolist()
    n = prompt.numel() - 1
    block = torch.tensor([[int(prompt[-1])] + [31] * 4])
    with torch.no_grad():
        out = BlockDraft(draft)(taps[None], block, model.get_input_embeddings()(block), torch.arange(n, n + 5)[None],
                                None)[0, 1:]  # [4, h]
        scored = draft.draft_lm_head_weight(model.lm_head.weight)
        prev = torch.tensor([int(prompt[-1])] + drafted[:-1])
        logits = draft.corrected_logits(out, scored, prev, torch.arange(4))
        slot1 = draft.logits(out[:1], scored) + draft.markov_bias(prev[:1])
    assert draft.to_target_ids(logits.argmax(-1)).tolist() == drafted
    torch.testing.assert_close(logits[:1], slot1)  # slot 1: the vanilla bias from the anchor
    with pytest.raises(ValueError, match="markov_context"):
        dspark_export(draft, ExportRequest("vllm", model, 4))


def test_markov_head_changes_the_tree_by_parent():
    """Children of different parents at one depth are ranked from different biases: base + bias(parent token)."""
    model = tiny_model("llama", num_hidden_layers=4, vocab_size=32, seed=3)
    draft = make_draft(model, block_size=4)
    proposer = DSparkProposer(draft, model, tree_from_choices(TREE), project_of(model, draft))
    base = torch.randn(3, 32)
    tree = proposer.tree
    tokens = proposer.markov_fill(tree, 7, base)
    for node in range(1, tree.size):
        parent = tree.parents[node]
        with torch.no_grad():
            scores = base[tree.depths[parent]] + draft.markov_bias(torch.tensor(tokens[parent]))
        assert tokens[node] == int(scores.topk(tree.ranks[node] + 1).indices[-1])


# ----------------------------------------------------------------------------------------------------
# decoding


@pytest.mark.parametrize("tree,markov_context", [(CHAIN3, False), (TREE, False), (TREE, True)])
def test_greedy_output_equals_generate(tree, markov_context):
    model = no_eos(tiny_model("llama", num_hidden_layers=4, vocab_size=16, seed=3))
    spec = Speculator(model, make_draft(model, markov_context=markov_context), tree=tree, cpu_linears=False)
    assert greedy_accepted_tokens(model, spec, 5) > 20


@pytest.mark.parametrize("tree", [CHAIN3, TREE])
def test_fixed_tree_records_the_confidence_head_s_steps(tree, monkeypatch):
    """Decoding a fixed tree records, per step, c_1 .. along the tree's rank-0 chain (the proposer's) and how many of
    that chain's nodes the verified path kept; the adaptive loop records nothing."""
    model = no_eos(tiny_model("llama", num_hidden_layers=4, vocab_size=16, seed=3))
    spec = Speculator(model, make_draft(model), tree=tree, cpu_linears=False)
    prompt = torch.randint(0, 15, (1, 7), generator=torch.Generator().manual_seed(2))  # one with accepted tokens
    paths, confidences, accept, call = [], [], decode._accept, DSparkProposer.__call__

    def spy_accept(tree, *args, **kwargs):
        path, bonus = accept(tree, *args, **kwargs)
        paths.append((tree, path))
        return path, bonus

    def spy_call(self, inp):
        out = call(self, inp)
        confidences.append(list(self.confidence))
        return out

    monkeypatch.setattr(decode, "_accept", spy_accept)
    monkeypatch.setattr(DSparkProposer, "__call__", spy_call)
    stats = spec.generate(prompt, 30, stop_token_ids=[], adaptive=False, lookup=False).stats
    on_chain = []
    for tree_used, path in paths:
        kept = 0
        while kept + 1 < len(path) and tree_used.ranks[path[kept + 1]] == 0:
            kept += 1
        on_chain.append(kept)
    assert stats.confidence_steps == list(zip(confidences, on_chain)) and len(on_chain) == stats.decode_forwards
    assert all(len(c) == 3 and all(0 < x < 1 for x in c) for c in confidences)
    accepted = sum(a * n for a, n in enumerate(stats.accept_hist))
    # a chain: every accepted token is on it; the tree here also accepted off its rank-0 chain
    assert sum(on_chain) == accepted > 0 if tree == CHAIN3 else 0 < sum(on_chain) < accepted
    assert spec.generate(prompt, 30, stop_token_ids=[], adaptive=True, lookup=False).stats.confidence_steps == []


def test_calibration_of_decoded_chains_by_hand():
    sums = chain_confidence_sums([([0.5, 0.5], 0), ([0.8, 0.5], 2), ([0.8, 0.25], 1)])
    got = calibration(sums)
    assert got["confidence_by_slot"] == [0.7, 0.375] and got["accepted_by_slot"] == [0.6667, 0.5]
    assert got["expected_chain_tokens"] == round(2.95 / 3, 4)
    # survivals .5 .25 | .8 .4 | .8 .2 against 0 0 | 1 1 | 1 0: bins 2, 4, 5, 8 off by .45, .6, .5, .4 over 6 slots
    assert got["survival_ece"] == round(1.95 / 6, 4)


@pytest.mark.parametrize("bias,drafts", [(-30.0, False), (30.0, True)])
def test_confidence_cut_is_lossless_at_both_ends(bias, drafts):
    """Confidence 0: the adaptive cut verifies no drafted token (every step plain); confidence 1: the whole tree.
    The output is plain greedy's either way."""
    model = no_eos(tiny_model("llama", num_hidden_layers=4, vocab_size=16, seed=3))
    spec = Speculator(model, make_draft(model, confidence_bias=bias), tree=CHAIN3, cpu_linears=False)
    prompt = torch.randint(0, 15, (1, 7), generator=torch.Generator().manual_seed(1))
    ref = model.generate(prompt, max_new_tokens=30, do_sample=False)[0, 7:].tolist()
    out = spec.generate(prompt, 30, stop_token_ids=[], adaptive=True, lookup=False)
    assert out.tokens == ref
    sizes = set(out.stats.step_sizes)
    assert (sizes == {1}) if not drafts else (max(sizes) > 1)


def test_cut_depth_is_the_brute_force_best_rate():
    model = tiny_model("llama", num_hidden_layers=4, vocab_size=16, seed=3)
    draft = make_draft(model, block_size=5)
    cost = StepCost({1: 1.0, 2: 1.05, 3: 1.3, 4: 1.4, 5: 2.0}, {0: 0.1})
    proposer = DSparkProposer(draft, model, tree_from_choices(CHAIN3), project_of(model, draft), step_cost=cost)
    tree = tree_from_choices([[0], [1], [0, 0], [0, 0, 0], [0, 0, 0, 0]])  # nodes to depth n: 1, 3, 4, 5, 6
    nodes = [1, 3, 4, 5, 6]
    for conf in ([0.9, 0.8, 0.7, 0.2], [0.1, 0.9, 0.9, 0.9], [0.99, 0.99, 0.99, 0.99], [0.5, 0.5, 0.5, 0.5]):
        rates, survival, expected = [], 1.0, 1.0
        for n in range(5):
            if n:
                survival *= conf[n - 1]
                expected += survival
            rates.append(expected / (cost.ratio(nodes[n]) + 0.1))
        assert proposer.cut_depth(tree, conf) == max(range(5), key=lambda n: (rates[n], -n))
    cut, tokens = proposer.cut_tree(tree, list(range(10, 16)), 2)
    assert cut.parents == [-1, 0, 0, 1] and cut.ranks == [0, 0, 1, 0] and tokens == [10, 11, 12, 13]


def test_sampling_matches_the_target_distribution():
    """Temperature 1 on a vocab-8 target, fixed tree and adaptive (with the cut): the first three tokens follow the
    target's exact joint distribution."""
    model = tiny_model("llama", num_hidden_layers=4, vocab_size=8, seed=3, hidden_size=32, intermediate_size=64)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    spec = Speculator(model, make_draft(model), tree=TREE, cpu_linears=False)
    prompt = torch.tensor([1, 5, 3, 6])
    exact = exact_first_three(model, prompt)
    for adaptive in (False, True):
        n, counts, accepted = 1500, torch.zeros(8, 8, 8), 0
        for s in range(n):
            out = spec.generate(prompt, 3, temperature=1.0, seed=s, stop_token_ids=[], adaptive=adaptive,
                                lookup=False)
            counts[tuple(out.tokens)] += 1
            accepted += sum(a * c for a, c in enumerate(out.stats.accept_hist))
        assert accepted > n // 4, adaptive
        pvalue = chi_square_pvalue(counts, exact)
        assert pvalue > 1e-3, f"adaptive {adaptive}: chi-square p = {pvalue:.3g}"


# ----------------------------------------------------------------------------------------------------
# training


def train_args(target_dir, data_dir, out, *extra) -> list[str]:
    return ["--target", str(target_dir), "--data_dir", str(data_dir), "--output_dir", str(out),
            "--per_device_batch_size", "2", "--eval_rows", "4", "--learning_rate", "3e-3", "--seed", "0",
            "--feature_layers", "1", "2", "3", "--block_size", "4", "--anchors_per_row", "4",
            "--draft_vocab_size", "64", "--markov_rank", "8"] + [str(e) for e in extra]


def test_train_learns_and_writes_calibration(llama_dir, sd_dir, tmp_path):
    metrics = main(train_args(llama_dir, sd_dir, tmp_path, "--num_epochs", "8", "--labels", "data"))
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in log if "bce" in r]
    assert steps[-1]["loss"] < 0.5 * steps[0]["loss"] and steps[-1]["bce"] < steps[0]["bce"]
    assert len(metrics["top1"]) == 3 and metrics["top1"][0] > 0.5 and 0 < metrics["chain_accepted_tokens"] <= 3
    assert len(metrics["confidence_by_slot"]) == len(metrics["accepted_by_slot"]) == 3
    assert all(0 < c < 1 for c in metrics["confidence_by_slot"]) and 0 <= metrics["survival_ece"] <= 1
    assert 0 < metrics["expected_chain_tokens"] <= 3 and metrics["method"] == "dspark"
    assert len(metrics["without_markov"]["top1"]) == 3 and 0 <= metrics["without_markov"]["chain_accepted_tokens"] <= 3
    _, _, info = load_target(str(llama_dir))
    draft = load_heads(tmp_path / "heads", info)
    assert isinstance(draft, DSparkDraft) and draft.config.markov_rank == 8 and draft.token_map.numel() == 64
    assert "DSpark" in (tmp_path / "heads" / "README.md").read_text()


class RowSource:
    """A FeatureSource stand-in for evaluate: the held-out rows and random taps per row (what the draft reads does
    not matter here)."""

    def __init__(self, rows, width):
        self.rows, self.width = rows, width

    def batch(self, batch):
        T = batch["input_ids"].shape[1]
        gen = torch.Generator().manual_seed(int(batch["rows"][0]))
        return torch.randn(1, T, self.width, generator=gen), torch.randn(1, T, 64, generator=gen)


def test_held_out_metrics_say_what_the_markov_head_adds():
    """metrics.json's `without_markov` (top1 by slot, chain) equals the held-out metrics of the same draft with its
    Markov head zeroed: on rows where each token is the previous one + 1, a head that biases prev + 1 by 20 logits
    gets every slot right, the draft without it almost none."""
    model = tiny_model("llama", num_hidden_layers=4)
    config = dspark_config_for(model, markov_rank=32, num_layers=1, block_size=4, mask_token_id=5,
                               feature_layers=[1, 2, 3], draft_vocab_size=32)
    draft = DSparkDraft(config)
    draft.set_draft_vocab(torch.arange(0, 32))
    with torch.no_grad():  # bias[prev] = 20 at draft index prev + 1
        draft.markov_head.markov_w1.weight.zero_()
        draft.markov_head.markov_w1.weight[:32] = torch.eye(32)
        draft.markov_head.markov_w2.weight.copy_(20 * torch.eye(32).roll(1, dims=0))
    rows = [{"input_ids": [1, 2] + list(range(i, i + 20)), "loss_mask": [0, 0] + [1] * 20} for i in range(3, 9)]
    source = RowSource(rows, 3 * 64)
    cfg = DSparkTrainConfig(block_size=4, labels="data", markov_rank=32)
    scored = draft.draft_lm_head_weight(model.get_output_embeddings().weight)
    model_block = BlockDraft(draft).eval()
    ids = list(range(len(rows)))
    with_head = evaluate(model_block, model, source, ids, cfg, Accelerator(cpu=True), 0, scored)
    # every slot right; chains end early only where the row does
    assert with_head["top1"] == [1.0, 1.0, 1.0] and with_head["chain_accepted_tokens"] > 2.5
    without = with_head["without_markov"]
    assert max(without["top1"]) < 0.5 and without["chain_accepted_tokens"] < 1.0
    with torch.no_grad():
        draft.markov_head.markov_w2.weight.zero_()
    zeroed = evaluate(model_block, model, source, ids, cfg, Accelerator(cpu=True), 0, scored)
    assert zeroed["top1"] == without["top1"] and zeroed["chain_accepted_tokens"] == without["chain_accepted_tokens"]
    assert zeroed["without_markov"] == without  # no bias left: the two figures agree


def platt_counts(z: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """[2, LOGIT_BINS] (accepted, slots) per logit bin, as train/dspark.py evaluate counts them."""
    z_bin = ((z + LOGIT_MAX) / LOGIT_STEP).long().clamp(0, LOGIT_BINS - 1)
    return torch.stack([torch.bincount(z_bin, weights=accepted.float(), minlength=LOGIT_BINS),
                        torch.bincount(z_bin, minlength=LOGIT_BINS).float()])


def test_platt_fit_recovers_a_known_scaling_and_refuses_to_invert():
    gen = torch.Generator().manual_seed(0)
    z = torch.rand(400_000, generator=gen) * 16 - 8  # [n] an overconfident head's logits
    accepted = torch.rand(z.shape, generator=gen) < torch.sigmoid(0.5 * z - 1.0)  # the truth: scale .5, shift -1
    fit = fit_platt(platt_counts(z, accepted))
    assert fit["slots"] == z.numel()
    assert abs(fit["scale"] - 0.5) < 0.01 and abs(fit["shift"] + 1.0) < 0.02, fit
    # logits that rank the slots backwards: scale 0 and the base rate, never an inverted head
    reversed_accepted = torch.rand(z.shape, generator=gen) < torch.sigmoid(-z)
    backwards = fit_platt(platt_counts(z, reversed_accepted))
    assert backwards["scale"] == 0.0
    assert abs(float(torch.sigmoid(torch.tensor(backwards["shift"]))) - float(reversed_accepted.float().mean())) < 1e-6
    # nothing to fit: every slot accepted, or none
    for every in (True, False):
        same = fit_platt(platt_counts(z, torch.full(z.shape, every)))
        assert (same["scale"], same["shift"]) == (1.0, 0.0)


def test_rescale_folds_the_scaling_into_the_head():
    torch.manual_seed(0)
    draft = DSparkDraft(dspark_config_for(tiny_model(), markov_rank=4, num_layers=1, block_size=4, mask_token_id=0))
    normed, prev = torch.randn(5, draft.config.hidden_size), torch.randint(0, draft.config.vocab_size, (5,))
    before = draft.confidence_logit(normed, prev)
    draft.confidence_head.rescale(0.4, -1.5)
    torch.testing.assert_close(draft.confidence_logit(normed, prev), 0.4 * before - 1.5)


def test_train_calibrates_the_confidence_head_on_the_held_out_rows(llama_dir, sd_dir, tmp_path):
    """The same run with and without calibrate_confidence: the calibrated head is the other's with its fit folded in,
    and `before` holds the other run's figures."""
    raw = main(train_args(llama_dir, sd_dir, tmp_path / "raw", "--num_epochs", "2", "--calibrate_confidence", "false"))
    cal = main(train_args(llama_dir, sd_dir, tmp_path / "cal", "--num_epochs", "2"))
    assert "confidence_calibration" not in raw and "platt_fit" not in raw and "platt_fit" not in cal
    fit = cal["confidence_calibration"]
    assert fit["before"] == {k: raw[k] for k in ("expected_chain_tokens", "confidence_by_slot", "survival_ece")}
    assert fit["slots"] > 0 and fit["scale"] >= 0 and cal["top1"] == raw["top1"]
    _, _, info = load_target(str(llama_dir))
    heads = [load_heads(tmp_path / run / "heads", info).confidence_head.proj for run in ("raw", "cal")]
    torch.testing.assert_close(heads[1].weight, fit["scale"] * heads[0].weight, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(heads[1].bias, fit["scale"] * heads[0].bias + fit["shift"], rtol=1e-5, atol=1e-5)
    assert "Platt-scaled" in (tmp_path / "cal" / "heads" / "README.md").read_text()
    # the held-out chains' acceptance records how well the head foresaw them, counted from the same steps
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [text], "category": "chat"}) + "\n"
                               for text in ("Tell me a story.", "Name three colours.")))
    assert acceptance_main(["--chain", "--heads", str(tmp_path / "cal" / "heads"), "--prompts", str(prompts),
                            "--per_category", "2", "--max_new_tokens", "16"]) == 0
    chain = json.loads((tmp_path / "cal" / "heads" / "chain_acceptance.json").read_text())
    hist, conf = chain["accept_hist"], chain["confidence"]
    assert conf["accepted_by_slot"][0] == round(sum(hist[1:]) / sum(hist), 4) and len(conf["confidence_by_slot"]) == 3
    assert 0 < conf["expected_chain_tokens"] <= 3 and 0 <= conf["survival_ece"] <= 1


def test_train_with_markov_context_learns_the_projection(llama_dir, sd_dir, tmp_path):
    metrics = main(train_args(llama_dir, sd_dir, tmp_path, "--num_epochs", "2", "--markov_context", "true"))
    _, _, info = load_target(str(llama_dir))
    draft = load_heads(tmp_path / "heads", info)
    assert metrics["markov_context"] is True and draft.config.markov_context
    assert float(draft.markov_head.context_proj.weight.abs().sum()) > 0  # it left its zero start


def test_markov_lr_scale_gives_the_markov_head_its_own_group():
    """markov_lr_scale moves the Markov head's parameters (and only them) out of the Muon / AdamW groups into an AdamW
    group of its own at learning_rate x the scale; 1 leaves the groups as they are."""
    from headstart.train.dflash import scaled_lr_groups
    from headstart.train.eagle import param_groups

    model = tiny_model("llama", num_hidden_layers=4, vocab_size=32, seed=3)
    draft = make_draft(model, block_size=5, draft_vocab=16)
    groups = param_groups(draft, "muon")
    assert scaled_lr_groups(draft, groups, {"markov_head.": 1.0}, 1e-3) == groups
    scaled = scaled_lr_groups(draft, groups, {"markov_head.": 10.0}, 1e-3)
    markov = [draft.markov_head.markov_w1.weight, draft.markov_head.markov_w2.weight]
    assert scaled[-1]["lr"] == pytest.approx(1e-2) and not scaled[-1].get("muon")
    assert [id(p) for p in scaled[-1]["params"]] == [id(p) for p in markov]
    rest = [id(p) for g in scaled[:-1] for p in g["params"]]
    assert sorted(rest + [id(p) for p in markov]) == sorted(id(p) for g in groups for p in g["params"])
    assert scaled[0]["muon"] and [id(p) for p in scaled[0]["params"]] == [id(p) for p in groups[0]["params"]]
    with pytest.raises(ConfigError, match="no trainable parameters"):
        scaled_lr_groups(draft, groups, {"nothing.": 2.0}, 1e-3)


def test_train_gives_the_markov_head_its_learning_rate(llama_dir, sd_dir, tmp_path):
    """The trainer's optimizer (its checkpoint) holds the Markov head's two tensors in a group at 10x the rate."""
    main(train_args(llama_dir, sd_dir, tmp_path, "--max_steps", "2", "--checkpoint_every", "1", "--markov_lr_scale", "10",
                    "--optimizer", "muon"))
    state = torch.load(tmp_path / "checkpoints" / "step-2" / "optimizer.bin", weights_only=False)
    groups = [(round(g["initial_lr"], 9), len(g["params"]), g["muon"]) for g in state["param_groups"]]
    assert groups[-1] == (0.03, 2, False) and [lr for lr, _, _ in groups[:-1]] == [0.003, 0.003]  # Muon's, AdamW's


def test_recipe_parses_and_bad_configs_fail():
    cfg = check_config(parse_config(DSparkTrainConfig, ["--config", "recipes/smollm2-135m/dspark.yaml"]))
    assert cfg.method == "dspark" and cfg.markov_rank == 64 and cfg.block_size == 8
    recipe_choices = (cfg.optimizer, cfg.labels, cfg.slot_weights, cfg.sliding_window, cfg.supervise_prompt,
                      cfg.markov_lr_scale)
    assert recipe_choices == ("muon", "target_argmax", "dpace", 64, True, 10)  # docs/measured.md
    for bad in (["--markov_rank", "0"], ["--method", "dflash"], ["--labels", "nope"], ["--block_size", "1"],
                ["--markov_lr_scale", "0"]):
        with pytest.raises(ConfigError):
            check_config(parse_config(DSparkTrainConfig, ["--config", "recipes/smollm2-135m/dspark.yaml", *bad]))


# ----------------------------------------------------------------------------------------------------
# export: vLLM 0.32 qwen3_dspark's contract (docs: /work/scratch/s26/dspark-spec.md sections 1.4 and 4.1)


@pytest.mark.parametrize("draft_vocab", [0, 16])
def test_vllm_export_meets_the_loader_contract(draft_vocab):
    model = tiny_model("llama", num_hidden_layers=4, vocab_size=32, seed=3)
    draft = make_draft(model, block_size=5, draft_vocab=draft_vocab, rank=8)
    config, tensors, notes = dspark_export(draft, ExportRequest("vllm", model, 4))
    V, h, r = 32, 64, 8
    Vd = draft_vocab or V
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    expected = {"eagle_aux_hidden_state_layer_ids": [1, 3], "mask_token_id": 31, "block_size": 5,
                "sample_from_anchor": False, "markov_rank": r, "markov_head_type": "vanilla",
                "enable_confidence_head": True, "confidence_head_with_markov": True, "target_hidden_size": h,
                "num_hidden_layers": 2, "tie_word_embeddings": False}
    assert {k: config[k] for k in expected} == expected
    assert config["dflash_config"]["target_layer_ids"] == [0, 2] and config["dflash_config"]["mask_token_id"] == 31
    assert ("draft_vocab_size" in config) == bool(draft_vocab) and config.get("draft_vocab_size", Vd) == Vd
    assert tensors["markov_head.markov_w1.weight"].shape == (V, r)  # the full target vocabulary
    assert tensors["markov_head.markov_w2.weight"].shape == (Vd, r)
    assert tensors["confidence_head.proj.weight"].shape == (1, h + r)
    assert tensors["confidence_head.proj.bias"].shape == (1,)
    assert tensors["confidence_head.proj.weight"].dtype == torch.float32
    assert not any("mask_embedding" in name for name in tensors) and "token_map" not in tensors
    assert ({"lm_head.weight", "d2t"} <= tensors.keys()) == bool(draft_vocab)
    if draft_vocab:
        assert tensors["lm_head.weight"].shape == (Vd, h) and tensors["d2t"].dtype == torch.int64
        assert torch.equal(tensors["d2t"] + torch.arange(Vd), draft.token_map)
    embed = tensors["embed_tokens.weight"]  # the trained mask vector rides in the mask token's row
    target = model.get_input_embeddings().weight
    assert torch.equal(embed[31], draft.mask_embedding) and torch.equal(embed[:31], target[:31])
    assert "num_speculative_tokens 4" in notes["block"] and "V2" in notes["runner"]
    with torch.no_grad():  # trained on the target's own row: no embedding shipped
        draft.mask_embedding.copy_(target[31])
    assert "embed_tokens.weight" not in dspark_export(draft, ExportRequest("vllm", model, 4))[1]


def test_llamacpp_export_meets_the_loader_contract_and_chains_as_headstart(tmp_path):
    """`--format llamacpp`: DFlash's GGUF plus the tensors and keys llama.cpp's DSpark draft reads (build b11434's
    src/models/dflash.cpp); its Markov chain and confidences recomputed from the GGUF alone as that graph does (logits
    scattered by d2t, bias w2 . w1[prev], prev = the argmax before, conf_proj over [output_norm(out); w1[prev]]) give
    headstart's chain and confidences; a head llama.cpp lacks is refused in one line."""
    from test_export_gguf import read_gguf, rms, target_gguf

    from headstart.heads.export import ExportError, export_heads

    model = tiny_model("llama", num_hidden_layers=4, vocab_size=32, seed=3)
    tgt = target_gguf(tmp_path / "target.gguf", layers=4, vocab=32)
    for with_markov in (True, False):
        draft = make_draft(model, block_size=5, draft_vocab=16)
        if not with_markov:  # a confidence head on the slot's output alone: zero columns for markov_w1[prev]
            draft.config.confidence_with_markov = False
            draft.confidence_head = type(draft.confidence_head)(64)
        src = tmp_path / f"dspark-{with_markov}" / "heads"
        draft.save_pretrained(src)
        out = export_heads(src, tmp_path / f"out-{with_markov}", "llamacpp", target=model, target_gguf=tgt)
        meta, dims, data = read_gguf(out / "draft.gguf")
        assert meta["general.architecture"] == "dflash" and "DSpark" in meta["general.name"]
        assert meta["dflash.sample_from_anchor"] is False and meta["dflash.has_confidence_head"] is True
        assert meta["dflash.block_size"] == 5 and meta["dflash.target_layers"] == [1, 3]
        assert {k: dims[k] for k in ("markov_w1.weight", "markov_w2.weight", "conf_proj.weight", "conf_proj.bias",
                                     "output.weight", "d2t")} == {
            "markov_w1.weight": [8, 32], "markov_w2.weight": [8, 16], "conf_proj.weight": [64 + 8, 1],
            "conf_proj.bias": [1], "output.weight": [64, 16], "d2t": [16]}  # GGUF dims: torch's reversed
        assert "--spec-type draft-dspark --spec-draft-n-max 4" in (out / "README.md").read_text()
        prompt = torch.randint(0, 31, (9,), generator=torch.Generator().manual_seed(4))
        proposer, tokens, taps = chain_proposal(model, draft, prompt, 4)
        n = prompt.numel() - 1
        block = torch.tensor([[int(prompt[-1])] + [31] * 4])
        with torch.no_grad():
            hidden = BlockDraft(draft)(taps[None], block, model.get_input_embeddings()(block),
                                       torch.arange(n, n + 5)[None], None)[0]  # [5, h]: anchor, then the slots
        w = {name: torch.as_tensor(a) for name, a in data.items()}
        normed = rms(hidden, w["output_norm.weight"], meta["dflash.attention.layer_norm_rms_epsilon"])
        base = torch.full((5, 32), float("-inf"))
        base[:, w["d2t"].long()] = normed @ w["output.weight"].T
        prev, chain, conf = int(prompt[-1]), [], []
        for i in range(1, 5):  # sample_from_anchor false: block position i is slot i
            bias = torch.zeros(32)
            bias[w["d2t"].long()] = w["markov_w2.weight"] @ w["markov_w1.weight"][prev]
            feat = torch.cat([normed[i], w["markov_w1.weight"][prev]])
            conf.append(float(torch.sigmoid(w["conf_proj.weight"] @ feat + w["conf_proj.bias"])))
            prev = int((base[i] + bias).argmax())
            chain.append(prev)
        assert chain == tokens[1:].tolist()
        torch.testing.assert_close(torch.tensor(conf), torch.tensor(proposer.confidence), rtol=1e-5, atol=1e-6)
    slot_reading = make_draft(model, block_size=5, markov_context=True)
    slot_reading.save_pretrained(tmp_path / "ctx" / "heads")
    with pytest.raises(ExportError) as err:
        export_heads(tmp_path / "ctx" / "heads", tmp_path / "ctx-out", "llamacpp", target=model, target_gguf=tgt)
    assert "markov_context" in str(err.value) and "\n" not in str(err.value) and not (tmp_path / "ctx-out").exists()


def gpu_vllm() -> str | None:
    """The python of a GPU vLLM that can run method dspark, or None (vLLM 0.32 runs dspark only in Model Runner V2,
    on a GPU with Triton; its CPU build refuses it)."""
    python = os.environ.get("HEADSTART_VLLM_PYTHON") or sys.executable
    probe = "import torch, vllm; assert torch.cuda.is_available()"
    return python if subprocess.run([python, "-c", probe], capture_output=True).returncode == 0 else None


GPU_VLLM = gpu_vllm()
NO_GPU_VLLM = ("no vLLM with a CUDA GPU (HEADSTART_VLLM_PYTHON or this python): vLLM 0.32 runs method dspark only in "
               "Model Runner V2 (GPU, Triton), its CPU build refuses it")


def vllm_compare(heads: list[str], out, num_prompts: int, max_new_tokens: int) -> dict:
    cmd = [sys.executable, "-m", "headstart.inference.vllm_check", "compare", "--heads", *heads, "--formats", "vllm",
           "--vllm_python", GPU_VLLM, "--num_prompts", str(num_prompts), "--max_new_tokens", str(max_new_tokens),
           "--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


@pytest.mark.skipif(GPU_VLLM is None, reason=NO_GPU_VLLM)
def test_vllm_loads_the_export_and_keeps_greedy_output(tmp_path, embedded_target):
    """GPU lane: a seeded random DSpark draft of the embedded target, exported and served by vLLM: greedy output with
    it is vLLM's without it, and the draft ran."""
    model, _, info = embedded_target
    torch.manual_seed(0)
    draft = DSparkDraft(dspark_config_for(model, markov_rank=16, num_layers=1, block_size=4,
                                          mask_token_id=model.config.vocab_size - 1, feature_layers=[2, 15, 28],
                                          target_info=info))
    draft.save_pretrained(tmp_path / "dspark" / "heads")
    results = vllm_compare([str(tmp_path / "dspark" / "heads")], tmp_path / "check", 2, 24)
    (run,) = results["runs"]
    assert "error" not in run, run.get("error")
    assert run["method"] == "dspark" and run["k"] == 3 and run["identical_to_vllm_without_draft"] == "2/2", run
    assert run["vllm_counters"]["vllm:spec_decode_num_drafts"] > 0, run


@pytest.mark.skipif(GPU_VLLM is None or not os.environ.get("HEADSTART_VLLM_DSPARK_HEADS"),
                    reason=NO_GPU_VLLM if GPU_VLLM is None else "set HEADSTART_VLLM_DSPARK_HEADS=DIR (trained DSpark "
                                                                "heads) for the acceptance check")
def test_trained_dspark_acceptance_in_vllm_matches_headstart(tmp_path):
    """vLLM's mean acceptance with the export (its fixed chain of block_size - 1, adaptive verification off) within 2%
    of headstart's tau on the same prompts."""
    results = vllm_compare([os.environ["HEADSTART_VLLM_DSPARK_HEADS"]], tmp_path / "check", 8, 64)
    for run in results["runs"]:
        assert "error" not in run and run["identical_to_vllm_without_draft"] == "8/8", run
        assert abs(run["relative_difference"]) <= 0.02, run
