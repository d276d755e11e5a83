"""The benchmark's figures per method (inference/bench/run.py's docstring defines them): tau, tokens/s, speedup over
vanilla with its spread over prompts and a bootstrap interval, the time split, the per-step cost model, identity
with vanilla's output, acceptance and adaptive-plan counts."""

from __future__ import annotations

import math
import random
import statistics
from typing import Sequence

from headstart.inference.bench.methods import Method, Run
from headstart.inference.bench.near_tie import first_difference

BOOTSTRAP_SAMPLES = 2000  # resamples of the prompts for the speedup's 95% interval
BOOTSTRAP_SEED = 0


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b; None when either is unknown or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def tokens_per_s(runs: Sequence[Run]) -> float | None:
    """Tokens/s over runs: total tokens / total seconds."""
    return ratio(sum(len(r.tokens) for r in runs), sum(r.seconds for r in runs))


def speedup_spread(runs: Sequence[Run], vanilla_runs: Sequence[Run], samples: int = BOOTSTRAP_SAMPLES,
                   seed: int = BOOTSTRAP_SEED) -> dict:
    """Per-prompt speedups and their min / median / mean / max; the overall speedup's 95% bootstrap interval."""
    per_prompt = [ratio(tokens_per_s([r]), tokens_per_s([v])) for r, v in zip(runs, vanilla_runs)]
    known = [x for x in per_prompt if x is not None]
    rng = random.Random(seed)
    n = len(runs)
    boot = sorted(x for x in (ratio(tokens_per_s([runs[i] for i in pick]), tokens_per_s([vanilla_runs[i] for i in pick]))
                              for pick in (rng.choices(range(n), k=n) for _ in range(samples))) if x is not None)
    ci95 = [boot[max(math.ceil(q * len(boot)) - 1, 0)] for q in (0.025, 0.975)] if boot else None
    figures = {"min": min, "median": statistics.median, "mean": statistics.mean, "max": max}
    return {"per_prompt": per_prompt, **{k: f(known) if known else None for k, f in figures.items()},
            "ci95": ci95, "bootstrap_samples": samples, "seed": seed}


def _step_ms(runs: Sequence[Run]) -> float | None:
    """Mean ms per target forward after the prefill (heads: tree forward + acceptance + compaction)."""
    if any(r.decode_forwards is None for r in runs):
        return None
    return ratio(1000.0 * sum(r.step_s for r in runs), sum(r.decode_forwards for r in runs))


def cost_model(method: Method, runs: Sequence[Run], vanilla_runs: Sequence[Run], tau: float | None,
               forwards: int | None, draft_s: float | None) -> dict:
    """Per decode step: speedup ~ tau * t_step(1) / (t_verify(tree) + t_draft), vanilla's step for t_step(1)."""
    step_ms, vanilla_step_ms = _step_ms(runs), _step_ms(vanilla_runs)
    draft_ms = None if draft_s is None or not forwards else 1000.0 * draft_s / forwards
    predicted = None
    if method.kind == "vanilla":
        predicted = 1.0
    elif tau is not None and step_ms and vanilla_step_ms and draft_ms is not None:
        predicted = tau * vanilla_step_ms / (step_ms + draft_ms)
    return {"prefill_ms": 1000.0 * sum(r.prefill_s for r in runs) / len(runs), "step_ms": step_ms,
            "draft_ms": draft_ms, "vanilla_step_ms": vanilla_step_ms, "predicted_speedup": predicted}


def _accept_histogram(runs: Sequence[Run]) -> list[int]:
    """Decode steps by tokens accepted, summed over the runs (index = accepted length)."""
    hist: list[int] = []
    for r in runs:
        for accepted, count in enumerate(r.accept_hist):
            hist.extend([0] * (accepted + 1 - len(hist)))
            hist[accepted] += count
    return hist


def summarise(method: Method, runs: Sequence[Run], vanilla_runs: Sequence[Run], ids: Sequence[str]) -> dict:
    """Every figure for one method over `runs` (one per prompt, same order as vanilla_runs and ids)."""
    tokens = sum(len(r.tokens) for r in runs)
    seconds = sum(r.seconds for r in runs)
    tps = ratio(tokens, seconds)
    if method.kind == "vanilla":
        forwards, tau = sum(r.decode_forwards or 0 for r in runs), 1.0
    elif any(r.decode_forwards is None for r in runs):
        forwards, tau = None, None
    else:
        forwards = sum(r.decode_forwards for r in runs)
        tau = ratio(tokens - sum(1 for r in runs if r.tokens), forwards)  # the prefill's token is not a decode token
    speedup = ratio(tps, tokens_per_s(vanilla_runs))
    draft = None if any(r.draft_s is None for r in runs) else sum(r.draft_s for r in runs)
    verify = sum(r.verify_s for r in runs)
    other = max(seconds - verify - (draft or 0.0), 0.0)
    mismatches = [{"id": prompt_id, "first_mismatch": first_difference(r.tokens, v.tokens), "near_tie": r.mismatch}
                  for prompt_id, r, v in zip(ids, runs, vanilla_runs) if r.tokens != v.tokens]
    return {
        "kind": method.kind, **method.info,
        "prompts": len(runs), "new_tokens": tokens, "seconds": seconds, "tokens_per_s": tps,
        "decode_forwards": forwards, "tau": tau, "speedup": speedup, "efficiency": ratio(speedup, tau),
        "speedup_spread": speedup_spread(runs, vanilla_runs),
        "time_split": {"draft_s": draft, "verify_s": verify, "other_s": other,
                       "draft_frac": ratio(draft, seconds), "verify_frac": ratio(verify, seconds),
                       "other_frac": ratio(other, seconds)},
        "cost_model": cost_model(method, runs, vanilla_runs, tau, forwards, draft),
        "identical": len(runs) - len(mismatches), "identical_of": len(runs), "all_identical": not mismatches,
        "mismatches": mismatches, "near_ties": sum(1 for m in mismatches if (m["near_tie"] or {}).get("near_tie")),
        "accept_hist": _accept_histogram(runs) if method.kind not in ("vanilla", "prompt_lookup") else None,
        "lookup_steps": sum(r.lookup_steps for r in runs) if method.info.get("lookup") else None,
        "proposals": _shares(runs) if method.info.get("adaptive") else None,
    }


def _shares(runs: Sequence[Run]) -> dict[str, float]:
    """Share of decode steps per adaptive plan kind (plain / heads / lookup / both) over the runs."""
    steps: dict[str, int] = {}
    for r in runs:
        for kind, count in r.proposals.items():
            steps[kind] = steps.get(kind, 0) + count
    total = sum(steps.values())
    return {kind: steps[kind] / total for kind in sorted(steps)} if total else {}


def versus_best_other(by_method: dict) -> dict[str, float | None]:
    """Each method's speedup over the best speedup among the other methods (vanilla included: 1.0)."""
    out: dict[str, float | None] = {}
    for name, s in by_method.items():
        others = [o["speedup"] for other, o in by_method.items() if other != name and o["speedup"] is not None]
        out[name] = ratio(s["speedup"], max(others)) if others else None
    return out


def summarise_all(methods: Sequence[Method], runs: dict[str, list[Run]], ids: Sequence[str],
                  index: Sequence[int] | None = None) -> dict:
    """{method name: figures}, over all prompts or the prompts at `index` (a category)."""
    index = range(len(ids)) if index is None else index
    vanilla = [runs[methods[0].name][i] for i in index]
    return {m.name: summarise(m, [runs[m.name][i] for i in index], vanilla, [ids[i] for i in index]) for m in methods}
