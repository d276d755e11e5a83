"""Replay decoding policies on the target's greedy outputs: modeled speedup per task family, without the wall clock.

    python -m headstart.inference.replay --heads runs/demo/medusa/heads --prompts mix:heldout+writing --per_category 3

Greedy speculative decoding emits exactly the target's greedy tokens, and Medusa heads draft from the target's
hidden state at the last accepted token, which is the same along that one sequence whatever was verified before.
So one greedy generation and one forward over it per prompt give every step's drafts, and any policy can be
replayed exactly (a node is accepted when its path equals the reference continuation) at no further target cost.
Each step is charged the step-cost curve of inference/adapt.py's StepCost (the heads' `--tree auto` calibration,
else the priors) plus the heads' draft when they draft; modeled speedup = tokens / charged one-token steps, plain
decoding = 1 per token. It ranks policies on a busy machine where the benchmark's wall clock cannot
(inference/bench/run.py measures the real thing). Methods: HF-style prompt lookup (10 tokens after the latest 2-, else
1-token match), the heads' fixed tree (alone, and with a context chain of its node count when the context repeats),
and the adaptive policy (alone and +lookup). Medusa heads only (an EAGLE draft's tree depends on its own state).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import torch

from headstart.heads.medusa import MEDUSA
from headstart.heads.output_dir import OutputDirError, refuse_link, write_file
from headstart.heads.prompt_rows import pick_per_category
from headstart.inference.adapt import HEADS_RANKS, StepCost
from headstart.inference.lookup import LookupConfig, chain_draft, lookup_continuation
from headstart.inference.medusa import medusa_logits
from headstart.inference.tree import Tree, static_tree_tokens, tree_from_choices

PLD = LookupConfig(num_tokens=10, min_ngram=1, max_ngram=2)  # HF prompt lookup's defaults
POLICIES = ("prompt_lookup", "fixed", "fixed +lookup", "adaptive", "adaptive +lookup")  # the table's rows


def accepted_path(tree: Tree, tokens: list[int], reference: list[int], start: int) -> list[int]:
    """Greedy acceptance against the reference: the deepest path whose node at depth d is reference[start + d - 1]."""
    path, node = [0], 0
    while True:
        nxt = next((c for c in tree.children[node] if start + tree.depths[c] - 1 < len(reference)
                    and tokens[c] == reference[start + tree.depths[c] - 1]), None)
        if nxt is None:
            return path
        path.append(nxt)
        node = nxt


def replay(policy_name: str, seq: list[int], prompt_len: int, topk: torch.Tensor, cost: StepCost, fixed: Tree,
           make_policy) -> tuple[int, float, int]:
    """(tokens after the first, charged one-token steps, steps) of one decoding policy (a POLICIES row) over one
    reference.
    topk: [positions, depth, ranks] the heads' drafts when the root is seq[prompt_len + i]."""
    i, charged, steps = prompt_len, 0.0, 0
    policy = make_policy(policy_name.endswith("+lookup")) if policy_name.startswith("adaptive") else None
    while i < len(seq) - 1:
        context, root = seq[: i + 1], seq[i]
        drafts = topk[i - prompt_len]
        if policy is not None:
            plan = policy.plan(context)
            heads_tree = heads_tokens = None
            if plan.heads_choices:
                heads_tree = tree_from_choices(plan.heads_choices)
                heads_tokens = static_tree_tokens(heads_tree, root, drafts)
            tree, tokens, keys = policy.build(plan, root, heads_tree, heads_tokens)
            path = accepted_path(tree, tokens.tolist(), seq, i + 1)
            policy.observe(plan, tree, keys, path)
            heads_nodes = len(plan.heads_choices) + 1 if plan.heads_choices else 0
        else:
            chain = []
            if policy_name in ("prompt_lookup", "fixed +lookup"):
                chain = lookup_continuation(context, PLD if policy_name == "prompt_lookup"
                                            else LookupConfig(num_tokens=fixed.size - 1))
            if chain:
                tree, tokens = chain_draft(root, chain)
                heads_nodes = 0
            elif policy_name == "prompt_lookup":
                tree, tokens, heads_nodes = tree_from_choices([]), torch.tensor([root]), 0
            else:
                tree, tokens, heads_nodes = fixed, static_tree_tokens(fixed, root, drafts), fixed.size
            path = accepted_path(tree, tokens.tolist(), seq, i + 1)
        charged += cost.cost(tree.size, heads_nodes)
        steps += 1
        i += len(path)
    return min(i, len(seq) - 1) - prompt_len, charged, steps  # the last step's bonus may pass the reference's end


@torch.no_grad()
def references(spec, rows: Sequence, max_new_tokens: int) -> list[dict]:
    """Per prompt: the target's greedy sequence and the heads' top-k drafts at every decode position."""
    from headstart.heads.chat import prompt_ids, stop_token_ids

    model, tokenizer = spec.model, spec.tokenizer
    stops = stop_token_ids(tokenizer, model.generation_config)
    limit = getattr(model.config, "max_position_embeddings", None)
    out = []
    for row in rows:
        ids = prompt_ids(tokenizer, row.turns[0], row.system)
        if limit is not None and len(ids) + max_new_tokens > limit:
            continue
        seq = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stops,
                             pad_token_id=tokenizer.pad_token_id)[0].tolist()
        hidden = model(torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0]  # [L, h] final-norm
        depth = spec.heads.config.num_heads
        ranks = max(HEADS_RANKS, max(spec.tree.ranks) + 1)  # the adaptive trees' and the fixed tree's (tree.json)
        topk = torch.stack([spec.heads.to_target_ids(medusa_logits(spec.heads, hidden[j], depth, spec.draft_project)
                                                     .topk(ranks, dim=-1).indices)
                            for j in range(len(ids) - 1, len(seq) - 1)])  # [positions, depth, ranks]
        out.append({"category": row.category or "other", "prompt_len": len(ids), "seq": seq, "topk": topk})
    return out


def modeled(spec, refs: list[dict]) -> dict:
    """{policy: {category | "all": {"speedup", "tau", "tokens"}}}."""
    results: dict[str, dict] = {}
    for policy_name in POLICIES:
        sums: dict[str, list[float]] = {}
        for ref in refs:
            tokens, charged, steps = replay(policy_name, ref["seq"], ref["prompt_len"], ref["topk"], spec.step_cost,
                                            spec.tree, spec.make_policy)
            for key in (ref["category"], "all"):
                acc = sums.setdefault(key, [0, 0.0, 0])
                acc[0], acc[1], acc[2] = acc[0] + tokens, acc[1] + charged, acc[2] + steps
        order = [key for key in sums if key != "all"] + ["all"]
        results[policy_name] = {key: {"speedup": sums[key][0] / sums[key][1] if sums[key][1] else None,
                                 "tau": sums[key][0] / sums[key][2] if sums[key][2] else None, "tokens": sums[key][0]}
                           for key in order}
    return results


def main(argv: Sequence[str] | None = None) -> int:
    from headstart.heads.prompts import PromptSourceError, load_prompts
    from headstart.inference.decode import SpeculatorError
    from headstart.inference.speculator import Speculator

    parser = argparse.ArgumentParser(prog="python -m headstart.inference.replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", required=True, help="a Medusa heads directory or Hub id")
    parser.add_argument("--prompts", required=True, help="prompt source spec (heads/prompts.py)")
    parser.add_argument("--per_category", type=int, default=3, help="prompts per family (a row's category)")
    parser.add_argument("--max_new_tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--tree", default=None, help="the fixed tree, and --tree auto's step-cost curve (see bench)")
    parser.add_argument("--output", default=None, help="write the table as JSON here")
    args = parser.parse_args(argv)
    try:
        if args.output:
            refuse_link(Path(args.output))  # before the run, not after it
        spec = Speculator.from_pretrained(args.heads, tree=args.tree)
        rows = load_prompts(args.prompts).rows
    except (SpeculatorError, PromptSourceError, OutputDirError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if spec.method is not MEDUSA:  # the drafts must depend on the target's hidden state alone
        print(f"error: replay needs Medusa heads (these are {spec.heads.config.method}): use "
              "python -m headstart.inference.bench for EAGLE and DFlash drafts", file=sys.stderr)
        return 2
    results = modeled(spec, references(spec, pick_per_category(rows, args.per_category), args.max_new_tokens))
    keys = list(next(iter(results.values())))
    print("Modeled speedup over plain greedy (tau), replayed on the target's greedy outputs")
    print("| method | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for policy_name, by_key in results.items():
        print(f"| {policy_name} | " + " | ".join(f"{v['speedup']:.2f}x ({v['tau']:.2f})" for v in by_key.values()) + " |")
    if args.output:
        write_file(Path(args.output), json.dumps(results, indent=1) + "\n")  # never through a link
    return 0


if __name__ == "__main__":
    sys.exit(main())
