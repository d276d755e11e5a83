"""Script configs: one dataclass per script, a recipe YAML via `--config`, any field overridable.

    cfg = parse_config(SelfDistillConfig)            # reads sys.argv
    cfg = parse_config(SelfDistillConfig, ["--config", "recipes/x.yaml", "--num_prompts", "8"])

Precedence: dataclass defaults < recipe YAML < command line. Unknown keys in the YAML and unknown
flags on the command line are errors (the TRL script convention).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TypeVar

import yaml
from transformers import HfArgumentParser

T = TypeVar("T")


class ConfigError(ValueError):
    """A recipe or command line that does not match the script's config."""


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
    return recipe


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
