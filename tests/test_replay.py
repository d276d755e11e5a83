"""inference/replay.py: replayed policies take exactly the steps the real decode loop takes on the same prompts."""

from __future__ import annotations

import json

import pytest
import torch
from test_bench import save_heads

from headstart.heads.chat import prompt_ids, stop_token_ids
from headstart.heads.prompts import load_prompts
from headstart.inference.replay import POLICIES, accepted_path, main, modeled, references
from headstart.inference.speculator import Speculator
from headstart.inference.tree import tree_from_choices

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ROWS = [{"category": "chat", "turns": ["hello there, how are you doing today?"]},
        {"category": "chat", "turns": ["Tell me a story about a dragon and a knight."]},
        {"category": "code", "turns": ["def add(a, b):\n    return a + b"]}]


def test_accepted_path_follows_the_reference():
    tree = tree_from_choices([[0], [1], [0, 0], [1, 0]])  # nodes: 1=[0] 2=[1] 3=[0,0] 4=[1,0]
    tokens = [5, 7, 8, 9, 3]
    assert accepted_path(tree, tokens, [0, 5, 8, 3, 1], 2) == [0, 2, 4]  # reference[2:] = 8, 3: rank 1, then its child
    assert accepted_path(tree, tokens, [0, 5, 6], 2) == [0]
    assert accepted_path(tree, tokens, [0, 5, 7], 2) == [0, 1]  # the reference ends: nothing deeper is checked


@pytest.fixture(scope="module")
def setup(tiny_target_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("replay")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    heads = save_heads(root / "heads", tiny_target_dir, seed=1)
    return prompts, heads


def test_replay_takes_the_decode_loops_steps(setup):
    """The same prompts decoded for real (adaptive +lookup and alone, and the fixed tree): replay counts the same
    target forwards and tokens, so its modeled figures describe what the loop does."""
    prompts, heads = setup
    spec = Speculator.from_pretrained(str(heads), tree="default")
    rows = load_prompts(str(prompts)).rows
    refs = references(spec, rows, 24)
    results = modeled(spec, refs)
    assert set(results) == set(POLICIES) and set(results["adaptive"]) == {"chat", "code", "all"}
    stops = stop_token_ids(spec.tokenizer, spec.model.generation_config)
    for method, kwargs in (("adaptive +lookup", {"lookup": True}), ("adaptive", {"lookup": False}),
                           ("fixed", {"lookup": False, "adaptive": False}),
                           ("fixed +lookup", {"lookup": True, "adaptive": False})):
        tokens = forwards = 0
        for row, ref in zip(rows, refs):
            out = spec.generate(prompt_ids(spec.tokenizer, row.turns[0]), 24, stop_token_ids=stops, **kwargs)
            assert out.tokens == ref["seq"][ref["prompt_len"]:]
            tokens += len(out.tokens) - 1
            forwards += out.stats.decode_forwards
        assert results[method]["all"]["tokens"] == tokens, method
        assert results[method]["all"]["tau"] == pytest.approx(tokens / forwards), method
    for by_key in results.values():
        assert 0 < by_key["all"]["speedup"] <= by_key["all"]["tau"]  # a step never costs less than a plain one


def test_cli_prints_the_table_and_refuses_eagle(setup, tmp_path, capsys):
    prompts, heads = setup
    out = tmp_path / "replay.json"
    assert main(["--heads", str(heads), "--prompts", str(prompts), "--per_category", "1", "--max_new_tokens", "8",
                 "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| adaptive +lookup |" in printed and "| chat | code | all |" in printed
    assert json.loads(out.read_text())["adaptive"]["chat"]["tokens"] > 0
    assert main(["--heads", str(tmp_path / "missing"), "--prompts", str(prompts)]) == 2
