"""Script configs: one dataclass per script, a recipe YAML via `--config`, any field overridable.

    cfg = parse_config(SelfDistillConfig)            # reads sys.argv
    cfg = parse_config(SelfDistillConfig, ["--config", "recipes/x.yaml", "--num_prompts", "8"])

A recipe path that is not a file from the working directory names a shipped recipe (resolve_recipe):
`recipes/smollm2-135m/medusa.yaml` or `smollm2-135m/medusa` works from any directory, from a clone or an install.

Precedence: dataclass defaults < recipe YAML < command line. Unknown keys in the YAML and unknown
flags on the command line are errors (the TRL script convention). A recipe is plain YAML data: tags other than
YAML's own, anchors and aliases are refused (an alias can expand a few lines into gigabytes).
Each config field's trailing `# comment` is its flag's --help text (`field_help`): every field has one.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import math
import sys
import tokenize
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, TypeVar

import yaml
from transformers import HfArgumentParser

from headstart.train.muon import check_precision

from headstart.heads.target import resolve_dtype

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
    output_dir: str = "runs/heads"  # where the heads directory, checkpoints and train_log.jsonl go
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
    per_device_batch_size: int = 4  # rows per batch on each process
    gradient_accumulation_steps: int = 1  # batches per optimizer step
    num_epochs: int = 1  # passes over the training rows (unless max_steps is set)
    max_steps: int = -1  # optimizer steps; > 0 overrides num_epochs (and sets the schedule length)
    learning_rate: float = 1e-3  # peak learning rate (cosine schedule with warmup)
    weight_decay: float = 0.0  # AdamW weight decay
    warmup_ratio: float = 0.1  # share of the optimizer steps the learning rate warms up over, in [0, 1)
    max_grad_norm: float = 1.0  # gradients are clipped to this global norm
    # optimizer muon: its Newton-Schulz iteration's dtype; auto = bfloat16 where the device multiplies bf16 in hardware
    # (about twice as fast there), else float32 (train/muon.py)
    muon_precision: str = "auto"  # auto | float32 | bfloat16
    seed: int = 0  # seeds the weights' initialisation and each epoch's row order
    # checkpoints, logging, output
    checkpoint_every: int = 0  # optimizer steps between accelerate save_state checkpoints; 0 = none
    keep_checkpoints: int = 2  # newest checkpoints kept (older ones are removed)
    resume: bool = False  # continue from the newest checkpoint in output_dir/checkpoints
    stop_after_steps: int = -1  # stop after this step as if preempted (schedule unchanged); for tests
    report_to: str = "none"  # none | wandb | tensorboard
    log_every: int = 10  # optimizer steps between records sent to the tracker (report_to)
    push_to_hub: Optional[str] = None  # Hub repo id to upload the heads directory to at the end
    push_format: str = "headstart"  # headstart (the heads directory) | vllm | sglang | speculators (heads/export.py)


def check_run_config(cfg: TrainRunConfig, methods: tuple[str, ...]) -> None:
    """The checks every training script makes on the shared fields; `methods`: the script's."""
    if cfg.method not in methods:
        raise ConfigError(f"method must be {' or '.join(map(repr, methods))}, got {cfg.method!r}")
    if cfg.push_format not in ("headstart", "vllm", "sglang", "speculators"):
        raise ConfigError(f"push_format must be headstart, vllm, sglang or speculators, got {cfg.push_format!r}")
    try:
        check_precision(cfg.muon_precision, "muon_precision")
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if cfg.report_to not in ("none", "wandb", "tensorboard"):
        raise ConfigError(f"report_to must be none, wandb or tensorboard, got {cfg.report_to!r}")
    check_number(cfg, "per_device_batch_size", 1)
    check_number(cfg, "gradient_accumulation_steps", 1)
    check_number(cfg, "max_steps", 1, unset=-1, unset_means="train num_epochs epochs")
    if cfg.max_steps == -1:
        check_number(cfg, "num_epochs", 1, hint="or set max_steps > 0")
    for name in ("learning_rate", "lm_head_learning_rate", "target_learning_rate"):  # 0 freezes those weights
        if hasattr(cfg, name):
            check_number(cfg, name, 0)
    check_number(cfg, "weight_decay", 0)
    check_number(cfg, "warmup_ratio", 0, high=1, below=True)
    check_number(cfg, "max_grad_norm", 0, above=True)
    check_number(cfg, "max_length", 2)
    check_number(cfg, "eval_rows", 0, unset=-1, unset_means="5% of the rows")
    check_number(cfg, "train_rows", 1, unset=-1, unset_means="every row")
    check_number(cfg, "num_prompts", 1)
    check_number(cfg, "seed", 0)
    check_number(cfg, "checkpoint_every", 0)
    check_number(cfg, "keep_checkpoints", 1)
    check_number(cfg, "log_every", 1)
    check_number(cfg, "stop_after_steps", 1, unset=-1, unset_means="no early stop")
    if cfg.feature_cache and cfg.feature_cache_dir:
        raise ConfigError("feature_cache (in memory; the shipped recipes set it) and feature_cache_dir (on disk) exclude "
                          "each other: add --feature_cache false to use the disk cache")
    if cfg.build_cache_only and not cfg.feature_cache_dir:
        raise ConfigError("build_cache_only needs feature_cache_dir")
    if cfg.feature_cache_writer not in ("target", "vllm"):
        raise ConfigError(f"feature_cache_writer must be target or vllm, got {cfg.feature_cache_writer!r}")
    if cfg.feature_cache_writer == "vllm" and not cfg.feature_cache_dir:
        raise ConfigError("feature_cache_writer vllm needs feature_cache_dir (the cache vLLM writes)")
    check_number(cfg, "feature_cache_shard_rows", 1)
    for name in ("dtype", "feature_cache_dtype"):
        if getattr(cfg, name) != "auto":
            try:
                resolve_dtype(getattr(cfg, name))
            except ValueError as err:
                raise ConfigError(f"{name}: {err}") from err
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output_dir {cfg.output_dir} is a file, not a directory: pass another --output_dir")


def check_number(cfg, name: str, low: float, *, above: bool = False, high: float | None = None, below: bool = False,
                 unset: float | None = None, unset_means: str = "", hint: str = "") -> None:
    """A ConfigError (one line) unless cfg.<name> is a finite number >= low (> low with `above`) and <= high (< high
    with `below`). None, and `unset` (a value meaning "not set", e.g. -1: `unset_means`), pass."""
    value = getattr(cfg, name)
    if value is None or (unset is not None and value == unset):
        return
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
          and (value > low if above else value >= low)
          and (high is None or (value < high if below else value <= high)))
    if ok:
        return
    bound = f"{'>' if above else '>='} {low:g}"
    if high is not None:
        bound += f" and {'<' if below else '<='} {high:g}"
    also = f" (or {unset:g}: {unset_means})" if unset is not None else f" ({hint})" if hint else ""
    raise ConfigError(f"{name} must be a number {bound}{also}, got {value!r}: pass another --{name}")


def _find_config_path(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a path to a recipe YAML file")
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


class RecipeLoader(yaml.SafeLoader):
    """YAML's safe loader without anchors and aliases: a recipe is a few plain values, and an alias nested in
    aliases expands a few lines into gigabytes."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise yaml.composer.ComposerError(None, None, "anchors (&name) and aliases (*name) are not allowed in a "
                                              "recipe", event.start_mark)
        return super().compose_node(parent, index)


# the shipped recipes: the repository's recipes/ beside train/, or headstart/recipes/ in an install (package data)
SHIPPED_RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def shipped_recipes() -> list[str]:
    """The shipped recipes by name (`smollm2-135m/medusa`); accelerate's launch configs are not recipes."""
    return sorted(path.relative_to(SHIPPED_RECIPES).with_suffix("").as_posix()
                  for path in SHIPPED_RECIPES.glob("*/*.yaml") if path.parent.name != "accelerate")


def resolve_recipe(path: str) -> Path:
    """The recipe file `path` names: the file itself when it exists from the working directory, else the shipped
    recipe of that name (`recipes/smollm2-135m/medusa.yaml`, `smollm2-135m/medusa.yaml` or `smollm2-135m/medusa`).
    ConfigError (one line listing the shipped recipes) when neither exists."""
    given = Path(path)
    if given.is_file():
        return given
    name = given.as_posix().removeprefix("./").removeprefix("recipes/")
    for candidate in (SHIPPED_RECIPES / name, SHIPPED_RECIPES / f"{name}.yaml"):
        if not given.is_absolute() and candidate.is_file():
            return candidate
    shipped = ", ".join(shipped_recipes()) or "none found"
    raise ConfigError(f"recipe {path} does not exist: pass a recipe file, or a shipped recipe by name ({shipped})")


def read_recipe_yaml(path: str):
    """A recipe file's YAML data (resolve_recipe: a file, or a shipped recipe by name); ConfigError (one line naming
    the file, and the line) for text that is not UTF-8, a syntax error, a tag other than YAML's own (e.g.
    !!python/object) or an anchor/alias."""
    file = resolve_recipe(path)
    try:
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"recipe {path} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}): "
                          "save it as UTF-8") from err
    try:
        return yaml.load(text, Loader=RecipeLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = " ".join(str(err.problem or err.context).split())
        if isinstance(err, yaml.constructor.ConstructorError):
            fix = "a recipe holds plain values (numbers, strings, true/false, lists): remove the tag"
        elif isinstance(err, yaml.composer.ComposerError):
            fix = "write each value out"
        else:
            fix = "fix the YAML syntax there"
        raise ConfigError(f"recipe {path}{where}: {problem}; {fix}") from err
    except yaml.YAMLError as err:
        raise ConfigError(f"recipe {path} is not valid YAML ({' '.join(str(err).split())}): fix its syntax") from err


def load_recipe(path: str, cls: type) -> dict:
    """Read a recipe YAML and check its keys against the dataclass `cls`."""
    recipe = read_recipe_yaml(path)
    recipe = {} if recipe is None else recipe
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


def field_help(cls: type) -> dict[str, str]:
    """{field: its --help text}: the trailing `# comment` on the field's line in the dataclass source (a subclass's
    comment wins over its base's for a redeclared field); a field without one is left out."""
    helps: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):  # no source shipped: flags keep no help
            continue
        source = inspect.cleandoc("\n" + source) if source[:1].isspace() else source
        comments = {tok.start[0]: tok.string.lstrip("#").strip()
                    for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
        (node,) = ast.parse(source).body
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.end_lineno in comments:
                helps[stmt.target.id] = comments[stmt.end_lineno]
    return helps


def describe_flags(parser, cls: type) -> None:
    """Give each of the parser's dataclass flags its field's help (field_help); argparse formats help with %."""
    helps = field_help(cls)
    for action in parser._actions:
        if action.dest not in helps or (action.help and action.help.strip()):
            continue
        text = helps[action.dest].replace("%", "%%")
        negated = any(opt.startswith("--no_") or opt.startswith("--no-") for opt in action.option_strings)
        action.help = f"set {action.dest} false ({text})" if negated else text


def parse_config(cls: type[T], argv: list[str] | None = None) -> T:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = HfArgumentParser(cls)
    describe_flags(parser, cls)
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
