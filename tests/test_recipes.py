"""Every recipe loads into its script's config, and opens with the command that launches it."""

from pathlib import Path

import pytest
import yaml

from headstart.train.config import parse_config
from headstart.train.dflash import DFlashTrainConfig
from headstart.train.eagle import EagleTrainConfig
from headstart.train.medusa import MedusaTrainConfig
from headstart.train.selfdistill import SelfDistillConfig

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
SCRIPT_CONFIGS = {"selfdistill": SelfDistillConfig, "medusa": MedusaTrainConfig, "eagle": EagleTrainConfig,
                  "dflash": DFlashTrainConfig}


def script_recipes():
    return sorted(p for p in RECIPES.rglob("*.yaml") if p.parent.name != "accelerate")


def config_class(path: Path):
    stem = path.stem.rstrip("0123456789")  # medusa2.yaml -> medusa, eagle3.yaml -> eagle
    if stem not in SCRIPT_CONFIGS:
        pytest.fail(f"{path}: no script config known for recipes named {path.stem!r}")
    return SCRIPT_CONFIGS[stem]


@pytest.mark.parametrize("path", script_recipes(), ids=lambda p: str(p.relative_to(RECIPES)))
def test_recipe_loads_and_names_its_launch_command(path):
    cfg = parse_config(config_class(path), ["--config", str(path)])
    recipe = yaml.safe_load(path.read_text())
    for key, value in recipe.items():
        assert getattr(cfg, key) == value
    first_lines = path.read_text().splitlines()[:6]
    assert any(f"train/{path.stem.rstrip('0123456789')}.py" in line for line in first_lines if line.startswith("#"))


@pytest.mark.parametrize("path", sorted((RECIPES / "accelerate").glob("*.yaml")), ids=lambda p: p.name)
def test_accelerate_configs_parse(path):
    config = yaml.safe_load(path.read_text())
    assert config["distributed_type"] in ("MULTI_GPU", "DEEPSPEED", "FSDP")
    assert config["num_processes"] >= 1


def test_recipes_exist_for_the_embedded_default_and_two_gpu_targets():
    names = {str(p.relative_to(RECIPES)) for p in script_recipes()}
    assert {"smollm2-135m/selfdistill.yaml", "smollm2-135m/medusa.yaml", "smollm2-135m/medusa2.yaml"} <= names
    assert any(n.startswith("llama-3") for n in names) and any(n.startswith("qwen") for n in names)
