"""The `headstart` command: one subcommand per stage, each handing the rest of its command line to that stage's own
`main`, so its flags and `--help` are the stage's.

    headstart selfdistill --config recipes/smollm2-135m/selfdistill.yaml --output_dir runs/sd
    headstart train --config recipes/smollm2-135m/medusa.yaml --output_dir runs/medusa    (the trainer: method:)
    headstart generate --heads runs/medusa/heads --prompt "Tell me about owls."
    headstart bench --heads runs/medusa/heads --output runs/bench
    headstart export runs/medusa/heads out/medusa-vllm --format vllm
    headstart acceptance --chain --heads runs/medusa/heads
    headstart vllm-check speed --heads runs/medusa/heads --vllm_python /path/to/vllm-venv/bin/python

A recipe is a file, or a shipped recipe by name from any directory (`smollm2-135m/medusa`; train/config.py
resolve_recipe). Each stage also runs as a module: `python -m headstart.inference.bench ...`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from headstart import __version__

# subcommand -> (the module whose main runs it, its line in `headstart --help`)
STAGES = {
    "selfdistill": ("headstart.train.selfdistill", "self-distil: the target answers prompts (the training data)"),
    "train": (None, "train draft heads by the recipe's method: (or --method); `headstart train --help` lists the "
                    "methods"),
    "generate": ("headstart.inference.generate", "generate with trained heads (speculative decoding, lossless)"),
    "bench": ("headstart.inference.bench", "benchmark heads against plain greedy and prompt lookup"),
    "export": ("headstart.heads.export", "export heads for a serving engine (vLLM, SGLang, speculators, llama.cpp)"),
    "acceptance": ("headstart.inference.acceptance", "acceptance on held-out prompts (--chain: what an engine's "
                   "fixed chain gets, which the export's draft length reads)"),
    "replay": ("headstart.inference.replay", "replay the adaptive drafting policy over recorded decodes"),
    "vllm-check": ("headstart.inference.vllm_check", "the engine check in vLLM: exports served, outputs, acceptance "
                   "and tokens/s against headstart's"),
    "llamacpp-check": ("headstart.inference.llamacpp_check", "the engine check in llama.cpp's llama-server: the "
                       "same for GGUF exports"),
}


def trainers() -> dict[str, str]:
    """A training method -> its trainer module: each registered drafting method's declaration (heads/methods.py)."""
    from headstart.heads.methods import method_names, method_of

    return {name: method_of(name).trainer for name in method_names() if method_of(name).trainer is not None}


def train_usage() -> str:
    return ("usage: headstart train --config RECIPE [flags] | headstart train --method METHOD [flags]\n"
            f"The trainer is the recipe's method: (or --method, which wins): {', '.join(trainers())}.\n"
            "`headstart train --method medusa --help` lists a trainer's flags.")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: the stage names and their one-line help (a stage parses its own flags)."""
    parser = argparse.ArgumentParser(prog="headstart", description="Train draft heads on a target's own outputs and "
                                     "run them. Each stage's flags: headstart STAGE --help.")
    parser.add_argument("--version", action="version", version=f"headstart {__version__}")
    stages = parser.add_subparsers(dest="stage", metavar="STAGE", title="stages")
    for name, (_, line) in STAGES.items():
        stages.add_parser(name, help=line, add_help=False)
    return parser


def last_flag_value(argv: list[str], flag: str) -> str | None:
    """The value of the last `--flag VALUE` / `--flag=VALUE` in argv (argparse takes the last), or None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def trainer_module(argv: list[str]) -> str | None:
    """The trainer for `headstart train ARGV`: --method, else the recipe's method: field; None when neither names
    one. ConfigError for an unknown method or a missing recipe."""
    from headstart.train.config import ConfigError, read_recipe_yaml

    known = trainers()
    method = last_flag_value(argv, "--method")
    recipe = last_flag_value(argv, "--config")
    if method is None and recipe is not None:
        data = read_recipe_yaml(recipe)
        method = data.get("method") if isinstance(data, dict) else None
        if method is None:
            raise ConfigError(f"recipe {recipe} has no method: field: pass --method ({', '.join(known)})")
    if method is None:
        return None
    if method not in known:
        raise ConfigError(f"unknown method {method!r}: pass --method (or a recipe's method:) as one of "
                          f"{', '.join(known)}")
    return known[method]


def run_stage(module_name: str, argv: list[str], prog: str) -> int:
    """The stage module's main(argv); its user errors print one line and exit 2 (train/cli.py run_main). A parser
    that names itself after sys.argv[0] (the trainers') shows `prog` in its usage meanwhile."""
    from headstart.train.cli import run_main

    code = 0

    def call() -> None:
        nonlocal code
        result = importlib.import_module(module_name).main(argv)
        code = result if isinstance(result, int) else 0  # trainers return their metrics, selfdistill None

    shown, sys.argv[0] = sys.argv[0], prog
    try:
        run_main(call)
    finally:
        sys.argv[0] = shown
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in STAGES:  # --help, --version, no stage, or a wrong one: argparse answers
        parser.parse_args(argv or ["--help"])
        return 2  # unreachable: parse_args exits for each of these
    stage, rest = argv[0], argv[1:]
    if stage != "train":
        return run_stage(STAGES[stage][0], rest, f"headstart {stage}")
    from headstart.train.cli import run_main

    module = None

    def pick() -> None:
        nonlocal module
        module = trainer_module(rest)

    run_main(pick)  # a missing recipe or an unknown method: one line, exit 2
    if module is None:
        print(train_usage(), file=sys.stdout if {"-h", "--help"} & set(rest) else sys.stderr)
        return 0 if {"-h", "--help"} & set(rest) else 2
    return run_stage(module, rest, "headstart train")


if __name__ == "__main__":
    raise SystemExit(main())
