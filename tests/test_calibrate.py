"""Tree calibration on a busy machine: scripted timers (no wall-clock assertions) check that the choice survives
a uniformly slower machine and spikes in a minority of rounds, that timings too noisy to trust fall back to the
small default tree (never to plain decoding), and that an untrustworthy tree.json is measured again."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import tiny_model

import headstart.inference.calibrate as calibrate_module
from headstart.heads.medusa import MedusaConfig, MedusaHeads
from headstart.inference.calibrate import FALLBACK_NODES, ROUNDS, busy_reading, calibrate_tree, others_cores, relative_mad, stale_reason
from headstart.inference.cpu_linear import ALWAYS_ONEDNN, use_cpu_linears
from headstart.inference.speculator import Speculator
from headstart.inference.tree import best_choices

QUIET_MS = {1: 40, 2: 40, 3: 42, 4: 52, 6: 58, 8: 62, 12: 80, 16: 95, 32: 170, 64: 275}  # a CPU-like step curve
DRAFT_MS = 2.0
ACCURACY = [[0.6, 0.15, 0.08, 0.04], [0.5, 0.12, 0.06, 0.03], [0.4, 0.1, 0.05, 0.02]]
QUIET_CHOICE = [[0], [0, 0]]  # what QUIET_MS and ACCURACY give: a 3-node chain (the neighbours 2 and 4 come close)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class ScriptedTimer:
    """timer(kind, size, run) -> ms from QUIET_MS (draft: DRAFT_MS) x factor(kind, size, round); never runs `run`."""

    def __init__(self, factor=lambda kind, size, r: 1.0, base: dict[int, float] | None = None):
        self.factor = factor
        self.base = QUIET_MS if base is None else base
        self.calls: dict[tuple[str, int], int] = {}

    def __call__(self, kind: str, size: int, run) -> float:
        r = self.calls.get((kind, size), 0)
        self.calls[(kind, size)] = r + 1
        return (DRAFT_MS if kind == "draft" else self.base[size]) * self.factor(kind, size, r)


@pytest.fixture(scope="module")
def model_and_heads():
    model = tiny_model("llama", vocab_size=128, seed=1)
    use_cpu_linears(model, ALWAYS_ONEDNN)  # fixed kernels (not measured): the records' "linear" below is "onednn"
    torch.manual_seed(0)
    return model, MedusaHeads(MedusaConfig(hidden_size=64, vocab_size=128, num_heads=3)).eval()


def calibrate(model_and_heads, timer, **kwargs):
    model, heads = model_and_heads
    return calibrate_tree(model, heads, ACCURACY, prefix_len=32, timer=timer, **kwargs)


def test_quiet_timings_choose_the_best_tree_and_record_what_was_measured(model_and_heads):
    timer = ScriptedTimer()
    calib = calibrate(model_and_heads, timer)
    assert calib.choices == QUIET_CHOICE and not calib.noisy and calib.chosen_by == "measurement"
    assert set(timer.calls.values()) == {ROUNDS} and calib.rounds == ROUNDS  # every size and the draft, each round
    assert calib.step_ratio == {n: ms / 40 for n, ms in QUIET_MS.items()} and set(calib.spread.values()) == {0.0}
    assert calib.samples_ms[8] == [62.0] * ROUNDS and calib.draft_samples_ms == {0: [DRAFT_MS] * ROUNDS}
    assert calib.draft_ms == DRAFT_MS and calib.device == "cpu" and calib.threads == 1
    assert calib.expected_tokens_per_s[1] == pytest.approx(1000.0 / 40)
    record = calib.to_json()
    assert {"spread", "samples_ms", "rounds", "noisy", "device", "threads", "step_ratio"} <= set(record)
    assert json.loads(json.dumps(record))["spread"]["64"] == 0.0


def test_a_uniformly_slower_machine_chooses_the_same_tree(model_and_heads):
    slow = calibrate(model_and_heads, ScriptedTimer(lambda kind, size, r: 8.0))
    assert slow.choices == QUIET_CHOICE and not slow.noisy
    assert slow.step_ms[64] == pytest.approx(8 * 275) and slow.draft_ms == pytest.approx(8 * DRAFT_MS)


def test_load_that_drifts_from_round_to_round_is_read_relative_to_the_same_rounds_step(model_and_heads):
    drift = calibrate(model_and_heads, ScriptedTimer(lambda kind, size, r: (1.0, 3.0, 1.5, 6.0, 2.0)[r % 5]))
    assert drift.choices == QUIET_CHOICE and not drift.noisy and max(drift.spread.values()) == pytest.approx(0.0)


@pytest.mark.parametrize("hit", [1, 3, 2])  # the 1-token step every ratio divides by, the chosen size, a neighbour
def test_spikes_in_a_minority_of_rounds_change_nothing(model_and_heads, hit):
    spiky = ScriptedTimer(lambda kind, size, r: 4.0 if kind == "step" and size == hit and r in (0, 2, 5, 7) else 1.0)
    calib = calibrate(model_and_heads, spiky)
    assert calib.choices == QUIET_CHOICE and not calib.noisy


def test_timings_too_noisy_to_trust_fall_back_to_the_default_tree_not_to_no_tree(model_and_heads):
    rng = random.Random(0)
    calib = calibrate(model_and_heads, ScriptedTimer(lambda kind, size, r: rng.uniform(0.3, 3.0)))
    assert calib.noisy and calib.chosen_by == "fallback: too noisy"
    assert max(calib.spread.values()) > calib.noise_limit
    assert calib.choices == best_choices(ACCURACY, FALLBACK_NODES) == [[0], [0, 0]]  # a tree, not plain decoding
    assert calib.expected_accept_length > 1.0


def test_one_erratic_size_does_not_void_the_measurement(model_and_heads):
    """A quiet machine where one size's rounds spread 0.19 (the demo's "size 2: spread 0.19 > 0.15"): the pooled
    spread stays small, the curve is fitted over all sizes and the measured tree is kept."""
    erratic = ScriptedTimer(lambda kind, size, r: (1.0, 1.4, 0.8, 1.25, 1.0, 0.7, 1.2, 1.0, 0.81)[r]
                            if kind == "step" and size == 2 else 1.0)
    calib = calibrate(model_and_heads, erratic)
    assert calib.spread[2] >= 0.19 and calib.pooled_spread == 0.0
    assert not calib.noisy and calib.chosen_by == "measurement" and calib.choices == QUIET_CHOICE


def test_five_calibrations_with_quiet_machine_noise_choose_the_same_tree(model_and_heads):
    """Every timing off by a random few percent (lognormal, sigma 0.05: what the step's own samples spread on a
    quiet machine), five calibrations: one tree."""
    chosen = []
    for seed in range(5):
        rng = random.Random(seed)
        calib = calibrate(model_and_heads, ScriptedTimer(lambda kind, size, r: rng.lognormvariate(0.0, 0.05)))
        assert not calib.noisy
        chosen.append(calib.choices)
    assert all(c == chosen[0] for c in chosen), chosen


def test_a_busy_machine_falls_back_to_the_default_tree_and_says_so(model_and_heads):
    """A CPU hog slows every size alike, so the rounds agree; /proc/stat's count of other processes' CPU time tells.
    Scripted readings: 3 CPU-seconds of others over 2 wall seconds = 1.5 cores."""
    def probe(others_cpu_s: float):
        readings = iter([(10.0, 100.0)])  # the first reading, then others_cpu_s more 2 s later
        return lambda: next(readings, (10.0 + others_cpu_s, 102.0))

    hogged = lambda others_cpu_s, idle: calibrate(  # noqa: E731
        model_and_heads, ScriptedTimer(lambda kind, size, r: 100.0), busy_probe=probe(others_cpu_s), idle_cores=idle)
    calib = hogged(3.0, 0.0)  # the timing's threads on every core
    assert calib.noisy and calib.chosen_by == "fallback: machine busy" and calib.other_cores == 1.5
    assert calib.rounds == 1  # no more rounds once the load is seen (a hogged CPU can take seconds a step)
    assert calib.choices == best_choices(ACCURACY, FALLBACK_NODES) and max(calib.spread.values()) == 0.0
    assert "1.5 CPU cores" in calib.fallback_reason() and "the 0 the timing left idle" in calib.fallback_reason()
    calm = calibrate(model_and_heads, ScriptedTimer(), busy_probe=probe(0.2), idle_cores=0.0)  # 0.1 core: measured
    assert calm.chosen_by == "measurement" and calm.choices == QUIET_CHOICE and calm.rounds == ROUNDS
    assert calm.other_cores == pytest.approx(0.1)
    # a one-thread timing on two cores leaves one idle: a one-core job beside it is not a hog, a second one is
    beside = hogged(2.8, 1.0)  # 1.4 cores: within the idle core + BUSY_LIMIT
    assert beside.chosen_by.startswith("measurement") and beside.rounds == ROUNDS and beside.idle_cores == 1.0
    crowded = hogged(3.2, 1.0)  # 1.6 cores
    assert crowded.chosen_by == "fallback: machine busy" and crowded.rounds == 1


def test_others_cores_reads_proc_stat_and_needs_a_second():
    before = busy_reading()
    assert others_cores(before, busy_reading()) is None  # too short to tell
    if before[0] is not None:
        assert others_cores((before[0], 0.0), (before[0] + 0.5, 2.0)) == 0.25


def test_relative_mad():
    assert relative_mad([1.0, 1.0, 1.0, 9.0, 9.0]) == 0.0  # two spikes in five: no spread
    assert relative_mad([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(1 / 3)


GOOD = {"choices": [[0]], "rounds": 5, "noisy": False, "device": "cpu", "linear": "onednn", "threads": 1,
        "draft_weights": "int8"}


@pytest.mark.parametrize("record,why", [
    ({"choices": [[0]], "device": "cpu"}, "older calibration"),
    (dict(GOOD, noisy=True), "too noisy"),
    (dict(GOOD, choices=[]), "chose no tree"),
    (dict(GOOD, device="cuda:0"), "measured on cuda:0"),
    (dict(GOOD, threads=2), "2 torch threads"),
    (dict(GOOD, linear="default"), "default linear kernels, not onednn"),  # timed before the oneDNN switch
    ({k: v for k, v in GOOD.items() if k != "draft_weights"}, "draft in float32, not int8"),  # before int8 drafts
])
def test_an_untrustworthy_tree_json_is_measured_again(model_and_heads, tmp_path, monkeypatch, record, why, capsys):
    model, heads = model_and_heads
    assert why in stale_reason(record, "cpu", 1, "onednn", "int8")
    (tmp_path / "tree.json").write_text(json.dumps(record))
    timer = ScriptedTimer()
    monkeypatch.setattr(calibrate_module, "time_ms", timer)  # the default timer, as set_tree(None) calibrates
    spec = Speculator(model, heads, heads_dir=tmp_path)
    spec.set_tree(None)
    assert timer.calls and why in capsys.readouterr().err
    rewritten = json.loads((tmp_path / "tree.json").read_text())
    quiet = calibrate_tree(model, heads, None, prefix_len=32, timer=ScriptedTimer())  # no accuracy in tmp_path
    assert rewritten["choices"] == quiet.choices != [] and spec.tree.size == len(quiet.choices) + 1
    assert stale_reason(rewritten, "cpu", 1, "onednn", "int8") is None and rewritten["rounds"] == ROUNDS


def test_a_trustworthy_tree_json_is_reused_without_timing(model_and_heads, tmp_path, monkeypatch):
    model, heads = model_and_heads
    assert stale_reason(GOOD, "cpu", 1, "onednn", "int8") is None
    (tmp_path / "tree.json").write_text(json.dumps(GOOD))

    def no_timing(kind, size, run):
        raise AssertionError("a trusted tree.json must not be re-measured")

    monkeypatch.setattr(calibrate_module, "time_ms", no_timing)
    spec = Speculator(model, heads, heads_dir=tmp_path)
    spec.set_tree(None)
    assert spec.tree.size == 2


# a flat optimum: the oneDNN step curve and the accuracies of `make demo`'s Medusa-1 heads (2026-12-01)
FLAT_MS = {1: 37.6, 2: 44.2, 3: 44.8, 4: 44.8, 6: 48.3, 8: 48.3, 12: 49.6, 16: 55.9, 32: 75.1, 64: 107.4}
FLAT_ACCURACY = [[0.394, 0.124, 0.052, 0.032, 0.022], [0.233, 0.106, 0.052, 0.042, 0.027],
                 [0.196, 0.078, 0.048, 0.045, 0.027]]
FLAT_PRIOR_SIZE = 6  # the tree the prior step-cost curve gives FLAT_ACCURACY (calibrate.prior_choices): 6 nodes


def flat_choice_size(model_and_heads, jitter: dict[int, float]) -> int:
    """The tree size chosen on FLAT_MS with each size's timing scaled by jitter[size], the same in every round."""
    model, heads = model_and_heads
    timer = ScriptedTimer(lambda kind, size, r: jitter.get(size, 1.0) if kind == "step" else 1.0, base=FLAT_MS)
    return len(calibrate_tree(model, heads, FLAT_ACCURACY, prefix_len=32, timer=timer).choices) + 1


JITTERS = [{n: 1 + 0.02 * (-1) ** (i + k) for i, n in enumerate(FLAT_MS) if n > 1} for k in range(2)]


def test_where_the_optimum_is_flat_steady_jitter_of_2_percent_keeps_the_choice(model_and_heads, monkeypatch):
    """Sizes 4-12 are expected within 5% of each other here. With +-2% on each size's timing (the same in every
    round, so no noise flag) the plain argmax moves (12 -> 8 nodes); the prior curve's tree (6 nodes, within
    KEEP_MARGIN of the best) stays."""
    assert [flat_choice_size(model_and_heads, jitter) for jitter in [{}] + JITTERS] == [FLAT_PRIOR_SIZE] * 3
    monkeypatch.setattr(calibrate_module, "NEAR_BEST", 0.0)
    monkeypatch.setattr(calibrate_module, "KEEP_MARGIN", 0.0)
    assert [flat_choice_size(model_and_heads, jitter) for jitter in [{}] + JITTERS] == [12, 8, 12]


def test_from_scratch_calibrations_on_a_shared_host_choose_the_same_tree(model_and_heads, monkeypatch):
    """Ten calibrations from scratch on FLAT_MS, every timing off by a random 5% (lognormal) and a third of them
    slowed 10-40% (another process's work): the prior curve's tree every time. Without the reference tree (the
    largest size within NEAR_BEST: the rule before), the band's edge moves with the noise and so does the tree."""
    model, heads = model_and_heads

    def sizes() -> list[int]:
        chosen = []
        for seed in range(10):
            rng = random.Random(seed)
            noise = lambda kind, size, r: rng.lognormvariate(0.0, 0.05) * (1 + rng.uniform(0.1, 0.4) * (rng.random() < 1 / 3))  # noqa: E731
            calib = calibrate_tree(model, heads, FLAT_ACCURACY, prefix_len=32, timer=ScriptedTimer(noise, base=FLAT_MS))
            assert not calib.noisy
            chosen.append(len(calib.choices) + 1)
        return chosen

    assert sizes() == [FLAT_PRIOR_SIZE] * 10
    monkeypatch.setattr(calibrate_module, "KEEP_MARGIN", 0.0)
    assert len(set(sizes())) > 1


def test_calibrating_again_keeps_the_previous_tree_while_it_is_still_near_the_best(model_and_heads):
    """On FLAT_MS sizes 4-12 are within NEAR_BEST of each other: a previous 8-node choice is kept (from scratch the
    prior curve's 6 nodes are), one more than KEEP_MARGIN below the best (2 nodes) is not."""
    model, heads = model_and_heads
    timer = lambda: ScriptedTimer(base=FLAT_MS)  # noqa: E731
    fresh = calibrate_tree(model, heads, FLAT_ACCURACY, prefix_len=32, timer=timer())
    eight = fresh.choices_by_size[8]
    again = calibrate_tree(model, heads, FLAT_ACCURACY, prefix_len=32, timer=timer(), previous=eight)
    assert len(fresh.choices) + 1 == FLAT_PRIOR_SIZE and again.choices == eight
    assert again.chosen_by == "measurement, the previous tree kept"
    assert fresh.chosen_by == "measurement, the prior curve's tree kept"
    assert again.expected_tokens_per_s[8] >= (1 - calibrate_module.NEAR_BEST) * max(again.expected_tokens_per_s.values())
    far = calibrate_tree(model, heads, FLAT_ACCURACY, prefix_len=32, timer=timer(), previous=fresh.choices_by_size[2])
    assert far.expected_tokens_per_s[2] < (1 - calibrate_module.KEEP_MARGIN) * max(far.expected_tokens_per_s.values())
    assert far.choices == fresh.choices and far.chosen_by == "measurement, the prior curve's tree kept"


def test_without_a_reference_near_the_best_the_largest_size_near_it_is_chosen(model_and_heads):
    """A GPU-like curve (a 64-node tree costs one step): the prior curve's tree is more than KEEP_MARGIN below the
    best, so the measurement decides: the largest size within NEAR_BEST of the best."""
    model, heads = model_and_heads
    gpu_ms = {n: 10.0 for n in FLAT_MS}
    calib = calibrate_tree(model, heads, FLAT_ACCURACY, prefix_len=32, timer=ScriptedTimer(base=gpu_ms))
    best = max(calib.expected_tokens_per_s.values())
    near = [n for n, e in calib.expected_tokens_per_s.items() if e >= (1 - calibrate_module.NEAR_BEST) * best]
    assert calib.chosen_by == "measurement" and len(calib.choices) + 1 == max(near) > FLAT_PRIOR_SIZE


def test_the_speculator_hands_its_last_calibration_to_the_next(model_and_heads, tmp_path):
    """Speculator.calibrate passes the heads dir's tree.json choice on: calibrating the same heads again keeps it
    while it is near the best, and the prior curve's tree when the record is no calibration of this device."""
    model, heads = model_and_heads
    spec = Speculator(model, heads, heads_dir=tmp_path)
    first = spec.calibrate(timer=ScriptedTimer(base=FLAT_MS))
    record = json.loads((tmp_path / "tree.json").read_text())
    assert record["choices"] == first.choices and first.chosen_by == "measurement, the prior curve's tree kept"
    best = max(first.expected_tokens_per_s.values())
    keep = sorted(n for n, e in first.expected_tokens_per_s.items() if e >= (1 - calibrate_module.KEEP_MARGIN) * best)
    assert 8 in keep and len(first.choices) + 1 != 8  # a flat optimum: another size within KEEP_MARGIN of the best
    record["choices"] = first.choices_by_size[8]  # as if the last calibration had landed on that one
    (tmp_path / "tree.json").write_text(json.dumps(record))
    second = spec.calibrate(timer=ScriptedTimer(base=FLAT_MS))
    assert second.choices == first.choices_by_size[8] and second.chosen_by == "measurement, the previous tree kept"
    (tmp_path / "tree.json").write_text(json.dumps(dict(record, threads=7)))  # measured with other threads: not handed on
    third = spec.calibrate(timer=ScriptedTimer(base=FLAT_MS))
    assert third.choices == first.choices and third.chosen_by == "measurement, the prior curve's tree kept"
