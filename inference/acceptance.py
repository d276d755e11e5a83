"""Held-out acceptance by task family: tau (tokens per target forward) of heads directories on prompts they never saw.

    python -m headstart.inference.acceptance --heads runs/demo/medusa/heads --prompts mix:heldout+writing --per_category 4

tau counts target forwards, not seconds, so it can be measured on a busy machine: the figure that judges a training
change (the benchmark, inference/bench/run.py, adds the wall clock). Each heads directory decodes the same prompts
greedily with one fixed tree every step (not adaptive: the figure is the draft's; its tree.json when it has one,
else the default; or --tree), the draft in float32 (not the decode loop's int8 copies, inference/int8_draft.py: an
engine runs the draft it is given), with lookup drafting off and on; the table gives tau per family (a prompt row's
`category`) and over all prompts, and --output writes it as JSON.

With --chain each heads directory decodes a greedy chain as deep as its export serves (Medusa: its heads; DFlash:
block_size - 1; EAGLE: its evaluated depth), lookup off, and the histogram of accepted lengths over all families is
written into the heads directory as chain_acceptance.json: the export predicts an engine's served speedup from it
(heads/served_speed.py), since engines verify chains, and held-out families are what users' prompts look like. For
a draft with a confidence head (DSpark) it also holds `confidence`: how well the head foresaw those chains
(heads/dspark.py calibration: expected against accepted tokens a chain, by slot, survival calibration error).

    python -m headstart.inference.acceptance --chain --heads runs/demo/medusa/heads
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
from headstart.heads.dspark import calibration, chain_confidence_sums
from headstart.heads.output_dir import OutputDirError, refuse_link, write_file
from headstart.heads.prompt_rows import pick_per_category
from headstart.heads.prompts import PromptSourceError, load_prompts
from headstart.heads.served_speed import CHAIN_FILE
from headstart.inference.speculator import Speculator, SpeculatorError


def heldout_tau(spec: Speculator, rows: list, max_new_tokens: int, lookup: bool, bar: tqdm | None = None) -> dict:
    """{category: {"tau", "prompts", "tokens", "forwards"}} plus "all", from greedy decoding of each row's first turn.
    A prompt longer than the target's context (max_position_embeddings less max_new_tokens) is skipped and counted
    ("skipped_too_long"). `bar` advances by one a prompt."""
    sums: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    hists: dict[str, list[int]] = collections.defaultdict(list)  # steps that accepted a = 0, 1, ... drafted tokens
    confidence: dict[str, list] = collections.defaultdict(list)  # a draft with a confidence head: its steps
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
                hist = hists[key]
                hist.extend([0] * (len(stats.accept_hist) - len(hist)))
                for accepted, steps in enumerate(stats.accept_hist):
                    hist[accepted] += steps
                confidence[key].extend(stats.confidence_steps)
        if bar is not None:
            bar.update(1)
    out = {key: {**counts, "tau": round(counts["tokens"] / counts["forwards"], 3) if counts["forwards"] else None,
                 "accept_hist": hists[key]} for key, counts in sums.items()}
    for key, steps in confidence.items():  # how well the confidence head foresaw these prompts' acceptance
        if steps:
            out[key]["confidence"] = calibration(chain_confidence_sums(steps))
    return out


def chain_depth(spec: Speculator) -> int:
    """The chain an engine export of these heads serves by default (heads/export.py `speculative_tokens`)."""
    from headstart.heads.directory import read_metrics
    from headstart.heads.export import speculative_tokens

    return speculative_tokens(spec.heads.config, read_metrics(Path(spec.heads_dir)), None)


def write_chain_acceptance(spec: Speculator, rows: list, max_new_tokens: int, prompts: str, per_category: int,
                           bar: tqdm | None = None) -> dict:
    """Decode `rows` with a greedy chain of `chain_depth`, lookup off, not adaptive, and write the accepted-length
    histogram over all rows to the heads directory's chain_acceptance.json (heads/served_speed.py reads it); returns
    what was written."""
    depth = chain_depth(spec)
    spec.set_tree([[0] * d for d in range(1, depth + 1)])
    by_family = heldout_tau(spec, rows, max_new_tokens, False, bar)
    hist = by_family.get("all", {}).get("accept_hist", [])
    if not hist:
        raise SpeculatorError(f"no prompt of {prompts} fits the target's context with {max_new_tokens} new tokens: "
                              "nothing to write; pass fewer --max_new_tokens or other --prompts")
    record = {"prompts": prompts, "per_category": per_category, "max_new_tokens": max_new_tokens, "depth": depth,
              "accept_hist": hist + [0] * (depth + 1 - len(hist)), "tau": by_family["all"]["tau"],
              "tau_by_family": {key: v["tau"] for key, v in sorted(by_family.items())}}
    if "confidence" in by_family["all"]:
        record["confidence"] = by_family["all"]["confidence"]
    write_file(Path(spec.heads_dir) / CHAIN_FILE, json.dumps(record, indent=1) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", nargs="+", required=True, help="heads directories or Hub ids")
    parser.add_argument("--prompts", default="mix:heldout+writing", help="prompt source spec (heads/prompts.py)")
    parser.add_argument("--per_category", type=int, default=4, help="prompts per task family")
    parser.add_argument("--max_new_tokens", type=int, default=96, help="tokens generated per prompt")
    parser.add_argument("--tree", default=None, help="default | PATH | CHOICES as JSON (default: the heads' tree.json)")
    parser.add_argument("--output", default=None, help="write the figures to this JSON file")
    parser.add_argument("--chain", action="store_true", help="decode a greedy chain as deep as the export serves "
                        "(lookup off) and write chain_acceptance.json into each (local) heads directory")
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
    if args.chain:
        return chain_main(args, rows)
    results = {}
    bar = tqdm(total=len(args.heads) * 2 * len(rows), desc="acceptance", unit="prompt", file=sys.stderr)
    for heads in args.heads:
        try:
            spec = Speculator.from_pretrained(heads, tree=args.tree, draft_int8=False)  # the heads' own precision
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


def chain_main(args: argparse.Namespace, rows: list) -> int:
    """--chain: write chain_acceptance.json into each heads directory, and print tau by family."""
    for heads in args.heads:
        if not Path(heads).is_dir():
            print(f"error: --chain writes into the heads directory: {heads!r:.100} is not a local directory (download "
                  "Hub heads with huggingface_hub's snapshot_download and pass that directory)", file=sys.stderr)
            return 2
        try:
            refuse_link(Path(heads) / CHAIN_FILE)  # before the decoding, not after it
        except OutputDirError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    bar = tqdm(total=len(args.heads) * len(rows), desc="chain acceptance", unit="prompt", file=sys.stderr)
    for heads in args.heads:
        try:
            # its tree is set to the chain: none measured; the draft in float32, as an engine reading the export runs it
            spec = Speculator.from_pretrained(heads, tree="default", draft_int8=False)
            record = write_chain_acceptance(spec, rows, args.max_new_tokens, args.prompts, args.per_category, bar)
        except (SpeculatorError, OutputDirError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        families = ", ".join(f"{key} {tau:.2f}" for key, tau in record["tau_by_family"].items() if tau is not None)
        print(f"{heads}: greedy chain of {record['depth']}, tau by family: {families}; wrote "
              f"{Path(heads) / 'chain_acceptance.json'}")
        if "confidence" in record:
            conf = record["confidence"]
            hist = record["accept_hist"]
            accepted = sum(a * steps for a, steps in enumerate(hist)) / sum(hist)
            print(f"  its confidence head expected {conf['expected_chain_tokens']:.3f} accepted tokens a chain "
                  f"(accepted {accepted:.3f}); survival calibration error {conf['survival_ece']:.3f}")
    bar.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
