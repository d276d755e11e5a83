"""The `headstart` command (headstart/cli.py) and the package namespace: each stage's argv goes to that stage's own
main; `train` picks its trainer from the recipe's method: (or --method); the source tree maps headstart.heads to
./heads; a wheel holds the package `headstart` alone, with the recipes."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import headstart
from headstart.cli import STAGES, main, trainer_module, trainers

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"


def test_help_lists_each_stage_with_its_line(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert out.startswith("usage: headstart [-h] [--version] STAGE ...")
    for name, (_, line) in STAGES.items():
        assert f"{name} {line}" in out
    assert list(STAGES) == ["selfdistill", "train", "generate", "bench", "export", "acceptance", "replay", "vllm-check",
                            "llamacpp-check"]


def test_version_and_an_unknown_stage(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"headstart {headstart.__version__}\n"
    with pytest.raises(SystemExit) as done:
        main(["distill"])
    assert done.value.code == 2 and "invalid choice: 'distill'" in capsys.readouterr().err


def test_train_picks_the_trainer_from_the_recipe_or_method():
    expected = trainers()  # every registered method with a trainer (heads/methods.py); a new one adds itself
    built_in = {"medusa": "headstart.train.medusa", "medusa2": "headstart.train.medusa",
                "eagle": "headstart.train.eagle", "eagle3": "headstart.train.eagle", "dflash": "headstart.train.dflash"}
    assert built_in.items() <= expected.items()
    for module in set(expected.values()):
        assert callable(importlib.import_module(module).main), module
    recipes = sorted(p for p in RECIPES.glob("*/*.yaml") if p.parent.name != "accelerate" and p.stem != "selfdistill")
    assert {p.stem for p in recipes} == set(expected)  # a recipe of every method
    for path in recipes:
        method = path.stem  # each recipe is named after its method
        assert trainer_module(["--config", str(path)]) == expected[method], path
    assert trainer_module(["--config", "smollm2-135m/medusa", "--method", "dflash"]) == "headstart.train.dflash"
    assert trainer_module(["--method=eagle3"]) == "headstart.train.eagle"
    assert trainer_module(["--output_dir", "x"]) is None


@pytest.mark.parametrize("argv,usage", [
    (["selfdistill", "--help"], "usage: headstart selfdistill [-h]"),
    (["train", "--config", "smollm2-135m/eagle3", "--help"], "usage: headstart train [-h]"),
    (["generate", "--help"], "usage: python -m headstart.inference.generate [-h]"),
    (["bench", "--help"], "usage: python -m headstart.inference.bench [-h]"),
    (["export", "--help"], "usage: python -m headstart.heads.export [-h]"),
    (["acceptance", "--help"], "usage: headstart acceptance [-h]"),
    (["replay", "--help"], "usage: python -m headstart.inference.replay [-h]"),
    (["vllm-check", "--help"], "usage: headstart vllm-check [-h]"),
    (["llamacpp-check", "--help"], "usage: headstart llamacpp-check [-h]"),
])
def test_each_stage_shows_its_own_help(argv, usage, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.startswith(usage)
    if argv[0] == "train":
        assert "--ttt_decay" in out  # EAGLE's trainer, from the recipe's method: eagle3


def test_train_without_a_method_shows_its_usage(capsys):
    assert main(["train", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: headstart train --config RECIPE [flags] | headstart train")
    assert main(["train", "--output_dir", "x"]) == 2
    assert capsys.readouterr().err.startswith("usage: headstart train --config RECIPE")


@pytest.mark.parametrize("argv,message", [
    (["train", "--config", "smollm2-135m/nope"], "error: recipe smollm2-135m/nope does not exist: pass a recipe file, "
                                                 "or a shipped recipe by name ("),
    (["train", "--method", "medusa3"], "error: unknown method 'medusa3': pass --method (or a recipe's method:) as one "
                                       "of {methods}"),
    (["train", "--config", "smollm2-135m/selfdistill"], "error: recipe smollm2-135m/selfdistill has no method: field: "
                                                        "pass --method ({methods})"),
])
def test_a_bad_train_command_is_one_line_and_exit_2(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as done:
        main(argv)
    err = capsys.readouterr().err
    message = message.replace("{methods}", ", ".join(trainers()))
    assert done.value.code == 2 and err.startswith(message) and err.count("\n") == 1


def test_the_stages_run_through_the_command(tiny_target_dir, tmp_path, monkeypatch, one_thread, capsys):
    """self-distil -> train (a shipped recipe by name, from a directory without recipes/) -> generate -> export."""
    monkeypatch.chdir(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"r{i}", "turns": [f"hello there number {i}, how are you?"]})
                                 for i in range(6)))
    assert main(["selfdistill", "--config", "smollm2-135m/selfdistill", "--target", str(tiny_target_dir), "--prompts",
                 str(prompts), "--num_prompts", "6", "--max_new_tokens", "12", "--max_length", "256",
                 "--output_dir", "sd"]) == 0
    assert (tmp_path / "sd" / "dataset").is_dir() and json.loads((tmp_path / "sd" / "meta.json").read_text())["rows"] == 6
    assert main(["train", "--config", "recipes/smollm2-135m/medusa.yaml", "--target", str(tiny_target_dir),
                 "--data_dir", "sd", "--max_steps", "2", "--eval_rows", "2", "--per_device_batch_size", "2",
                 "--gradient_accumulation_steps", "1", "--draft_vocab_size", "64", "--max_length", "256",
                 "--report_to", "none", "--output_dir", "medusa"]) == 0
    config = json.loads((tmp_path / "medusa" / "heads" / "config.json").read_text())
    assert config["method"] == "medusa" and config["num_heads"] == 3  # the recipe's
    capsys.readouterr()
    assert main(["generate", "--heads", "medusa/heads", "--prompt", "hi", "--max_new_tokens", "4"]) == 0
    assert "tau" in capsys.readouterr().err  # the decoding stats
    assert main(["export", "medusa/heads", "out-vllm", "--format", "vllm"]) == 0
    assert {"config.json", "model.safetensors", "README.md"} <= {p.name for p in (tmp_path / "out-vllm").iterdir()}


def test_the_console_script_and_python_m_headstart(tmp_path):
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"headstart": "headstart.cli:main"}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "headstart", "--help"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("usage: headstart ")
    assert all(name in run.stdout for name in STAGES)


def test_the_source_tree_maps_the_folders_into_headstart(tmp_path):
    import headstart.heads
    import headstart.inference
    import headstart.train

    for name in ("heads", "train", "inference"):
        assert Path(getattr(headstart, name).__file__) == ROOT / name / "__init__.py"
    # a copy of the package without the source tree around it (an install) adds nothing to its path
    site = tmp_path / "site"
    shutil.copytree(ROOT / "headstart", site / "headstart", ignore=shutil.ignore_patterns("__pycache__"))
    run = subprocess.run([sys.executable, "-c", "import headstart; print(headstart.__path__)"], cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == str([str(site / "headstart")]), run.stderr


def test_the_wheel_holds_headstart_alone_with_the_recipes(tmp_path):
    """Built from a copy of the files the package is made of (the checkout stays free of build/ and egg-info)."""
    src = tmp_path / "src"
    for name in ("headstart", "train", "heads", "inference", "recipes"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "--wheel-dir", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp_path / "dist").glob("headstart-*.whl")
    assert wheel.name.startswith(f"headstart-{headstart.__version__}-")
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"headstart", f"headstart-{headstart.__version__}.dist-info"}
    for folder in ("train", "heads", "inference"):
        expected = {f"headstart/{folder}/{p.name}" for p in (ROOT / folder).glob("*.py")}
        assert expected <= set(names) and len(expected) > 3
    recipes = {f"headstart/recipes/{p.relative_to(RECIPES).as_posix()}" for p in RECIPES.glob("*/*.yaml")}
    assert recipes == {name for name in names if name.startswith("headstart/recipes/")}
    assert {"headstart/__init__.py", "headstart/cli.py", "headstart/__main__.py"} <= set(names)
    entry_points = zipfile.ZipFile(wheel).read(f"headstart-{headstart.__version__}.dist-info/entry_points.txt")
    assert "headstart = headstart.cli:main" in entry_points.decode()



def test_the_api_entry_points_import_from_the_package_on_first_use():
    """`from headstart import Speculator, prompt_ids` is the README's API; `import headstart` alone loads no torch."""
    code = ("import sys, headstart; assert 'torch' not in sys.modules; "
            "from headstart import Speculator, SpeculatorError, prompt_ids, load_heads; "
            "from headstart.inference.speculator import Speculator as S; from headstart.heads.chat import prompt_ids as p; "
            "assert Speculator is S and prompt_ids is p and 'torch' in sys.modules; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr
    with pytest.raises(AttributeError, match="module 'headstart' has no attribute 'Speculater'"):
        headstart.Speculater
