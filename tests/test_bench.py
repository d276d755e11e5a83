"""Benchmark CLI on a tiny random target: every figure for every method, exactness flags, tau, reports, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from headstart.heads.chat import prompt_ids, stop_token_ids
from headstart.heads.medusa import MedusaConfig, MedusaHeads
from headstart.heads.prompt_rows import PromptRow
from headstart.heads.target import load_target
from headstart.inference.bench.run import main, time_methods
from headstart.inference.bench.inputs import BenchError, Prompt, read_prompt_rows
from headstart.inference.bench.methods import Method, Run
from headstart.inference.bench.report import markdown
from headstart.inference.bench.summary import summarise_all, versus_best_other
from headstart.inference.speculator import Speculator

PROMPTS = [  # Spec-Bench style rows, two categories
    {"question_id": 1, "category": "writing", "turns": ["Tell me a story about a dragon and a knight.", "More."]},
    {"question_id": 2, "category": "coding", "turns": ["def add(a, b):\n    return a + b"]},
    {"question_id": 3, "category": "writing", "turns": ["hello there, how are you doing today?"]},
]
METHOD_KEYS = {"kind", "prompts", "new_tokens", "seconds", "tokens_per_s", "decode_forwards", "tau", "speedup",
               "efficiency", "time_split", "cost_model", "identical", "identical_of", "all_identical", "mismatches",
               "accept_hist", "speedup_spread"}
SPREAD_KEYS = {"per_prompt", "min", "median", "mean", "max", "ci95", "bootstrap_samples", "seed"}
COST_KEYS = {"prefill_ms", "step_ms", "draft_ms", "vanilla_step_ms", "predicted_speedup"}
SPLIT_KEYS = {"draft_s", "verify_s", "other_s", "draft_frac", "verify_frac", "other_frac"}
SETTINGS_KEYS = {"command", "date", "device", "dtype", "torch", "transformers", "target", "prompts", "num_prompts",
                 "num_prompts_used", "max_new_tokens", "tree", "prompt_lookup_num_tokens", "stop_token_ids"}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def save_heads(path: Path, target_dir: Path, seed: int, fingerprint: str | None = None) -> Path:
    """Random Medusa heads for the target in target_dir (lm_heads = the target's, perturbed; blocks random)."""
    model, _, info = load_target(str(target_dir))
    torch.manual_seed(seed)
    heads = MedusaHeads(MedusaConfig(hidden_size=info.hidden_size, vocab_size=info.vocab_size, num_heads=3))
    heads.init_lm_heads_from(model.get_output_embeddings().weight)
    with torch.no_grad():
        for block in heads.blocks:
            for layer in block.layers:
                layer.weight.normal_(0, 0.05)
    heads.config.target = {**info.to_dict(), "name": str(target_dir)}
    if fingerprint is not None:
        heads.config.target["fingerprint"] = fingerprint
    heads.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def setup(tiny_target_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    heads_a = save_heads(root / "a" / "heads", tiny_target_dir, seed=1)
    heads_b = save_heads(root / "b" / "heads", tiny_target_dir, seed=2)
    return root, prompts, heads_a, heads_b


@pytest.fixture(scope="module")
def results(setup):
    root, prompts, heads_a, heads_b = setup
    out = root / "out"
    rc = main(["--heads", str(heads_a), str(heads_b), "--prompts", str(prompts), "--num_prompts", "3",
               "--max_new_tokens", "16", "--output", str(out), "--tree", "default"])
    assert rc == 0
    return out, json.loads((out / "results.json").read_text())


def test_results_have_every_figure_for_every_method(results):
    out, res = results
    # unique short labels; each heads dir alone and with chains from the context (--lookup both, the default)
    order = ["vanilla", "prompt_lookup", "a/heads", "a/heads +lookup", "b/heads", "b/heads +lookup"]
    assert list(res["methods"]) == order
    assert SETTINGS_KEYS <= set(res["settings"])
    st = res["settings"]
    assert st["num_prompts_used"] == 3 and st["max_new_tokens"] == 16 and st["device"] == "cpu"
    assert st["order"] == order and st["heads_lookup"] == "both"
    for name, m in res["methods"].items():
        assert METHOD_KEYS <= set(m), name
        assert SPLIT_KEYS <= set(m["time_split"]), name
        assert COST_KEYS <= set(m["cost_model"]) and m["cost_model"]["step_ms"] > 0, name
        spread = m["speedup_spread"]
        assert set(spread) == SPREAD_KEYS and len(spread["per_prompt"]) == 3, name
        assert spread["ci95"][0] <= m["speedup"] <= spread["ci95"][1] and spread["min"] <= spread["max"], name
        for p, x in zip(res["prompts"], spread["per_prompt"]):  # that prompt's tokens/s over vanilla's on it
            mine, van = p["runs"][name], p["runs"]["vanilla"]
            assert x == pytest.approx((mine["new_tokens"] / mine["seconds"]) / (van["new_tokens"] / van["seconds"]))
        assert m["prompts"] == 3 and m["new_tokens"] > 0 and m["seconds"] > 0
        assert m["tokens_per_s"] == pytest.approx(m["new_tokens"] / m["seconds"])
        assert m["all_identical"] and m["identical"] == m["identical_of"] == 3, name  # greedy fp32: lossless
        assert m["tau"] is not None and m["tau"] >= 1.0
        assert m["efficiency"] == pytest.approx(m["speedup"] / m["tau"])
        split = m["time_split"]
        assert split["verify_s"] > 0 and split["other_s"] >= 0
    van = res["methods"]["vanilla"]
    assert van["tau"] == 1.0 and van["speedup"] == pytest.approx(1.0)
    assert van["time_split"]["verify_s"] == pytest.approx(van["seconds"]) and van["time_split"]["draft_s"] == 0
    assert van["cost_model"]["predicted_speedup"] == 1.0 and van["cost_model"]["draft_ms"] == 0
    pld = res["methods"]["prompt_lookup"]
    assert pld["time_split"]["draft_s"] is None and pld["prompt_lookup_num_tokens"] == 10
    for name in order[2:]:
        m = res["methods"][name]
        assert m["tree"]["size"] == len(m["tree"]["choices"]) + 1 and m["time_split"]["draft_s"] > 0
        assert m["lookup"] == name.endswith(" +lookup")
        assert (0 <= m["lookup_steps"] <= m["decode_forwards"]) if m["lookup"] else m["lookup_steps"] is None
        total = sum(p["runs"][name]["new_tokens"] for p in res["prompts"])
        forwards = sum(p["runs"][name]["decode_forwards"] for p in res["prompts"])
        assert m["new_tokens"] == total and m["decode_forwards"] == forwards
        assert m["tau"] == pytest.approx((total - len(res["prompts"])) / forwards)  # prefill's token excluded
        assert sum(m["accept_hist"]) == forwards
        assert m["adaptive"] and sum(m["proposals"].values()) == pytest.approx(1.0)  # the Speculator's default
        assert set(m["proposals"]) <= ({"plain", "heads", "lookup", "both"} if m["lookup"] else {"plain", "heads"})
        cost = m["cost_model"]
        assert cost["predicted_speedup"] == pytest.approx(
            m["tau"] * van["cost_model"]["step_ms"] / (cost["step_ms"] + cost["draft_ms"]))
        tps = m["new_tokens"] / m["seconds"]
        assert m["speedup"] == pytest.approx(tps / (van["new_tokens"] / van["seconds"]))
    for p in res["prompts"]:  # the forward hook sees prefill + one forward per further token for plain greedy
        assert p["runs"]["vanilla"]["decode_forwards"] == p["runs"]["vanilla"]["new_tokens"] - 1


def test_heads_tau_matches_the_speculator_stats(results, setup, tiny_target_dir):
    _, res = results
    _, _, heads_a, _ = setup
    model, tokenizer, _ = load_target(str(tiny_target_dir))
    spec = Speculator.from_pretrained(str(heads_a), target=model, tokenizer=tokenizer, tree="default")
    for name, lookup in (("a/heads", False), ("a/heads +lookup", True)):
        tokens = forwards = 0
        for row, record in zip(PROMPTS, res["prompts"]):
            ids = prompt_ids(tokenizer, row["turns"][0])
            assert len(ids) == record["prompt_tokens"]
            out = spec.generate(ids, 16, stop_token_ids=stop_token_ids(tokenizer, model.generation_config), lookup=lookup)
            assert out.stats.decode_forwards == record["runs"][name]["decode_forwards"]
            assert out.stats.new_tokens == record["runs"][name]["new_tokens"]
            tokens, forwards = tokens + out.stats.new_tokens, forwards + out.stats.decode_forwards
        assert res["methods"][name]["tau"] == pytest.approx((tokens - len(PROMPTS)) / forwards)


def test_category_breakdown_and_reports(results, capsys):
    out, res = results
    assert set(res["categories"]) == {"writing", "coding"}
    assert res["categories"]["writing"]["vanilla"]["prompts"] == 2
    assert res["categories"]["coding"]["a/heads"]["prompts"] == 1
    for cat in res["categories"].values():
        assert set(cat) == set(res["methods"]) and all(METHOD_KEYS <= set(m) for m in cat.values())
    md = (out / "results.md").read_text()
    assert md.startswith("Command: `python -m headstart.inference.bench --heads ")
    for cell in ("| vanilla |", "| a/heads |", "predicted speedup", "| writing |", "| coding |", "95% CI",
                 "| per-prompt min | median | mean | max |"):
        assert cell in md
    png = (out / "speedup.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_adaptive_both_adds_fixed_rows_and_each_method_is_compared_with_the_best_other(setup, tmp_path):
    root, prompts, heads_a, _ = setup
    rc = main(["--heads", str(heads_a), "--prompts", str(prompts), "--num_prompts", "3", "--max_new_tokens", "12",
               "--output", str(tmp_path / "o"), "--tree", "default", "--lookup", "on", "--adaptive", "both"])
    assert rc == 0
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    assert list(res["methods"]) == ["vanilla", "prompt_lookup", "heads +lookup", "heads +lookup fixed"]
    fixed, adaptive = res["methods"]["heads +lookup fixed"], res["methods"]["heads +lookup"]
    assert fixed["adaptive"] is False and fixed["proposals"] is None and fixed["all_identical"]
    assert adaptive["adaptive"] and adaptive["all_identical"]
    for cat, by_method in list(res["categories"].items()) + [("all", res["methods"])]:
        best = versus_best_other(by_method)
        for name, x in best.items():
            others = max(m["speedup"] for other, m in by_method.items() if other != name)
            assert x == pytest.approx(by_method[name]["speedup"] / others), (cat, name)
    md = (tmp_path / "o" / "results.md").read_text()
    assert "over the best of the other methods'" in md and "| heads +lookup | " in md.split("share of decode")[1]


def test_draft_int8_both_adds_float32_draft_rows(setup, tmp_path):
    root, prompts, heads_a, _ = setup
    rc = main(["--heads", str(heads_a), "--prompts", str(prompts), "--num_prompts", "2", "--max_new_tokens", "12",
               "--output", str(tmp_path / "o"), "--tree", "default", "--lookup", "on", "--draft_int8", "both"])
    assert rc == 0
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    assert list(res["methods"]) == ["vanilla", "prompt_lookup", "heads +lookup", "heads +lookup float32 draft"]
    int8, float32 = res["methods"]["heads +lookup"], res["methods"]["heads +lookup float32 draft"]
    assert int8["draft"] == "int8" and float32["draft"] == "float32" and res["settings"]["draft_int8"] == "both"
    assert int8["all_identical"] and float32["all_identical"]  # lossless in both precisions


def test_no_prompt_lookup_and_one_heads_dir_via_training_output_dir(setup, tmp_path, capsys):
    root, prompts, heads_a, _ = setup
    # the training output_dir (holding heads/) is accepted too; a prompt source without categories
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"prompt": "Once upon a time"}) + "\n")
    rc = main(["--heads", str(heads_a.parent), "--prompts", str(plain), "--num_prompts", "5", "--max_new_tokens",
               "8", "--output", str(tmp_path / "o"), "--no_prompt_lookup", "--lookup", "off", "--rounds", "2"])
    assert rc == 0
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    assert list(res["methods"]) == ["vanilla", "heads"] and res["categories"] == {}
    assert res["settings"]["num_prompts_used"] == 1 and res["settings"]["prompt_lookup_num_tokens"] is None
    assert res["settings"]["timed_rounds"] == 2 and res["prompts"][0]["runs"]["heads"]["identical"]
    printed = capsys.readouterr().out
    assert "| method | tau |" in printed and "| heads |" in printed and "fastest of 2 rounds" in printed


def test_rounds_keep_each_methods_fastest_run_of_each_prompt_and_refuse_changing_output():
    prompts = [Prompt(PromptRow(id=f"p{i}", turns=["hi"]), ids=[1, 2]) for i in range(2)]
    # per method, the seconds its successive calls take: warm-up, then prompt 0 rounds 1-3, prompt 1 rounds 1-3
    seconds = {"vanilla": [9.0, 3.0, 2.0, 4.0, 5.0, 6.0, 1.5], "heads": [9.0, 1.0, 0.5, 0.7, 2.0, 0.9, 3.0]}
    order = []

    def scripted_method(name: str, tokens: list[list[int]]) -> Method:
        calls = iter(zip(seconds[name], tokens))

        def run(ids: list[int], max_new_tokens: int) -> Run:
            s, t = next(calls)
            order.append(name)
            return Run(t, s, decode_forwards=len(t), draft_s=0.0, verify_s=s, prefill_s=0.0, step_s=s)
        return Method(name, name, run=run)

    same = [[4]] + [[5, 6]] * 3 + [[7]] * 3
    runs = time_methods([scripted_method("vanilla", same), scripted_method("heads", same)], prompts, 4, rounds=3)
    assert order == ["vanilla", "heads"] * 7  # interleaved: every round of a prompt runs each method in turn
    assert [r.seconds for r in runs["vanilla"]] == [2.0, 1.5] and [r.seconds for r in runs["heads"]] == [0.5, 0.9]
    assert [r.tokens for r in runs["heads"]] == [[5, 6], [7]]
    changing = [[4], [5, 6], [5, 6], [5, 9]] + [[7]] * 3
    with pytest.raises(BenchError, match=r"heads decoded prompt 'p0' differently in round 3.*--rounds 1"):
        time_methods([scripted_method("vanilla", same), scripted_method("heads", changing)], prompts, 4, rounds=3)


def test_errors(setup, tiny_target_dir, tmp_path, capsys):
    root, prompts, heads_a, _ = setup
    base = ["--prompts", str(prompts), "--max_new_tokens", "8", "--output", str(tmp_path / "o")]

    def error(argv: list[str]) -> str:
        assert main(argv) == 2
        return capsys.readouterr().err

    assert "no heads directories found" in error(["--heads", str(tmp_path / "nothing*"), *base])
    assert "no such directory" in error(["--heads", str(tmp_path / "missing"), *base])
    (tmp_path / "empty").mkdir()
    assert "not a heads directory" in error(["--heads", str(tmp_path / "empty"), *base])
    other = save_heads(tmp_path / "other", tiny_target_dir, seed=3, fingerprint="0123456789abcdef")
    msg = error(["--heads", str(heads_a), str(other), *base])
    assert "different targets" in msg and "0123456789abcdef" in msg
    assert "--num_prompts must be at least 1" in error(["--heads", str(heads_a), "--num_prompts", "0", *base])
    assert "--threads must be at least 1" in error(["--heads", str(heads_a), "--threads", "0", *base])
    assert "--rounds must be at least 1" in error(["--heads", str(heads_a), "--rounds", "0", *base])
    assert "fingerprint" in error(["--heads", str(other), *base])  # recorded fingerprint != the loaded target's
    if not torch.cuda.is_available():
        assert "no CUDA device" in error(["--heads", str(heads_a), "--device", "cuda", *base])
    assert not (tmp_path / "o").exists()  # nothing written on error


def test_medusa2_heads_run_against_their_adapter_merged_target(setup, tiny_target_dir, tmp_path, capsys, monkeypatch):
    from peft import LoraConfig, get_peft_model

    from headstart.inference.speculator import Speculator as SpeculatorClass

    _, prompts, heads_a, _ = setup
    heads_dir = save_heads(tmp_path / "m2", tiny_target_dir, seed=4)
    model, tokenizer, _ = load_target(str(tiny_target_dir))
    base = load_target(str(tiny_target_dir))[0]
    tuned = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in tuned.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)  # a real change: LoRA starts as a no-op
    tuned.save_pretrained(heads_dir / "adapter")
    merged = tuned.merge_and_unload().eval()
    config = json.loads((heads_dir / "config.json").read_text())
    (heads_dir / "config.json").write_text(json.dumps(dict(config, adapter=True, method="medusa2")))
    argv = ["--prompts", str(prompts), "--num_prompts", "2", "--max_new_tokens", "8", "--no_prompt_lookup"]
    assert main(["--heads", str(heads_a), str(heads_dir), *argv, "--output", str(tmp_path / "x")]) == 2
    assert "one directory at a time" in capsys.readouterr().err
    outputs = {}  # what the heads generated, per prompt (the last run of each: the warm-up comes first)
    generate = SpeculatorClass.generate

    def recording(self, input_ids, *args, **kwargs):
        out = generate(self, input_ids, *args, **kwargs)
        outputs[tuple(input_ids)] = out.tokens
        return out

    monkeypatch.setattr(SpeculatorClass, "generate", recording)
    assert main(["--heads", str(heads_dir), *argv, "--lookup", "off", "--output", str(tmp_path / "o")]) == 0
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    assert res["settings"]["adapter_merged"] == str(heads_dir)
    assert res["methods"]["m2"]["all_identical"]  # lossless against the merged target that vanilla ran on
    stops = stop_token_ids(tokenizer, merged.generation_config)
    assert len(outputs) == 2
    for ids, tokens in outputs.items():  # the merged target's greedy output, not the base target's
        prompt = torch.tensor([ids])
        want = [merged.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=stops)[0, len(ids):].tolist(),
                base.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=stops)[0, len(ids):].tolist()]
        assert tokens == want[0] != want[1]


def scripted(tokens: list[int], seconds: list[float]) -> list[Run]:
    return [Run([7] * n, s, decode_forwards=n, draft_s=0.0, verify_s=s, prefill_s=0.0, step_s=s)
            for n, s in zip(tokens, seconds)]


def test_speedup_spread_against_a_hand_computation():
    methods = [Method("vanilla", "vanilla", run=None), Method("heads", "medusa", run=None)]
    runs = {"vanilla": scripted([10, 20, 5], [1.0, 2.0, 0.5]),  # 10 tokens/s on every prompt
            "heads": scripted([10, 20, 5], [0.5, 2.5, 0.125])}  # 20, 8, 40 tokens/s
    res = summarise_all(methods, runs, ["p0", "p1", "p2"])
    spread = res["heads"]["speedup_spread"]
    assert spread["per_prompt"] == [2.0, 0.8, 4.0]
    assert (spread["min"], spread["median"], spread["max"]) == (0.8, 2.0, 4.0)
    assert spread["mean"] == pytest.approx(6.8 / 3)
    assert res["heads"]["speedup"] == pytest.approx((35 / 3.125) / (35 / 3.5))  # overall: total / total
    # The overall speedup of a resample is a weighted mean of its prompts' speedups, so it lies in
    # [0.8, 4.0] and reaches an end only when all three draws are the same prompt (1 in 27 resamples, more
    # than 2.5% of them): the 95% interval is exactly [0.8, 4.0].
    assert spread["ci95"] == pytest.approx([0.8, 4.0]) and (spread["bootstrap_samples"], spread["seed"]) == (2000, 0)
    assert summarise_all(methods, runs, ["p0", "p1", "p2"])["heads"]["speedup_spread"] == spread  # seeded
    vanilla = res["vanilla"]["speedup_spread"]
    assert vanilla["per_prompt"] == [1.0] * 3 and vanilla["ci95"] == [1.0, 1.0] and vanilla["mean"] == 1.0
    category = summarise_all(methods, runs, ["p0", "p1", "p2"], index=[0, 2])["heads"]["speedup_spread"]
    assert category["per_prompt"] == [2.0, 4.0] and category["ci95"] == pytest.approx([2.0, 4.0])
    assert category["median"] == category["mean"] == 3.0


def test_speedup_spread_skips_prompts_without_tokens_and_is_in_the_report(results):
    methods = [Method("vanilla", "vanilla", run=None), Method("heads", "medusa", run=None)]
    runs = {"vanilla": scripted([0, 10, 10, 10], [0.1, 1.0, 1.0, 1.0]),
            "heads": scripted([0, 10, 10, 10], [0.1, 0.5, 0.25, 1.0])}
    spread = summarise_all(methods, runs, ["a", "b", "c", "d"])["heads"]["speedup_spread"]
    assert spread["per_prompt"] == [None, 2.0, 4.0, 1.0] and (spread["min"], spread["median"], spread["max"]) == (
        1.0, 2.0, 4.0)
    assert 1.0 <= spread["ci95"][0] < spread["ci95"][1] <= 4.0
    _, res = results
    res = dict(res, methods={name: dict(m) for name, m in res["methods"].items()})
    res["methods"]["a/heads"]["speedup_spread"] = spread
    assert "| a/heads | " in markdown(res) and "| 1.00-" in markdown(res) and " | 1.00x | 2.00x | 2.33x | 4.00x |" in (
        markdown(res))


def test_per_category_takes_the_first_rows_of_each_family(tmp_path):
    rows = [{"id": f"{c}{i}", "category": c, "turns": [f"{c} question {i}"]} for i in range(3) for c in "abc"]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r.id for r in read_prompt_rows(str(path), 20, per_category=2)] == ["a0", "b0", "c0", "a1", "b1", "c1"]
    assert [r.id for r in read_prompt_rows(str(path), 4)] == ["a0", "b0", "c0", "a1"]  # without it: the first rows

