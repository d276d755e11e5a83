"""The draft length to serve a draft with in an engine, and the speedup it is predicted to give there.

An engine verifies a fixed chain of k drafted tokens every step (vLLM's `num_speculative_tokens`, SGLang's
`--speculative-num-steps`, llama.cpp's `--draft-max`). At batch 1 its served speedup is

    speedup(k) = tau(k) / step_cost(k)

tau(k): mean acceptance length of a greedy chain of k (tokens per target step, bonus token included)
(`expected_acceptance`): from the heads directory's chain_acceptance.json when it has one (a greedy chain decoded on
held-out task families by `python -m headstart.inference.acceptance --chain`), else from metrics.json's held-out rows, which come
from the training distribution and so overstate tau on prompts unlike the training ones. step_cost(k): the time of one step with the draft (the target verifying
k + 1 tokens, plus the draft's own forwards: EAGLE one per depth, DFlash one per block, Medusa's heads nearly free)
over the time of one plain one-token step of the same engine.

step_cost comes from the engine's measured curve in the heads directory's `engines.json` (written by the engine
checks with `record_engine_run`; `read_engines` checks every number) when it holds records for that engine, else
from the engine's documented prior (PRIORS; the derivation, with the figures and their source, is docs/serving.md
"Choosing the draft length per engine"). The chosen k is the one with the highest predicted speedup; when none
reaches PAYS_AT the answer is to serve without a draft (k None).

    from headstart.heads.served_speed import choose_draft_length
    choice = choose_draft_length(read_metrics(heads_dir), "eagle3", "vllm", heads_dir)
    choice.k, choice.speedup, choice.source        # e.g. 3, 1.42, "prior"; or None, 0.91, "prior": serve without
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from headstart.heads.directory import MAX_DEPTH, HeadsLoadError, checked, checked_list
from headstart.heads.methods import method_of

ENGINES_FILE = "engines.json"
CHAIN_FILE = "chain_acceptance.json"  # inference/acceptance.py --chain: accepted lengths on held-out task families
MAX_CHAIN_STEPS = 10**9
# engine keys -> the name users know. "llamacpp": a quantised target GGUF (the common case, and the costlier one for a
# draft); "llamacpp-f32": an f32 / f16 target GGUF (e.g. convert_hf_to_gguf.py's output)
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "llamacpp": "llama.cpp", "llamacpp-f32": "llama.cpp (f32 target)"}
# a predicted speedup must reach this before a draft is recommended: the prior's error on the measured figures it was
# derived from is a few percent, so a prediction of PAYS_AT still measures above 0.97x (docs/serving.md)
PAYS_AT = 1.05
# the engine's model-free drafting, which needs no trained draft (mentioned when no draft length pays)
MODEL_FREE = {
    "vllm": "vLLM's model-free n-gram drafting (`--speculative-config '{\"method\": \"ngram\", "
            "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4}'`) needs no draft",
    "llamacpp": "llama.cpp's own n-gram lookup mode (its docs/speculative.md) needs no draft",
    "llamacpp-f32": "llama.cpp's own n-gram lookup mode (its docs/speculative.md) needs no draft",
}
MAX_RECORDS = 4096  # records in engines.json
MAX_TOKENS_PER_S = 1e7
STEP_COST_RANGE = (0.5, 1000.0)  # a step with a draft over a plain step: noise may put it a little below 1
FIX = f"rerun the engine check to rewrite {ENGINES_FILE}, or delete it (the export then uses the documented prior)"


@dataclass(frozen=True)
class StepCostPrior:
    """An engine's step cost, from one measured verify point (docs/serving.md "Choosing the draft length per engine").

    verify_extra: what verifying a chain of `measured_k` drafted tokens costs beyond a one-token step (ratio - 1).
    Between a fixed per-step overhead and a per-token cost, one point cannot tell which; the prior takes the upper
    envelope of both readings: the whole extra at k <= measured_k, growing linearly in k beyond it.
    draft_forward: one forward of the draft (an EAGLE depth, a DFlash block) over a one-token target step."""

    measured_k: int
    verify_extra: float
    draft_forward: float

    def step_cost(self, method: str, k: int) -> float:
        verify = self.verify_extra * max(1.0, k / self.measured_k)
        return 1.0 + verify + draft_forwards(method, k) * self.draft_forward


# The figures and their derivation: docs/serving.md "Choosing the draft length per engine".
PRIORS = {
    "vllm": StepCostPrior(measured_k=3, verify_extra=0.282, draft_forward=0.10),
    "sglang": StepCostPrior(measured_k=3, verify_extra=0.282, draft_forward=0.10),  # vLLM's CPU figures stand in
    "llamacpp": StepCostPrior(measured_k=3, verify_extra=2.0, draft_forward=0.16),
    "llamacpp-f32": StepCostPrior(measured_k=3, verify_extra=1.2, draft_forward=0.10),
}


def draft_forwards(method: str, k: int) -> int:
    """The draft's own forwards per step of a chain of k, as its method declares (heads/draft_method.py): EAGLE one
    per depth, DFlash one per block, Medusa none (its heads read the target's last hidden state in the verify pass)."""
    return method_of(method).engine_draft_forwards(k)


def expected_acceptance(metrics: dict, k: int) -> float | None:
    """Mean acceptance length (tokens per target step, bonus included) a greedy chain of k should reach. With
    `chain_accept_hist` (`heldout_metrics`: steps that accepted a = 0..depth drafted tokens of a chain of that depth,
    on held-out task families) and k <= depth: 1 + mean(min(a, k)), since a shorter chain drafts the same first k
    tokens (its steps fall at other positions: an estimate). Else from metrics.json's held-out rows:
    `chain_accepted_tokens` when k is the evaluated depth, else the product estimate 1 + sum_j prod_{i<=j} top1_i
    (heads treated as independent). None beyond what was measured."""
    hist = metrics.get("chain_accept_hist")
    if hist and k <= len(hist) - 1:
        return 1.0 + sum(min(a, k) * n for a, n in enumerate(hist)) / sum(hist)
    top1 = metrics.get("top1") or []
    if metrics.get("chain_accepted_tokens") is not None and len(top1) == k:
        return 1.0 + float(metrics["chain_accepted_tokens"])
    if len(top1) < k:
        return None
    total, run = 1.0, 1.0
    for p in top1[:k]:
        run *= float(p)
        total += run
    return total


def read_chain_acceptance(heads_dir: str | Path | None) -> dict | None:
    """heads_dir/chain_acceptance.json (None when there is none), checked: `accept_hist` a list of 2..MAX_DEPTH + 1
    step counts (index a: steps that accepted a drafted tokens) with at least one step, `prompts` a string.
    HeadsLoadError naming the file and the field otherwise."""
    if heads_dir is None or not (Path(heads_dir) / CHAIN_FILE).is_file():
        return None
    file = Path(heads_dir) / CHAIN_FILE
    fix = "rerun `python -m headstart.inference.acceptance --chain --heads DIR` to rewrite it, or delete it"
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HeadsLoadError(f"{file} is not valid JSON ({err}); {fix}") from err
    checked(raw, dict, file, "the top level", fix=fix)
    hist = checked_list(raw.get("accept_hist"), int, file, "accept_hist", 0, MAX_CHAIN_STEPS, MAX_DEPTH + 1, fix)
    if len(hist) < 2 or sum(hist) == 0:
        raise HeadsLoadError(f"{file}: accept_hist needs a chain of depth >= 1 and at least one step; {fix}")
    checked(raw.get("prompts"), str, file, "prompts", fix=fix)
    return raw


def heldout_metrics(heads_dir: str | Path) -> dict:
    """metrics.json's figures (`read_metrics`) plus, when the heads directory has chain_acceptance.json, its histogram
    as `chain_accept_hist` and its prompts as `chain_prompts`: what `expected_acceptance` reads."""
    from headstart.heads.directory import read_metrics

    metrics = dict(read_metrics(Path(heads_dir)))
    chain = read_chain_acceptance(heads_dir)
    if chain is not None:
        metrics["chain_accept_hist"], metrics["chain_prompts"] = chain["accept_hist"], chain["prompts"]
    return metrics


def acceptance_source(metrics: dict) -> str:
    """Where `expected_acceptance` takes tau from, for cards and printed lines."""
    if metrics.get("chain_accept_hist"):
        return f"a greedy chain on held-out task families ({CHAIN_FILE}, {metrics.get('chain_prompts')})"
    return "held-out rows of the training data (metrics.json)"


# ------------------------------------------------------------------------------------------------ measured curves


@dataclass(frozen=True)
class EngineRecord:
    """One engine-check measurement of these heads (a record of engines.json)."""

    engine: str
    version: str
    k: int  # the chain length measured
    acceptance: float  # the engine's mean acceptance length at k (1 + accepted / drafts)
    tokens_per_s_with: float  # batch 1, with the draft
    tokens_per_s_without: float  # batch 1, the same engine without a draft
    step_cost: dict[int, float] = field(default_factory=dict)  # k -> a step with the draft / a plain step


def read_engines(heads_dir: str | Path | None) -> list[EngineRecord]:
    """heads_dir/engines.json's records ([] when there is none), every field checked (`checked`): a JSON list of
    objects {engine (a key of ENGINE_NAMES), version, k (1..MAX_DEPTH), acceptance (1..k + 1), tokens_per_s_with,
    tokens_per_s_without (> 0), step_cost ({"k": ratio}, optional)}; other keys are kept by the file, unread here.
    HeadsLoadError naming the file and the field otherwise."""
    if heads_dir is None:
        return []
    file = Path(heads_dir) / ENGINES_FILE
    return [_record(entry, file, f"[{i}]", FIX) for i, entry in enumerate(_raw_records(file, FIX))]


def record_engine_run(heads_dir: str | Path, record: dict) -> list[EngineRecord]:
    """Add one engine-check measurement to heads_dir/engines.json and return the file's records as `read_engines`
    reads them. `record` is a dict of the schema `read_engines` reads ({"engine": "vllm", "version": "0.32.0",
    "k": 3, "acceptance": 1.17, "tokens_per_s_with": 12.5, "tokens_per_s_without": 13.7, "step_cost": {"3": 1.28}};
    other keys, e.g. the prompts measured, are kept) and is checked by the same checks first: a NaN, infinite, zero
    or out-of-range figure is refused with a HeadsLoadError naming the field, and nothing is written. The file's
    earlier records are kept as they are, except one of the same engine, version and k, which the new record
    replaces; an existing file that does not read is left as it is (HeadsLoadError). Written atomically
    (headstart.heads.output_dir.write_file: a new file renamed over the old one)."""
    from headstart.heads.output_dir import write_file

    file = Path(heads_dir) / ENGINES_FILE
    fix = "the engine check measured no usable figure: nothing was written; check the engine's log and rerun it"
    new = _record(record, file, "the new record", fix)
    keep_fix = "it is left as it is: delete it (or correct the field) and rerun the engine check"
    kept = []  # the earlier records, as the file holds them, but one this measurement replaces
    for i, entry in enumerate(_raw_records(file, keep_fix)):
        old = _record(entry, file, f"[{i}]", keep_fix)
        if (old.engine, old.version, old.k) != (new.engine, new.version, new.k):
            kept.append(entry)
    if len(kept) >= MAX_RECORDS:
        raise HeadsLoadError(f"{file} holds {len(kept)} records, the most it takes is {MAX_RECORDS}: move it aside "
                             "and rerun the engine check")
    entries = [*kept, record]
    write_file(file, json.dumps(entries, indent=1, allow_nan=False) + "\n")
    return [_record(entry, file, f"[{i}]", FIX) for i, entry in enumerate(entries)]


def measured_model_free(heads_dir: str | Path | None, engine: str) -> dict | None:
    """The engine's own model-free drafting as the engine check last measured it beside these heads (a record of
    `engine` with `model_free` and `tokens_per_s_model_free`, both checked): {"mode", "speedup" (over the same
    record's tokens/s without a draft), "draft_speedup" (the trained draft's, same record)}; None when not measured."""
    if heads_dir is None:
        return None
    file = Path(heads_dir) / ENGINES_FILE
    found = None
    for i, entry in enumerate(_raw_records(file, FIX)):
        record = _record(entry, file, f"[{i}]", FIX)
        if record.engine != engine or entry.get("model_free") is None:
            continue
        mode = checked(entry["model_free"], str, file, f"[{i}].model_free", fix=FIX)
        free = checked(entry.get("tokens_per_s_model_free"), float, file, f"[{i}].tokens_per_s_model_free", 1e-6,
                       MAX_TOKENS_PER_S, FIX)
        found = {"mode": mode[:100], "speedup": round(free / record.tokens_per_s_without, 4),
                 "draft_speedup": round(record.tokens_per_s_with / record.tokens_per_s_without, 4)}
    return found


def _raw_records(file: Path, fix: str) -> list:
    """engines.json's list of records as JSON gives it ([] when the file is absent); HeadsLoadError when it is not a
    JSON list of at most MAX_RECORDS entries."""
    if not file.is_file():
        return []
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HeadsLoadError(f"{file} is not valid JSON ({err}); {fix}") from err
    checked(raw, list, file, "the top level", fix=fix)
    if len(raw) > MAX_RECORDS:
        raise HeadsLoadError(f"{file} holds {len(raw)} records, more than {MAX_RECORDS}; {fix}")
    return raw


def _record(entry, file: Path, where: str, fix: str) -> EngineRecord:
    checked(entry, dict, file, where, fix=fix)
    for name in ("engine", "version", "k", "acceptance", "tokens_per_s_with", "tokens_per_s_without"):
        if name not in entry:
            raise HeadsLoadError(f"{file}: {where} has no {name!r}; {fix}")
    engine = checked(entry["engine"], str, file, f"{where}.engine", fix=fix)
    if engine not in ENGINE_NAMES:
        raise HeadsLoadError(f"{file}: {where}.engine is {engine!r:.40}, not one of {', '.join(ENGINE_NAMES)}; {fix}")
    version = checked(entry["version"], str, file, f"{where}.version", fix=fix)
    if len(version) > 200:
        raise HeadsLoadError(f"{file}: {where}.version is {len(version)} characters long, more than 200; {fix}")
    k = checked(entry["k"], int, file, f"{where}.k", 1, MAX_DEPTH, fix)
    acceptance = checked(entry["acceptance"], float, file, f"{where}.acceptance", 1.0, k + 1.0, fix)
    speeds = [checked(entry[name], float, file, f"{where}.{name}", 1e-6, MAX_TOKENS_PER_S, fix)
              for name in ("tokens_per_s_with", "tokens_per_s_without")]
    costs = {}
    step_cost = checked(entry.get("step_cost", {}), dict, file, f"{where}.step_cost", fix=fix)
    for key, ratio in step_cost.items():
        if not (isinstance(key, str) and key.isdigit() and 1 <= int(key) <= MAX_DEPTH):
            raise HeadsLoadError(f"{file}: {where}.step_cost has key {key!r:.40}, not a chain length 1..{MAX_DEPTH}; "
                                 f"{fix}")
        costs[int(key)] = checked(ratio, float, file, f"{where}.step_cost.{key}", *STEP_COST_RANGE, fix)
    return EngineRecord(engine, version, k, acceptance, speeds[0], speeds[1], costs)


# --------------------------------------------------------------------------------------------------------- choice


@dataclass(frozen=True)
class DraftChoice:
    """The draft length for one engine. k: the chain to serve with, None when no length is predicted to reach
    PAYS_AT (serve without a draft) or none can be predicted; speedup: the predicted speedup at k (at best_k when k is
    None; None when nothing could be predicted); source: "measured" (engines.json), "prior" (PRIORS), or "none" (no
    held-out acceptance and no measurement); curve: the predicted speedup of each candidate length; version: the
    measured engine's version."""

    engine: str
    k: int | None
    speedup: float | None
    source: str
    best_k: int | None
    curve: dict[int, float]
    version: str | None = None

    @property
    def pays(self) -> bool:
        return self.k is not None


def predicted_curve(metrics: dict, method: str, engine: str, heads_dir: str | Path | None,
                    candidates: Iterable[int]) -> tuple[dict[int, float], str, str | None]:
    """(the predicted speedup per candidate chain length, its source, the measured engine's version). A measured
    curve (engines.json records of `engine`) replaces the prior wholly where it covers a candidate: a record's own k
    gives its measured speedup (tokens/s with / without), a step_cost entry tau(k) / its cost; otherwise the prior
    gives tau(k) / PRIORS[engine].step_cost(method, k). Candidates without a held-out tau are left out."""
    if engine not in PRIORS:
        raise ValueError(f"unknown engine {engine!r}; one of {', '.join(PRIORS)}")
    candidates = list(candidates)
    records = [r for r in read_engines(heads_dir) if r.engine == engine]
    direct, costs = {}, {}
    for record in records:  # later records (newer measurements) win
        costs.update(record.step_cost)
        costs[record.k] = record.acceptance * record.tokens_per_s_without / record.tokens_per_s_with
        direct[record.k] = record.tokens_per_s_with / record.tokens_per_s_without
    measured = {}
    for k in candidates:
        tau = expected_acceptance(metrics, k)
        if k in direct:
            measured[k] = direct[k]
        elif k in costs and tau is not None:
            measured[k] = tau / costs[k]
    if measured:
        return measured, "measured", records[-1].version
    prior = PRIORS[engine]
    curve = {}
    for k in candidates:
        tau = expected_acceptance(metrics, k)
        if tau is not None:
            curve[k] = tau / prior.step_cost(method, k)
    return curve, ("prior" if curve else "none"), None


def choose_draft_length(metrics: dict, method: str, engine: str, heads_dir: str | Path | None = None,
                        candidates: Iterable[int] | None = None) -> DraftChoice:
    """The chain length with the highest predicted served speedup in `engine` among `candidates` (default: 1 to the
    evaluated depth, metrics.json's top1; DFlash callers pass [block_size - 1], Medusa 1..num_heads); k None when it is
    below PAYS_AT (serve without a draft) or when nothing could be predicted (source "none")."""
    if candidates is None:
        candidates = range(1, len(metrics.get("top1") or []) + 1)
    curve, source, version = predicted_curve(metrics, method, engine, heads_dir, candidates)
    if not curve:
        return DraftChoice(engine, None, None, "none", None, {}, version)
    best = max(curve, key=lambda k: (curve[k], -k))  # ties: the shorter chain
    k = best if curve[best] >= PAYS_AT else None
    return DraftChoice(engine, k, curve[best], source, best, curve, version)


def predict_at(metrics: dict, method: str, engine: str, heads_dir: str | Path | None, k: int) -> DraftChoice:
    """The predicted speedup of a chain of exactly k (a length the user chose): k is kept whatever it predicts."""
    curve, source, version = predicted_curve(metrics, method, engine, heads_dir, [k])
    return DraftChoice(engine, k, curve.get(k), source if curve else "none", k, curve, version)


# ---------------------------------------------------------------------------------------- what an export records


def served_record(choice: DraftChoice, chosen_by: str, fallback_k: int | None = None) -> dict:
    """export.json's `served_speed`: the engine, the chain length (`fallback_k` when nothing was predicted) and its
    predicted speedup, where the figure comes from, whether to serve without a draft (only when the export chose and
    nothing pays; a user's k is honoured), and a warning when a user's k is predicted to slow serving down."""
    k = choice.k if choice.k is not None else choice.best_k if choice.best_k is not None else fallback_k
    without = chosen_by == "export" and choice.source != "none" and choice.k is None
    warning = None
    if chosen_by == "user" and choice.speedup is not None and choice.speedup < 1.0:
        warning = (f"num_speculative_tokens {k} is predicted to slow {ENGINE_NAMES[choice.engine]} down "
                   f"({choice.speedup:.2f}x, {choice.source}); omit --num_speculative_tokens to let the export "
                   "choose, or serve without a draft")
    return {"engine": choice.engine, "k": k, "predicted_speedup": None if choice.speedup is None else
            round(choice.speedup, 4), "source": choice.source, "engine_version": choice.version,
            "serve_without_draft": without, "pays_at": PAYS_AT, "chosen_by": chosen_by,
            "curve": {str(n): round(x, 4) for n, x in sorted(choice.curve.items())}, "warning": warning}


def served_summary(record: dict) -> str:
    """One sentence on a `served_record`: the predicted speedup, or that nothing pays, or that nothing was predicted."""
    name = ENGINE_NAMES[record["engine"]]
    if record["source"] == "none":
        return (f"served speedup in {name} not predicted (no held-out acceptance in metrics.json, no measurement in "
                f"{ENGINES_FILE}): measure it before serving with the draft")
    figure = f"{record['predicted_speedup']:.2f}x ({record['source']})"
    if record["serve_without_draft"]:
        return (f"no draft length is predicted to pay in {name} (best: k={record['k']} at {figure}; a draft is "
                f"recommended from {record['pays_at']:.2f}x): serve the target without a draft")
    return f"predicted served speedup in {name} at k={record['k']}: {figure}"
