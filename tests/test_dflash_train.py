"""train/dflash.py and heads/dflash.py on tiny random targets (4 layers): the training blocks against the
inference-time cache, anchors, learning, the heads directory, exact resume, 2-process equivalence."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest
import torch

from headstart.heads.dflash import DFlashDraft, default_feature_layers, dflash_config_for
from headstart.heads.load import load_heads
from headstart.heads.target import load_target
from conftest import tiny_model
from test_eagle_train import llama_dir, sd_dir, train_log, weights  # noqa: F401 (fixtures: a 4-layer target, its rows)
from headstart.train.config import ConfigError, parse_config
from headstart.train.dflash import (BlockDraft, DFlashTrainConfig, block_inputs, check_config, choose_mask_token,
                                    dpace_weights, init_from_target, main, pick_anchors, prepare_batch, valid_anchors)

REPO = Path(__file__).resolve().parents[1]


def args(target_dir, data_dir, out, *extra) -> list[str]:
    return ["--target", str(target_dir), "--data_dir", str(data_dir), "--output_dir", str(out),
            "--per_device_batch_size", "2", "--eval_rows", "4", "--learning_rate", "3e-3", "--seed", "0",
            "--feature_layers", "1", "2", "3", "--block_size", "4", "--anchors_per_row", "4",
            "--draft_vocab_size", "64"] + [str(e) for e in extra]


def random_draft(model, block_size: int = 4, num_layers: int = 2, seed: int = 0, block_causal: bool = False,
                 sliding_window: int = 0) -> DFlashDraft:
    torch.manual_seed(seed)
    draft = DFlashDraft(dflash_config_for(model, num_layers, block_size, mask_token_id=5, feature_layers=[1, 2, 3],
                                          block_causal=block_causal, sliding_window=sliding_window))
    with torch.no_grad():  # norms away from 1 and a mask embedding, so a wrong norm or embedding shows
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
        draft.mask_embedding.normal_()
    return draft.eval()


# ----------------------------------------------------------------------------------------------------
# pieces


def test_default_feature_layers_follow_z_lab():
    assert default_feature_layers(36) == [2, 10, 18, 26, 34]  # z-lab's Qwen3-8B layers 1, 9, 17, 25, 33, as HF indices
    assert default_feature_layers(30) == [2, 9, 15, 21, 28]
    assert default_feature_layers(4) == [2]  # a 4-layer target: layers 1 .. L-3 is layer 1 alone


def test_anchors_need_two_target_tokens_and_repeat_per_row():
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 0, 0])
    valid = valid_anchors(mask, 8)  # positions 2, 3 (then 4 -> 5 is a user token), 6 (7 is the last kept)
    assert valid.tolist() == [2, 3, 6]
    many = torch.arange(100)
    a = pick_anchors(many, 5, seed=0, step=3, row=7)
    assert torch.equal(a, pick_anchors(many, 5, seed=0, step=3, row=7))  # the same in any batch layout
    assert not torch.equal(a, pick_anchors(many, 5, seed=0, step=4, row=7))
    assert a.tolist() == sorted(set(a.tolist())) and len(a) == 5
    assert pick_anchors(many, 5, 0, None, 0).tolist() == [0, 25, 50, 74, 99]  # evaluation: evenly spaced


def test_block_mask_sees_only_the_past_and_its_own_block():
    cfg = DFlashTrainConfig(block_size=3)
    batch = {"input_ids": torch.arange(10)[None] + 20, "attention_mask": torch.ones(1, 10, dtype=torch.long),
             "loss_mask": torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 0]]), "rows": torch.tensor([0])}
    blocks = block_inputs(batch, cfg, mask_token_id=9, step=None, anchors=2)
    assert blocks["tokens"].tolist() == [[23, 9, 9, 27, 9, 9]]  # anchors 3 and 7 (evenly spaced of 3..7)
    assert blocks["positions"].tolist() == [[3, 4, 5, 7, 8, 9]]
    assert blocks["labels"].tolist() == [[[24, 25], [28, 29]]]
    assert blocks["supervised"].tolist() == [[[True, True], [True, False]]]  # x_9 is a user token
    mask = blocks["mask"][0, 0]
    assert mask[0, :10].tolist() == [True] * 3 + [False] * 7  # strictly before the anchor
    assert mask[4, :10].tolist() == [True] * 7 + [False] * 3
    assert mask[:, 10:].int().tolist() == [[1, 1, 1, 0, 0, 0]] * 3 + [[0, 0, 0, 1, 1, 1]] * 3
    causal = block_inputs(batch, DFlashTrainConfig(block_size=3, block_causal=True), 9, None, 2)["mask"][0, 0]
    assert torch.equal(causal[:, :10], mask[:, :10])  # the context rule is unchanged
    assert causal[:, 10:].int().tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                                             [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]
    windowed = block_inputs(batch, DFlashTrainConfig(block_size=3, sliding_window=4), 9, None, 2)["mask"][0, 0]
    assert windowed[:, :10].int().tolist() == [  # a query at q sees the context s < its anchor with q - s < 4
        [1, 1, 1, 0, 0, 0, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0, 1, 0, 0, 0]]
    assert torch.equal(windowed[:, 10:], mask[:, 10:])  # the block stays in view
    with pytest.raises(ConfigError, match="sliding_window 2 must be 0"):
        check_config(DFlashTrainConfig(block_size=3, sliding_window=2))


def test_blocks_stop_at_the_batch_s_most_anchors_and_padding_blocks_change_nothing(one_thread):
    """K is the most anchors any row of the batch gets, not anchors_per_row: a row with fewer is padded with
    unsupervised blocks, and the real blocks' outputs are the same with or without more padding blocks after them."""
    cfg = DFlashTrainConfig(block_size=3)
    batch = {"input_ids": torch.arange(20).view(2, 10) + 20, "attention_mask": torch.ones(2, 10, dtype=torch.long),
             "loss_mask": torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0, 1, 1, 0, 0]]),
             "rows": torch.tensor([0, 1])}
    blocks = block_inputs(batch, cfg, mask_token_id=9, step=3, anchors=64)
    assert blocks["labels"].shape == (2, 5, 2)  # row 0 has 5 valid anchors (3..7), row 1 one (6)
    assert blocks["supervised"][0, :, 0].all() and blocks["supervised"][1, :, 0].tolist() == [True] + [False] * 4
    assert torch.equal(blocks["tokens"], block_inputs(batch, cfg, 9, 3, anchors=5)["tokens"])
    model = tiny_model("llama", num_hidden_layers=4)
    draft = random_draft(model, block_size=3)
    taps = torch.randn(2, 10, 3 * 64)
    run = lambda b: BlockDraft(draft)(taps, b["tokens"], model.get_input_embeddings()(b["tokens"]),  # noqa: E731
                                      b["positions"], b["mask"])
    padded = dict(blocks)  # 3 more padding blocks per row, as the old fixed K = anchors_per_row gave
    extra = 9
    padded["tokens"] = torch.cat([blocks["tokens"], torch.full((2, extra), 9)], 1)
    padded["positions"] = torch.cat([blocks["positions"], torch.zeros(2, extra, dtype=torch.long)], 1)
    Q = blocks["tokens"].shape[1]
    mask = torch.zeros(2, 1, Q + extra, 10 + Q + extra, dtype=torch.bool)
    mask[:, :, :Q, :10 + Q] = blocks["mask"]
    mask[:, :, Q:, 10 + Q:] = True  # padding blocks see only themselves
    padded["mask"] = mask
    with torch.no_grad():
        assert torch.allclose(run(padded)[:, :Q], run(blocks), atol=1e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_block_local_attention_equals_the_dense_mask(causal, one_thread):
    """With a sliding window each block attends over its own gathered keys (BlockDraft block_local): the outputs and
    every parameter's gradient equal the dense-mask forward's, on rows of different lengths whose anchors sit near
    the row start (a window reaching before position 0) and with padding blocks; a dense mask that lets a block see
    a key outside its window is refused."""
    model = tiny_model("llama", num_hidden_layers=4)
    draft = random_draft(model, block_size=3, block_causal=causal, sliding_window=5).train()
    cfg = DFlashTrainConfig(block_size=3, block_causal=causal, sliding_window=5, supervise_prompt=True)
    batch = {"input_ids": torch.arange(40).view(2, 20) % 30 + 20,
             "attention_mask": torch.tensor([[1] * 20, [1] * 9 + [0] * 11]),
             "loss_mask": torch.tensor([[0] * 4 + [1] * 16, [0] * 4 + [1] * 5 + [0] * 11]), "rows": torch.tensor([0, 1])}
    blocks = block_inputs(batch, cfg, mask_token_id=5, step=1, anchors=12)
    assert blocks["positions"][1, ::3].tolist()[-1] == 0 and blocks["positions"][:, 0].min() < 4  # padding, row start
    taps = torch.randn(2, 20, 3 * 64)
    embeds = model.get_input_embeddings()(blocks["tokens"]).detach()
    outputs, grads = [], []
    for local in (False, True):
        draft.zero_grad()
        out = BlockDraft(draft, block_local=local)(taps, blocks["tokens"], embeds, blocks["positions"], blocks["mask"])
        (out * torch.linspace(-1, 1, out.shape[-1])).square().sum().backward()
        outputs.append(out.detach())
        grads.append({n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None})
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-5, msg=name)
    leaky = blocks["mask"].clone()
    leaky[0, 0, 0, 19] = True  # the first block's anchor sees a later position
    with pytest.raises(ValueError, match="outside its window"):
        BlockDraft(draft)(taps, blocks["tokens"], embeds, blocks["positions"], leaky)


@pytest.mark.parametrize("model_type,causal,window", [("llama", False, 0), ("qwen2", False, 0), ("llama", True, 0),
                                                      ("llama", False, 6), ("llama", True, 6)])
def test_training_blocks_equal_the_inference_cache(model_type, causal, window, one_thread):
    """Two blocks drawn in one training forward give what inference computes for each: the context's keys and values
    appended in pieces (as the decode loop commits accepted tokens), then the block alone under decode_mask (none
    for a bidirectional block over its whole context). With a sliding window of 6 the training mask is built here by
    the rule (q - s < 6), so both sides are checked against it."""
    model = tiny_model(model_type, num_hidden_layers=4)
    draft = random_draft(model, block_size=4, block_causal=causal, sliding_window=window)
    T = 12
    taps = torch.randn(1, T, 3 * 64)
    anchors = [5, 9]
    tokens = torch.tensor([[30, 5, 5, 5, 40, 5, 5, 5]])
    positions = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    embeds = model.get_input_embeddings()(tokens)
    mask = torch.zeros(1, 1, 8, T + 8, dtype=torch.bool)
    for k, p in enumerate(anchors):
        for j in range(4):
            mask[0, 0, 4 * k + j, :p] = True if not window else (p + j - torch.arange(p)) < window
        mask[0, 0, 4 * k : 4 * k + 4, T + 4 * k : T + 4 * k + 4] = torch.ones(4, 4).tril().bool() if causal else True
    if window:
        assert not mask[0, 0, 7, :7].any() and mask[0, 0, 4, 4:9].all() and not mask[0, 0, 4, :4].any()  # the window cuts the context
    with torch.no_grad():
        trained = BlockDraft(draft)(taps, tokens, embeds, positions, mask)[0]  # [8, h]
        for k, p in enumerate(anchors):
            ctx = draft.fuse(taps[:, :p])
            pieces = [(0, 2), (2, p)]  # committed in two steps
            cache = [None] * len(draft.layers)
            for a, b in pieces:
                kv = draft.context_kv(ctx[:, a:b], torch.arange(a, b)[None])
                cache = [new if old is None else (torch.cat([old[0], new[0]], 2), torch.cat([old[1], new[1]], 2))
                         for old, new in zip(cache, kv)]
            block = slice(4 * k, 4 * k + 4)
            alone = draft(draft.embed_block(tokens[:, block], embeds[:, block]), positions[:, block], cache,
                          draft.decode_mask(p))[0]
            torch.testing.assert_close(trained[4 * k : 4 * k + 4], alone, rtol=1e-5, atol=1e-5)


def test_mask_token_is_the_lowest_unused_id():
    rows = [{"input_ids": [0, 1, 2, 4]}, {"input_ids": [5, 1]}]
    assert choose_mask_token(rows, 8) == 3
    with pytest.raises(ConfigError, match="mask_token_id"):
        choose_mask_token([{"input_ids": list(range(4))}], 4)


def test_dpace_weights_by_hand():
    """3 selected slots with draft probabilities .5, .25, 1 (CE = ln 2, ln 4, 0), alpha .5: s = .75, .625, 1,
    P = .75, .46875, .46875, w = suffix sums 1.6875, .9375, .46875; an unselected slot weighs 0 and counts as s = 1."""
    ce = torch.tensor([2.0, 4.0, 1.0]).log()
    w = dpace_weights(ce, torch.tensor([[[True, True, True]]]), 0.5)
    assert w.tolist() == [[[1.6875, 0.9375, 0.46875]]]
    w = dpace_weights(ce[:2], torch.tensor([[[True, False, True]]]), 0.5)  # the second slot unsupervised
    assert w.tolist() == [[[0.75 + 0.75 * 0.625, 0.0, 0.75 * 0.625]]]
    assert dpace_weights(torch.zeros(2), torch.tensor([[[True, True], [False, False]]]), 0.5).tolist() == \
        [[[2.0, 1.0], [0.0, 0.0]]]  # a perfect draft: B - j; a padding block: nothing


class FixedSource:
    """A FeatureSource stand-in: given taps and final hidden states."""

    def __init__(self, taps, final):
        self.taps, self.final = taps, final

    def batch(self, batch):
        return self.taps, self.final


def test_target_argmax_labels_keep_out_of_vocabulary_slots():
    """labels target_argmax: every supervised slot is selected, the label is the target's argmax over the draft
    vocabulary at the position before (the best in-vocabulary token where the data token is outside it); labels
    data drops the out-of-vocabulary slots; dpace gives base weights 1 (the loss is divided by their count)."""
    model = tiny_model("llama", num_hidden_layers=4)
    draft = DFlashDraft(dflash_config_for(model, 2, 3, mask_token_id=5, feature_layers=[1, 2, 3], draft_vocab_size=32))
    draft.set_draft_vocab(torch.arange(0, 32))  # target ids 0..31 only
    ids = torch.tensor([[3, 4, 10, 40, 12, 13, 50, 8]])  # 40 and 50 are outside the draft vocabulary
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.tensor([[0, 1, 1, 1, 1, 1, 1, 0]]),
             "rows": torch.tensor([0])}
    final = torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(0))
    scored = draft.draft_lm_head_weight(model.get_output_embeddings().weight)  # [32, h]
    source = FixedSource(torch.randn(1, 8, 3 * 64), final)
    common = dict(block_size=3, anchors_per_row=2)
    hard = prepare_batch(batch, source, model, draft, scored, DFlashTrainConfig(labels="target_argmax", **common), None, 2)
    data = prepare_batch(batch, source, model, draft, scored, DFlashTrainConfig(labels="data", slot_weights="dpace",
                                                                                **common), None, 2)
    # anchors 1 and 5 (evenly spaced of 1..5): slots x2, x3 and x6, x7 (x7 is a user token)
    assert hard["labels"].tolist() == [[[10, 40], [50, 8]]]
    assert hard["selected"].tolist() == [[[True, True], [True, False]]]
    assert data["selected"].tolist() == [[[True, False], [False, False]]]
    expected = (final[0, [1, 2, 5]] @ scored.t()).argmax(-1)  # the target's logits one position before each label
    assert torch.equal(hard["target_labels"], expected)
    assert data["target_labels"].tolist() == [10] and data["weights"].tolist() == [[[1.0, 0.0], [0.0, 0.0]]]
    assert hard["probs"] is None and data["probs"] is None


def test_supervise_prompt_trains_anchors_anywhere_along_the_target_s_greedy_path():
    """supervise_prompt, in training: anchors at every position with a next token in the row; slot 1 always supervised,
    slot j > 1 while x_{p+1} .. x_{p+j-1} are each the target's greedy choice; labels the target's greedy tokens.
    Evaluation (step None) keeps the target-written anchors."""
    model = tiny_model("llama", num_hidden_layers=4)
    draft = DFlashDraft(dflash_config_for(model, 2, 3, mask_token_id=5, feature_layers=[1, 2, 3], draft_vocab_size=32))
    draft.set_draft_vocab(torch.arange(0, 32))
    ids = torch.tensor([[3, 4, 10, 11, 12, 13, 14, 8]])
    greedy = [4, 10, 20, 12, 13, 14, 8, 0]  # the target's argmax at each position: x_3 = 11 is not its choice
    final = torch.nn.functional.one_hot(torch.tensor(greedy), 64).float()[None]  # [1, 8, h]
    scored = torch.eye(32, 64)  # logits = final's first 32 features, argmax = greedy
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.tensor([[0, 0, 0, 0, 0, 1, 1, 0]]),
             "rows": torch.tensor([0])}
    source = FixedSource(torch.randn(1, 8, 3 * 64), final)
    cfg = DFlashTrainConfig(block_size=3, labels="target_argmax", supervise_prompt=True)
    prep = prepare_batch(batch, source, model, draft, scored, cfg, 0, 64)
    assert prep["positions"].view(7, 3)[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert prep["selected"][0].tolist() == [[True, True], [True, True], [True, False], [True, True], [True, True],
                                            [True, True], [True, False]]  # x_3 breaks anchor 2's path; x_8 is past the row
    assert prep["target_labels"].tolist() == [4, 10, 10, 20, 20, 12, 13, 13, 14, 14, 8, 8]
    answers_only = prepare_batch(batch, source, model, draft, scored, dataclasses.replace(cfg, supervise_prompt=False), 0, 64)
    assert answers_only["positions"].tolist() == [[5, 6, 7]] and answers_only["selected"].tolist() == [[[True, False]]]
    held_out = prepare_batch(batch, source, model, draft, scored, cfg, None, 64)
    assert torch.equal(held_out["positions"], answers_only["positions"])
    assert torch.equal(held_out["selected"], answers_only["selected"])
    with pytest.raises(ConfigError, match="supervise_prompt needs the target's labels"):
        check_config(DFlashTrainConfig(labels="data", supervise_prompt=True))


def test_mask_input_target_row_is_the_frozen_target_row_and_init_std():
    model = tiny_model("llama", num_hidden_layers=4)
    draft = random_draft(model)
    init_from_target(draft, model, layers=False, mask_input="target_row", init_std=0.02)
    assert torch.equal(draft.mask_embedding, model.get_input_embeddings().weight[5]) and not draft.mask_embedding.requires_grad
    for weight in (draft.fc.weight.detach(), draft.layers[0].mlp.up_proj.weight.detach()):
        assert abs(float(weight.std()) - 0.02) < 2e-3 and abs(float(weight.mean())) < 2e-3
    assert torch.all(draft.norm.weight != 1)  # norms are left as they were (random_draft's)
    trained = random_draft(model)
    init_from_target(trained, model, layers=False)
    assert trained.mask_embedding.requires_grad and not torch.equal(trained.mask_embedding, model.get_input_embeddings().weight[5])


# ----------------------------------------------------------------------------------------------------
# end to end


def test_train_learns_and_writes_heads_dir(llama_dir, sd_dir, tmp_path, one_thread):
    """12 rows, held-out rows = copies of 4 of them: the draft fits its rows, the heads dir round-trips strictly."""
    metrics = main(args(llama_dir, sd_dir, tmp_path, "--num_epochs", "12", "--labels", "data",
                        "--init_layers_from_target", "false"))
    log = train_log(tmp_path)
    first, last = log[:6], log[-6:]  # one epoch each: the same rows
    mean = lambda recs, key: sum(r[key] if key == "loss" else r[key][0] for r in recs) / len(recs)  # noqa: E731
    assert mean(last, "loss") < 0.25 * mean(first, "loss")
    assert mean(first, "acc") < 0.2 and mean(last, "acc") > 0.4
    assert len(metrics["top1"]) == 3 and metrics["top1"][0] > 0.5
    for j in range(3):
        assert abs(sum(metrics["rank_accuracy"][j][:5]) - metrics["top5"][j]) < 1e-3
    assert 0 < metrics["chain_accepted_tokens"] <= 3
    heads_dir = tmp_path / "heads"
    assert {"config.json", "model.safetensors", "README.md", "metrics.json"} <= {p.name for p in heads_dir.iterdir()}
    _, _, info = load_target(str(llama_dir))
    draft = load_heads(heads_dir, info)
    assert isinstance(draft, DFlashDraft) and draft.config.block_size == 4 and draft.config.draft_vocab_size == 64
    assert draft.config.feature_layers == [1, 2, 3] and draft.token_map.numel() == 64
    assert info.fingerprint in (heads_dir / "README.md").read_text()


def test_resume_is_exact(llama_dir, sd_dir, tmp_path, one_thread):
    common = ["--max_steps", "6", "--gradient_accumulation_steps", "2", "--checkpoint_every", "2"]
    main(args(llama_dir, sd_dir, tmp_path / "full", *common))
    main(args(llama_dir, sd_dir, tmp_path / "cut", *common, "--stop_after_steps", "3"))
    main(args(llama_dir, sd_dir, tmp_path / "cut", *common, "--resume", "true"))
    full, resumed = weights(tmp_path / "full"), weights(tmp_path / "cut")
    for name in full:
        assert torch.equal(full[name], resumed[name]), name
    assert [r["loss"] for r in train_log(tmp_path / "full")] == [r["loss"] for r in train_log(tmp_path / "cut")]


def test_two_processes_equal_one(llama_dir, sd_dir, tmp_path, launch):
    """2 gloo processes x batch 1 == 1 process x batch 2: the same losses and weights."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    common = ["--max_steps", "3"]
    one = launch.start([sys.executable, str(REPO / "train" / "dflash.py"), *args(llama_dir, sd_dir, tmp_path / "one", *common)],
                       env, tmp_path)
    launch.wait(one)
    two_args = args(llama_dir, sd_dir, tmp_path / "two", *common)
    two_args[two_args.index("--per_device_batch_size") + 1] = "1"
    two = launch.start([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                        str(REPO / "train" / "dflash.py"), *two_args], env, tmp_path)
    launch.wait(two)
    a, b = weights(tmp_path / "one"), weights(tmp_path / "two")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)
    losses = lambda out: [r["loss"] for r in train_log(out)]  # noqa: E731
    assert losses(tmp_path / "one") == pytest.approx(losses(tmp_path / "two"), rel=1e-5)


def test_recipe_parses_and_bad_configs_fail():
    cfg = check_config(parse_config(DFlashTrainConfig, ["--config", str(REPO / "recipes" / "smollm2-135m" / "dflash.yaml")]))
    assert cfg.method == "dflash" and cfg.block_size >= 2
    recipe_choices = (cfg.optimizer, cfg.labels, cfg.slot_weights, cfg.sliding_window, cfg.supervise_prompt)
    assert recipe_choices == ("muon", "target_probs", "dpace", 64, True)  # docs/measured.md
    with pytest.raises(ConfigError, match="block_size"):
        check_config(DFlashTrainConfig(block_size=1))
    with pytest.raises(ConfigError, match="method"):
        check_config(DFlashTrainConfig(method="eagle3"))
    for field, value in (("labels", "soft"), ("slot_weights", "pace"), ("optimizer", "sgd"), ("lr_schedule", "step"),
                         ("mask_input", "zero")):
        with pytest.raises(ConfigError, match=field):
            check_config(DFlashTrainConfig(**{field: value}))
    with pytest.raises(ConfigError, match="dpace_alpha"):
        check_config(DFlashTrainConfig(dpace_alpha=1.5))


SPECULATORS_PYTHON = os.environ.get("HEADSTART_SPECULATORS_PYTHON")


@pytest.mark.skipif(not SPECULATORS_PYTHON, reason="the reference trainer's harness runs in speculators 0.9.0's own "
                    "venv: set HEADSTART_SPECULATORS_PYTHON to its python (docs/measured.md, DFlash against the "
                    "reference trainer)")
@pytest.mark.parametrize("causal", [False, True])
def test_the_reference_forward_scores_headstart_heads_exactly(llama_dir, sd_dir, tmp_path, causal, one_thread):
    """scripts/speculators_dflash/score.py (one evaluator for both trainers) loads headstart's heads into speculators'
    DFlashDraftModel and must reproduce headstart's own held-out figures to the last digit."""
    import json
    import subprocess

    metrics = main(args(llama_dir, sd_dir, tmp_path, "--max_steps", "40", "--block_causal", str(causal).lower()))
    score = subprocess.run(
        [SPECULATORS_PYTHON, str(REPO / "scripts/speculators_dflash/score.py"), "--target", str(llama_dir),
         "--data_dir", str(sd_dir), "--eval_rows", "4", "--headstart_heads", str(tmp_path / "heads"),
         "--out", str(tmp_path / "score.json")],
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    assert score.returncode == 0, score.stderr[-2000:]
    reference = json.loads((tmp_path / "score.json").read_text())
    for key in ("top1", "top5", "rank_accuracy", "eval_positions", "chain_accepted_tokens"):
        assert reference[key] == metrics[key], key
