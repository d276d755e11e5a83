"""Benchmark: vanilla greedy vs HF prompt-lookup vs draft heads (Medusa, EAGLE), same prompts, interleaved, batch 1.

    python -m inference.bench --heads runs/medusa-smollm2/heads [DIR ...] --prompts chitchat:heldout \
        --num_prompts 20 --max_new_tokens 128 --output runs/bench [--device cpu|cuda] [--dtype float32|bfloat16] \
        [--tree auto|default|PATH|CHOICES] [--no_prompt_lookup] [--prompt_lookup_num_tokens 10] [--lookup off|on|both] \
        [--adaptive on|off|both] [--target NAME_OR_PATH] [--threads N]

Every heads directory must belong to the same target (checked by the weight fingerprint recorded in
its config.json); the target is loaded once and shared. Each prompt is the row's first user turn
(with the row's system message, if any) rendered with the target's chat template. For every prompt the
methods run one after another in a fixed order (vanilla, prompt-lookup, heads 1, heads 1 +lookup, heads 2, ...),
after one uncounted warm-up round on the first prompt. Heads rows draft adaptively (the Speculator's default,
inference/adapt.py): each step verifies a plain step, a heads tree, branches found in the context, or both merged,
whichever this generation's acceptance so far says pays most; "+lookup" rows may use the context, rows without it
are the heads alone (plain steps where they do not pay); "... fixed" rows (--adaptive both/off) verify the fixed
tree every step, a context chain of its node count instead when the context repeats. "prompt_lookup" is HF's
prompt-lookup decoding.
"exact" rows verify each tree node with a one-token step's attention (inference/forward.py), the option that
keeps half-precision greedy output plain greedy's.

Figures (defined here; the README's "Benchmark" section reports them):
  tau        tokens generated / target forwards after the one that reads the prompt (bonus token included;
             for vanilla 1 by definition; prompt-lookup: counted with a forward hook on the target)
  tokens/s   generated tokens / wall seconds including the prefill, summed over prompts (total / total),
             timed the same way around every method (torch.cuda.synchronize on both sides on GPU)
  speedup    tokens/s of the method / tokens/s of vanilla
  spread     per-prompt speedup (that prompt's tokens/s over vanilla's on the same prompt): min / median / mean /
             max; and a 95% interval of the overall speedup: the 2.5th and 97.5th percentiles (nearest rank) of the
             overall speedup over BOOTSTRAP_SAMPLES resamples of the prompts with replacement (seeded: reproducible)
  efficiency speedup / tau
  vs best    per category: a method's speedup over the best speedup among the other methods (vanilla's 1.0
             included)
  choices    adaptive rows: share of decode steps per plan kind (plain / heads / lookup / both)
  time split draft / verify / other seconds: heads from the Speculator's stats (verify = target forwards incl.
             the prefill, acceptance and cache compaction); prompt-lookup: verify = time inside the target's
             forward calls, its n-gram lookup sits in "other"; vanilla: all verify
  mismatch   for an output that differs from vanilla's, at its first differing token: each run's top-2 logit gap
             there and its margin for its own token over the other run's (both runs decoded again up to that
             token, after the timed rounds, keeping the logits); a near-tie when both margins are within
             NEAR_TIE_ULPS units in the last place of the dtype at the top logit

Writes OUTPUT/results.json, OUTPUT/results.md (the command line at the top) and OUTPUT/speedup.png.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import glob
import json
import math
import platform
import random
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from inference.forward import sync
from inference.tree import tree_choices

SCHEMA_VERSION = 1
WARMUP_TOKENS = 32  # the warm-up round decodes at most this many tokens per method
RESERVED_NAMES = ("vanilla", "prompt_lookup")
LOOKUP_SUFFIX = " +lookup"  # the heads with chains from the context drafted too
FIXED_SUFFIX = " fixed"  # the heads' fixed tree every step (--adaptive both: beside the adaptive rows)
BOOTSTRAP_SAMPLES = 2000  # resamples of the prompts for the speedup's 95% interval
BOOTSTRAP_SEED = 0
NEAR_TIE_ULPS = 4  # a mismatch is a near-tie when both runs' margins are within this many ulps of the top logit
EXACT_SUFFIX = " exact"  # the heads verifying each tree node with a one-token step's attention


class BenchError(ValueError):
    """Bad benchmark input; the message names the problem and the fix."""


# ---------------------------------------------------------------------------------------------
# Inputs: heads directories, their common target, the prompts


@dataclass
class HeadsEntry:
    path: Path  # the heads directory (config.json inside)
    label: str  # short unique name used in tables and the plot
    target: dict  # config.json's "target": name, fingerprint, dims
    adapter: bool  # Medusa-2: needs the target with its LoRA adapter merged


def _expand(patterns: Sequence[str]) -> list[str]:
    found: list[str] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        for m in matches:
            if m not in found:
                found.append(m)
    return found


def _unique_labels(paths: Sequence[Path]) -> list[str]:
    """Shortest path suffixes that tell the directories apart (runs/a/heads, runs/b/heads -> a/heads, b/heads)."""
    parts = [p.resolve().parts for p in paths]
    for n in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-n:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]


def find_heads(patterns: Sequence[str]) -> list[HeadsEntry]:
    """Resolve --heads arguments (dirs, globs, a training output_dir holding heads/, Hub ids) and read each config
    through heads.load (strict: a broken directory fails here, before the target loads)."""
    from heads.directory import CONFIG_NAME, HeadsLoadError, resolve_heads_dir
    from heads.load import load_heads

    names = _expand(patterns)
    if not names:
        raise BenchError(f"no heads directories found for --heads {' '.join(patterns)}: the pattern(s) matched "
                         "nothing. Pass the heads directory written by train/medusa.py (OUTPUT_DIR/heads)")
    dirs: list[Path] = []
    configs = []
    for name in names:
        path = Path(name).expanduser()
        if path.is_dir() and not (path / CONFIG_NAME).is_file() and (path / "heads" / CONFIG_NAME).is_file():
            path = path / "heads"  # the output_dir of train/medusa.py or train/eagle.py
        try:
            path = resolve_heads_dir(path if path.is_dir() else name)
            if path.resolve() not in [d.resolve() for d in dirs]:
                configs.append(load_heads(path).config)
                dirs.append(path)
        except HeadsLoadError as err:
            raise BenchError(str(err)) from err
    entries = []
    for path, label, config in zip(dirs, _unique_labels(dirs), configs):
        label = f"heads:{label}" if label in RESERVED_NAMES else label
        entries.append(HeadsEntry(path=path, label=label, target=dict(config.target or {}),
                                  adapter=getattr(config, "adapter", False)))
    return entries


def common_target(entries: Sequence[HeadsEntry], target_override: str | None) -> str:
    """The one target all heads were trained on (name to load); raise when they disagree."""
    keyed: dict[str, list[str]] = {}
    for e in entries:
        key = e.target.get("fingerprint") or f"name:{e.target.get('name')}"
        keyed.setdefault(key, []).append(f"{e.path} (target {e.target.get('name')!r})")
    if len(keyed) > 1:
        listing = "; ".join(f"fingerprint {k}: {', '.join(v)}" for k, v in keyed.items())
        raise BenchError(f"the heads directories were trained for different targets ({listing}). A benchmark "
                         "compares heads on one target: run it once per target")
    if any(e.adapter for e in entries) and len(entries) > 1:
        raise BenchError("Medusa-2 heads (with adapter/) each need their own adapter-merged target: benchmark "
                         f"them one directory at a time ({', '.join(str(e.path) for e in entries if e.adapter)})")
    name = target_override or entries[0].target.get("name")
    if not name:
        raise BenchError(f"{entries[0].path}/config.json names no target: pass --target NAME_OR_PATH")
    return name


# ---------------------------------------------------------------------------------------------
# Timing and forward counting


class ForwardMeter:
    """Counts the target's top-level forward calls (what HF `generate` makes) and the time spent in them.

    The Speculator calls `model.base_model` directly, so its forwards are not seen here (it counts its own).
    """

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.device = device
        self.calls = 0
        self.seconds = 0.0
        self.first_s = 0.0  # the first call: the one that reads the prompt
        self._t0 = 0.0
        self._handles = [model.register_forward_pre_hook(self._pre), model.register_forward_hook(self._post)]

    def _pre(self, module, args):
        sync(self.device)
        self._t0 = time.perf_counter()

    def _post(self, module, args, output):
        sync(self.device)
        dt = time.perf_counter() - self._t0
        self.seconds += dt
        if self.calls == 0:
            self.first_s = dt
        self.calls += 1

    def reset(self) -> None:
        self.calls, self.seconds, self.first_s = 0, 0.0, 0.0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


@contextlib.contextmanager
def plain_generation_config(model, stops: Sequence[int], pad_id: int | None):
    """Swap in a bare GenerationConfig so HF greedy is the target's plain argmax: transformers merges the model's
    own generation_config (repetition_penalty, no_repeat_ngram_size...) even into an explicitly passed one."""
    from transformers import GenerationConfig

    saved = model.generation_config
    model.generation_config = GenerationConfig(eos_token_id=list(stops) or None, pad_token_id=pad_id,
                                               bos_token_id=saved.bos_token_id)
    try:
        yield saved
    finally:
        model.generation_config = saved


def altered_generation_fields(config) -> dict:
    """Fields of the target's own generation_config that change greedy output (neutralised here, reported)."""
    checks = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0,
              "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None,
              "forced_bos_token_id": None, "forced_eos_token_id": None, "min_new_tokens": None, "min_length": 0,
              "sequence_bias": None}
    out = {}
    for name, neutral in checks.items():
        value = getattr(config, name, neutral)
        if value not in (neutral, None) and not (name == "min_length" and value == 0):
            out[name] = value
    return out


# ---------------------------------------------------------------------------------------------
# Methods


@dataclass
class Run:
    tokens: list[int]
    seconds: float  # wall, prefill included
    decode_forwards: int | None  # target forwards after the one that reads the prompt; None = not counted
    draft_s: float | None
    verify_s: float
    prefill_s: float  # the target forward that reads the prompt
    step_s: float  # target forwards after it (heads: tree forwards + acceptance + cache compaction)
    accept_hist: list[int] = field(default_factory=list)
    lookup_steps: int = 0  # heads: steps that verified a chain from the context (inference/lookup.py)
    proposals: dict[str, int] = field(default_factory=dict)  # adaptive heads: steps per plan kind (inference/adapt.py)
    mismatch: dict | None = None  # differs from vanilla: the near-tie analysis at the first difference (near_tie)


@dataclass
class Method:
    name: str
    kind: str  # vanilla | prompt_lookup | medusa | eagle | eagle3
    run: Callable[[list[int], int], Run]
    info: dict = field(default_factory=dict)  # heads dir, tree...
    trace: Callable[[list[int], int], tuple[list[int], torch.Tensor]] | None = None  # untimed rerun: tokens, logits


def hf_method(name: str, kind: str, model, meter: ForwardMeter, device: torch.device, pad_id: int | None,
              prompt_lookup_num_tokens: int | None) -> Method:
    extra = {"prompt_lookup_num_tokens": prompt_lookup_num_tokens} if prompt_lookup_num_tokens else {}

    @torch.no_grad()
    def run(ids: list[int], max_new_tokens: int) -> Run:
        input_ids = torch.tensor([ids], device=device)
        meter.reset()
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=pad_id, **extra)
        sync(device)
        seconds = time.perf_counter() - t0
        tokens = out[0, len(ids):].tolist()
        decode = max(meter.calls - 1, 0)
        forwards = dict(prefill_s=meter.first_s, step_s=meter.seconds - meter.first_s)
        if kind == "vanilla":
            return Run(tokens, seconds, decode, draft_s=0.0, verify_s=seconds, **forwards)
        return Run(tokens, seconds, decode, draft_s=None, verify_s=meter.seconds, **forwards)

    @torch.no_grad()
    def trace(ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
        input_ids = torch.tensor([ids], device=device)
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=pad_id, output_logits=True,
                             return_dict_in_generate=True, **extra)
        return out.sequences[0, len(ids):].tolist(), torch.cat(out.logits).float()  # [n, V]

    info = {"prompt_lookup_num_tokens": prompt_lookup_num_tokens} if prompt_lookup_num_tokens else {}
    return Method(name=name, kind=kind, run=run, trace=trace, info=info)


def heads_method(entry: HeadsEntry, spec, stops: Sequence[int], device: torch.device, lookup: bool,
                 exact: bool = False, adaptive: bool = True, suffix_fixed: bool = False) -> Method:
    """The heads alone, or (lookup) with chains from the context drafted too (inference/lookup.py); exact: each
    tree node verified with a one-token step's attention (inference/forward.py); adaptive: each step verifies
    what inference/adapt.py's policy chooses (off: the fixed tree; rows '... fixed' when both are run)."""
    def run(ids: list[int], max_new_tokens: int) -> Run:
        sync(device)
        t0 = time.perf_counter()
        out = spec.generate(ids, max_new_tokens, stop_token_ids=list(stops), lookup=lookup, exact=exact,
                            adaptive=adaptive)
        sync(device)
        seconds = time.perf_counter() - t0
        s = out.stats
        return Run(list(out.tokens), seconds, s.decode_forwards, draft_s=s.draft_s, verify_s=s.verify_s + s.prefill_s,
                   prefill_s=s.prefill_s, step_s=s.verify_s, accept_hist=list(s.accept_hist),
                   lookup_steps=s.lookup_steps, proposals=dict(s.proposals))

    def trace(ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
        out = spec.generate(ids, max_new_tokens, stop_token_ids=list(stops), lookup=lookup, exact=exact,
                            keep_logits=True, adaptive=adaptive)
        return list(out.tokens), torch.stack(out.logits)  # [n, V]

    name = (entry.label + (LOOKUP_SUFFIX if lookup else "") + (EXACT_SUFFIX if exact else "")
            + (FIXED_SUFFIX if suffix_fixed and not adaptive else ""))
    info = {"heads_dir": str(entry.path), "lookup": lookup, "exact": exact, "adaptive": adaptive,
            "draft_vocab_size": spec.heads.config.draft_vocab_size}
    if spec.is_eagle:
        dyn = spec.dynamic
        info.update({"method": spec.heads.config.method,
                     "tree": {"dynamic": True, "size": dyn.total_tokens, "depth": dyn.depth, "topk": dyn.topk}})
        return Method(name=name, kind=spec.heads.config.method, run=run, trace=trace, info=info)
    tree = spec.tree
    choices = tree_choices(tree)
    info.update({"num_heads": spec.heads.config.num_heads,
                 "tree": {"size": tree.size, "depth": tree.max_depth, "choices": choices}})
    return Method(name=name, kind="medusa", run=run, trace=trace, info=info)


# ---------------------------------------------------------------------------------------------
# Mismatches: the near-tie analysis


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first differing token (the shorter length when one output is a prefix of the other)."""
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _ulp(x: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype` numbers at magnitude |x|."""
    return float(torch.finfo(dtype).eps) * 2.0 ** math.floor(math.log2(max(abs(x), float(torch.finfo(dtype).tiny))))


def _side(logits: torch.Tensor, own: int, other: int, dtype: torch.dtype) -> dict:
    """One run's logits row [V] at the first difference: its top-2 gap, its margin for its own token over the other
    run's, the other token's rank here (0 = top), and that margin in ulps of `dtype` at the top logit."""
    top2 = logits.topk(2).values
    margin = float(logits[own] - logits[other])
    return {"gap": float(top2[0] - top2[1]), "margin": margin, "other_rank": int((logits > logits[other]).sum()),
            "margin_ulps": margin / _ulp(float(top2[0]), dtype)}


def near_tie(vanilla: Method, method: Method, ids: list[int], vanilla_tokens: list[int], method_tokens: list[int],
             dtype: torch.dtype) -> dict:
    """Decode both again up to the first differing token (keeping the logits) and compare them there."""
    at = first_difference(vanilla_tokens, method_tokens)
    out = {"at": at, "vanilla_token": None, "method_token": None, "vanilla": None, "method": None,
           "near_tie": None, "reproduced": None}
    if at >= min(len(vanilla_tokens), len(method_tokens)):  # one output stops earlier: no differing token
        return out
    v_tok, m_tok = vanilla_tokens[at], method_tokens[at]
    v_seen, v_logits = vanilla.trace(ids, at + 1)
    m_seen, m_logits = method.trace(ids, at + 1)
    out.update(vanilla_token=v_tok, method_token=m_tok, vanilla=_side(v_logits[at], v_tok, m_tok, dtype),
               method=_side(m_logits[at], m_tok, v_tok, dtype),
               reproduced=v_seen == vanilla_tokens[:at + 1] and m_seen == method_tokens[:at + 1])
    out["near_tie"] = max(out["vanilla"]["margin_ulps"], out["method"]["margin_ulps"]) <= NEAR_TIE_ULPS
    return out


# ---------------------------------------------------------------------------------------------
# Aggregation


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _tps(runs: Sequence[Run]) -> float | None:
    """Tokens/s over runs: total tokens / total seconds."""
    return _ratio(sum(len(r.tokens) for r in runs), sum(r.seconds for r in runs))


def speedup_spread(runs: Sequence[Run], vanilla_runs: Sequence[Run], samples: int = BOOTSTRAP_SAMPLES,
                   seed: int = BOOTSTRAP_SEED) -> dict:
    """Per-prompt speedups and their min / median / mean / max; the overall speedup's 95% bootstrap interval."""
    per_prompt = [_ratio(_tps([r]), _tps([v])) for r, v in zip(runs, vanilla_runs)]
    known = [x for x in per_prompt if x is not None]
    rng = random.Random(seed)
    n = len(runs)
    boot = sorted(x for x in (_ratio(_tps([runs[i] for i in pick]), _tps([vanilla_runs[i] for i in pick]))
                              for pick in (rng.choices(range(n), k=n) for _ in range(samples))) if x is not None)
    ci95 = [boot[max(math.ceil(q * len(boot)) - 1, 0)] for q in (0.025, 0.975)] if boot else None
    figures = {"min": min, "median": statistics.median, "mean": statistics.mean, "max": max}
    return {"per_prompt": per_prompt, **{k: f(known) if known else None for k, f in figures.items()},
            "ci95": ci95, "bootstrap_samples": samples, "seed": seed}


def _step_ms(runs: Sequence[Run]) -> float | None:
    """Mean ms per target forward after the prefill (heads: tree forward + acceptance + compaction)."""
    if any(r.decode_forwards is None for r in runs):
        return None
    return _ratio(1000.0 * sum(r.step_s for r in runs), sum(r.decode_forwards for r in runs))


def summarise(method: Method, runs: Sequence[Run], vanilla_runs: Sequence[Run], ids: Sequence[str]) -> dict:
    """Every figure for one method over `runs` (one per prompt, same order as vanilla_runs and ids)."""
    tokens = sum(len(r.tokens) for r in runs)
    seconds = sum(r.seconds for r in runs)
    tps = _ratio(tokens, seconds)
    if method.kind == "vanilla":
        forwards, tau = sum(r.decode_forwards or 0 for r in runs), 1.0
    elif any(r.decode_forwards is None for r in runs):
        forwards, tau = None, None
    else:
        forwards = sum(r.decode_forwards for r in runs)
        tau = _ratio(tokens - sum(1 for r in runs if r.tokens), forwards)  # the prefill's token is not a decode token
    speedup = _ratio(tps, _tps(vanilla_runs))
    draft = None if any(r.draft_s is None for r in runs) else sum(r.draft_s for r in runs)
    verify = sum(r.verify_s for r in runs)
    other = max(seconds - verify - (draft or 0.0), 0.0)
    mismatches = [{"id": prompt_id, "first_mismatch": first_difference(r.tokens, v.tokens), "near_tie": r.mismatch}
                  for prompt_id, r, v in zip(ids, runs, vanilla_runs) if r.tokens != v.tokens]
    # cost model: speedup ~ tau * t_step(1) / (t_verify(tree) + t_draft), per decode step
    step_ms, vanilla_step_ms = _step_ms(runs), _step_ms(vanilla_runs)
    draft_ms = None if draft is None or not forwards else 1000.0 * draft / forwards
    predicted = None
    if method.kind == "vanilla":
        predicted = 1.0
    elif tau is not None and step_ms and vanilla_step_ms and draft_ms is not None:
        predicted = tau * vanilla_step_ms / (step_ms + draft_ms)
    hist: list[int] = []
    for r in runs:
        for a, count in enumerate(r.accept_hist):
            hist.extend([0] * (a + 1 - len(hist)))
            hist[a] += count
    return {
        "kind": method.kind, **method.info,
        "prompts": len(runs), "new_tokens": tokens, "seconds": seconds, "tokens_per_s": tps,
        "decode_forwards": forwards, "tau": tau, "speedup": speedup, "efficiency": _ratio(speedup, tau),
        "speedup_spread": speedup_spread(runs, vanilla_runs),
        "time_split": {"draft_s": draft, "verify_s": verify, "other_s": other,
                       "draft_frac": _ratio(draft, seconds), "verify_frac": _ratio(verify, seconds),
                       "other_frac": _ratio(other, seconds)},
        "cost_model": {"prefill_ms": 1000.0 * sum(r.prefill_s for r in runs) / len(runs), "step_ms": step_ms,
                       "draft_ms": draft_ms, "vanilla_step_ms": vanilla_step_ms, "predicted_speedup": predicted},
        "identical": len(runs) - len(mismatches), "identical_of": len(runs), "all_identical": not mismatches,
        "mismatches": mismatches, "near_ties": sum(1 for m in mismatches if (m["near_tie"] or {}).get("near_tie")),
        "accept_hist": hist if method.kind not in ("vanilla", "prompt_lookup") else None,
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
        out[name] = _ratio(s["speedup"], max(others)) if others else None
    return out


def summarise_all(methods: Sequence[Method], runs: dict[str, list[Run]], ids: Sequence[str],
                  index: Sequence[int] | None = None) -> dict:
    """{method name: figures}, over all prompts or the prompts at `index` (a category)."""
    index = range(len(ids)) if index is None else index
    vanilla = [runs[methods[0].name][i] for i in index]
    return {m.name: summarise(m, [runs[m.name][i] for i in index], vanilla, [ids[i] for i in index]) for m in methods}


# ---------------------------------------------------------------------------------------------
# Reports: markdown table, plot


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
    lines = [f"Command: `{st['command']}`", "",
             f"Target `{st['target']['name']}` (fingerprint {st['target']['fingerprint']}), {st['device']} "
             f"{st['dtype']} (torch threads: {st['torch_threads']}), prompts `{st['prompts']}` x "
             f"{st['num_prompts_used']}, max_new_tokens "
             f"{st['max_new_tokens']}, batch 1, interleaved, torch {st['torch']}, transformers {st['transformers']}, "
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


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["methods"])
    speedup = [results["methods"][n]["speedup"] or 0.0 for n in names]
    tau = [results["methods"][n]["tau"] for n in names]
    x = range(len(names))
    width = 0.38
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(names) + 2), 4))
    spreads = [results["methods"][n]["speedup_spread"] for n in names]
    ci = [p["ci95"] or [s, s] for p, s in zip(spreads, speedup)]
    errors = [[max(s - lo, 0.0) for s, (lo, _) in zip(speedup, ci)],
              [max(hi - s, 0.0) for s, (_, hi) in zip(speedup, ci)]]
    bars_s = ax.bar([i - width / 2 for i in x], speedup, width, yerr=errors, capsize=3,
                    label="speedup vs vanilla (tokens/s), 95% CI")
    for i, p in zip(x, spreads):
        points = [v for v in p["per_prompt"] if v is not None]
        offsets = [width * (0.6 * (j + 0.5) / len(points) - 0.3) for j in range(len(points))]
        ax.scatter([i - width / 2 + o for o in offsets], points, s=6, color="black", zorder=3,
                   label="per-prompt speedup" if i == 0 else None)
    bars_t = ax.bar([i + width / 2 for i in x], [t or 0.0 for t in tau], width, label="tau (tokens / target forward)")
    for bar, value, (_, hi), p in zip(bars_s, speedup, ci, spreads):  # the label above the interval and the points
        top = max([value, hi] + [v for v in p["per_prompt"] if v is not None])
        ax.annotate(f"{value:.2f}x", (bar.get_x() + bar.get_width() / 2, top), ha="center", va="bottom", fontsize=8)
    for bar, value in zip(bars_t, tau):
        ax.annotate("n/a" if value is None else f"{value:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xticks(list(x), names, rotation=15, ha="right")
    st = results["settings"]
    ax.set_title(f"{Path(st['target']['name']).name}, {st['device']} {st['dtype']}, {st['num_prompts_used']} prompts "
                 f"x {st['max_new_tokens']} tokens", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# The benchmark


def _device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda but torch sees no CUDA device (CPU-only torch build or no GPU): "
                         "use --device cpu")
    return device


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m inference.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", nargs="+", required=True, help="heads directories (globs ok) or Hub ids")
    parser.add_argument("--prompts", required=True, help="prompt source spec (see heads/prompts.py)")
    parser.add_argument("--num_prompts", type=int, default=20)
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--output", required=True, help="directory for results.json, results.md, speedup.png")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--tree", default=None, help="auto | default | PATH | CHOICES as JSON, e.g. '[[0], [0, 0]]' "
                                                      "(default: each heads dir's tree.json, "
                                                      "else the default tree); auto times trees on this device "
                                                      "and writes tree.json into each heads dir")
    parser.add_argument("--no_prompt_lookup", action="store_true", help="skip HF prompt-lookup decoding")
    parser.add_argument("--prompt_lookup_num_tokens", type=int, default=10)
    parser.add_argument("--lookup", choices=["off", "on", "both"], default="both",
                        help="heads alone (off), heads + chains drafted from the context (on, the Speculator's "
                             "default; rows named '... +lookup'), or both rows (default)")
    parser.add_argument("--adaptive", choices=["off", "on", "both"], default="on",
                        help="each step verifies what the heads' and lookup's acceptance so far says pays most "
                             "(on, the Speculator's default; inference/adapt.py), the fixed tree (off), or both "
                             "(fixed rows named '... fixed')")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own choice); "
                        "on a busy shared CPU 1 thread is much steadier (oversubscribed OpenMP threads spin)")
    parser.add_argument("--target", default=None, help="load this target instead of the one the heads name "
                                                        "(it must have the same fingerprint)")
    parser.add_argument("--exact", choices=["off", "on", "both"], default="off",
                        help="verify each tree node with a one-token step's attention (rows '... exact'): half-"
                             "precision greedy output stays plain greedy's (inference/forward.py); on = only those "
                             "rows, both = with and without")
    return parser.parse_args(argv)


def run_bench(args: argparse.Namespace, command: str) -> dict:
    import transformers
    from tqdm import tqdm

    from heads.chat import prompt_ids, stop_token_ids
    from heads.prompts import PromptSourceError, load_prompts
    from heads.target import TargetLoadError, load_target
    from inference.cpu_linear import linear_kernel
    from inference.decode import SpeculatorError, check_context
    from inference.forward import rows_invariant
    from inference.speculator import Speculator

    if args.num_prompts < 1:
        raise BenchError(f"--num_prompts must be at least 1, got {args.num_prompts}")
    if args.max_new_tokens < 1:
        raise BenchError(f"--max_new_tokens must be at least 1, got {args.max_new_tokens}")
    if not args.no_prompt_lookup and args.prompt_lookup_num_tokens < 1:
        raise BenchError("--prompt_lookup_num_tokens must be at least 1 (or pass --no_prompt_lookup)")
    if args.threads is not None:
        if args.threads < 1:
            raise BenchError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    device = _device(args.device)
    entries = find_heads(args.heads)
    target_name = common_target(entries, args.target)
    try:
        source = load_prompts(args.prompts, limit=args.num_prompts)
    except PromptSourceError as err:
        raise BenchError(str(err)) from err
    if not source.rows:
        raise BenchError(f"prompt source {args.prompts!r} gave no usable rows (skipped: {dict(source.skipped)})")

    # The target, once; every Speculator shares it (each checks the fingerprint its heads recorded).
    try:
        model, tokenizer, info = load_target(target_name, args.dtype, device)
        specs = [Speculator.from_pretrained(e.path, target=(model, tokenizer, info), tree=args.tree, dtype=args.dtype,
                                            device=device) for e in entries]
    except (TargetLoadError, SpeculatorError) as err:
        raise BenchError(str(err)) from err
    if entries[0].adapter:  # Medusa-2 (one dir only): the Speculator holds the adapter-merged copy of the target;
        model = specs[0].model  # vanilla and prompt-lookup run on that copy, the model the heads are lossless for
    stops = stop_token_ids(tokenizer, model.generation_config)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stops[0] if stops else None)

    prompts, skipped = [], []
    for row in source.rows:
        ids = prompt_ids(tokenizer, row.turns[0], row.system)
        try:
            check_context(model, len(ids), args.max_new_tokens)
        except SpeculatorError as err:
            skipped.append({"id": row.id, "reason": str(err)})
            continue
        prompts.append((row, ids))
    if not prompts:
        raise BenchError(f"every prompt was skipped: {skipped[0]['reason']}")
    if len(source.rows) < args.num_prompts:
        print(f"note: {args.prompts!r} has only {len(source.rows)} usable rows (asked for {args.num_prompts})",
              file=sys.stderr)

    meter = ForwardMeter(model, device)
    altered = altered_generation_fields(model.generation_config)
    methods = [hf_method("vanilla", "vanilla", model, meter, device, pad_id, None)]
    if not args.no_prompt_lookup:
        methods.append(hf_method("prompt_lookup", "prompt_lookup", model, meter, device, pad_id,
                                 args.prompt_lookup_num_tokens))
    lookups = {"off": [False], "on": [True], "both": [False, True]}[args.lookup]
    exacts = {"off": [False], "on": [True], "both": [False, True]}[args.exact]
    adaptives = {"off": [False], "on": [True], "both": [True, False]}[args.adaptive]
    methods += [heads_method(e, s, stops, device, lookup, exact, adaptive, args.adaptive == "both")
                for e, s in zip(entries, specs) for lookup in lookups for exact in exacts for adaptive in adaptives]
    runs: dict[str, list[Run]] = {m.name: [] for m in methods}
    try:
        with plain_generation_config(model, stops, pad_id), torch.no_grad():
            warm_ids = prompts[0][1]
            for m in methods:  # warm-up round, not counted
                m.run(warm_ids, min(args.max_new_tokens, WARMUP_TOKENS))
            bar = tqdm(prompts, desc="bench", unit="prompt", file=sys.stderr)
            for _, input_ids in bar:
                for m in methods:
                    runs[m.name].append(m.run(input_ids, args.max_new_tokens))
                speedups = {m.name: _ratio(_tps(runs[m.name]), _tps(runs["vanilla"])) for m in methods[1:]}
                bar.set_postfix({name: f"{x or 0:.2f}x" for name, x in speedups.items()})
            for m in methods[1:]:  # after the timed rounds: each output that differs from vanilla's, decoded again
                for (_, input_ids), r, v in zip(prompts, runs[m.name], runs["vanilla"]):
                    if r.tokens != v.tokens:
                        r.mismatch = near_tie(methods[0], m, input_ids, v.tokens, r.tokens, model.dtype)
    finally:
        meter.remove()

    rows = [row for row, _ in prompts]
    row_ids = [row.id for row in rows]
    categories: dict[str, dict] = {}
    if any(r.category for r in rows):
        by_cat: dict[str, list[int]] = {}
        for i, r in enumerate(rows):
            by_cat.setdefault(r.category or "uncategorized", []).append(i)
        categories = {cat: summarise_all(methods, runs, row_ids, index) for cat, index in by_cat.items()}
    settings = {
        "schema_version": SCHEMA_VERSION, "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
        "torch_threads": torch.get_num_threads(), "dtype": args.dtype, "linear": linear_kernel(model),
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "target": info.to_dict() if hasattr(info, "to_dict") else dict(info),
        "adapter_merged": str(entries[0].path) if entries[0].adapter else None,
        "prompts": args.prompts, "num_prompts": args.num_prompts, "num_prompts_used": len(prompts),
        "skipped_prompts": skipped, "max_new_tokens": args.max_new_tokens,
        "tree": args.tree or "heads' tree.json, else default",
        "prompt_lookup_num_tokens": None if args.no_prompt_lookup else args.prompt_lookup_num_tokens,
        "heads_lookup": args.lookup, "adaptive": args.adaptive,
        "exact": args.exact,
        "rows_invariant": rows_invariant(model, max(s.tree_size for s in specs)) if args.exact != "off" else None,
        "stop_token_ids": list(stops), "batch_size": 1, "warmup_rounds": 1, "order": [m.name for m in methods],
        "neutralised_generation_config": altered,
    }
    per_prompt = [{"id": row.id, "category": row.category, "prompt_tokens": len(input_ids),
                   "runs": {m.name: {"new_tokens": len(runs[m.name][i].tokens), "seconds": runs[m.name][i].seconds,
                                     "decode_forwards": runs[m.name][i].decode_forwards,
                                     "identical": runs[m.name][i].tokens == runs["vanilla"][i].tokens,
                                     "near_tie": runs[m.name][i].mismatch}
                            for m in methods}}
                  for i, (row, input_ids) in enumerate(prompts)]
    return {"settings": settings, "methods": summarise_all(methods, runs, row_ids), "categories": categories,
            "prompts": per_prompt}


def write_reports(results: dict, output: Path) -> str:
    output.mkdir(parents=True, exist_ok=True)
    (output / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    table = markdown(results)
    (output / "results.md").write_text(table)
    plot(results, output / "speedup.png")
    return table


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    command = "python -m inference.bench " + shlex.join(argv)
    try:
        results = run_bench(args, command)
    except BenchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    table = write_reports(results, Path(args.output))
    print(table)
    print(f"wrote {Path(args.output) / 'results.json'}, results.md, speedup.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
