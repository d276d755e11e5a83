"""train/eagle.py on tiny random targets (4 layers, so the EAGLE-3 taps are distinct): feature taps, the
training-time-test mask against an inference-style chain, the draft vocabulary, learning, exact resume,
2-process equivalence, the offline feature cache."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch
import torch.nn.functional as F
from accelerate.utils import DistributedType
from transformers import DynamicCache

from headstart.heads.draft_vocab import most_frequent_tokens
from headstart.heads.eagle import EagleDraft, eagle_config_for
from headstart.heads.load import load_heads
from headstart.heads.target import load_target
from conftest import tiny_chat_tokenizer, tiny_model
from headstart.train.config import ConfigError, check_run_config, parse_config
from headstart.train.data import DataError, supervised_token_counts
from headstart.train.eagle import (EagleTrainConfig, check_config, draft_loss, init_from_target, main, optimizer_for,
                         prepare_batch, step_valid)
from headstart.train.eagle_unroll import unroll
from headstart.train.features import FeatureSource, cache_bytes, target_features
from headstart.train.muon import MuonAdamW, iteration_dtype, native_bf16_matmul, orthogonalise

REPO = Path(__file__).resolve().parents[1]


def make_target_dir(path: Path, model_type: str) -> Path:
    """A saved 4-layer target with a peaked lm_head (so its greedy text and its distributions are learnable)."""
    tokenizer = tiny_chat_tokenizer()
    model = tiny_model(model_type, vocab_size=len(tokenizer), num_hidden_layers=4, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_greedy_selfdistilled(path: Path, target_dir: Path, num_rows: int = 12, eval_copies: int = 4) -> Path:
    """Self-distilled rows the way train/selfdistill.py writes them: random user tokens (mask 0), then the target's
    own greedy continuation (mask 1). The last `eval_copies` rows repeat the first ones, so the held-out metrics
    measure how well the draft fits its training rows."""
    model, tokenizer, info = load_target(str(target_dir))
    rng = random.Random(0)
    rows = []
    for i in range(num_rows):
        user = [rng.randrange(4, info.vocab_size) for _ in range(rng.randrange(3, 8))]
        ids = torch.tensor([user])
        n = rng.randrange(8, 16)
        with torch.no_grad():
            for _ in range(n):
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
        rows.append({"id": f"r{i}", "input_ids": ids[0].tolist(), "loss_mask": [0] * len(user) + [1] * n})
    rows += [dict(rows[i], id=f"copy{i}") for i in range(eval_copies)]
    path.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows).save_to_disk(str(path / "dataset"))
    (path / "meta.json").write_text(json.dumps({"target": info.to_dict(), "rows": len(rows)}))
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_target_dir(tmp_path_factory.mktemp("llama4"), "llama")


@pytest.fixture(scope="module")
def sd_dir(llama_dir, tmp_path_factory):
    return write_greedy_selfdistilled(tmp_path_factory.mktemp("sd"), llama_dir)


def args(target_dir, data_dir, out, method="eagle3", *extra) -> list[str]:
    base = ["--target", str(target_dir), "--data_dir", str(data_dir), "--output_dir", str(out), "--method", method,
            "--per_device_batch_size", "2", "--eval_rows", "4", "--learning_rate", "3e-3", "--seed", "0"]
    if method == "eagle3":
        base += ["--feature_layers", "1", "2", "3", "--draft_vocab_size", "64", "--ttt_steps", "3"]
    return base + [str(e) for e in extra]


def weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "heads" / "model.safetensors")


def train_log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------------------------------
# pieces


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_feature_taps_are_hf_hidden_states(model_type, one_thread):
    model = tiny_model(model_type, num_hidden_layers=4)
    ids = torch.randint(0, 128, (2, 9))
    attn = torch.ones_like(ids)
    attn[1, 6:] = 0  # right padding
    taps, final = target_features(model, ids, attn, [0, 2, 3])
    hidden = model(ids, attention_mask=attn, output_hidden_states=True).hidden_states
    h = model.config.hidden_size
    for k, i in enumerate([0, 2, 3]):
        torch.testing.assert_close(taps[..., k * h : (k + 1) * h], hidden[i], rtol=0, atol=0)
    torch.testing.assert_close(final, hidden[4], rtol=0, atol=0)  # final-norm output: the logits come from it
    torch.testing.assert_close(final @ model.lm_head.weight.t(), model(ids, attention_mask=attn).logits)


def inference_chain(draft: EagleDraft, embeds: torch.Tensor, feats: torch.Tensor, root: int, depth: int) -> torch.Tensor:
    """What a tree node at `depth` below root position `root` gets at inference: the true prefix 0..root run causally
    (depth 1 is its last output), then one token at a time, each fed the previous output, attending to all so far."""
    cache = DynamicCache()
    out = draft(embeds[:, : root + 1], feats[:, : root + 1], torch.arange(root + 1)[None], None, cache)[:, -1:]
    for d in range(1, depth):
        p = root + d
        out = draft(embeds[:, p : p + 1], out, torch.tensor([[p]]), torch.zeros(1, 1, 1, p + 1), cache)
    return out[0, 0]


ALL_NORMS = {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}


@pytest.mark.parametrize("model_type,method,norms", [("llama", "eagle3", {}), ("qwen2", "eagle3", {}), ("llama", "eagle", {}),
                                                     ("llama", "eagle3", ALL_NORMS)])
def test_unrolled_steps_equal_the_inference_chain(model_type, method, norms, one_thread):
    """Step i at t (padded batch) == the chain rooted at t - i run as inference does, for every valid t."""
    model = tiny_model(model_type, num_hidden_layers=4)
    draft = EagleDraft(eagle_config_for(model, method, feature_layers=[1, 2, 3] if method == "eagle3" else None,
                                        **norms)).eval()
    torch.manual_seed(1)
    B, T, h, steps = 2, 11, model.config.hidden_size, 4
    embeds = torch.randn(B, T, h)
    feats = draft.fuse(torch.randn(B, T, len(draft.config.feature_layers) * h))
    lengths = [T, 8]
    key_valid = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    with torch.no_grad():
        outs = unroll(draft, embeds, feats, key_valid, steps)
        for b, n in enumerate(lengths):
            for i in range(steps):
                for t in range(i, n):
                    want = inference_chain(draft, embeds[b : b + 1, :n], feats[b : b + 1, :n], t - i, i + 1)
                    torch.testing.assert_close(outs[i][b, t], want, atol=1e-5, rtol=1e-5)


def test_draft_vocab_and_restricted_loss(llama_dir, sd_dir, one_thread):
    target, tokenizer, info = load_target(str(llama_dir))
    rows = [dict(r) for r in datasets.load_from_disk(str(sd_dir / "dataset")).select_columns(["input_ids", "loss_mask"])]
    counts = supervised_token_counts(rows, info.vocab_size)
    brute = torch.zeros(info.vocab_size, dtype=torch.long)
    for r in rows:
        for tok, m in zip(r["input_ids"], r["loss_mask"]):
            brute[tok] += m
    assert torch.equal(counts, brute)
    cfg = check_config(parse_config(EagleTrainConfig, ["--ttt_steps", "2", "--draft_vocab_size", "16"]))
    batch = {"input_ids": torch.tensor([rows[0]["input_ids"]]), "attention_mask": torch.ones(1, len(rows[0]["input_ids"]), dtype=torch.long),
             "loss_mask": torch.tensor([rows[0]["loss_mask"]]), "rows": torch.tensor([0])}
    full_logits = target(batch["input_ids"]).logits[0]  # [T, V]
    for k in (16, info.vocab_size):
        draft = EagleDraft(eagle_config_for(target, "eagle3", k, [1, 2, 3]))
        ids = most_frequent_tokens(counts, k)
        draft.set_draft_vocab(ids)
        assert torch.equal(draft.to_target_ids(torch.arange(k)), ids)  # every d2t entry: draft id -> its target id
        assert torch.equal(torch.nonzero(draft.t2d).squeeze(-1), ids)
        if k < info.vocab_size:  # the k most frequent (ties by id)
            assert counts[ids].min() >= counts[~draft.t2d].max()
        init_from_target(draft, target, layer=False)
        torch.testing.assert_close(draft.lm_head.weight, target.lm_head.weight[ids], rtol=0, atol=0)
        prep = prepare_batch(batch, FeatureSource(target, rows, [1, 2, 3]), target, draft, cfg, 0, step=None)
        t = prep["t_index"]
        want_probs = torch.softmax(full_logits[t + 1][:, ids], -1)
        torch.testing.assert_close(prep["probs"], want_probs)
        assert torch.equal(prep["in_vocab"], draft.t2d[full_logits[t + 1].argmax(-1)])
        with torch.no_grad():
            outs = torch.stack(unroll(draft, prep["embeds"], draft.fuse(prep["taps"]), prep["key_valid"], 2))[:, prep["select"]]
            logits = draft.logits(outs)
            valid = step_valid(prep, 2)
            loss, parts = draft_loss(outs, logits, prep, valid, valid.sum(-1).float(), cfg, draft)
        if k == info.vocab_size:  # the full draft vocabulary: the plain soft cross-entropy against the target
            assert prep["in_vocab"].all()
            plain = [-(torch.softmax(full_logits[t + 1], -1) * F.log_softmax(logits[i], -1)).sum(-1)[t >= i].mean()
                     for i in range(2)]
            torch.testing.assert_close(loss, plain[0] + 0.8 * plain[1])


def test_supervise_prompt_trains_on_every_position_and_evaluates_answers(llama_dir, sd_dir, one_thread):
    """supervise_prompt: training batches supervise every real position t + 2 < T with the target's own distribution
    at t + 1 (prompt and user turns too); evaluation batches (step None) keep the target-written positions."""
    target, _, _ = load_target(str(llama_dir))
    rows = [dict(r) for r in datasets.load_from_disk(str(sd_dir / "dataset")).select_columns(["input_ids", "loss_mask"])]
    row = rows[0]
    T = len(row["input_ids"])
    assert 0 < sum(row["loss_mask"]) < T  # the row has prompt positions to add
    batch = {"input_ids": torch.tensor([row["input_ids"]]), "attention_mask": torch.ones(1, T, dtype=torch.long),
             "loss_mask": torch.tensor([row["loss_mask"]]), "rows": torch.tensor([0])}
    full_logits = target(batch["input_ids"]).logits[0]  # [T, V]
    draft = EagleDraft(eagle_config_for(target, "eagle3", 0, [1, 2, 3]))
    answers = [t for t in range(T - 2) if row["loss_mask"][t + 2]]
    assert check_config(parse_config(EagleTrainConfig, [])).supervise_prompt  # EAGLE-3's default
    assert not check_config(parse_config(EagleTrainConfig, ["--method", "eagle"])).supervise_prompt
    for supervise, step, want in ((False, 0, answers), (True, 0, list(range(T - 2))), (True, None, answers)):
        cfg = check_config(parse_config(EagleTrainConfig, ["--supervise_prompt", str(supervise).lower()]))
        prep = prepare_batch(batch, FeatureSource(target, rows, [1, 2, 3]), target, draft, cfg, 0, step=step)
        assert prep["t_index"].tolist() == want
        assert prep["labels"].tolist() == [row["input_ids"][t + 2] for t in want]
        torch.testing.assert_close(prep["probs"], torch.softmax(full_logits[prep["t_index"] + 1], -1))


# ----------------------------------------------------------------------------------------------------
# end to end


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_train_learns_and_writes_heads_dir(llama_dir, sd_dir, tmp_path, method, one_thread):
    """12 rows, held-out rows = copies of 4 of them: the draft fits its rows (a real margin), heads dir round-trips."""
    metrics = main(args(llama_dir, sd_dir, tmp_path, method, "--num_epochs", "10"))
    log = train_log(tmp_path)
    first, last = log[:6], log[-6:]  # one epoch each: the same rows
    mean = lambda recs, key: sum(r[key] if key == "loss" else r[key][0] for r in recs) / len(recs)  # noqa: E731
    assert mean(last, "loss") < 0.5 * mean(first, "loss")
    assert mean(first, "acc") < 0.1 and mean(last, "acc") > 0.5
    assert metrics["top1"][0] > 0.5 and metrics["target_top1"] == 1.0  # greedy data: the target's own argmax
    assert len(metrics["top1"]) == 3 and len(metrics["rank_accuracy"]) == 3
    for d in range(3):
        assert abs(sum(metrics["rank_accuracy"][d][:5]) - metrics["top5"][d]) < 1e-3
        assert metrics["rank_accuracy"][d][0] == pytest.approx(metrics["top1"][d], abs=1e-3)
    assert 0 < metrics["chain_accepted_tokens"] <= 3
    heads_dir = tmp_path / "heads"
    assert {"config.json", "model.safetensors", "README.md", "metrics.json"} <= {p.name for p in heads_dir.iterdir()}
    saved = json.loads((heads_dir / "metrics.json").read_text())
    assert saved["top1"] == metrics["top1"]
    assert saved["config"]["optimizer"] == ("muon" if method == "eagle3" else "adamw")  # each method's default
    _, _, info = load_target(str(llama_dir))
    draft = load_heads(heads_dir, info)
    assert draft.config.method == method and info.fingerprint in (heads_dir / "README.md").read_text()
    if method == "eagle3":
        assert draft.config.draft_vocab_size == 64 and int(draft.t2d.sum()) == 64
        assert 0 < metrics["draft_vocab_coverage"] <= 1
    else:
        assert "feature_loss" in log[0] and log[-1]["feature_loss"][0] < log[0]["feature_loss"][0]


def test_qwen2_target_and_layer_init(tmp_path, one_thread):
    target_dir = make_target_dir(tmp_path / "qwen", "qwen2")
    sd = write_greedy_selfdistilled(tmp_path / "sd", target_dir, num_rows=8)
    metrics = main(args(target_dir, sd, tmp_path / "out", "eagle3", "--max_steps", "3", "--init_layer_from_target", "true",
                        "--report_to", "tensorboard", "--log_every", "1"))
    assert list((tmp_path / "out").rglob("events.out.tfevents.*"))
    target, _, info = load_target(str(target_dir))
    draft = load_heads(tmp_path / "out" / "heads", info)
    assert metrics["steps"] == 3 and draft.config.layer_config["model_type"] == "qwen2"
    fresh = EagleDraft(draft.config)
    fresh.set_draft_vocab(torch.nonzero(draft.t2d).squeeze(-1))
    names = init_from_target(fresh, target, layer=True)
    last = target.model.layers[-1]
    h = info.hidden_size
    assert {"layers.0.mlp.down_proj.weight", "layers.0.self_attn.q_proj.bias", "layers.0.self_attn.q_proj.weight"} <= set(names)
    torch.testing.assert_close(fresh.layers[0].mlp.down_proj.weight, last.mlp.down_proj.weight, rtol=0, atol=0)
    torch.testing.assert_close(fresh.layers[0].self_attn.k_proj.weight[:, h:], last.self_attn.k_proj.weight, rtol=0, atol=0)
    torch.testing.assert_close(fresh.norm.weight, target.model.norm.weight, rtol=0, atol=0)


def test_muon_orthogonalises_matrix_updates_and_keeps_adamw_for_the_rest():
    torch.manual_seed(0)
    u, _, v = torch.linalg.svd(torch.randn(12, 20), full_matrices=False)
    grad = u @ torch.diag(torch.logspace(0, -2, 12)) @ v  # singular values 1 .. 0.01
    for g in (grad, grad.T):  # wide and tall
        sv = torch.linalg.svdvals(orthogonalise(g))
        assert orthogonalise(g).shape == g.shape and sv.min() > 0.6 and sv.max() < 1.2  # from a condition number of 100
    matrix, bias = torch.nn.Parameter(torch.randn(12, 20)), torch.nn.Parameter(torch.randn(7))
    reference = torch.nn.Parameter(bias.detach().clone())
    start = matrix.detach().clone()
    opt = MuonAdamW([{"params": [matrix], "muon": True}, {"params": [bias]}], lr=0.01, betas=(0.9, 0.95),
                    weight_decay=0.05)  # the AdamW group's; the Muon group keeps Muon's 0.1
    adamw = torch.optim.AdamW([reference], lr=0.01, betas=(0.9, 0.95), weight_decay=0.05)
    for step in range(3):
        g = torch.randn(7)
        matrix.grad, bias.grad, reference.grad = grad.clone(), g.clone(), g.clone()
        opt.step()
        adamw.step()
        if step == 0:  # momentum = grad, Nesterov = 1.95 grad; decoupled decay 0.1; RMS scale 0.2 sqrt(20)
            want = start * (1 - 0.01 * 0.1) - 0.01 * 0.2 * 20 ** 0.5 * orthogonalise(1.95 * grad)
            torch.testing.assert_close(matrix.detach(), want)
    assert torch.equal(bias.detach(), reference.detach())  # the AdamW group is AdamW, bit for bit
    with pytest.raises(ValueError, match="2-D weight matrices only"):
        MuonAdamW([{"params": [torch.nn.Parameter(torch.zeros(3))], "muon": True}], lr=0.1, betas=(0.9, 0.9),
                  weight_decay=0.0)


def test_muon_iterates_in_bf16_where_the_device_multiplies_it_natively():
    """precision auto takes bf16 exactly where the device has native bf16 matmuls; the bf16 iteration orthogonalises
    as the fp32 one does (singular values in the same band, the update within a few percent of it), returned in fp32."""
    torch.manual_seed(0)
    u, _, v = torch.linalg.svd(torch.randn(48, 80), full_matrices=False)
    grad = u @ torch.diag(torch.logspace(0, -2, 48)) @ v
    fp32, bf16 = orthogonalise(grad), orthogonalise(grad, dtype=torch.bfloat16)
    sv, sv32 = torch.linalg.svdvals(bf16), torch.linalg.svdvals(fp32)
    assert bf16.dtype == torch.float32 and (sv - sv32).abs().max() < 0.02 and sv.min() > 0.6 and sv.max() < 1.25
    assert 0 < (bf16 - fp32).norm() / fp32.norm() < 0.05  # bf16 rounding, not the same numbers
    cpu = torch.device("cpu")
    assert iteration_dtype("auto", cpu) == (torch.bfloat16 if native_bf16_matmul(cpu) else torch.float32)
    assert iteration_dtype("float32", cpu) == torch.float32 and iteration_dtype("bfloat16", cpu) == torch.bfloat16
    matrix = torch.nn.Parameter(torch.randn(12, 20))
    opt = MuonAdamW([{"params": [matrix], "muon": True}], lr=0.01, betas=(0.9, 0.95), weight_decay=0.0,
                    precision="bfloat16")
    start, matrix.grad = matrix.detach().clone(), grad[:12, :20].clone()
    opt.step()
    want = start * (1 - 0.01 * 0.1) - 0.01 * 0.2 * 20 ** 0.5 * orthogonalise(1.95 * grad[:12, :20], dtype=torch.bfloat16)
    torch.testing.assert_close(matrix.detach(), want)
    with pytest.raises(ValueError, match="muon precision must be auto, float32 or bfloat16"):
        iteration_dtype("half", cpu)
    with pytest.raises(ConfigError, match="muon_precision must be auto"):
        check_run_config(dataclasses.replace(EagleTrainConfig(), muon_precision="fp8"), ("eagle3", "eagle"))


def test_optimizer_default_is_muon_for_eagle3_unless_the_matrices_are_sharded(capsys):
    def accelerator(kind: DistributedType):
        return SimpleNamespace(distributed_type=kind, print=print)

    eagle3, eagle = (check_config(parse_config(EagleTrainConfig, ["--method", m])) for m in ("eagle3", "eagle"))
    assert eagle3.optimizer is None and eagle.optimizer is None
    assert optimizer_for(eagle3, accelerator(DistributedType.NO)) == "muon"
    assert optimizer_for(eagle3, accelerator(DistributedType.MULTI_CPU)) == "muon"  # plain data parallel
    assert capsys.readouterr().out == ""
    for sharded in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        assert optimizer_for(eagle3, accelerator(sharded)) == "adamw"
        assert f"optimizer: adamw, as {sharded.value} shards" in capsys.readouterr().out
    assert optimizer_for(eagle, accelerator(DistributedType.NO)) == "adamw"
    chosen = check_config(parse_config(EagleTrainConfig, ["--method", "eagle3", "--optimizer", "adamw"]))
    assert optimizer_for(chosen, accelerator(DistributedType.NO)) == "adamw"  # an explicit choice stays


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_is_exact(llama_dir, sd_dir, tmp_path, optimizer, one_thread):
    """Killed after step 5 (checkpoints every 2), resumed: bit-identical weights to an uninterrupted run (noise on)."""
    common = ["--max_steps", "8", "--gradient_accumulation_steps", "2", "--checkpoint_every", "2", "--feature_noise", "0.05",
              "--optimizer", optimizer]
    main(args(llama_dir, sd_dir, tmp_path / "full", "eagle3", *common))
    main(args(llama_dir, sd_dir, tmp_path / "cut", "eagle3", *common, "--stop_after_steps", "5"))
    assert not (tmp_path / "cut" / "heads").exists()
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()) == ["step-2", "step-4"]
    main(args(llama_dir, sd_dir, tmp_path / "cut", "eagle3", *common, "--resume", "true"))
    full, resumed = weights(tmp_path / "full"), weights(tmp_path / "cut")
    assert full.keys() == resumed.keys()
    for name in full:
        assert torch.equal(full[name], resumed[name]), name
    assert [r["step"] for r in train_log(tmp_path / "cut")] == list(range(1, 9))  # step 5, replayed, logged once
    assert [r["loss"] for r in train_log(tmp_path / "full")] == [r["loss"] for r in train_log(tmp_path / "cut")]


def test_two_processes_equal_one(llama_dir, sd_dir, tmp_path, launch):
    """2 gloo processes x batch 1 == 1 process x batch 2: same per-step losses and final weights (noise on). The two
    sum their gradients in another order (equal to fp32 rounding): Muon iterates in fp32 here, as its bf16 iteration
    (auto on a bf16 CPU) would round those last bits up to bf16's."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    common = ["--max_steps", "4", "--feature_noise", "0.05", "--muon_precision", "float32"]

    def start(launcher: list[str], out: Path, batch: int):
        argv = args(llama_dir, sd_dir, out, "eagle3", *common)
        argv[argv.index("--per_device_batch_size") + 1] = str(batch)
        return launch.start([*launcher, REPO / "train" / "eagle.py", *argv], env=env, cwd=tmp_path)

    runs = [start([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                   "--main_process_port", "29519"], tmp_path / "two", 1),
            start([sys.executable], tmp_path / "one", 2)]  # side by side: most of their time is start-up
    for proc in runs:
        launch.wait(proc)
    one, two = train_log(tmp_path / "one"), train_log(tmp_path / "two")
    assert len(one) == len(two) == 4
    for a, b in zip(one, two):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["ce"] == pytest.approx(b["ce"], rel=1e-5)
    m1 = json.loads((tmp_path / "one" / "heads" / "metrics.json").read_text())
    m2 = json.loads((tmp_path / "two" / "heads" / "metrics.json").read_text())
    assert m1["global_batch"] == m2["global_batch"] == 2 and m1["eval_positions"] == m2["eval_positions"]
    w1, w2 = weights(tmp_path / "one"), weights(tmp_path / "two")
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], atol=1e-5, rtol=1e-4)


def test_offline_feature_cache(llama_dir, sd_dir, tmp_path, capsys, one_thread):
    """Written once with a size estimate, reused, resumed after an interrupted write; training from it == online (the
    features equal to fp32 rounding: Muon iterates in fp32 here, see test_two_processes_equal_one)."""
    cache = tmp_path / "cache"
    common = ["--max_steps", "4", "--feature_noise", "0.05", "--muon_precision", "float32"]
    with_cache = ["--feature_cache_dir", cache, "--feature_cache_shard_rows", "5"]
    main(args(llama_dir, sd_dir, tmp_path / "online", "eagle3", *common))
    main(args(llama_dir, sd_dir, tmp_path / "disk", "eagle3", *common, *with_cache))
    out = capsys.readouterr().out
    meta = json.loads((cache / "cache.json").read_text())
    tokens, dim = meta["identity"]["tokens"], 64 * 3 + 64  # 3 taps + the final hidden state, fp32
    assert meta["bytes_estimate"] == tokens * dim * 4 and f"{tokens * dim * 4 / 2**20:.1f} MiB" in out
    shards = sorted(cache.glob("shard-*.safetensors"))
    assert len(shards) == 4 and "4 to write" in out  # 16 rows (12 train + 4 held out), 5 per shard
    assert sum(p.stat().st_size for p in shards) == pytest.approx(meta["bytes_estimate"], rel=0.05)
    online, disk = weights(tmp_path / "online"), weights(tmp_path / "disk")
    for name in online:
        torch.testing.assert_close(disk[name], online[name], atol=1e-5, rtol=1e-4)
    # interrupted write: one shard missing, a partial temporary file left behind -> only that shard is written again
    before = {p.name: p.stat().st_mtime_ns for p in shards}
    content = shards[1].read_bytes()
    shards[1].unlink()
    shards[1].with_suffix(".tmp").write_bytes(b"partial")
    main(args(llama_dir, sd_dir, tmp_path / "x", "eagle3", *common, *with_cache, "--build_cache_only", "true"))
    assert "1 to write" in capsys.readouterr().out
    assert shards[1].read_bytes() == content and not shards[1].with_suffix(".tmp").exists()
    assert all(p.stat().st_mtime_ns == before[p.name] for p in (shards[0], *shards[2:]))
    # memory cache: the same per-row features, so exactly the disk run's weights
    main(args(llama_dir, sd_dir, tmp_path / "memory", "eagle3", *common, "--feature_cache", "true"))
    memory = weights(tmp_path / "memory")
    assert all(torch.equal(memory[n], disk[n]) for n in disk)
    with pytest.raises(ConfigError, match="feature_layers"):  # a cache written for other taps is refused
        main(args(llama_dir, sd_dir, tmp_path / "y", "eagle3", *common, *with_cache, "--feature_layers", "0", "2", "4"))


def test_cache_bytes():
    """Tokens x (final state + n taps) x hidden x bytes; taps that are the final state itself are not stored twice."""
    assert cache_bytes(2048, 4096, [32], 32, torch.float32) == 2048 * 4096 * 4  # Medusa / EAGLE-1: the final state
    assert cache_bytes(2048, 4096, [2, 16, 29], 32, torch.bfloat16) == 2048 * 4 * 4096 * 2  # EAGLE-3: 3 taps + final
    assert cache_bytes(10, 8, [1, 2, 3, 4, 5], 6, torch.float16) == 10 * 6 * 8 * 2  # DFlash: 5 taps + final
    assert cache_bytes(10, 8, [6], 8, torch.float32) == 10 * 2 * 8 * 4  # one tap below the last layer: tap + final


def test_cache_size_table_in_the_docs():
    """docs/training.md's worked example (rows of 2,048 tokens, 100k rows) is what cache_bytes gives."""
    lines = [line for line in (REPO / "docs" / "training.md").read_text().splitlines()
             if line.startswith(("| 7B", "| 70B"))]
    assert len(lines) == 4
    for line in lines:
        target, what, *sizes = [cell.strip() for cell in line.strip("|").split("|")]
        hidden, layers = (4096, 32) if target.startswith("7B") else (8192, 80)
        taps = [layers] if what.startswith("Medusa") else [2, layers // 2, layers - 3]
        row = [cache_bytes(2048, hidden, taps, layers, dtype) for dtype in (torch.float32, torch.bfloat16)]
        expected = [f"{b / 2**20:.0f} MiB" for b in row] + [f"{b * 100_000 / 2**40:.2f} TiB" for b in row]
        assert sizes == expected, line


def test_feature_cache_refused_when_the_disk_is_too_small(llama_dir, sd_dir, tmp_path, monkeypatch):
    import shutil as real_shutil
    from headstart.train import features

    free = real_shutil._ntuple_diskusage(total=10**9, used=10**9 - 1000, free=1000)
    monkeypatch.setattr(features.shutil, "disk_usage", lambda path: free)
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match=r"GiB more; .* has 0.00 GiB free: free space.*feature_cache_dtype"):
        main(args(llama_dir, sd_dir, tmp_path / "x", "eagle3", "--feature_cache_dir", cache, "--build_cache_only", "true"))
    assert not list(cache.glob("shard-*"))


def load_vllm_features_script():
    """scripts/vllm_features.py without vLLM: its row finding and shard writing run on fake captured forwards."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm_features", REPO / "scripts" / "vllm_features.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_feature_cache_written_from_vllm_states(llama_dir, sd_dir, tmp_path, capsys, one_thread):
    """feature_cache_writer vllm: headstart writes the request (rows' ids, identity), no shard; training refuses to
    start until the shards are there. The script's writer, fed forwards shaped like vLLM's captures (several rows per
    forward in any order, padding after them, vLLM's aux states = HF hidden_states[j]), writes the same shards as
    headstart, and training reads them without running the target."""
    from safetensors.torch import load_file
    from headstart.train.feature_shards import read_rows, shard_path

    script = load_vllm_features_script()
    common = ["--max_steps", "2", "--feature_cache_shard_rows", "5"]
    hf_cache, vllm_cache = tmp_path / "hf", tmp_path / "vllm"
    main(args(llama_dir, sd_dir, tmp_path / "a", "eagle3", *common, "--feature_cache_dir", hf_cache))
    request = [*common, "--feature_cache_dir", vllm_cache, "--feature_cache_writer", "vllm"]
    main(args(llama_dir, sd_dir, tmp_path / "b", "eagle3", *request, "--build_cache_only", "true"))
    assert f"python scripts/vllm_features.py --cache_dir {vllm_cache}" in capsys.readouterr().out
    meta = json.loads((vllm_cache / "cache.json").read_text())
    assert meta["identity"] == json.loads((hf_cache / "cache.json").read_text())["identity"]
    assert meta["vllm_request"] == {"target": str(llama_dir), "target_dtype": "float32", "hidden_size": 64,
                                    "num_hidden_layers": 4, "taps_are_final": False}
    assert not list(vllm_cache.glob("shard-*"))
    with pytest.raises(ConfigError, match="4 of its 4 shards are missing: run `python scripts/vllm_features.py"):
        main(args(llama_dir, sd_dir, tmp_path / "c", "eagle3", *request))

    rows = read_rows(vllm_cache)  # 16 rows: 12 training, 4 held out (copies of rows 0-3)
    model, _, _ = load_target(str(llama_dir))
    layers, S = meta["identity"]["feature_layers"], meta["identity"]["shard_rows"]
    for k in range(4):
        shard = rows[k * S : (k + 1) * S]
        forwards = []
        for group in filter(None, (shard[::-1][:3], shard[::-1][3:])):  # vLLM batches rows as it likes
            ids = torch.tensor([t for row in group for t in row] + group[0][:3])  # padding: a row's start, not a row
            positions = torch.tensor([p for row in group for p in range(len(row))] + [0, 1, 2])
            with torch.no_grad():  # each row attends to itself alone, as in vLLM's packed forward
                states = [model.model(torch.tensor([row]), output_hidden_states=True).hidden_states for row in group]
            padding = torch.randn(3, 64)
            forwards.append({"input_ids": ids, "positions": positions,
                             "taps": {j: torch.cat([h[j][0] for h in states] + [padding]) for j in range(4)},
                             "final": torch.cat([h[4][0] for h in states] + [padding])})
        per_row = script.rows_from_forwards(forwards, shard, layers, 4, taps_are_final=False)
        script.write_shard(shard_path(vllm_cache, k), per_row, torch.float32)
        vllm_shard, hf_shard = load_file(shard_path(vllm_cache, k)), load_file(shard_path(hf_cache, k))
        assert vllm_shard.keys() == hf_shard.keys() == {"final", "taps", "offsets"}
        for name in hf_shard:
            torch.testing.assert_close(vllm_shard[name], hf_shard[name], atol=1e-5, rtol=1e-5)
    main(args(llama_dir, sd_dir, tmp_path / "d", "eagle3", *request))
    assert "0 to write" in capsys.readouterr().out
    a, d = weights(tmp_path / "a"), weights(tmp_path / "d")
    for name in a:
        torch.testing.assert_close(d[name], a[name], atol=1e-5, rtol=1e-4)
    with pytest.raises(RuntimeError, match=r"rows \[0\] were in no forward"):  # a row cut in two is not taken
        cut = {"input_ids": torch.tensor(rows[0][:4]), "positions": torch.arange(4), "taps": {}, "final": None}
        script.rows_from_forwards([cut], rows[:1], layers, 4, taps_are_final=False)


def test_every_eagle_recipe_parses():
    recipes = sorted((REPO / "recipes").glob("*/eagle*.yaml"))
    assert {r.parent.name for r in recipes} >= {"smollm2-135m", "llama-3.1-8b-instruct", "qwen2.5-7b-instruct"}
    for recipe in recipes:
        header = [line for line in recipe.read_text().splitlines() if line.startswith("#")]
        assert any("train/eagle.py" in line for line in header), f"{recipe}: its header shows no train/eagle.py command"
        cfg = check_config(parse_config(EagleTrainConfig, ["--config", str(recipe)]))
        assert cfg.method == ("eagle3" if recipe.stem == "eagle3" else "eagle")


def test_bad_configs_fail(tmp_path):
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        check_config(parse_config(EagleTrainConfig, ["--method", "eagle", "--draft_vocab_size", "100"]))
    with pytest.raises(ConfigError, match="method"):
        check_config(parse_config(EagleTrainConfig, ["--method", "eagle2"]))
    with pytest.raises(ConfigError, match="optimizer must be adamw or muon"):
        check_config(parse_config(EagleTrainConfig, ["--optimizer", "sgd"]))
    with pytest.raises(ConfigError, match="muon: method eagle3"):
        check_config(parse_config(EagleTrainConfig, ["--method", "eagle", "--optimizer", "muon"]))
    with pytest.raises(ConfigError, match="exclude"):
        check_config(parse_config(EagleTrainConfig, ["--feature_cache", "true", "--feature_cache_dir", str(tmp_path)]))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("method: eagle3\nttt_step: 3\n")
    with pytest.raises(ConfigError, match="ttt_step"):
        main(["--config", str(recipe)])
