"""The benchmark's markdown report (OUTPUT/results.md) from its results dict (inference/bench/run.py)."""

from __future__ import annotations

import statistics

from headstart.inference.bench.near_tie import NEAR_TIE_ULPS
from headstart.inference.bench.summary import versus_best_other


def _fmt(x: float | None, digits: int = 2, suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:.{digits}f}{suffix}"


def _split(s: dict) -> str:
    t = s["time_split"]
    parts = [_fmt(None if t[k] is None else 100 * t[k], 0, "%") for k in ("draft_frac", "verify_frac", "other_frac")]
    return " / ".join(parts)


def _ci(s: dict) -> str:
    ci = s["speedup_spread"]["ci95"]
    return "n/a" if ci is None else f"{ci[0]:.2f}-{ci[1]:.2f}x"


def mismatch_table(results: dict) -> list[str]:
    """Markdown lines: per method with mismatches, where the outputs first differ and how close the target's two
    candidates were there, in each run (none when every output is identical)."""
    rows = [(name, s) for name, s in results["methods"].items() if s["mismatches"]]
    if not rows:
        return []
    lines = ["", f"Mismatches at the first differing token: each run's top-2 logit gap there (median / max) and its "
             f"margin for its own token over the other's; a near-tie when both margins are within {NEAR_TIE_ULPS} ulps "
             "of the top logit", "",
             "| method | differ | first difference at (min / median / max) | near-ties | vanilla gap | method gap | "
             "margin vanilla / method (median) | other token top-2 in both |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in rows:
        found = [m["near_tie"] for m in s["mismatches"] if (m["near_tie"] or {}).get("vanilla")]
        at = [m["first_mismatch"] for m in s["mismatches"]]

        def med_max(side: str, key: str) -> str:
            values = [f[side][key] for f in found]
            return f"{_fmt(statistics.median(values), 3)} / {_fmt(max(values), 3)}" if values else "n/a"

        margins = " / ".join(_fmt(statistics.median([f[side]["margin"] for f in found]), 3) if found else "n/a"
                             for side in ("vanilla", "method"))
        second = sum(1 for f in found if f["vanilla"]["other_rank"] <= 1 and f["method"]["other_rank"] <= 1)
        lines.append(f"| {name} | {len(at)}/{s['identical_of']} | {min(at)} / {statistics.median(at):g} / {max(at)} | "
                     f"{s['near_ties']}/{len(at)} | {med_max('vanilla', 'gap')} | {med_max('method', 'gap')} | "
                     f"{margins} | {second}/{len(found)} |")
    return lines


def markdown(results: dict) -> str:
    st = results["settings"]
    rounds = st.get("timed_rounds", 1)
    timing = "interleaved" if rounds == 1 else f"interleaved, fastest of {rounds} rounds"
    lines = [f"Command: `{st['command']}`", "",
             f"Target `{st['target']['name']}` (fingerprint {st['target']['fingerprint']}), {st['device']} "
             f"{st['dtype']} (torch threads: {st['torch_threads']}), prompts `{st['prompts']}` x "
             f"{st['num_prompts_used']}, max_new_tokens "
             f"{st['max_new_tokens']}, batch 1, {timing}, torch {st['torch']}, transformers {st['transformers']}, "
             f"{st['date']}", "",
             "| method | tau | tokens/s | speedup | efficiency | draft / verify / other | identical to vanilla "
             "| tree |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in results["methods"].items():
        tree = (s.get("tree") or {}).get("size")
        lines.append(f"| {name} | {_fmt(s['tau'])} | {_fmt(s['tokens_per_s'], 1)} | {_fmt(s['speedup'], 2, 'x')} | "
                     f"{_fmt(s['efficiency'])} | {_split(s)} | {s['identical']}/{s['identical_of']} | "
                     f"{tree if tree else '-'} |")
    lines += ["", "Cost model per decode step: predicted speedup = tau x vanilla step / (step + draft)", "",
              "| method | prefill ms | step ms | draft ms | predicted speedup | measured speedup |",
              "|---|---:|---:|---:|---:|---:|"]
    for name, s in results["methods"].items():
        c = s["cost_model"]
        lines.append(f"| {name} | {_fmt(c['prefill_ms'], 1)} | {_fmt(c['step_ms'], 1)} | {_fmt(c['draft_ms'], 1)} | "
                     f"{_fmt(c['predicted_speedup'], 2, 'x')} | {_fmt(s['speedup'], 2, 'x')} |")
    spread = results["methods"]["vanilla"]["speedup_spread"]
    lines += ["", f"Speedup spread over prompts: per-prompt speedup = that prompt's tokens/s over vanilla's on it; "
              f"95% CI = percentile bootstrap of the overall speedup ({spread['bootstrap_samples']} resamples of the "
              f"prompts, seed {spread['seed']})", "",
              "| method | speedup | 95% CI | per-prompt min | median | mean | max |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for name, s in results["methods"].items():
        p = s["speedup_spread"]
        lines.append(f"| {name} | {_fmt(s['speedup'], 2, 'x')} | {_ci(s)} | "
                     + " | ".join(_fmt(p[k], 2, "x") for k in ("min", "median", "mean", "max")) + " |")
    cats = results["categories"]
    if len(cats) > 1:
        names = list(results["methods"])
        lines += ["", "Per category: speedup [95% CI] (tau)", "",
                  "| category | prompts | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
        for cat, by_method in cats.items():
            cells = [f"{_fmt(by_method[n]['speedup'], 2, 'x')} [{_ci(by_method[n])}] ({_fmt(by_method[n]['tau'])})"
                     for n in names]
            lines.append(f"| {cat} | {by_method[names[0]]['prompts']} | " + " | ".join(cells) + " |")
        lines += ["", "Per category: each method's speedup over the best of the other methods' (vanilla's 1.00x "
                  "included)", "", "| category | " + " | ".join(names[1:]) + " |", "|---|" + "---:|" * len(names[1:])]
        for cat, by_method in list(cats.items()) + [("all", results["methods"])]:
            best = versus_best_other(by_method)
            lines.append(f"| {cat} | " + " | ".join(_fmt(best[n], 2, "x") for n in names[1:]) + " |")
    shares = [(name, s["proposals"]) for name, s in results["methods"].items() if s.get("proposals")]
    if shares:
        lines += ["", "Adaptive drafting: share of decode steps per choice (inference/adapt.py)", "",
                  "| method | plain | heads | lookup | both |", "|---|---:|---:|---:|---:|"]
        for name, share in shares:
            lines.append(f"| {name} | " + " | ".join(_fmt(100 * share.get(k, 0.0), 0, "%")
                                                     for k in ("plain", "heads", "lookup", "both")) + " |")
    lines += mismatch_table(results)
    if st["dtype"] != "float32":
        lines += ["", f"In {st['dtype']}, tree verification rounds differently from one-token steps, so some outputs may "
                  "differ from vanilla's on long generations: the identical column measures how often at this dtype "
                  "(exactness is gated in float32; '... exact' rows verify each node as a one-token step does)."]
    lines += ["", "tau = tokens / target forwards after the prefill (bonus included; vanilla 1 by definition); "
              "speedup = tokens/s over vanilla's (total tokens / total seconds, prefill included); "
              "efficiency = speedup / tau."]
    return "\n".join(lines) + "\n"
