"""Sharded training on 2 gloo CPU processes: FSDP2 (recipes/accelerate/fsdp.yaml with two overrides) trains the heads
one process trains at the same global batch, for Medusa-1, Medusa-2 (LoRA) and EAGLE-3 (their SmolLM2 recipes on a
tiny target); a run resumes with another number of processes; DeepSpeed ZeRO-2 where deepspeed is installed."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types
from pathlib import Path

import pytest
import torch
from accelerate.utils import DistributedType
from safetensors.torch import load_file

from test_medusa_train import write_selfdistilled
from headstart.train.cli import CheckpointError
from headstart.train.config import ConfigError
from headstart.train.eagle import main as eagle_main
from headstart.train.medusa import main as medusa_main
from conftest import tiny_model
from headstart.train.sharding import enable_fsdp_on_cpu, full_state

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
TOLERANCE = 1e-4  # max abs difference of any head weight between the launches

# method -> (script, its main, recipe flags): the SmolLM2 recipes, their draft vocabulary cut to the tiny target's
METHODS = {
    "medusa": ("medusa.py", medusa_main, ["--config", REPO / "recipes/smollm2-135m/medusa.yaml"]),
    "medusa2": ("medusa.py", medusa_main, ["--config", REPO / "recipes/smollm2-135m/medusa2.yaml"]),
    "eagle3": ("eagle.py", eagle_main, ["--config", REPO / "recipes/smollm2-135m/eagle3.yaml",
                                        "--feature_layers", "0", "1", "2",  # 2 layers: the default taps do not exist
                                        "--optimizer", "adamw"]),  # what FSDP runs; one process would take muon
}


@pytest.fixture(scope="module")
def sd_dir(tiny_target_dir, tmp_path_factory):
    return write_selfdistilled(tmp_path_factory.mktemp("sd"), tiny_target_dir)


def argv(method: str, target: Path, data: Path, out: Path, batch: int, *extra) -> list[str]:
    _, _, recipe = METHODS[method]
    return [str(a) for a in (*recipe, "--target", target, "--data_dir", data, "--output_dir", out, "--draft_vocab_size",
                             "64", "--per_device_batch_size", batch, "--eval_rows", "4", "--learning_rate", "1e-2",
                             "--checkpoint_every", "2", "--seed", "0", *extra)]


def launcher(port: int, config: str = "fsdp.yaml") -> list:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", REPO / "recipes" / "accelerate" / config,
            "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(port)]


def trained(out: Path) -> dict[str, torch.Tensor]:
    """What a run leaves to use: the heads' tensors, and Medusa-2's adapter."""
    tensors = load_file(out / "heads" / "model.safetensors")
    adapter = out / "heads" / "adapter" / "adapter_model.safetensors"
    if adapter.is_file():
        tensors.update({f"adapter.{k}": v for k, v in load_file(adapter).items()})
    return tensors


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def train_log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("method", list(METHODS))
def test_fsdp_trains_the_heads_of_one_process(method, tiny_target_dir, sd_dir, tmp_path, launch):
    """2 FSDP processes x batch 1 == 1 process x batch 2: the same per-step losses and heads (Medusa-2: adapter too),
    evaluated and saved from the gathered tensors; the FSDP run's mid-run checkpoint holds them too."""
    script, main, _ = METHODS[method]
    steps = ["--max_steps", "4"]
    proc = launch.start([*launcher(29531 + list(METHODS).index(method)), REPO / "train" / script,
                         *argv(method, tiny_target_dir, sd_dir, tmp_path / "fsdp", 1, *steps)], env=ENV, cwd=tmp_path)
    main(argv(method, tiny_target_dir, sd_dir, tmp_path / "one", 2, *steps))  # meanwhile, in this process
    output = launch.wait(proc)
    assert "FSDP2 over 2 processes: process 0 holds" in output  # sharded, not DDP
    one, fsdp = trained(tmp_path / "one"), trained(tmp_path / "fsdp")
    diff = max_diff(one, fsdp)
    print(f"\n{method}: FSDP2 2 processes vs 1 process, 4 steps, heads max abs diff {diff:.1e}")
    assert diff <= TOLERANCE
    for a, b in zip(train_log(tmp_path / "one"), train_log(tmp_path / "fsdp"), strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    m1, m2 = (json.loads((tmp_path / d / "heads" / "metrics.json").read_text()) for d in ("one", "fsdp"))
    assert m1["top1"] == m2["top1"] and m1["eval_positions"] == m2["eval_positions"]  # evaluated on the whole heads
    # the checkpoints gathered the same trained tensors, which moved well past the tolerance after step 2
    at2 = [load_file(tmp_path / d / "checkpoints" / "step-2" / "model.safetensors") for d in ("one", "fsdp")]
    assert max_diff(*at2) <= TOLERANCE
    assert max_diff(at2[0], load_file(tmp_path / "one" / "checkpoints" / "step-4" / "model.safetensors")) > 10 * TOLERANCE


def test_resume_with_another_number_of_processes(tiny_target_dir, sd_dir, tmp_path, launch):
    """Medusa-2 (LoRA: the checkpoint holds adapter and heads, not the frozen target), checkpoints every 2 of 6 steps.
    Stopped after step 3 as if killed (step-2 kept): 2 FSDP processes -> resumed by 1, and 1 -> resumed by 2 FSDP
    processes; both end with the heads and adapter of an uninterrupted 1-process run."""
    script, main, _ = METHODS["medusa2"]
    steps, stop = ["--max_steps", "6"], ["--stop_after_steps", "3"]

    def fsdp(out: Path, *extra, port: int):
        return launch.start([*launcher(port), REPO / "train" / script,
                             *argv("medusa2", tiny_target_dir, sd_dir, out, 1, *steps, *extra)], env=ENV, cwd=tmp_path)

    two_first = fsdp(tmp_path / "two-one", *stop, port=29541)
    main(argv("medusa2", tiny_target_dir, sd_dir, tmp_path / "full", 2, *steps))
    main(argv("medusa2", tiny_target_dir, sd_dir, tmp_path / "one-two", 2, *steps, *stop))
    checkpoint = load_file(tmp_path / "one-two" / "checkpoints" / "step-2" / "model.safetensors")
    assert any(".lora_" in k for k in checkpoint) and not any("embed_tokens" in k for k in checkpoint)
    one_first = fsdp(tmp_path / "one-two", "--resume", "true", port=29542)
    launch.wait(two_first)
    assert sorted(p.name for p in (tmp_path / "two-one" / "checkpoints").iterdir()) == ["step-2"]
    assert not (tmp_path / "two-one" / "heads").exists()
    with pytest.raises(CheckpointError, match="global batch of 2 rows .* this run takes 1"):
        main(argv("medusa2", tiny_target_dir, sd_dir, tmp_path / "two-one", 1, *steps, "--resume", "true"))
    main(argv("medusa2", tiny_target_dir, sd_dir, tmp_path / "two-one", 2, *steps, "--resume", "true"))
    assert "written by 1 process(es), resumed by 2" in launch.wait(one_first)
    full = trained(tmp_path / "full")
    for name in ("two-one", "one-two"):
        diff = max_diff(full, trained(tmp_path / name))
        print(f"\nmedusa2: stopped after step 3, resumed from step 2 ({name.replace('-', ' -> ')} processes): heads "
              f"and adapter max abs diff to an uninterrupted 1-process run {diff:.1e}")
        assert diff <= TOLERANCE
        assert [r["step"] for r in train_log(tmp_path / name)] == list(range(1, 7))  # step 3 replayed, logged once


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed (its extra)")
def test_deepspeed_zero2_trains_the_heads_of_one_process(tiny_target_dir, sd_dir, tmp_path, launch):
    """recipes/accelerate/deepspeed-zero2.yaml on 2 gloo CPU processes: the Medusa-1 heads of one process."""
    script, main, _ = METHODS["medusa"]
    steps = ["--max_steps", "4", "--checkpoint_every", "0"]  # DeepSpeed's checkpoints are pickles: not resumable here
    proc = launch.start([*launcher(29551, "deepspeed-zero2.yaml"), REPO / "train" / script,
                         *argv("medusa", tiny_target_dir, sd_dir, tmp_path / "ds", 1, *steps)], env=ENV, cwd=tmp_path)
    main(argv("medusa", tiny_target_dir, sd_dir, tmp_path / "one", 2, *steps))
    assert "2 processes (DEEPSPEED): each holds all" in launch.wait(proc)
    diff = max_diff(trained(tmp_path / "one"), trained(tmp_path / "ds"))
    print(f"\nmedusa: DeepSpeed ZeRO-2 2 processes vs 1 process, 4 steps, heads max abs diff {diff:.1e}")
    assert diff <= TOLERANCE


def test_muon_under_fsdp_is_refused_with_the_fix(tiny_target_dir, sd_dir, tmp_path, launch):
    proc = launch.start([*launcher(29561), REPO / "train" / "eagle.py",
                         *argv("eagle3", tiny_target_dir, sd_dir, tmp_path / "o", 1, "--max_steps", "2", "--optimizer",
                               "muon")], env=ENV, cwd=tmp_path)
    output, _ = proc.communicate(timeout=1800)
    assert proc.returncode != 0 and "optimizer muon orthogonalises whole weight matrices" in output
    assert "use optimizer adamw" in output and not (tmp_path / "o" / "heads").exists()


def test_fsdp1_on_cpu_is_refused(monkeypatch):
    """FSDP1 needs GPUs: an FSDP launch of CPU processes must ask for FSDP2, or fail saying so (never run unsharded)."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ConfigError, match="fsdp_version: 2"):
        enable_fsdp_on_cpu(types.SimpleNamespace(distributed_type=DistributedType.MULTI_CPU))


def test_full_state_leaves_out_a_tied_frozen_weight():
    """A checkpoint holds what training changes: with a tied target (SmolLM2's lm_head is its embedding), neither name
    of the frozen shared weight, which named_parameters lists once, gets in."""
    target = tiny_model("llama", tie_word_embeddings=True).requires_grad_(False)
    model = torch.nn.ModuleDict({"target": target, "head": torch.nn.Linear(64, 8)})
    assert target.lm_head.weight is target.model.embed_tokens.weight
    assert sorted(full_state(model)) == ["head.bias", "head.weight"]
