"""Benchmark: vanilla greedy vs HF prompt-lookup vs draft heads (Medusa, EAGLE, DFlash), same prompts, interleaved, batch 1.

    python -m headstart.inference.bench --heads runs/medusa-smollm2/heads [DIR ...] --prompts chitchat:heldout \
        --num_prompts 20 --max_new_tokens 128 --output runs/bench [--device cpu|cuda] [--dtype float32|bfloat16] \
        [--tree auto|default|PATH|CHOICES] [--no_prompt_lookup] [--prompt_lookup_num_tokens 10] [--lookup off|on|both] \
        [--adaptive on|off|both] [--draft_int8 on|off|both] [--target NAME_OR_PATH] [--threads N] [--rounds N]

Every heads directory must belong to the same target (checked by the weight fingerprint recorded in
its config.json); the target is loaded once and shared. Each prompt is the row's first user turn
(with the row's system message, if any) rendered with the target's chat template. For every prompt the
methods run one after another in a fixed order (vanilla, prompt-lookup, heads 1, heads 1 +lookup, heads 2, ...),
after one uncounted warm-up round on the first prompt; with --rounds N each prompt goes through the methods N times in
turn and each method keeps its fastest run of that prompt (greedy output is the same every round; load from other
processes only ever slows a run, so the fastest is the steadiest figure on a shared machine). Heads rows draft
adaptively (the Speculator's default, inference/adapt.py): each step verifies a plain step, a heads tree, branches
found in the context, or both merged, whichever this generation's acceptance so far says pays most; "+lookup" rows
may use the context, rows without it are the heads alone (plain steps where they do not pay); "... fixed" rows
(--adaptive both/off) verify the fixed tree every step, a context chain of its node count instead when the context
repeats. "prompt_lookup" is HF's
prompt-lookup decoding.
"exact" rows verify each tree node with a one-token step's attention (inference/forward.py), the option that
keeps half-precision greedy output plain greedy's.

Figures (defined here; docs/benchmark.md reports them):
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

This module is the command: its arguments and the run from inputs to results. The parts, beside it in
inference/bench/: inputs.py (heads directories, target, prompts), methods.py (the methods' runs), near_tie.py
(mismatches), summary.py (the figures), report.py and plot.py (results.md, speedup.png).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import sys
from pathlib import Path
from typing import Sequence

import torch
import transformers
from tqdm import tqdm
from transformers import PreTrainedModel

from headstart.heads.chat import stop_token_ids
from headstart.heads.directory import HeadsLoadError
from headstart.heads.output_dir import OutputDirError, RunKind, check_output_dir, claim_output_dir, write_file
from headstart.heads.target import TargetLoadError, load_target
from headstart.inference.bench.inputs import (BenchError, HeadsEntry, Prompt, common_target, encode_prompts, find_heads,
                                    read_prompt_rows)
from headstart.inference.bench.methods import (ForwardMeter, Method, Run, altered_generation_fields, heads_method, hf_method,
                                     plain_generation_config, speculator_for)
from headstart.inference.bench.near_tie import near_tie
from headstart.inference.bench.plot import plot
from headstart.inference.bench.report import markdown
from headstart.inference.bench.summary import ratio, summarise_all, tokens_per_s
from headstart.inference.cpu_linear import linear_kernel
from headstart.inference.decode import SpeculatorError
from headstart.inference.forward import rows_invariant
from headstart.inference.speculator import Speculator

SCHEMA_VERSION = 1
WARMUP_TOKENS = 32  # the warm-up round decodes at most this many tokens per method
MODES = {"off": [False], "on": [True], "both": [False, True]}  # --lookup / --exact: the rows each value asks for
ADAPTIVE_MODES = {"off": [False], "on": [True], "both": [True, False]}  # --adaptive: adaptive rows first


def _device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda but torch sees no CUDA device (CPU-only torch build or no GPU): "
                         "use --device cpu")
    return device


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m headstart.inference.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", nargs="+", required=True, help="heads directories (globs ok) or Hub ids")
    parser.add_argument("--prompts", required=True, help="prompt source spec (see heads/prompts.py)")
    parser.add_argument("--num_prompts", type=int, default=20, help="the first N prompts of the source")
    parser.add_argument("--per_category", type=int, default=None,
                        help="instead of the first --num_prompts rows, the first N rows of each task family")
    parser.add_argument("--max_new_tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--output", required=True, help="directory for results.json, results.md, speedup.png")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="the target's dtype")
    parser.add_argument("--tree", default=None, help="auto | default | PATH | CHOICES as JSON, e.g. '[[0], [0, 0]]' "
                                                      "(default: each heads dir's tree.json, "
                                                      "else the default tree); auto times trees on this device "
                                                      "and writes tree.json into each heads dir")
    parser.add_argument("--no_prompt_lookup", action="store_true", help="skip HF prompt-lookup decoding")
    parser.add_argument("--prompt_lookup_num_tokens", type=int, default=10, help="HF prompt lookup: tokens drafted per step")
    parser.add_argument("--lookup", choices=["off", "on", "both"], default="both",
                        help="heads alone (off), heads + chains drafted from the context (on, the Speculator's "
                             "default; rows named '... +lookup'), or both rows (default)")
    parser.add_argument("--adaptive", choices=["off", "on", "both"], default="on",
                        help="each step verifies what the heads' and lookup's acceptance so far says pays most "
                             "(on, the Speculator's default; inference/adapt.py), the fixed tree (off), or both "
                             "(fixed rows named '... fixed')")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own choice); "
                        "on a busy shared CPU 1 thread is much steadier (oversubscribed OpenMP threads spin)")
    parser.add_argument("--rounds", type=int, default=1, help="timed rounds per prompt, interleaved; each method "
                        "keeps its fastest run of each prompt (steadier figures on a shared machine, N times longer)")
    parser.add_argument("--target", default=None, help="load this target instead of the one the heads name "
                                                        "(it must have the same fingerprint)")
    parser.add_argument("--exact", choices=["off", "on", "both"], default="off",
                        help="verify each tree node with a one-token step's attention (rows '... exact'): half-"
                             "precision greedy output stays plain greedy's (inference/forward.py); on = only those "
                             "rows, both = with and without")
    parser.add_argument("--draft_int8", choices=["off", "on", "both"], default="on",
                        help="draft from int8 copies of the heads' linear layers where they are float32 on a CPU "
                             "(inference/int8_draft.py; the Speculator's default); off = the float32 draft, both = "
                             "each heads row also with the float32 draft (rows '... float32 draft'; their tree and "
                             "step-cost curve are the int8 draft's)")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise BenchError(f"--num_prompts must be at least 1, got {args.num_prompts}")
    if args.per_category is not None and args.per_category < 1:
        raise BenchError(f"--per_category must be at least 1, got {args.per_category}")
    if args.max_new_tokens < 1:
        raise BenchError(f"--max_new_tokens must be at least 1, got {args.max_new_tokens}")
    if not args.no_prompt_lookup and args.prompt_lookup_num_tokens < 1:
        raise BenchError("--prompt_lookup_num_tokens must be at least 1 (or pass --no_prompt_lookup)")
    if args.threads is not None and args.threads < 1:
        raise BenchError(f"--threads must be at least 1, got {args.threads}")
    if args.rounds < 1:
        raise BenchError(f"--rounds must be at least 1, got {args.rounds}")


def load_speculators(entries: Sequence[HeadsEntry], target_name: str, args: argparse.Namespace,
                     device: torch.device) -> tuple[PreTrainedModel, object, object, list[Speculator]]:
    """The target, once, and a Speculator per heads directory sharing it -> (model, tokenizer, target info,
    speculators). For Medusa-2 heads (one directory only) the model is the adapter-merged target: vanilla and
    prompt-lookup run on it too, the model the heads are lossless for."""
    try:
        model, tokenizer, info = load_target(target_name, args.dtype, device)
        specs = [speculator_for(e, model, tokenizer, info, args.tree) for e in entries]
    except (TargetLoadError, HeadsLoadError, SpeculatorError) as err:
        raise BenchError(str(err)) from err
    return specs[0].model, tokenizer, info, specs


def bench_methods(args: argparse.Namespace, entries: Sequence[HeadsEntry], specs: Sequence[Speculator],
                  model: PreTrainedModel, meter: ForwardMeter, device: torch.device, stops: Sequence[int],
                  pad_id: int | None) -> list[Method]:
    """The methods in their fixed order: vanilla, prompt-lookup, then per heads directory its rows (alone / +lookup,
    exact, adaptive / fixed) as the arguments ask."""
    methods = [hf_method("vanilla", model, meter, device, pad_id)]
    if not args.no_prompt_lookup:
        methods.append(hf_method("prompt_lookup", model, meter, device, pad_id, args.prompt_lookup_num_tokens))
    for entry, spec in zip(entries, specs):
        for lookup in MODES[args.lookup]:
            for exact in MODES[args.exact]:
                for adaptive in ADAPTIVE_MODES[args.adaptive]:
                    for int8 in ADAPTIVE_MODES[args.draft_int8]:
                        methods.append(heads_method(entry, spec, stops, device, lookup, exact, adaptive,
                                                    suffix_fixed=args.adaptive == "both", draft_int8=int8,
                                                    suffix_float32=args.draft_int8 == "both"))
    return methods


def time_methods(methods: Sequence[Method], prompts: Sequence[Prompt], max_new_tokens: int,
                 rounds: int = 1) -> dict[str, list[Run]]:
    """One uncounted warm-up round on the first prompt, then every prompt through the methods in turn, `rounds`
    times -> {method name: the fastest Run per prompt}. A method whose tokens change between rounds is an error:
    its runs would not time the same work."""
    runs: dict[str, list[Run]] = {m.name: [] for m in methods}
    for m in methods:
        m.run(prompts[0].ids, min(max_new_tokens, WARMUP_TOKENS))
    bar = tqdm(prompts, desc="bench", unit="prompt", file=sys.stderr)
    for prompt in bar:
        fastest: dict[str, Run] = {}
        for round_index in range(rounds):
            for m in methods:
                run = m.run(prompt.ids, max_new_tokens)
                kept = fastest.get(m.name)
                if kept is not None and run.tokens != kept.tokens:
                    raise BenchError(f"{m.name} decoded prompt {prompt.row.id!r} differently in round "
                                     f"{round_index + 1} than before: its output is not deterministic here, so its "
                                     "rounds do not time the same work; use --rounds 1")
                if kept is None or run.seconds < kept.seconds:
                    fastest[m.name] = run
        for m in methods:
            runs[m.name].append(fastest[m.name])
        vanilla_tps = tokens_per_s(runs["vanilla"])
        bar.set_postfix({m.name: f"{ratio(tokens_per_s(runs[m.name]), vanilla_tps) or 0:.2f}x" for m in methods[1:]})
    return runs


def analyse_mismatches(methods: Sequence[Method], prompts: Sequence[Prompt], runs: dict[str, list[Run]],
                       dtype: torch.dtype) -> None:
    """After the timed rounds: each output that differs from vanilla's, decoded again (Run.mismatch)."""
    vanilla = methods[0]
    for m in methods[1:]:
        for prompt, r, v in zip(prompts, runs[m.name], runs[vanilla.name]):
            if r.tokens != v.tokens:
                r.mismatch = near_tie(vanilla, m, prompt.ids, v.tokens, r.tokens, dtype)


def by_category(methods: Sequence[Method], runs: dict[str, list[Run]], prompts: Sequence[Prompt]) -> dict[str, dict]:
    """{category: {method name: figures}} over each category's prompts; {} when the rows have no categories."""
    rows = [p.row for p in prompts]
    if not any(r.category for r in rows):
        return {}
    index: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        index.setdefault(r.category or "uncategorized", []).append(i)
    ids = [r.id for r in rows]
    return {cat: summarise_all(methods, runs, ids, at) for cat, at in index.items()}


def prompt_records(methods: Sequence[Method], runs: dict[str, list[Run]], prompts: Sequence[Prompt]) -> list[dict]:
    """Per prompt: its id, category, length and each method's run on it."""
    records = []
    for i, prompt in enumerate(prompts):
        by_method = {}
        for m in methods:
            r = runs[m.name][i]
            by_method[m.name] = {"new_tokens": len(r.tokens), "seconds": r.seconds,
                                 "decode_forwards": r.decode_forwards,
                                 "identical": r.tokens == runs["vanilla"][i].tokens, "near_tie": r.mismatch}
        records.append({"id": prompt.row.id, "category": prompt.row.category, "prompt_tokens": len(prompt.ids),
                        "runs": by_method})
    return records


def bench_settings(args: argparse.Namespace, command: str, device: torch.device, model: PreTrainedModel, info,
                   entries: Sequence[HeadsEntry], specs: Sequence[Speculator], methods: Sequence[Method],
                   prompts: Sequence[Prompt], skipped: list[dict], stops: Sequence[int], altered: dict) -> dict:
    """What was run, on what, with which software: results.json's "settings"."""
    return {
        "schema_version": SCHEMA_VERSION, "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
        "torch_threads": torch.get_num_threads(), "dtype": args.dtype, "linear": linear_kernel(model),
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "target": info.to_dict() if hasattr(info, "to_dict") else dict(info),
        "adapter_merged": str(entries[0].path) if entries[0].adapter else None,
        "prompts": args.prompts, "num_prompts": args.num_prompts, "per_category": args.per_category,
        "num_prompts_used": len(prompts),
        "skipped_prompts": skipped, "max_new_tokens": args.max_new_tokens,
        "tree": args.tree or "heads' tree.json, else default",
        "prompt_lookup_num_tokens": None if args.no_prompt_lookup else args.prompt_lookup_num_tokens,
        "heads_lookup": args.lookup, "adaptive": args.adaptive,
        "exact": args.exact,
        "draft_int8": args.draft_int8,
        "rows_invariant": rows_invariant(model, max(s.tree_size for s in specs)) if args.exact != "off" else None,
        "stop_token_ids": list(stops), "batch_size": 1, "warmup_rounds": 1, "timed_rounds": args.rounds,
        "order": [m.name for m in methods],
        "neutralised_generation_config": altered,
    }


def run_bench(args: argparse.Namespace, command: str) -> dict:
    """The benchmark from parsed arguments to the results dict (results.json)."""
    check_args(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = _device(args.device)
    entries = find_heads(args.heads)  # each heads directory loaded once, here
    target_name = common_target(entries, args.target)
    rows = read_prompt_rows(args.prompts, args.num_prompts, args.per_category)
    model, tokenizer, info, specs = load_speculators(entries, target_name, args, device)
    stops = stop_token_ids(tokenizer, model.generation_config)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stops[0] if stops else None)
    prompts, skipped = encode_prompts(rows, tokenizer, model, args.max_new_tokens)
    if len(rows) < args.num_prompts and not args.per_category:
        print(f"note: {args.prompts!r} has only {len(rows)} usable rows (asked for {args.num_prompts})",
              file=sys.stderr)

    meter = ForwardMeter(model, device)
    altered = altered_generation_fields(model.generation_config)
    methods = bench_methods(args, entries, specs, model, meter, device, stops, pad_id)
    try:
        with plain_generation_config(model, stops, pad_id), torch.no_grad():
            runs = time_methods(methods, prompts, args.max_new_tokens, args.rounds)
            analyse_mismatches(methods, prompts, runs, model.dtype)
    finally:
        meter.remove()

    return {"settings": bench_settings(args, command, device, model, info, entries, specs, methods, prompts, skipped,
                                       stops, altered),
            "methods": summarise_all(methods, runs, [p.row.id for p in prompts]),
            "categories": by_category(methods, runs, prompts),
            "prompts": prompt_records(methods, runs, prompts)}


# what a benchmark writes in its --output directory, and what marks one an earlier version wrote (heads/output_dir.py)
BENCH_RUN = RunKind("bench", names=("results.json", "results.md", "speedup.png", ".*.tmp"), markers=("results.json",),
                    flag="--output")


def write_reports(results: dict, output: Path) -> str:
    """results.json, results.md, speedup.png in `output` (new, empty, or an earlier benchmark's)."""
    with claim_output_dir(output, BENCH_RUN):
        write_file(output / "results.json", json.dumps(results, indent=1) + "\n")
        table = markdown(results)
        write_file(output / "results.md", table)
        plot(results, output / "speedup.png")
    return table


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    command = "python -m headstart.inference.bench " + shlex.join(argv)
    try:
        check_output_dir(Path(args.output), BENCH_RUN)  # refused before the benchmark runs
        results = run_bench(args, command)
        table = write_reports(results, Path(args.output))
    except (BenchError, OutputDirError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(table)
    print(f"wrote {Path(args.output) / 'results.json'}, results.md, speedup.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
