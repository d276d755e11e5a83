"""The main job on the embedded default: the toolkit trains its own heads and shows the speedup.

    python scripts/demo.py --output_dir runs/demo        (what `make demo` runs once the install is done)

Stages, each printed with its command before it runs (a rerun reuses the finished ones; the benchmark runs again
each time and is kept, so several runs give the speedup's run-to-run median):
  1. self-distillation: the target answers `num_prompts` prompts of the broad mix (`mix:train`: chat, instructions
     over passages, translation, math word problems, code; heads/prompt_families.py)
  2. Medusa-1 heads on those answers (recipes/smollm2-135m/medusa.yaml; the target's features computed once)
  3. the benchmark on held-out prompts of every task family (`mix:heldout+writing`: the held-out part of each
     trained family, and `writing`, a family no training mix has) against plain HF greedy and HF prompt lookup, tree
     sized by `--tree auto` (the heads alone, and with chains found in the context)
Then it prints one table (tau, speedup with its per-prompt spread, identical outputs), the speedup by task family,
each stage's minutes and what to run next; the same text is written to OUTPUT_DIR/summary.md, the stage times to
OUTPUT_DIR/stages.json.

Only Medusa-1 is trained: on 2 CPU cores it reached a higher speedup than EAGLE-3 on the same data and trains in
half the time (docs/measured.md). The recipes train the other methods.
"""

from __future__ import annotations

import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from headstart.heads.output_dir import OutputDirError, RunKind, claim_output_dir  # noqa: E402
from headstart.heads.served_speed import (acceptance_source, choose_draft_length, heldout_metrics, served_record,  # noqa: E402
                                served_summary)
from headstart.train.config import ConfigError, parse_config  # noqa: E402

# what the demo writes in its output_dir: each stage in a folder of its own (each stage's script claims its folder),
# and its records (heads/output_dir.py)
DEMO_RUN = RunKind("demo", names=("sd", "medusa", "bench", "stages.json", "summary.md", "bench_runs.jsonl", ".*.tmp"),
                   markers=("stages.json", "sd/meta.json", "sd/run.json"))


@dataclass
class DemoConfig:
    config: Optional[str] = None  # a YAML with any of these fields
    output_dir: str = "runs/demo"  # every stage's output goes below it
    target: str = "smollm2-135m"  # alias, Hub id, local dir or .gguf file
    prompts: str = "mix:train"  # the prompt source self-distilled (heads/prompts.py)
    num_prompts: int = 384  # prompts self-distilled and trained on
    processes: int = 2  # CPU processes for self-distillation and training (accelerate, gloo)
    num_epochs: int = 6  # training epochs over the self-distilled rows
    bench_per_category: int = 2  # held-out prompts benchmarked per task family
    max_new_tokens: int = 96  # tokens generated per benchmarked prompt
    # more flags for a stage's script, e.g. --train_args="--learning_rate 1e-3 --max_steps 50"
    selfdistill_args: str = ""  # more flags for train/selfdistill.py
    train_args: str = ""  # more flags for train/medusa.py
    bench_args: str = ""  # more flags for inference/bench/run.py


def launcher(processes: int) -> list[str]:
    if processes == 1:
        return [sys.executable]
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]


def in_repo(path: str) -> str:
    """A repo file as seen from the working directory (the demo may run from elsewhere)."""
    return os.path.relpath(ROOT / path)


def stage_commands(cfg: DemoConfig) -> list[tuple[str, list[str], Optional[Path]]]:
    """(stage name, command, the file whose presence means the stage is done; None = always run)."""
    out = Path(cfg.output_dir)
    target = ["--target", cfg.target]
    per_device = str(max(8 // cfg.processes, 1))  # the recipe's global batch of 8 rows
    return [
        ("self-distillation", launcher(cfg.processes) + [
            in_repo("train/selfdistill.py"), "--config", in_repo("recipes/smollm2-135m/selfdistill.yaml"), *target,
            "--prompts", cfg.prompts, "--output_dir", str(out / "sd"), "--num_prompts", str(cfg.num_prompts),
            *shlex.split(cfg.selfdistill_args)],
         out / "sd" / "meta.json"),
        ("Medusa-1 training", launcher(cfg.processes) + [
            in_repo("train/medusa.py"), "--config", in_repo("recipes/smollm2-135m/medusa.yaml"), *target,
            "--data_dir", str(out / "sd"), "--num_prompts", str(cfg.num_prompts), "--num_epochs", str(cfg.num_epochs),
            "--per_device_batch_size", per_device, "--output_dir", str(out / "medusa"), *shlex.split(cfg.train_args)],
         out / "medusa" / "heads" / "model.safetensors"),
        ("held-out chain acceptance", [  # what an engine's fixed chain gets on held-out families: in_engines reads it
            sys.executable, "-m", "headstart.inference.acceptance", "--chain", "--heads", str(out / "medusa" / "heads"),
            "--prompts", "mix:heldout+writing", "--per_category", str(cfg.bench_per_category),
            "--max_new_tokens", str(cfg.max_new_tokens)],
         out / "medusa" / "heads" / "chain_acceptance.json"),
        ("benchmark", [sys.executable, "-m", "headstart.inference.bench", "--heads", str(out / "medusa"),
                       "--prompts", "mix:heldout+writing", "--per_category", str(cfg.bench_per_category),
                       "--max_new_tokens", str(cfg.max_new_tokens), "--tree", "auto", "--output", str(out / "bench"),
                       *shlex.split(cfg.bench_args)], None),
    ]


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # waited-for children and their waited-for children
    return usage.ru_utime + usage.ru_stime


class StageError(RuntimeError):
    """A stage's command failed (it printed why)."""


def run_stages(cfg: DemoConfig) -> dict:
    """Run the stages not done yet; -> {stage: {"minutes", "cpu_minutes", "command"} or {"reused": True, ...}}."""
    out = Path(cfg.output_dir)
    stages_file = out / "stages.json"
    stages = json.loads(stages_file.read_text()) if stages_file.is_file() else {}
    commands = stage_commands(cfg)
    for number, (name, command, done) in enumerate(commands, 1):
        shown = shlex.join(command).replace(sys.executable, "python")
        if done is not None and done.is_file():
            print(f"\n[{number}/{len(commands)}] {name}: done already ({done}); reused", flush=True)
            stages.setdefault(name, {"command": shown})["reused"] = True
            continue
        print(f"\n[{number}/{len(commands)}] {name}\n$ {shown}", flush=True)
        wall, cpu = time.perf_counter(), children_cpu_s()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        result = subprocess.run(command, env=env)
        if result.returncode != 0:
            raise StageError(f"demo stage '{name}' failed (exit {result.returncode}); fix what it printed and rerun: "
                             "finished stages are reused")
        stages[name] = {"command": shown, "minutes": round((time.perf_counter() - wall) / 60, 2),
                        "cpu_minutes": round((children_cpu_s() - cpu) / 60, 2), "reused": False}
        stages_file.write_text(json.dumps(stages, indent=1))
    return stages


def best_lossless(methods: dict) -> Optional[tuple[str, dict]]:
    """The fastest method (not vanilla) whose every output equals vanilla's."""
    lossless = [(name, s) for name, s in methods.items() if s["kind"] != "vanilla" and s["all_identical"]
                and s["speedup"] is not None]
    return max(lossless, key=lambda item: item[1]["speedup"]) if lossless else None


def shown_name(name: str, figures: dict) -> str:
    """The benchmark names the heads by their directory ("heads"); the summary by their method."""
    if figures["kind"] != "medusa":
        return name
    return "Medusa-1" + (" +lookup" if figures.get("lookup") else "")


def record_bench_run(out: Path, results: dict) -> list[float]:
    """Append this benchmark run's best lossless speedup to bench_runs.jsonl; -> all runs' figures so far."""
    best = best_lossless(results["methods"])
    history = out / "bench_runs.jsonl"
    with history.open("a") as f:
        f.write(json.dumps({"time": time.strftime("%Y-%m-%d %H:%M:%S"), "best": best and shown_name(*best),
                            "speedup": best and best[1]["speedup"]}) + "\n")
    return [row["speedup"] for row in map(json.loads, history.read_text().splitlines()) if row["speedup"] is not None]


def family_table(results: dict) -> list[str]:
    """Each method's speedup over plain greedy by task family, as markdown lines ([] without families)."""
    families = results.get("categories") or {}
    if not families:
        return []
    names = [name for name, s in results["methods"].items() if s["kind"] != "vanilla"]
    shown = [shown_name(name, results["methods"][name]) for name in names]
    lines = ["", "Speedup by task family:", "", "| family | " + " | ".join(shown) + " |",
             "|---|" + "---:|" * len(names)]
    for family, figures in families.items():
        cells = [f"{figures[name]['speedup']:.2f}x" if figures.get(name, {}).get("speedup") is not None else "n/a"
                 for name in names]
        lines.append(f"| {family} | " + " | ".join(cells) + " |")
    return lines


def summary(cfg: DemoConfig, stages: dict, results: dict, heads_metrics: dict, runs_so_far: list[float]) -> str:
    methods = results["methods"]
    lines = [f"# headstart demo: {cfg.target}, {cfg.num_prompts} prompts self-distilled, Medusa-1 heads", "",
             f"Held-out top-1 of the heads (depth 1 / 2 / 3): "
             + " / ".join(f"{x:.3f}" for x in heads_metrics["top1"]), "",
             f"Benchmark: {results['settings']['num_prompts_used']} held-out prompts ({cfg.bench_per_category} of each "
             f"task family; `writing` is in no training mix) x {cfg.max_new_tokens} new tokens, greedy, batch 1, "
             "against plain HF greedy:", "",
             "| method | tau | speedup | per-prompt min / median / max | 95% CI | identical |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, s in methods.items():
        name = shown_name(name, s)
        spread = s["speedup_spread"]
        ci = spread["ci95"]
        lines.append(f"| {name} | {s['tau']:.2f} | {s['speedup']:.2f}x | {spread['min']:.2f} / {spread['median']:.2f} / "
                     f"{spread['max']:.2f} | {ci[0]:.2f}-{ci[1]:.2f} | {s['identical']}/{s['identical_of']} |"
                     if ci and s["tau"] is not None else f"| {name} | n/a | n/a | n/a | n/a | n/a |")
    lines += family_table(results)
    best = best_lossless(methods)
    lines.append("")
    if best:
        lines.append(f"Best lossless method: {shown_name(*best)}, {best[1]['speedup']:.2f}x.")
    else:
        lines.append("No method gave outputs identical to plain greedy on every prompt: see bench/results.md.")
    if len(runs_so_far) > 1:
        lines.append(f"Benchmark runs so far (best lossless speedup): {', '.join(f'{x:.2f}x' for x in runs_so_far)}; "
                     f"median {statistics.median(runs_so_far):.2f}x.")
    lines += ["", *in_engines(cfg, heads_metrics)]
    lines += ["", "| stage | minutes | CPU minutes |", "|---|---:|---:|"]
    for name, st in stages.items():
        lines.append(f"| {name} | reused | - |" if st.get("reused") else
                     f"| {name} | {st['minutes']:.1f} | {st['cpu_minutes']:.1f} |")
    lines += ["", "Next:",
              f"- the full recipes (768 prompts), one per method ({', '.join(recipe_methods())}): "
              "recipes/smollm2-135m/, docs/training.md",
              "- your own target on a GPU: `python train/selfdistill.py --target HUB_ID --device cuda --dtype bfloat16 "
              "--output_dir runs/sd-mine`, then `accelerate launch train/eagle.py --config "
              "recipes/llama-3.1-8b-instruct/eagle3.yaml` (or its qwen2.5-7b-instruct sibling)",
              f"- generate with these heads: `python -m headstart.inference.generate --heads {cfg.output_dir}/medusa/heads "
              "--prompt \"Write a haiku about tea\"`",
              f"- the full report and plot: {cfg.output_dir}/bench/results.md, {cfg.output_dir}/bench/speedup.png"]
    return "\n".join(lines) + "\n"


def recipe_methods() -> list[str]:
    """The methods the embedded target has a recipe for (every recipes/smollm2-135m/*.yaml but self-distillation's)."""
    return sorted(p.stem for p in Path(in_repo("recipes/smollm2-135m")).glob("*.yaml") if p.stem != "selfdistill")


def in_engines(cfg: DemoConfig, heads_metrics: dict) -> list[str]:
    """What these heads would give where users serve: vLLM's chain length and predicted speedup (heads/served_speed.py:
    tau from the held-out chain acceptance stage, step costs measured in the heads' engines.json when the engine check
    wrote one, else the engine's documented prior), with the export command; llama.cpp has no Medusa loader."""
    heads_dir = Path(cfg.output_dir) / "medusa" / "heads"
    k_max = len(heads_metrics["top1"])
    metrics = heldout_metrics(heads_dir)
    vllm = served_record(choose_draft_length(metrics, "medusa", "vllm", heads_dir, range(1, k_max + 1)),
                         "export", fallback_k=k_max)
    return ["In an engine (batch 1, a fixed chain; no lookup, no tree):",
            f"- vLLM: {served_summary(vllm)}; acceptance from {acceptance_source(metrics)}. Export: `python -m headstart.heads.export {heads_dir} {cfg.output_dir}/vllm "
            "--format vllm` (its card gives the command); measure it with `headstart vllm-check speed` (docs/serving.md).",
            "- llama.cpp: it loads EAGLE-3 and DFlash drafts, not Medusa heads: train EAGLE-3 "
            "(recipes/smollm2-135m/eagle3.yaml) and export it with `--format llamacpp` (docs/serving.md, "
            "\"llama.cpp (GGUF)\")."]


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(DemoConfig, argv)
    out = Path(cfg.output_dir)
    with claim_output_dir(out, DEMO_RUN):  # new, empty or an earlier demo's; one demo at a time
        stages = run_stages(cfg)
        results = json.loads((out / "bench" / "results.json").read_text())
        heads_metrics = json.loads((out / "medusa" / "heads" / "metrics.json").read_text())
        text = summary(cfg, stages, results, heads_metrics, record_bench_run(out, results))
        (out / "summary.md").write_text(text)
    print("\n" + text, flush=True)


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, StageError, OutputDirError) as err:  # a bad flag or recipe; a failed stage: one line, exit 2
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
