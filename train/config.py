"""Script configs: one dataclass per script, a recipe YAML via `--config`, any field overridable.

    cfg = parse_config(SelfDistillConfig)            # reads sys.argv
    cfg = parse_config(SelfDistillConfig, ["--config", "recipes/x.yaml", "--num_prompts", "8"])

Precedence: dataclass defaults < recipe YAML < command line. Unknown keys in the YAML and unknown
flags on the command line are errors (the TRL script convention).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, TypeVar

import yaml
from transformers import HfArgumentParser

from heads.target import resolve_dtype

T = TypeVar("T")


class ConfigError(ValueError):
    """A recipe or command line that does not match the script's config."""


@dataclass
class TrainRunConfig:
    """Fields every training script (train/medusa.py, train/eagle.py) shares: target, data, schedule, checkpoints,
    logging. A script's config subclasses it, adds its method's fields and may redeclare a default."""

    config: Optional[str] = None  # recipe YAML
    method: str = ""  # each script's config sets its default and checks the value
    # target and data
    target: str = "smollm2-135m"  # alias, Hub id, local dir or .gguf file
    dtype: str = "auto"  # target dtype: auto = bfloat16 on CUDA, float32 on CPU
    data_dir: str = "runs/sd-mix-768"  # a train/selfdistill.py output dir (dataset/ + meta.json)
    selfdistill_recipe: Optional[str] = None  # used when data_dir holds no dataset yet: self-distil first
    num_prompts: Optional[int] = 768  # prompts (of the self-distillation recipe's source) to self-distil when data_dir is empty
    output_dir: str = "runs/heads"
    max_length: int = 512  # tokens per row (longer rows are cut)
    eval_rows: int = -1  # the last eval_rows rows are held out; -1 = 5% (at least 1)
    train_rows: int = -1  # > 0: train on only the first train_rows rows (data-scaling runs; eval rows unchanged)
    # the target's features (train/features.py): online, in memory (feature_cache), or on disk (feature_cache_dir)
    feature_cache: bool = False  # keep each row's target features in memory (train/features.py)
    feature_cache_dir: Optional[str] = None  # offline feature cache on disk (written first if missing; resumable)
    feature_cache_dtype: str = "auto"  # auto = the target's dtype (exactly what online training sees)
    feature_cache_shard_rows: int = 64  # rows per cache file
    feature_cache_writer: str = "target"  # target: headstart runs the target; vllm: scripts/vllm_features.py writes it
    build_cache_only: bool = False  # write feature_cache_dir, then stop
    # optimisation
    per_device_batch_size: int = 4
    gradient_accumulation_steps: int = 1
    num_epochs: int = 1
    max_steps: int = -1  # optimizer steps; > 0 overrides num_epochs (and sets the schedule length)
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    warmup_ratio: float = 0.1
    max_grad_norm: float = 1.0
    seed: int = 0
    # checkpoints, logging, output
    checkpoint_every: int = 0  # optimizer steps between accelerate save_state checkpoints; 0 = none
    keep_checkpoints: int = 2
    resume: bool = False  # continue from the newest checkpoint in output_dir/checkpoints
    stop_after_steps: int = -1  # stop after this step as if preempted (schedule unchanged); for tests
    report_to: str = "none"  # none | wandb | tensorboard
    log_every: int = 10
    push_to_hub: Optional[str] = None  # Hub repo id to upload the heads directory to at the end
    push_format: str = "headstart"  # headstart (the heads directory) | vllm | sglang | speculators (heads/export.py)


def check_run_config(cfg: TrainRunConfig, methods: tuple[str, ...]) -> None:
    """The checks every training script makes on the shared fields; `methods`: the script's."""
    if cfg.method not in methods:
        raise ConfigError(f"method must be {' or '.join(map(repr, methods))}, got {cfg.method!r}")
    if cfg.push_format not in ("headstart", "vllm", "sglang", "speculators"):
        raise ConfigError(f"push_format must be headstart, vllm, sglang or speculators, got {cfg.push_format!r}")
    if cfg.report_to not in ("none", "wandb", "tensorboard"):
        raise ConfigError(f"report_to must be none, wandb or tensorboard, got {cfg.report_to!r}")
    if cfg.per_device_batch_size < 1 or cfg.gradient_accumulation_steps < 1:
        raise ConfigError("per_device_batch_size and gradient_accumulation_steps must be >= 1")
    for name in ("learning_rate", "lm_head_learning_rate", "target_learning_rate"):
        value = getattr(cfg, name, None)
        if value is not None and not (math.isfinite(value) and value >= 0):  # 0 freezes those weights
            raise ConfigError(f"{name} must be a non-negative number, got {value!r}")
    if not 0 <= cfg.warmup_ratio < 1 or cfg.weight_decay < 0:
        raise ConfigError(f"warmup_ratio must be in [0, 1) and weight_decay >= 0, got {cfg.warmup_ratio}, {cfg.weight_decay}")
    if cfg.feature_cache and cfg.feature_cache_dir:
        raise ConfigError("feature_cache (in memory) and feature_cache_dir (on disk) exclude each other: choose one")
    if cfg.build_cache_only and not cfg.feature_cache_dir:
        raise ConfigError("build_cache_only needs feature_cache_dir")
    if cfg.feature_cache_writer not in ("target", "vllm"):
        raise ConfigError(f"feature_cache_writer must be target or vllm, got {cfg.feature_cache_writer!r}")
    if cfg.feature_cache_writer == "vllm" and not cfg.feature_cache_dir:
        raise ConfigError("feature_cache_writer vllm needs feature_cache_dir (the cache vLLM writes)")
    if cfg.feature_cache_shard_rows < 1:
        raise ConfigError(f"feature_cache_shard_rows must be >= 1, got {cfg.feature_cache_shard_rows}")
    for name in ("dtype", "feature_cache_dtype"):
        if getattr(cfg, name) != "auto":
            try:
                resolve_dtype(getattr(cfg, name))
            except ValueError as err:
                raise ConfigError(f"{name}: {err}") from err
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir {cfg.output_dir} is a file, not a directory: pass another --output_dir")


def _find_config_path(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a path to a recipe YAML file")
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def load_recipe(path: str, cls: type) -> dict:
    """Read a recipe YAML and check its keys against the dataclass `cls`."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"recipe {path} does not exist")
    recipe = yaml.safe_load(file.read_text()) or {}
    if not isinstance(recipe, dict):
        raise ConfigError(f"recipe {path} must be a mapping of field: value, got {type(recipe).__name__}")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(recipe) - fields)
    if unknown:
        raise ConfigError(
            f"recipe {path} has unknown key(s) {unknown} for {cls.__name__}; valid keys: {sorted(fields - {'config'})}"
        )
    hints = typing.get_type_hints(cls)
    for key, value in recipe.items():
        if not _has_type(value, hints[key]):
            raise ConfigError(f"recipe {path}: {key} must be {_type_name(hints[key])}, got {value!r}")
    return recipe


def _has_type(value, hint) -> bool:
    """Whether a YAML value fits a config field's annotation (the command line's argparse checks its own)."""
    if typing.get_origin(hint) is typing.Union:
        return any(_has_type(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_has_type(v, item) for v in value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _type_name(hint) -> str:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union:
        return f"{_type_name(args[0])} or null"
    if typing.get_origin(hint) is list:
        return f"a list of {_type_name(args[0])}"
    return {float: "a number", int: "an integer", bool: "true or false", str: "a string"}.get(hint, str(hint))


def parse_config(cls: type[T], argv: list[str] | None = None) -> T:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = HfArgumentParser(cls)
    config_path = _find_config_path(argv)
    if config_path is not None:
        parser.set_defaults(**load_recipe(config_path, cls))
    try:
        (cfg,) = parser.parse_args_into_dataclasses(args=argv)
    except ValueError as err:  # HfArgumentParser's message for leftover arguments
        raise ConfigError(f"{err}; run with --help to list the flags of {cls.__name__}") from err
    return cfg


def build_config(cls: type[T], recipe: str | None = None, **overrides) -> T:
    """A config without a command line (a script running another script's job): dataclass defaults < the recipe YAML
    < overrides, the recipe checked as parse_config checks it."""
    values = load_recipe(recipe, cls) if recipe else {}
    return cls(**{**values, **overrides, "config": recipe})
