"""Every recipe loads into its script's config, and opens with the command that launches it."""

import importlib
from pathlib import Path

import pytest
import yaml

from headstart.heads.methods import method_of
from headstart.train.config import ConfigError, build_config, parse_config, resolve_recipe, shipped_recipes
from headstart.train.medusa import MedusaTrainConfig
from headstart.train.selfdistill import SelfDistillConfig

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def script_recipes():
    return sorted(p for p in RECIPES.rglob("*.yaml") if p.parent.name != "accelerate")


def config_class(path: Path):
    """The recipe's config dataclass: self-distillation's, or its method's trainer's (heads/methods.py)."""
    method = yaml.safe_load(path.read_text()).get("method")
    if method is None:
        return SelfDistillConfig
    declared = method_of(method)
    return getattr(importlib.import_module(declared.trainer), declared.train_config)


@pytest.mark.parametrize("path", script_recipes(), ids=lambda p: str(p.relative_to(RECIPES)))
def test_recipe_loads_and_names_its_launch_command(path):
    cfg = parse_config(config_class(path), ["--config", str(path)])
    recipe = yaml.safe_load(path.read_text())
    for key, value in recipe.items():
        assert getattr(cfg, key) == value
    first_lines = path.read_text().splitlines()[:6]
    script = "selfdistill" if cfg.__class__ is SelfDistillConfig else method_of(cfg.method).trainer.rsplit(".", 1)[1]
    assert any(f"train/{script}.py" in line for line in first_lines if line.startswith("#"))


@pytest.mark.parametrize("path", sorted((RECIPES / "accelerate").glob("*.yaml")), ids=lambda p: p.name)
def test_accelerate_configs_parse(path):
    config = yaml.safe_load(path.read_text())
    assert config["distributed_type"] in ("MULTI_GPU", "DEEPSPEED", "FSDP")
    assert config["num_processes"] >= 1


def test_recipes_exist_for_the_embedded_default_and_two_gpu_targets():
    names = {str(p.relative_to(RECIPES)) for p in script_recipes()}
    assert {"smollm2-135m/selfdistill.yaml", "smollm2-135m/medusa.yaml", "smollm2-135m/medusa2.yaml"} <= names
    assert any(n.startswith("llama-3") for n in names) and any(n.startswith("qwen") for n in names)


# ----------------------------------------------------------------------------------------------------
# a shipped recipe by name, from any directory (train/config.py resolve_recipe)


def test_a_shipped_recipe_is_found_by_path_or_name_from_another_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no recipes/ here
    recipe = yaml.safe_load((RECIPES / "smollm2-135m" / "medusa.yaml").read_text())
    for name in ("recipes/smollm2-135m/medusa.yaml", "smollm2-135m/medusa.yaml", "smollm2-135m/medusa"):
        assert resolve_recipe(name) == RECIPES / "smollm2-135m" / "medusa.yaml"
        cfg = parse_config(MedusaTrainConfig, ["--config", name])
        assert {key: getattr(cfg, key) for key in recipe} == recipe
        assert cfg.config == name
    # the self-distillation recipe a training recipe names resolves the same way
    distill = build_config(SelfDistillConfig, cfg.selfdistill_recipe)
    assert cfg.selfdistill_recipe == "recipes/smollm2-135m/selfdistill.yaml"
    assert distill.num_prompts == yaml.safe_load((RECIPES / "smollm2-135m" / "selfdistill.yaml").read_text())["num_prompts"]


def test_a_recipe_file_in_the_working_directory_wins_over_the_shipped_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes" / "smollm2-135m").mkdir(parents=True)
    (tmp_path / "recipes" / "smollm2-135m" / "medusa.yaml").write_text("method: medusa\nnum_heads: 2\n")
    assert resolve_recipe("recipes/smollm2-135m/medusa.yaml") == Path("recipes/smollm2-135m/medusa.yaml")
    assert parse_config(MedusaTrainConfig, ["--config", "recipes/smollm2-135m/medusa.yaml"]).num_heads == 2


def test_a_missing_recipe_is_one_line_listing_the_shipped_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shipped = sorted(p.relative_to(RECIPES).with_suffix("").as_posix() for p in script_recipes())
    assert shipped_recipes() == shipped and "smollm2-135m/medusa" in shipped
    for name in ("recipes/smollm2-135m/nope.yaml", "nope", str(tmp_path / "smollm2-135m" / "medusa.yaml")):
        with pytest.raises(ConfigError) as err:
            parse_config(MedusaTrainConfig, ["--config", name])
        assert str(err.value) == (f"recipe {name} does not exist: pass a recipe file, or a shipped recipe by name "
                                  f"({', '.join(shipped)})")
