"""Training-side guards (issue 45): non-finite losses and logits, numeric flags, recipes a YAML parser must not
trust, truncated or poisoned feature-cache shards, and a --help text for every flag of every script."""

from __future__ import annotations

import argparse
import importlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_eagle_train import llama_dir, sd_dir  # noqa: F401 (fixtures: a 4-layer target, its greedy rows)
from test_eagle_train import args as eagle_args
from test_medusa_train import base_args, write_selfdistilled
from headstart.cli import trainers
from headstart.train.config import ConfigError, parse_config
from headstart.train.data import DataError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def medusa_sd(tiny_target_dir, tmp_path_factory):
    return write_selfdistilled(tmp_path_factory.mktemp("sd"), tiny_target_dir)


def run_script(script: str, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, str(REPO / script), *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1800)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The one line a refused run prints (exit 2, `error: ...`, no traceback)."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def poison_shard(path: Path, row: int) -> None:
    """Rewrite a feature-cache shard with NaN in one row's final states (offsets and shapes kept)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    a, b = tensors["offsets"][row].item(), tensors["offsets"][row + 1].item()
    tensors["final"][a:b] = float("nan")
    save_file(tensors, str(path))


# ----------------------------------------------------------------------------------------------------
# case 5: NaN features, losses and logits


def test_nan_in_a_feature_cache_shard_exits_2_naming_the_file(tiny_target_dir, medusa_sd, tmp_path):
    """The issue's probe: NaN in one cache shard gave exit 0, NaN heads and held-out top-1 .83. Now one line naming
    the shard, exit 2, and no heads directory."""
    from headstart.train.medusa import main

    cache = tmp_path / "cache"
    with_cache = ["--feature_cache_dir", cache, "--feature_cache_shard_rows", "10"]
    main(base_args(tiny_target_dir, medusa_sd, tmp_path / "build", *with_cache, "--build_cache_only", "true"))
    poison_shard(cache / "shard-00000.safetensors", row=3)
    proc = run_script("train/medusa.py", *base_args(tiny_target_dir, medusa_sd, tmp_path / "out", *with_cache))
    line = one_error_line(proc)
    assert "shard-00000.safetensors" in line and "NaN" in line and "delete" in line
    assert not (tmp_path / "out" / "heads").exists()


def test_a_non_finite_loss_stops_training_at_its_step(tiny_target_dir, medusa_sd, tmp_path, monkeypatch):
    """NaN features of one training row (in memory): the run stops at the first step whose loss is NaN, with one
    line naming the step and the likely causes; no heads directory; the logged steps before it are finite."""
    from headstart.train import features
    from headstart.train.medusa import main

    compute = features.FeatureSource.compute

    def nan_row_zero(self, r):
        taps, final = compute(self, r)
        return (taps * float("nan"), final * float("nan")) if r == 0 else (taps, final)

    monkeypatch.setattr(features.FeatureSource, "compute", nan_row_zero)
    with pytest.raises(DataError, match=r"^step (\d+): the loss is nan; nothing was written as finished heads\. "
                                        r"Likely causes: non-finite values .* learning rate") as err:
        main(base_args(tiny_target_dir, medusa_sd, tmp_path, "--num_epochs", "2", "--feature_cache", "true"))
    step = int(err.value.args[0].split()[1].rstrip(":"))
    assert not (tmp_path / "heads").exists()
    import json

    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, step)) and all(math.isfinite(r["loss"]) for r in log)


def test_truth_rank_never_counts_a_non_finite_row_as_a_hit():
    from headstart.train.evaluate import truth_rank

    logits = torch.tensor([[3.0, 1.0, 2.0], [float("nan")] * 3, [1.0, float("nan"), 0.0], [float("inf"), 0.0, 1.0],
                           [0.0, 1.0, 2.0]])
    truth = logits.gather(-1, torch.tensor([[0], [0], [0], [0], [0]]))
    assert truth_rank(logits, truth, 10).tolist() == [0, 10, 10, 10, 2]
    assert truth_rank(logits, truth, 1).tolist() == [0, 1, 1, 1, 1]


def test_medusa_evaluation_of_nan_heads_scores_no_hits(tiny_target_dir, medusa_sd):
    """NaN heads (the issue's run): every held-out position is a miss, top-1 and top-5 are 0 (they were .83)."""
    import datasets
    from accelerate import Accelerator

    from headstart.heads.medusa import MedusaConfig, MedusaHeads
    from headstart.heads.target import load_target
    from headstart.train.medusa import MedusaTrainConfig, evaluate

    target, tokenizer, info = load_target(str(tiny_target_dir))
    heads = MedusaHeads(MedusaConfig(hidden_size=info.hidden_size, vocab_size=info.vocab_size, num_heads=3,
                                     num_layers=1, target=info.to_dict()))
    with torch.no_grad():
        for p in heads.parameters():
            p.fill_(float("nan"))
    rows = [dict(r) for r in datasets.load_from_disk(str(medusa_sd / "dataset")).select_columns(["input_ids", "loss_mask"])]
    cfg = MedusaTrainConfig(num_heads=3, per_device_batch_size=4)
    metrics = evaluate(target, heads, rows, list(range(len(rows) - 4, len(rows))), cfg, Accelerator(cpu=True),
                       tokenizer.pad_token_id)
    assert metrics["top1"] == [0.0, 0.0, 0.0] and metrics["top5"] == [0.0, 0.0, 0.0]
    assert all(p > 0 for p in metrics["eval_positions"])


def nan_weights_after_training(module, monkeypatch):
    """The trained draft handed to evaluation with every floating weight NaN (as NaN training leaves it)."""
    plain_model = module.plain_model

    def poisoned(*args, **kwargs):
        model = plain_model(*args, **kwargs)
        with torch.no_grad():
            for p in model.parameters():
                if p.is_floating_point():
                    p.fill_(float("nan"))
        return model

    monkeypatch.setattr(module, "plain_model", poisoned)


def test_eagle_evaluation_of_a_nan_draft_scores_no_hits(llama_dir, sd_dir, tmp_path, monkeypatch, one_thread):
    import headstart.train.eagle

    nan_weights_after_training(headstart.train.eagle, monkeypatch)
    metrics = headstart.train.eagle.main(eagle_args(llama_dir, sd_dir, tmp_path, "eagle3", "--max_steps", "1"))
    assert metrics["top1"] == [0.0] * 3 and metrics["top5"] == [0.0] * 3 and metrics["chain_accepted_tokens"] == 0


def test_dflash_evaluation_of_a_nan_draft_scores_no_hits(llama_dir, sd_dir, tmp_path, monkeypatch, one_thread):
    import headstart.train.dflash

    nan_weights_after_training(headstart.train.dflash, monkeypatch)
    metrics = headstart.train.dflash.main(["--target", str(llama_dir), "--data_dir", str(sd_dir), "--output_dir", str(tmp_path),
                                 "--per_device_batch_size", "2", "--eval_rows", "4", "--feature_layers", "1", "2", "3",
                                 "--block_size", "4", "--anchors_per_row", "4", "--draft_vocab_size", "64",
                                 "--max_steps", "1"])
    assert metrics["top1"] == [0.0] * 3 and metrics["top5"] == [0.0] * 3 and metrics["chain_accepted_tokens"] == 0


# ----------------------------------------------------------------------------------------------------
# case 8: numeric flags


@pytest.mark.parametrize("script, flag, value, message", [
    ("medusa", "num_epochs", "-1", "num_epochs must be a number >= 1 (or set max_steps > 0), got -1"),
    ("medusa", "num_epochs", "0", "num_epochs must be a number >= 1"),
    ("medusa", "max_steps", "0", "max_steps must be a number >= 1 (or -1: train num_epochs epochs), got 0"),
    ("medusa", "per_device_batch_size", "0", "per_device_batch_size must be a number >= 1"),
    ("medusa", "weight_decay", "nan", "weight_decay must be a number >= 0"),
    ("medusa", "max_grad_norm", "nan", "max_grad_norm must be a number > 0"),
    ("medusa", "warmup_ratio", "nan", "warmup_ratio must be a number >= 0 and < 1"),
    ("medusa", "keep_checkpoints", "0", "keep_checkpoints must be a number >= 1"),
    ("medusa", "log_every", "0", "log_every must be a number >= 1"),
    ("medusa", "eval_rows", "-2", "eval_rows must be a number >= 0 (or -1: 5% of the rows)"),
    ("medusa", "max_length", "1", "max_length must be a number >= 2"),
    ("medusa", "head_decay", "nan", "head_decay must be a number > 0"),
    ("medusa", "lora_dropout", "1", "lora_dropout must be a number >= 0 and < 1"),
    ("eagle", "ttt_decay", "nan", "ttt_decay must be a number > 0"),
    ("eagle", "adam_beta2", "1", "adam_beta2 must be a number >= 0 and < 1"),
    ("dflash", "loss_decay", "nan", "loss_decay must be a number > 0"),
    ("dflash", "mask_token_id", "-5", "mask_token_id must be a number >= 0 (or -1:"),
])
def test_bad_numeric_flags_are_refused(script, flag, value, message):
    module = importlib.import_module(f"headstart.train.{script}")
    cls = {"medusa": module.__dict__.get("MedusaTrainConfig"), "eagle": module.__dict__.get("EagleTrainConfig"),
           "dflash": module.__dict__.get("DFlashTrainConfig")}[script]
    with pytest.raises(ConfigError) as err:
        module.check_config(parse_config(cls, [f"--{flag}", value]))
    assert message in str(err.value) and f"--{flag}" in str(err.value)


def test_negative_epochs_exit_2_before_anything_runs(tiny_target_dir, medusa_sd, tmp_path):
    """The issue's probe: --num_epochs -1 trained 0 steps and wrote untrained heads with exit 0."""
    proc = run_script("train/medusa.py", *base_args(tiny_target_dir, medusa_sd, tmp_path / "out", "--num_epochs", "-1"))
    assert "num_epochs must be a number >= 1 (or set max_steps > 0), got -1" in one_error_line(proc)
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------------
# cases 11 and 16: recipes


def alias_bomb(levels: int, width: int) -> str:
    """A recipe whose num_epochs is a list of `levels` lists, each `width` aliases of the one before: width**levels
    leaves in a few lines."""
    lines = ["num_epochs:", "  - &a0 [x]"]
    lines += [f"  - &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("levels, width", [(6, 9), (12, 12)])  # 9**6 = 531441 leaves; 12**12 = 8.9e12
def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path, levels, width):
    from headstart.train.medusa import MedusaTrainConfig

    recipe = tmp_path / "bomb.yaml"
    recipe.write_text(alias_bomb(levels, width))
    with pytest.raises(ConfigError) as err:
        parse_config(MedusaTrainConfig, ["--config", str(recipe)])
    message = str(err.value)
    assert f"recipe {recipe} line 2: anchors (&name) and aliases (*name) are not allowed" in message
    assert len(message) < 300


@pytest.mark.parametrize("content, expected", [
    (b"num_epochs: 2\nlearning_rate: [1e-3\n", "line 3: expected ',' or ']'"),
    (b"num_epochs: !!python/object/apply:os.system [\"true\"]\n",
     "line 1: could not determine a constructor for the tag 'tag:yaml.org,2002:python/object/apply:os.system'; "
     "a recipe holds plain values"),
    (b"num_epochs: 2\ntarget: caf\xe9\n", "is not UTF-8 text (byte 0xe9 at offset 25): save it as UTF-8"),
])
def test_a_broken_recipe_is_one_line_naming_the_file(tmp_path, content, expected):
    from headstart.train.medusa import MedusaTrainConfig

    recipe = tmp_path / "bad.yaml"
    recipe.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        parse_config(MedusaTrainConfig, ["--config", str(recipe)])
    assert str(err.value).startswith(f"recipe {recipe}") and expected in str(err.value)
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------------------------------
# case 13: truncated or corrupt feature-cache shards


def test_a_truncated_feature_shard_is_named_and_written_again(tiny_target_dir, medusa_sd, tmp_path, capsys):
    """The issue's probe: a cut shard printed "0 to write", then crashed on every rerun without naming the file."""
    from headstart.train.medusa import main

    cache = tmp_path / "cache"
    with_cache = ["--feature_cache_dir", cache, "--feature_cache_shard_rows", "10"]
    main(base_args(tiny_target_dir, medusa_sd, tmp_path / "build", *with_cache, "--build_cache_only", "true"))
    shard = cache / "shard-00001.safetensors"
    intact = shard.read_bytes()
    shard.write_bytes(intact[: len(intact) // 2])
    capsys.readouterr()
    main(base_args(tiny_target_dir, medusa_sd, tmp_path / "out", "--max_steps", "2", *with_cache))
    out = capsys.readouterr().out
    assert f"the feature cache file {shard} is not a complete shard (it cannot be read, truncated or corrupt" in out
    assert "1 to write" in out and (tmp_path / "out" / "heads" / "model.safetensors").is_file()
    assert shard.read_bytes() == intact  # the same rows, the same target: the same bytes


def test_shard_problem_names_what_is_wrong(tmp_path):
    from safetensors.torch import save_file

    from headstart.train.feature_shards import shard_problem, write_shard

    path = tmp_path / "shard.safetensors"
    rows = [(None, torch.randn(3, 8)), (None, torch.randn(5, 8))]
    write_shard(path, rows, torch.float32)
    assert shard_problem(path, [3, 5], {"final": 8}, torch.float32) is None
    assert "offsets" in shard_problem(path, [4, 4], {"final": 8}, torch.float32)
    assert "F32 [8, 8], not BF16 [8, 8]" in shard_problem(path, [3, 5], {"final": 8}, torch.bfloat16)
    assert "not F32 [8, 16]" in shard_problem(path, [3, 5], {"final": 16}, torch.float32)
    assert "tensors" in shard_problem(path, [3, 5], {"final": 8, "taps": 16}, torch.float32)
    save_file({"final": torch.zeros(8, 8)}, str(path))
    assert "tensors ['final']" in shard_problem(path, [3, 5], {"final": 8}, torch.float32)
    path.write_bytes(b"\x00" * 7)
    assert "cannot be read" in shard_problem(path, [3, 5], {"final": 8}, torch.float32)


# ----------------------------------------------------------------------------------------------------
# case 19: --help


# every registered method's trainer (heads/methods.py), then the other stages' and scripts' parsers
SCRIPTS = sorted(set(trainers().values())) + [
    "headstart.train.selfdistill", "headstart.train.bench_selfdistill", "headstart.heads.export",
    "headstart.inference.replay", "headstart.inference.bench", "headstart.inference.forward",
    "headstart.inference.generate", "headstart.inference.acceptance", "headstart.inference.vllm_check",
    "headstart.inference.vllm_side", "scripts.vllm_features", "headstart.inference.llamacpp_check", "scripts.demo"]


class ParserBuilt(Exception):
    pass


def script_parser(module_name: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser a script's main builds (stopped at its first parse)."""
    built = []

    def stop(self, *args, **kwargs):
        built.append(self)
        raise ParserBuilt

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", stop)
    module = importlib.import_module(module_name)
    with pytest.raises(ParserBuilt):
        (module.main if hasattr(module, "main") else module.parse_args)([])
    return built[0]


def undescribed(parser: argparse.ArgumentParser) -> list[str]:
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                missing += [f"{name} {flag}" for flag in undescribed(sub)]
        elif action.help != argparse.SUPPRESS and not (action.help or "").strip():
            missing.append(action.option_strings[0] if action.option_strings else action.dest)
    return missing


@pytest.mark.parametrize("module_name", SCRIPTS)
def test_every_flag_of_every_script_has_a_help_text(module_name, monkeypatch):
    parser = script_parser(module_name, monkeypatch)
    assert len(parser._actions) > 1
    assert undescribed(parser) == []
    parser.format_help()  # every help text formats (a bare % would not)


def test_a_trainer_help_shows_the_fields_comments(monkeypatch):
    from headstart.train.config import field_help
    from headstart.train.medusa import MedusaTrainConfig

    helps = field_help(MedusaTrainConfig)
    assert helps["num_epochs"] == "passes over the training rows (unless max_steps is set)"
    assert helps["method"].startswith("medusa (Medusa-1, frozen target)")  # the subclass's comment wins
    text = " ".join(script_parser("headstart.train.medusa", monkeypatch).format_help().split())  # argparse wraps help texts
    assert "--num-epochs NUM_EPOCHS passes over the training rows (unless max_steps is set)" in text
    assert "-1 = 5% (at least 1)" in text


def test_num_prompts_over_an_existing_dataset_says_it_does_not_apply(medusa_sd, tmp_path, capsys):
    """A recipe's num_prompts self-distils only into an empty data_dir: over rows already there, one line says so and
    the rows are used as they are."""
    from headstart.train.loop import ensure_data
    from headstart.train.medusa import MedusaTrainConfig

    dataset, _ = ensure_data(MedusaTrainConfig(data_dir=str(medusa_sd), num_prompts=768, output_dir=str(tmp_path)))
    assert len(dataset) == 24
    assert capsys.readouterr().out == (f"{medusa_sd} already holds 24 self-distilled rows: num_prompts 768 applies only "
                                       "to an empty data_dir (--train_rows trains on fewer of them)\n")
    ensure_data(MedusaTrainConfig(data_dir=str(medusa_sd), num_prompts=24, output_dir=str(tmp_path)))
    assert capsys.readouterr().out == ""


def test_a_disk_cache_over_a_recipe_with_the_memory_cache_names_the_fix():
    """The shipped recipes set feature_cache (in memory); adding --feature_cache_dir is refused with the flag that
    switches the memory cache off, and with it the two go together."""
    from headstart.train.dflash import DFlashTrainConfig, check_config

    recipe = ["--config", str(Path(__file__).resolve().parents[1] / "recipes/smollm2-135m/dflash.yaml")]
    with pytest.raises(ConfigError, match="add --feature_cache false to use the disk cache"):
        check_config(parse_config(DFlashTrainConfig, recipe + ["--feature_cache_dir", "cache"]))
    cfg = check_config(parse_config(DFlashTrainConfig, recipe + ["--feature_cache_dir", "cache", "--feature_cache", "false"]))
    assert cfg.feature_cache_dir == "cache" and not cfg.feature_cache
