"""train/medusa.py end to end on a tiny random target and synthetic self-distilled rows: exact resume,
2-process equivalence, Medusa-2 adapter round trip, bad inputs."""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from pathlib import Path

import datasets
import pytest
import torch

from headstart.heads.load import load_heads, load_heads_and_target
from headstart.heads.target import load_target
from headstart.inference.ngram import NGRAM_FILE, NgramTable
from headstart.train.config import ConfigError
from headstart.train.data import DataError
from headstart.heads.medusa import MedusaConfig, MedusaHeads
from headstart.train.medusa import MedusaTrainConfig, block_groups, check_config, main

REPO = Path(__file__).resolve().parents[1]


def write_selfdistilled(path: Path, target_dir: Path, num_rows: int = 24, seed: int = 0, fingerprint=None) -> Path:
    """A synthetic self-distilled run dir (dataset/ + meta.json) with the columns of train/selfdistill.py.

    Each row: a user turn (mask 0) then an assistant answer (mask 1) that repeats a short pattern, ending with eos.
    """
    _, tokenizer, info = load_target(str(target_dir))
    eos, vocab = tokenizer.eos_token_id, len(tokenizer)
    rng = random.Random(seed)
    rows = []
    for i in range(num_rows):
        user = [rng.randrange(4, vocab) for _ in range(rng.randrange(3, 8))]
        pattern = [rng.randrange(4, vocab) for _ in range(3)]
        answer = (pattern * 6)[: rng.randrange(6, 16)] + [eos]
        ids = user + answer
        rows.append({"id": f"r{i}", "category": "synthetic", "conversation": [{"role": "user", "content": "x"}],
                     "input_ids": ids, "loss_mask": [0] * len(user) + [1] * len(answer), "num_generated": len(answer)})
    path.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows).save_to_disk(str(path / "dataset"))
    meta = {"target": {**info.to_dict(), **({"fingerprint": fingerprint} if fingerprint else {})}, "rows": num_rows}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


@pytest.fixture(scope="module")
def sd_dir(tiny_target_dir, tmp_path_factory):
    return write_selfdistilled(tmp_path_factory.mktemp("sd"), tiny_target_dir)


def base_args(target_dir, data_dir, out, *extra) -> list[str]:
    return ["--target", str(target_dir), "--data_dir", str(data_dir), "--output_dir", str(out), "--num_heads", "3",
            "--per_device_batch_size", "2", "--eval_rows", "4", "--learning_rate", "1e-2", "--seed", "0", *map(str, extra)]


def heads_state(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "heads" / "model.safetensors")


def held_out_rows(sd_dir: Path, eval_rows: int) -> list[dict]:
    dataset = datasets.load_from_disk(str(sd_dir / "dataset"))
    return [dict(r) for r in dataset.select(range(len(dataset) - eval_rows, len(dataset)))]


@torch.no_grad()
def greedy_agreement(model_a, model_b, rows: list[dict]) -> tuple[int, int]:
    """(positions where both models' greedy next token is the same, positions) over the positions whose next token
    the target wrote (loss_mask of the next token = 1), as train/medusa.py evaluates."""
    agree = positions = 0
    for row in rows:
        ids = torch.tensor([row["input_ids"]])
        valid = torch.tensor(row["loss_mask"][1:]).bool()
        a, b = (m(ids).logits[0, :-1][valid].argmax(-1) for m in (model_a, model_b))
        agree, positions = agree + int((a == b).sum()), positions + int(valid.sum())
    return agree, positions


def test_train_writes_heads_dir(tiny_target_dir, sd_dir, tmp_path):
    metrics = main(base_args(tiny_target_dir, sd_dir, tmp_path, "--num_epochs", "3"))
    heads_dir = tmp_path / "heads"
    assert {"config.json", "model.safetensors", "README.md", "metrics.json"} <= {p.name for p in heads_dir.iterdir()}
    config = json.loads((heads_dir / "config.json").read_text())
    _, _, info = load_target(str(tiny_target_dir))
    assert config["method"] == "medusa" and config["target"]["fingerprint"] == info.fingerprint
    assert config["hidden_size"] == info.hidden_size and config["vocab_size"] == info.vocab_size
    saved = json.loads((heads_dir / "metrics.json").read_text())
    assert saved["top1"] == metrics["top1"] and len(saved["top1"]) == 3 and len(saved["top5"]) == 3
    assert len(saved["rank_accuracy"]) == 3 and all(len(r) == 10 for r in saved["rank_accuracy"])
    for k in range(3):  # rank accuracies are exact-rank probabilities: they sum to top-5 over the first 5
        assert abs(sum(saved["rank_accuracy"][k][:5]) - saved["top5"][k]) < 1e-3
        assert saved["rank_accuracy"][k][0] == pytest.approx(saved["top1"][k], abs=1e-3)
    assert saved["train_rows"] == 20 and saved["eval_rows"] == 4 and saved["steps"] == 30
    card = (heads_dir / "README.md").read_text()
    assert "Medusa-1" in card and info.fingerprint in card and "| 1 |" in card
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 30 and log[-1]["loss"] < log[0]["loss"]  # it learns the repeated patterns
    heads = load_heads(heads_dir, info)
    assert heads.config.num_heads == 3
    dataset = datasets.load_from_disk(str(sd_dir / "dataset"))  # the n-gram table: of the 20 training rows only
    table = NgramTable.load(heads_dir / NGRAM_FILE)
    assert table.next_token == NgramTable.build([dict(r) for r in dataset.select(range(20))]).next_token
    assert table.next_token != NgramTable.build([dict(r) for r in dataset]).next_token  # the held-out rows stay out


def test_soft_labels_and_prompt_positions_train(tiny_target_dir, sd_dir, tmp_path):
    """soft_label_weight 1 with supervise_prompt: the heads learn the target's distribution (the logged soft CE falls)
    and reach the hard-label run's held-out accuracy on the tiny target's repeated patterns; supervise_prompt without
    soft labels is refused."""
    hard = main(base_args(tiny_target_dir, sd_dir, tmp_path / "hard", "--num_epochs", "3"))
    soft = main(base_args(tiny_target_dir, sd_dir, tmp_path / "soft", "--num_epochs", "3", "--soft_label_weight", "1.0",
                          "--supervise_prompt", "true"))
    log = [json.loads(line) for line in (tmp_path / "soft" / "train_log.jsonl").read_text().splitlines()]
    first, last = sum(log[0]["head_soft_ce"]), sum(sum(r["head_soft_ce"]) for r in log[-5:]) / 5
    assert last < first, (first, last)
    assert "head_soft_ce" not in json.loads((tmp_path / "hard" / "train_log.jsonl").read_text().splitlines()[0])
    assert soft["top1"][0] >= hard["top1"][0] - 0.1
    assert heads_state(tmp_path / "soft").keys() == heads_state(tmp_path / "hard").keys()
    with pytest.raises(ConfigError, match="supervise_prompt needs soft labels"):
        main(base_args(tiny_target_dir, sd_dir, tmp_path / "bad", "--supervise_prompt", "true"))


def test_feature_cache_matches_online_features(tiny_target_dir, sd_dir, tmp_path, capsys):
    """In memory and on disk: the same per-row features, so exactly the same heads; both match online training.
    The disk cache holds the final hidden state alone (train/features.py), written once and then reused."""
    main(base_args(tiny_target_dir, sd_dir, tmp_path / "a", "--num_epochs", "2"))
    main(base_args(tiny_target_dir, sd_dir, tmp_path / "b", "--num_epochs", "2", "--feature_cache", "true"))
    a, b = heads_state(tmp_path / "a"), heads_state(tmp_path / "b")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-4, rtol=1e-4)
    cache = tmp_path / "cache"
    with_cache = ["--feature_cache_dir", cache, "--feature_cache_shard_rows", "10"]
    built = main(base_args(tiny_target_dir, sd_dir, tmp_path / "x", *with_cache, "--build_cache_only", "true"))
    assert built["rows"] == 24 and not (tmp_path / "x" / "heads").exists()
    assert "3 to write" in capsys.readouterr().out  # 24 rows (20 train + 4 held out), 10 per shard
    from safetensors import safe_open

    with safe_open(str(cache / "shard-00000.safetensors"), framework="pt") as shard:
        assert set(shard.keys()) == {"final", "offsets"}  # Medusa reads the final state: no taps stored
    main(base_args(tiny_target_dir, sd_dir, tmp_path / "c", "--num_epochs", "2", *with_cache))
    assert "0 to write" in capsys.readouterr().out
    c = heads_state(tmp_path / "c")
    assert all(torch.equal(c[name], b[name]) for name in b)
    with pytest.raises(ConfigError, match="frozen target"):
        main(base_args(tiny_target_dir, sd_dir, tmp_path / "y", "--method", "medusa2", *with_cache))


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_is_exact(tiny_target_dir, sd_dir, tmp_path, optimizer):
    """Stop after step 4 (as if killed) with checkpoints every 2 steps, resume to 12 == uninterrupted 12 steps."""
    common = ["--max_steps", "12", "--gradient_accumulation_steps", "2", "--checkpoint_every", "2", "--optimizer", optimizer]
    main(base_args(tiny_target_dir, sd_dir, tmp_path / "full", *common))
    main(base_args(tiny_target_dir, sd_dir, tmp_path / "cut", *common, "--stop_after_steps", "5"))
    assert not (tmp_path / "cut" / "heads").exists()
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()) == ["step-2", "step-4"]
    main(base_args(tiny_target_dir, sd_dir, tmp_path / "cut", *common, "--resume", "true"))  # resumes at step 4
    full, resumed = heads_state(tmp_path / "full"), heads_state(tmp_path / "cut")
    for name in full:
        torch.testing.assert_close(resumed[name], full[name], atol=1e-6, rtol=1e-5)
    full_log = [json.loads(x) for x in (tmp_path / "full" / "train_log.jsonl").read_text().splitlines()]
    cut_log = [json.loads(x) for x in (tmp_path / "cut" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in cut_log] == list(range(1, 13))  # step 5, replayed after the resume, logged once
    for a, b in zip(full_log, cut_log):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["lr"] == pytest.approx(b["lr"])


def test_muon_takes_the_blocks_weight_matrices():
    heads = MedusaHeads(MedusaConfig(hidden_size=16, vocab_size=32, num_heads=2, num_layers=1))
    adamw = block_groups(heads, MedusaTrainConfig(learning_rate=0.01))
    assert len(adamw) == 1 and len(adamw[0]["params"]) == 4 and not adamw[0].get("muon")  # 2 heads x (weight, bias)
    muon, rest = block_groups(heads, MedusaTrainConfig(learning_rate=0.01, optimizer="muon"))
    assert muon["muon"] and [tuple(p.shape) for p in muon["params"]] == [(16, 16), (16, 16)]
    assert not rest.get("muon") and [tuple(p.shape) for p in rest["params"]] == [(16,), (16,)]
    assert muon["lr"] == rest["lr"] == 0.01
    with pytest.raises(ConfigError, match="optimizer must be adamw or muon"):
        check_config(MedusaTrainConfig(optimizer="sgd"))


def test_two_processes_equal_one(tiny_target_dir, sd_dir, tmp_path, launch):
    """2 gloo processes x batch 1 == 1 process x batch 2: same per-step losses and final weights; the DDP run's step-4
    checkpoint, resumed by 1 process, ends there too."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    common = base_args(tiny_target_dir, sd_dir, tmp_path / "x", "--max_steps", "6", "--checkpoint_every", "2")

    def run(launcher: list[str], out: Path, batch: int):
        args = [a for a in common]
        args[args.index("--output_dir") + 1] = str(out)
        args[args.index("--per_device_batch_size") + 1] = str(batch)
        launch.wait(launch.start([*launcher, REPO / "train" / "medusa.py", *args], env=env, cwd=tmp_path))

    accelerate = [sys.executable, "-m", "accelerate.commands.launch"]
    run([*accelerate, "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
         "--dynamo_backend", "no", "--main_process_port", "29517"], tmp_path / "two", 1)
    run([sys.executable], tmp_path / "one", 2)
    two = [json.loads(x) for x in (tmp_path / "two" / "train_log.jsonl").read_text().splitlines()]
    one_log = [json.loads(x) for x in (tmp_path / "one" / "train_log.jsonl").read_text().splitlines()]
    assert len(two) == len(one_log) == 6
    for a, b in zip(one_log, two):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["head_ce"] == pytest.approx(b["head_ce"], rel=1e-5)
    m1 = json.loads((tmp_path / "one" / "heads" / "metrics.json").read_text())
    m2 = json.loads((tmp_path / "two" / "heads" / "metrics.json").read_text())
    assert m2["global_batch"] == m1["global_batch"] == 2
    assert m1["eval_positions"] == m2["eval_positions"]  # eval shards over processes, then sums
    w1, w2 = heads_state(tmp_path / "one"), heads_state(tmp_path / "two")
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], atol=1e-5, rtol=1e-4)
    shutil.copytree(tmp_path / "two" / "checkpoints" / "step-4", tmp_path / "resumed" / "checkpoints" / "step-4")
    main(base_args(tiny_target_dir, sd_dir, tmp_path / "resumed", "--max_steps", "6", "--resume", "true"))
    resumed = heads_state(tmp_path / "resumed")
    for name in w1:
        torch.testing.assert_close(resumed[name], w1[name], atol=1e-5, rtol=1e-4)


def test_medusa2_adapter_round_trip(tiny_target_dir, sd_dir, tmp_path):
    main(base_args(tiny_target_dir, sd_dir, tmp_path / "m1", "--max_steps", "2"))  # Medusa-1 heads to start from
    with pytest.raises(ConfigError, match="differ"):
        main(base_args(tiny_target_dir, sd_dir, tmp_path / "bad", "--num_heads", "2", "--init_heads_from", tmp_path / "m1" / "heads"))
    metrics = main(base_args(tiny_target_dir, sd_dir, tmp_path / "m2", "--method", "medusa2", "--max_steps", "6",
                             "--init_heads_from", tmp_path / "m1" / "heads",
                             "--medusa2_warmup_steps", "2", "--target_learning_rate", "1e-2",
                             "--lora_r", "4", "--lora_target_modules", "q_proj,v_proj"))
    heads_dir = tmp_path / "m2" / "heads"
    config = json.loads((heads_dir / "config.json").read_text())
    assert config["method"] == "medusa2" and config["adapter"] is True
    assert (heads_dir / "adapter" / "adapter_config.json").is_file()
    # the share of held-out positions where the tuned target's greedy token is the original's, recomputed here
    # from the saved adapter (merged) and the base target, row by row without padding
    _, tuned, _, _ = load_heads_and_target(heads_dir, str(tiny_target_dir))
    base, _, _ = load_target(str(tiny_target_dir))
    agree, positions = greedy_agreement(tuned, base, held_out_rows(sd_dir, 4))
    assert 0 < agree < positions  # the adapter changed some greedy tokens, not all
    assert metrics["greedy_agreement"] == pytest.approx(agree / positions, abs=0.6 / positions)
    log = [json.loads(x) for x in (tmp_path / "m2" / "train_log.jsonl").read_text().splitlines()]
    # 2 heads-only warmup steps; then loss = KL + 0.2 * heads loss, KL = 0 until the LoRA B matrices move
    assert [r["loss"] == pytest.approx(r["heads_loss"]) for r in log[:2]] == [True, True]
    assert log[2]["kl"] == pytest.approx(0.0, abs=1e-6) and log[2]["loss"] == pytest.approx(0.2 * log[2]["heads_loss"])
    assert all(r["kl"] > 0 for r in log[3:])
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    assert not torch.allclose(tuned(ids).logits, base(ids).logits)  # the adapter was merged
    assert "lora" not in " ".join(n for n, _ in tuned.named_parameters())


def test_medusa2_starts_from_medusa1_heads_with_a_draft_vocabulary(tiny_target_dir, sd_dir, tmp_path):
    """The recipes' two commands: Medusa-1 with a draft vocabulary, then Medusa-2 --init_heads_from its heads, here on
    other rows (whose own most frequent tokens differ). At learning rate 0 nothing moves, so the heads written are
    exactly the Medusa-1 heads (token_map included) and the untouched adapter agrees with the target everywhere;
    trained, the heads move and keep the Medusa-1 draft vocabulary."""
    from headstart.heads.draft_vocab import most_frequent_tokens
    from headstart.train.data import supervised_token_counts

    _, _, info = load_target(str(tiny_target_dir))
    shape = ["--share_lm_head", "true", "--draft_vocab_size", "24"]
    main(base_args(tiny_target_dir, sd_dir, tmp_path / "m1", "--max_steps", "4", *shape))
    medusa1 = load_heads(tmp_path / "m1" / "heads", info)
    other = write_selfdistilled(tmp_path / "sd2", tiny_target_dir, seed=1)
    counts = supervised_token_counts(held_out_rows(other, 24)[:20], info.vocab_size)  # its 20 training rows
    assert not torch.equal(most_frequent_tokens(counts, 24), medusa1.token_map)
    medusa2 = ["--method", "medusa2", "--init_heads_from", tmp_path / "m1" / "heads", "--lora_r", "4",
               "--lora_target_modules", "q_proj,v_proj", "--share_lm_head", "true"]
    with pytest.raises(ConfigError, match="draft_vocab_size"):  # the shapes must match (the old medusa2.yaml did not)
        main(base_args(tiny_target_dir, other, tmp_path / "bad", "--max_steps", "1", *medusa2))
    still = main(base_args(tiny_target_dir, other, tmp_path / "lr0", "--max_steps", "2", "--learning_rate", "0",
                           "--target_learning_rate", "0", "--draft_vocab_size", "24", *medusa2))
    unmoved = load_heads(tmp_path / "lr0" / "heads", info)
    assert unmoved.config.method == "medusa2" and unmoved.state_dict().keys() == medusa1.state_dict().keys()
    for name, tensor in medusa1.state_dict().items():
        assert torch.equal(unmoved.state_dict()[name], tensor), name
    assert still["greedy_agreement"] == 1.0
    assert still["draft_vocab_coverage"] == pytest.approx(float(counts[medusa1.token_map].sum() / counts.sum()), abs=1e-4)
    main(base_args(tiny_target_dir, other, tmp_path / "m2", "--max_steps", "3", "--draft_vocab_size", "24", *medusa2))
    trained = load_heads(tmp_path / "m2" / "heads", info)
    assert torch.equal(trained.token_map, medusa1.token_map)
    assert not torch.equal(trained.blocks[0].layers[0].weight, medusa1.blocks[0].layers[0].weight)


def test_smollm2_medusa2_recipe_fits_the_medusa1_heads():
    """recipes/smollm2-135m/medusa2.yaml starts from the heads of medusa.yaml (its launch command): same data, and
    the head shape init_heads_from checks."""
    from headstart.train.config import parse_config
    from headstart.train.medusa import MedusaTrainConfig

    medusa1, medusa2 = (parse_config(MedusaTrainConfig, ["--config", str(REPO / "recipes" / "smollm2-135m" / name)])
                        for name in ("medusa.yaml", "medusa2.yaml"))
    for field in ("target", "data_dir", "num_prompts", "selfdistill_recipe", "num_heads", "num_layers", "share_lm_head",
                  "draft_vocab_size"):
        assert getattr(medusa2, field) == getattr(medusa1, field), field
    assert "--init_heads_from runs/medusa-smollm2/heads" in (REPO / "recipes" / "smollm2-135m" / "medusa2.yaml").read_text()


def test_unknown_recipe_key_fails(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("num_heads: 2\nnum_hedas: 3\n")
    with pytest.raises(ConfigError, match="num_hedas"):
        main(["--config", str(recipe)])


@pytest.mark.parametrize("how", ["no_shards", "zero_rows", "nothing_supervised"])
def test_empty_dataset_fails(tiny_target_dir, tmp_path, how):
    sd = write_selfdistilled(tmp_path / "sd", tiny_target_dir, num_rows=8)
    full = datasets.load_from_disk(str(sd / "dataset"))
    if how == "no_shards":  # what save_to_disk writes for a dataset built from no rows at all
        empty = datasets.Dataset.from_dict({"id": [], "input_ids": [], "loss_mask": []})
    elif how == "zero_rows":
        empty = full.select([])
    else:  # rows whose loss mask is all zero (only user tokens)
        empty = full.map(lambda r: {"loss_mask": [0] * len(r["loss_mask"])})
    empty.save_to_disk(str(sd / "new"))
    del full, empty
    shutil.rmtree(sd / "dataset")
    (sd / "new").rename(sd / "dataset")
    with pytest.raises(DataError, match="empty|no training row"):
        main(base_args(tiny_target_dir, sd, tmp_path / "out"))


def test_data_from_another_target_fails(tiny_target_dir, tmp_path):
    sd = write_selfdistilled(tmp_path / "sd", tiny_target_dir, num_rows=8, fingerprint="0123456789abcdef")
    with pytest.raises(DataError, match="fingerprint"):
        main(base_args(tiny_target_dir, sd, tmp_path / "out"))


def test_failed_push_keeps_local_copy(tiny_target_dir, sd_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    main(base_args(tiny_target_dir, sd_dir, tmp_path, "--max_steps", "2", "--push_to_hub", "someone/medusa-test"))
    out = capsys.readouterr().out
    assert "push to the Hub failed" in out and "hf upload someone/medusa-test" in out
    assert (tmp_path / "heads" / "model.safetensors").is_file()
    load_heads(tmp_path / "heads")


def test_failed_push_of_an_engine_export_keeps_both_copies(tiny_target_dir, sd_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    main(base_args(tiny_target_dir, sd_dir, tmp_path, "--max_steps", "2", "--push_to_hub", "someone/medusa-vllm",
                   "--push_format", "vllm"))
    out = capsys.readouterr().out
    assert "push to the Hub failed" in out and "hf upload someone/medusa-vllm" in out
    load_heads(tmp_path / "heads")
    exported = json.loads((tmp_path / "heads-vllm" / "config.json").read_text())
    assert exported["model_type"] == "medusa" and exported["num_heads"] == 3


def test_every_medusa_recipe_parses():
    from headstart.train.config import parse_config
    from headstart.train.medusa import MedusaTrainConfig, check_config

    recipes = sorted((REPO / "recipes").glob("*/medusa*.yaml"))
    assert len(recipes) >= 4
    for recipe in recipes:
        assert recipe.read_text().startswith("#"), f"{recipe} must open with its launch command"
        check_config(parse_config(MedusaTrainConfig, ["--config", str(recipe)]))


def test_draft_vocabulary_is_the_most_frequent_tokens(tiny_target_dir, sd_dir, tmp_path):
    """--draft_vocab_size 24: token_map = the 24 most frequent target-written training tokens; the heads score
    only those; held-out ranks count a token outside them as a miss; a run stopped and resumed writes exactly the
    heads (token_map included) of the uninterrupted run."""
    from headstart.train.data import supervised_token_counts

    common = ["--num_epochs", "2", "--draft_vocab_size", "24", "--checkpoint_every", "4"]
    metrics = main(base_args(tiny_target_dir, sd_dir, tmp_path, *common))
    main(base_args(tiny_target_dir, sd_dir, tmp_path / "cut", *common, "--stop_after_steps", "14"))
    assert main(base_args(tiny_target_dir, sd_dir, tmp_path / "cut", *common, "--resume", "true"))["steps_this_run"] == 8
    uninterrupted, resumed = heads_state(tmp_path), heads_state(tmp_path / "cut")
    assert uninterrupted.keys() == resumed.keys() and "token_map" in resumed
    for name in uninterrupted:
        assert torch.equal(resumed[name], uninterrupted[name]), name
    _, _, info = load_target(str(tiny_target_dir))
    heads = load_heads(tmp_path / "heads", info)
    assert heads.config.draft_vocab_size == 24 and heads.token_map.shape == (24,)
    train_rows = datasets.load_from_disk(str(sd_dir / "dataset")).select(range(20))
    counts = supervised_token_counts([dict(r) for r in train_rows], info.vocab_size)
    in_map = torch.zeros(info.vocab_size, dtype=torch.bool)
    in_map[heads.token_map] = True
    assert counts[in_map].min() >= counts[~in_map].max()  # no token outside is more frequent than one inside
    assert metrics["draft_vocab_coverage"] == pytest.approx(float(counts[in_map].sum() / counts.sum()), abs=1e-4)
    assert 0 < metrics["draft_vocab_coverage_heldout"] <= 1
    assert heads.lm_heads[0].weight.shape == (24, info.hidden_size)
    assert heads(torch.randn(1, 2, info.hidden_size)).shape == (3, 1, 2, 24)
    labels, ok = heads.to_draft_labels(torch.arange(info.vocab_size))
    assert torch.equal(ok, in_map) and torch.equal(heads.token_map[labels[ok]], torch.arange(info.vocab_size)[ok])
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        main(base_args(tiny_target_dir, sd_dir, tmp_path / "bad", "--draft_vocab_size", "-1"))
