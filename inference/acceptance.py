"""Held-out acceptance by task family: tau (tokens per target forward) of heads directories on prompts they never saw.

    python -m headstart.inference.acceptance --heads runs/demo/medusa/heads --prompts mix:heldout+writing --per_category 4

tau counts target forwards, not seconds, so it can be measured on a busy machine: the figure that judges a training
change (the benchmark, inference/bench.py, adds the wall clock). Each heads directory decodes the same prompts
greedily with one fixed tree every step (not adaptive: the figure is the draft's; its tree.json when it has one,
else the default; or --tree), with lookup drafting off and on; the table gives tau per family (a prompt row's
`category`) and over all prompts, and --output writes it as JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from headstart.heads.chat import prompt_ids
from headstart.heads.output_dir import OutputDirError, refuse_link, write_file
from headstart.heads.prompt_rows import pick_per_category
from headstart.heads.prompts import PromptSourceError, load_prompts
from headstart.inference.speculator import Speculator, SpeculatorError


def heldout_tau(spec: Speculator, rows: list, max_new_tokens: int, lookup: bool, bar: tqdm | None = None) -> dict:
    """{category: {"tau", "prompts", "tokens", "forwards"}} plus "all", from greedy decoding of each row's first turn.
    A prompt longer than the target's context (max_position_embeddings less max_new_tokens) is skipped and counted
    ("skipped_too_long"). `bar` advances by one a prompt."""
    sums: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    context = getattr(spec.model.config, "max_position_embeddings", None)
    for row in rows:
        ids = prompt_ids(spec.tokenizer, row.turns[0], row.system)
        if context is not None and len(ids) + max_new_tokens > context:
            for key in (row.category or "other", "all"):
                sums[key]["skipped_too_long"] += 1
        else:
            stats = spec.generate(torch.tensor(ids), max_new_tokens, lookup=lookup, adaptive=False).stats
            for key in (row.category or "other", "all"):
                sums[key]["prompts"] += 1
                sums[key]["tokens"] += stats.new_tokens - 1  # the prefill's token is not the decode phase's
                sums[key]["forwards"] += stats.decode_forwards
        if bar is not None:
            bar.update(1)
    return {key: {**counts, "tau": round(counts["tokens"] / counts["forwards"], 3) if counts["forwards"] else None}
            for key, counts in sums.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", nargs="+", required=True, help="heads directories or Hub ids")
    parser.add_argument("--prompts", default="mix:heldout+writing", help="prompt source spec (heads/prompts.py)")
    parser.add_argument("--per_category", type=int, default=4, help="prompts per task family")
    parser.add_argument("--max_new_tokens", type=int, default=96, help="tokens generated per prompt")
    parser.add_argument("--tree", default=None, help="default | PATH | CHOICES as JSON (default: the heads' tree.json)")
    parser.add_argument("--output", default=None, help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    if args.per_category < 1 or args.max_new_tokens < 1:
        print("error: --per_category and --max_new_tokens must be >= 1", file=sys.stderr)
        return 2
    try:
        if args.output:
            refuse_link(Path(args.output))  # before the run, not after it
        rows = pick_per_category(load_prompts(args.prompts).rows, args.per_category)
    except (PromptSourceError, OutputDirError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    results = {}
    bar = tqdm(total=len(args.heads) * 2 * len(rows), desc="acceptance", unit="prompt", file=sys.stderr)
    for heads in args.heads:
        try:
            spec = Speculator.from_pretrained(heads, tree=args.tree)
        except SpeculatorError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        results[heads] = {f"lookup {mode}": heldout_tau(spec, rows, args.max_new_tokens, mode == "on", bar)
                          for mode in ("off", "on")}
    bar.close()
    categories = sorted({key for r in results.values() for by in r.values() for key in by if key != "all"}) + ["all"]
    print("| heads | lookup | " + " | ".join(categories) + " |")
    print("|---|---|" + "---|" * len(categories))
    for heads, by_mode in results.items():
        for mode, by in by_mode.items():
            print(f"| {heads} | {mode.split()[1]} | " + " | ".join(
                f"{by[c]['tau']:.2f}" if by.get(c, {}).get("tau") is not None else "-" for c in categories) + " |")
    if args.output:
        write_file(Path(args.output), json.dumps({"prompts": args.prompts, "per_category": args.per_category,
                                                  "max_new_tokens": args.max_new_tokens, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
