"""inference/vllm_check.py's speed mode without vLLM: the interleaving order, the timing of each prompt on an injected
clock, the fastest of N rounds, the ratio and engines.json's record on scripted timings and counters, and `speed`
end to end with a stand-in for the vLLM venv's python that answers scripted figures (tests/test_vllm.py runs the
real vLLM)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

from headstart.heads.served_speed import EngineRecord, read_engines

check = importlib.import_module("headstart.inference.vllm_check")
side = importlib.import_module("headstart.inference.vllm_side")


def scripted_clock(times):
    """A clock that returns `times` in turn (the calls measure_interleaved makes: start, end per generation)."""
    it = iter(times)
    return lambda: next(it)


def test_prompts_alternate_between_the_engines_and_who_goes_first():
    assert side.interleaved_order(3, 2) == [
        (0, 0, "without"), (0, 0, "with"), (0, 1, "with"), (0, 1, "without"), (0, 2, "without"), (0, 2, "with"),
        (1, 0, "with"), (1, 0, "without"), (1, 1, "without"), (1, 1, "with"), (1, 2, "with"), (1, 2, "without")]
    assert side.interleaved_order(2, 0) == []


def test_each_prompt_is_timed_alone_on_the_clock_given():
    calls = []
    outputs = {("without", 0): [5, 6, 7], ("with", 0): [5, 6, 7], ("without", 1): [8, 9], ("with", 1): [8, 9]}

    def generate(engine, i):
        calls.append((engine, i))
        return outputs[engine, i]

    # durations in the order run: round 0: without 0 (2 s), with 0 (1 s), with 1 (1 s), without 1 (2 s);
    # round 1 (an even number of prompts: the same order): without 0 (1 s), with 0 (3 s), with 1 (3 s), without 1 (1 s)
    times = []
    for duration in (2, 1, 1, 2, 1, 3, 3, 1):
        start = 100.0 + len(times)
        times += [start, start + duration]
    measured = side.measure_interleaved(generate, 2, 2, clock=scripted_clock(times))
    assert calls == [(e, i) for _, i, e in side.interleaved_order(2, 2)]
    assert measured["rounds"] == {"without": [{"tokens": 5, "seconds": 4.0}, {"tokens": 5, "seconds": 2.0}],
                                  "with": [{"tokens": 5, "seconds": 2.0}, {"tokens": 5, "seconds": 6.0}]}
    assert measured["outputs"] == {"without": [[5, 6, 7], [8, 9]], "with": [[5, 6, 7], [8, 9]]}
    assert measured["rounds_agree"] == {"without": True, "with": True}
    # fastest of the rounds, each engine its own: without 5 / 2.0, with 5 / 2.0
    assert check.fastest_tokens_per_s(measured["rounds"]["without"], "without") == 2.5
    assert check.fastest_tokens_per_s(measured["rounds"]["with"], "with") == 2.5


def test_a_round_that_generated_other_tokens_is_flagged():
    seen = {"with": 0}

    def generate(engine, i):
        if engine == "with":
            seen["with"] += 1
            return [1, 2] if seen["with"] == 1 else [1, 3]
        return [1, 2]

    measured = side.measure_interleaved(generate, 1, 2, clock=scripted_clock([0, 1] * 4))
    assert measured["rounds_agree"] == {"without": True, "with": False}
    assert measured["outputs"]["with"] == [[1, 2]]  # the first round's


def run_result(with_rounds=((96, 8.0), (96, 6.0)), without_rounds=((96, 7.0), (96, 7.5)), drafts=100,
               accepted=17, outputs_with=([1, 2], [3, 4]), outputs_without=([1, 2], [3, 5])):
    return {"version": "0.32.0", "k": 3,
            "rounds": {"with": [{"tokens": t, "seconds": s} for t, s in with_rounds],
                       "without": [{"tokens": t, "seconds": s} for t, s in without_rounds]},
            "outputs": {"with": [list(o) for o in outputs_with], "without": [list(o) for o in outputs_without]},
            "rounds_agree": {"with": True, "without": True}, "num_drafts": drafts, "num_accepted_tokens": accepted}


def test_the_record_takes_each_engines_fastest_round_and_the_counters():
    record = check.speed_record(run_result(), 3)
    assert record == {"engine": "vllm", "version": "0.32.0", "k": 3, "acceptance": 1.17,
                      "tokens_per_s_with": 16.0, "tokens_per_s_without": round(96 / 7.0, 3),
                      "step_cost": {"3": round(1.17 * (96 / 7.0) / 16.0, 4)}}
    assert check.identical_outputs(run_result()) == 1


@pytest.mark.parametrize("run,words", [
    (run_result(with_rounds=((96, 8.0), (0, 6.0))), "vLLM with the draft generated 0 tokens in round 2"),
    (run_result(without_rounds=((96, float("nan")),)), "vLLM without the draft took nan s in round 1"),
    (run_result(without_rounds=((96, 0.0),)), "vLLM without the draft took 0.0 s in round 1"),
    (run_result(with_rounds=()), "vLLM with the draft ran no timed round"),
    (run_result(drafts=0), "vLLM counted 0 drafts and 17 accepted tokens"),
    (run_result(drafts=None, accepted=None), "vLLM counted None drafts and None accepted tokens"),
    (run_result(accepted=float("nan")), "vLLM counted 100 drafts and nan accepted tokens"),
])
def test_no_figure_from_zero_tokens_a_zero_time_or_no_drafts(run, words):
    with pytest.raises(check.CheckError) as err:
        check.speed_record(run, 3)
    assert words in str(err.value) and "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------- `speed` end to end


@pytest.fixture
def fake_vllm(tmp_path):
    """A stand-in for the vLLM venv's python: it writes the scripted result (result.json beside it) to --out."""
    script = tmp_path / "fake-vllm-python"
    script.write_text(f"#!{sys.executable}\nimport pathlib, shutil, sys\n"
                      "args = sys.argv[1:]\n"
                      "assert args[1] == 'speed-run' and '--rounds' in args, args\n"
                      # vLLM's context holds the longest prompt and its answer
                      "prompts = __import__('json').load(open(args[args.index('--prompts') + 1]))\n"
                      "need = max(map(len, prompts)) + int(args[args.index('--max_new_tokens') + 1])\n"
                      "assert int(args[args.index('--max_model_len') + 1]) >= max(need, 1024), args\n"
                      f"shutil.copy({str(tmp_path / 'result.json')!r}, args[args.index('--out') + 1])\n")
    script.chmod(0o755)
    return script


def speed_args(tmp_path, tiny_target_dir, heads, python, *extra):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Hello there", "Add two numbers")))
    return ["speed", "--heads", str(heads), "--target", str(tiny_target_dir), "--target_dir", str(tiny_target_dir),
            "--vllm_python", str(python), "--prompts", str(prompts), "--num_prompts", "2", "--max_new_tokens", "2",
            "--rounds", "2", "--output", str(tmp_path / "speed"), *extra]


@pytest.fixture
def medusa_heads(tmp_path, tiny_target_dir):
    from headstart.heads.medusa import MedusaConfig, MedusaHeads
    from headstart.heads.target import load_target

    model, _, info = load_target(str(tiny_target_dir))
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(model.config.hidden_size, model.config.vocab_size, num_heads=3,
                                     share_lm_head=True, target=info.to_dict()))
    path = tmp_path / "medusa" / "heads"
    heads.save_pretrained(path)
    (path / "metrics.json").write_text(json.dumps({"top1": [0.2, 0.1, 0.1]}))
    return path


def test_speed_writes_the_record_into_the_heads_engines_json(tmp_path, tiny_target_dir, medusa_heads, fake_vllm,
                                                             capsys):
    (tmp_path / "result.json").write_text(json.dumps(run_result()))
    args = speed_args(tmp_path, tiny_target_dir, medusa_heads, fake_vllm, "--k", "3")
    assert check.main(args) == 0
    printed = capsys.readouterr().out
    assert f"{medusa_heads} in vLLM 0.32.0, k=3: 16.0 tok/s with the draft, 13.7 without: 1.17x" in printed
    assert "mean acceptance length 1.170 (headstart predicts 1.222, -4.3%); outputs 1/2 identical" in printed
    assert read_engines(medusa_heads) == [EngineRecord("vllm", "0.32.0", 3, 1.17, 16.0, 13.714,
                                                       {3: round(1.17 * (96 / 7.0) / 16.0, 4)})]
    raw = json.loads((medusa_heads / "engines.json").read_text())[0]
    assert (raw["method"], raw["num_prompts"], raw["rounds"], raw["identical_outputs"]) == ("medusa", 2, 2, "1/2")
    row = json.loads((tmp_path / "speed" / "speed.json").read_text())["runs"][0]
    assert row["predicted_acceptance"] == 1.222 and row["speedup"] == round(16.0 / 13.714, 4)
    assert row["prediction_source"] == "prior"
    # a second measurement at the same engine, version and k replaces the first
    (tmp_path / "result.json").write_text(json.dumps(run_result(with_rounds=((96, 12.0),))))
    assert check.main(args) == 0
    assert [r.tokens_per_s_with for r in read_engines(medusa_heads)] == [8.0]


def test_speed_refuses_an_output_directory_holding_someone_elses_files(tmp_path, tiny_target_dir, medusa_heads,
                                                                      fake_vllm, capsys):
    (tmp_path / "result.json").write_text(json.dumps(run_result()))
    (tmp_path / "speed").mkdir()
    (tmp_path / "speed" / "prompts.json").write_text("my own prompts")  # a name the check writes, not its file
    assert check.main(speed_args(tmp_path, tiny_target_dir, medusa_heads, fake_vllm, "--k", "3")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "not a headstart engine-check:vllm run" in err
    assert (tmp_path / "speed" / "prompts.json").read_text() == "my own prompts"
    assert sorted(p.name for p in (tmp_path / "speed").iterdir()) == ["prompts.json"]
    assert not (medusa_heads / "engines.json").exists()


def test_speed_reports_no_figure_from_a_run_without_drafts(tmp_path, tiny_target_dir, medusa_heads, fake_vllm,
                                                           capsys):
    (tmp_path / "result.json").write_text(json.dumps(run_result(drafts=0)))
    assert check.main(speed_args(tmp_path, tiny_target_dir, medusa_heads, fake_vllm)) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]  # one line
    assert err == [f"error: {medusa_heads}: vLLM counted 0 drafts and 17 accepted tokens with the draft: no acceptance "
                   "is computed from them; check that the export loaded as a draft in vLLM's log"]
    assert not (medusa_heads / "engines.json").exists()
    row = json.loads((tmp_path / "speed" / "speed.json").read_text())["runs"][0]
    assert "error" in row and "tokens_per_s_with" not in row


def test_speed_refuses_zero_rounds_in_one_line(tmp_path, tiny_target_dir, medusa_heads, fake_vllm, capsys):
    assert check.main(speed_args(tmp_path, tiny_target_dir, medusa_heads, fake_vllm, "--rounds", "0")) == 2
    assert capsys.readouterr().err.strip() == "error: rounds must be a number >= 1, got 0: pass another --rounds"
    assert not (tmp_path / "speed").exists()


def test_the_vllm_side_imports_only_the_standard_library_at_the_top():
    """inference/vllm_side.py runs by path in the vLLM venv, where headstart is not installed: its module-level
    imports are the standard library's (vllm itself is imported inside the functions that run it)."""
    import ast
    import sys as system

    tree = ast.parse(Path(side.__file__).read_text())
    top = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            top |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            top.add(node.module.split(".")[0])
    assert top - {"__future__"} <= set(system.stdlib_module_names), top
    assert top == {"__future__", "argparse", "json", "time", "pathlib", "typing"}
