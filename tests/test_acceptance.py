"""Held-out acceptance by task family (python -m headstart.inference.acceptance) on a tiny random target: per-family tau equals
the Speculator's own stats summed by hand; per_category picks the first rows of each family; errors exit 2."""

from __future__ import annotations

import json

import pytest
import torch

from headstart.heads.chat import prompt_ids
from headstart.heads.prompts import PromptRow
from headstart.heads.prompt_rows import pick_per_category
from headstart.inference.acceptance import main
from headstart.inference.speculator import Speculator

from test_bench import save_heads

ROWS = [
    {"id": "a1", "category": "chat", "turns": ["hello there, how are you doing today?"]},
    {"id": "c1", "category": "code", "turns": ["def add(a, b):\n    return a + b"]},
    {"id": "a2", "category": "chat", "turns": ["Tell me a story about a dragon and a knight."]},
    {"id": "a3", "category": "chat", "turns": ["The quick brown fox jumps over the lazy dog."]},
    {"id": "l1", "category": "long", "turns": ["word " * 2000]},  # longer than the tiny target's 1024 positions
]

pytestmark = pytest.mark.usefixtures("one_thread")


def test_pick_per_category_keeps_source_order():
    rows = [PromptRow(id=r["id"], turns=r["turns"], category=r["category"]) for r in ROWS]
    assert [r.id for r in pick_per_category(rows, 2)] == ["a1", "c1", "a2", "l1"]


def test_tau_per_family_matches_the_speculator(tiny_target_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    heads = save_heads(tmp_path / "heads", tiny_target_dir, seed=1)
    out = tmp_path / "acc.json"
    assert main(["--heads", str(heads), "--prompts", str(prompts), "--per_category", "2", "--max_new_tokens", "12",
                 "--tree", "default", "--output", str(out)]) == 0
    results = json.loads(out.read_text())["results"][str(heads)]
    spec = Speculator.from_pretrained(heads, tree="default")
    for mode, lookup in (("lookup off", False), ("lookup on", True)):
        tokens = {"chat": 0, "code": 0}
        forwards = {"chat": 0, "code": 0}
        for row in ROWS[:3]:
            stats = spec.generate(torch.tensor(prompt_ids(spec.tokenizer, row["turns"][0])), 12, lookup=lookup,
                                  adaptive=False).stats
            tokens[row["category"]] += stats.new_tokens - 1
            forwards[row["category"]] += stats.decode_forwards
        for family in ("chat", "code"):
            assert results[mode][family]["prompts"] == (2 if family == "chat" else 1)
            assert results[mode][family]["tau"] == round(tokens[family] / forwards[family], 3)
        assert results[mode]["all"]["tau"] == round(sum(tokens.values()) / sum(forwards.values()), 3)
        assert results[mode]["long"] == {"skipped_too_long": 1, "tau": None, "accept_hist": []}
        assert results[mode]["all"]["skipped_too_long"] == 1
    captured = capsys.readouterr()
    table = captured.out
    assert "| heads | lookup | chat | code | long | all |" in table and "| - |" in table  # long: skipped
    assert "acceptance: 100%" in captured.err and "8/8" in captured.err  # 4 prompts (1 skipped) x lookup off, on


def test_errors_exit_2(tmp_path, capsys):
    assert main(["--heads", str(tmp_path / "none"), "--prompts", "nosuch"]) == 2
    assert "unknown prompt source" in capsys.readouterr().err
    assert main(["--heads", str(tmp_path / "none"), "--prompts", "writing", "--per_category", "1"]) == 2
    assert "error:" in capsys.readouterr().err


def test_chain_mode_writes_the_speculators_chain_histogram(tiny_target_dir, tmp_path, capsys):
    """--chain: each heads directory decodes a greedy chain as deep as its export serves (3 Medusa heads), lookup
    off, and chain_acceptance.json holds the Speculator's own accepted-length histogram summed over the prompts that
    fit; the export then reads it. A Hub id (not a local directory) is refused before anything runs."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    heads = save_heads(tmp_path / "heads", tiny_target_dir, seed=1)
    assert main(["--chain", "--heads", str(heads), "--prompts", str(prompts), "--per_category", "2",
                 "--max_new_tokens", "12"]) == 0
    written = json.loads((heads / "chain_acceptance.json").read_text())
    spec = Speculator.from_pretrained(heads, tree=[[0], [0, 0], [0, 0, 0]])
    hist = [0, 0, 0, 0]
    for row in ROWS[:3]:
        stats = spec.generate(torch.tensor(prompt_ids(spec.tokenizer, row["turns"][0])), 12, lookup=False,
                              adaptive=False).stats
        for accepted, steps in enumerate(stats.accept_hist):
            hist[accepted] += steps
    assert (written["depth"], written["accept_hist"], written["prompts"]) == (3, hist, str(prompts))
    assert sum(hist) > 0
    from headstart.heads.served_speed import heldout_metrics
    assert heldout_metrics(heads)["chain_accept_hist"] == hist
    assert "greedy chain of 3" in capsys.readouterr().out
    assert main(["--chain", "--heads", "someone/heads", "--prompts", str(prompts)]) == 2
    assert "not a local directory" in capsys.readouterr().err
    outside = tmp_path / "outside.txt"  # someone else's file, behind a link where the result would go
    outside.write_text("mine")
    (heads / "chain_acceptance.json").unlink()
    (heads / "chain_acceptance.json").symlink_to(outside)
    assert main(["--chain", "--heads", str(heads), "--prompts", str(prompts)]) == 2
    assert "symbolic link" in capsys.readouterr().err and outside.read_text() == "mine"
