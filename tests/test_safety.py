"""Nothing lost, nothing executed (issue 23): an export never deletes what it did not write, a checkpoint folder runs
no pickled code on --resume, a full disk is named and loses no trained state, bad --tree / learning_rate /
output_dir / --num_prompts / prompt files / server URLs are one clear error, and the CLIs exit 2 on them."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from headstart.heads.directory import HeadsLoadError
from headstart.heads.export import ExportError, export_heads
from headstart.heads.load import load_heads, load_heads_and_target
from headstart.heads.medusa import MedusaConfig, MedusaHeads
from headstart.heads.output_dir import OutputDirError
from headstart.heads.prompts import PromptSourceError, load_prompts
from headstart.heads.target import load_target
from headstart.inference.decode import SpeculatorError
from test_medusa_train import base_args, heads_state, write_selfdistilled
from test_selfdistill import tiny_cfg, write_prompts
from headstart.train.config import ConfigError, parse_config
from headstart.train.medusa import MedusaTrainConfig
from headstart.train.medusa import main as medusa_main
from headstart.train.selfdistill import run_selfdistill

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def cli(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd or REPO, env=ENV, capture_output=True, text=True,
                          timeout=1800)


def assert_one_line_error(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and all(w in last for w in words), last


class Payload:
    """Unpickling this creates the directory `marker`: code a checkpoint must never get to run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def tree_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def sd_dir(tiny_target_dir, tmp_path_factory):
    return write_selfdistilled(tmp_path_factory.mktemp("sd"), tiny_target_dir)


# ------------------------------------------------------------------------------------------ 1. export


def medusa_dir(path: Path) -> Path:
    heads = MedusaHeads(MedusaConfig(hidden_size=16, vocab_size=32, num_heads=2))
    heads.save_pretrained(path)
    return path


def test_export_refuses_its_source_and_deletes_nothing_it_did_not_write(tmp_path):
    run = tmp_path / "run"
    heads = medusa_dir(run / "heads")
    (run / "checkpoints" / "step-2").mkdir(parents=True)
    (run / "checkpoints" / "step-2" / "trainer_state.json").write_text("{}")
    (run / "train_log.jsonl").write_text('{"step": 1}\n')
    before = tree_of(run)
    for out in (run, heads, heads / "vllm"):  # holds, is, lies inside the source
        with pytest.raises(ExportError, match="heads directory"):
            export_heads(heads, out, "vllm", overwrite=True)
    other = tmp_path / "notes"
    other.mkdir()
    (other / "mine.txt").write_text("keep me")
    with pytest.raises(OutputDirError, match="not empty and not a headstart export:vllm run .*mine.txt"):
        export_heads(heads, other, "vllm", overwrite=True)
    assert tree_of(run) == before and (other / "mine.txt").read_text() == "keep me"

    old = os.umask(0o022)
    try:
        out = export_heads(heads, tmp_path / "export", "vllm")
    finally:
        os.umask(old)
    assert (out.stat().st_mode & 0o777) == 0o755
    (out / "NOTES.md").write_text("mine")  # an earlier export with a file of the user's: replaced, the file kept
    with pytest.raises(ExportError, match="not empty"):
        export_heads(heads, out, "vllm")
    export_heads(heads, out, "vllm", overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [".headstart-run.json", "NOTES.md", "README.md", "config.json",
                                                     "export.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


# ------------------------------------------------------------------------------------------ 2. resume runs no code

PICKLES = ("custom_checkpoint_0.pkl", "optimizer.bin", "random_states_0.pkl", "scheduler.bin", "pytorch_model.bin")


def resume_with_payloads(run: Path, args: list[str], tmp_path: Path, main=medusa_main) -> None:
    """For each pickle-format file of run's last checkpoint (and those accelerate may read), a copy of the run with a
    code payload in that file: --resume refuses it, names the file, and the payload never runs."""
    ckpt = sorted((run / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
    assert {"optimizer.bin", "random_states_0.pkl"} <= {p.name for p in ckpt.iterdir()}
    for name in PICKLES:
        copy = tmp_path / f"copy-{name}"
        shutil.copytree(run, copy)
        marker = tmp_path / f"ran-{name}"
        torch.save(Payload(marker), copy / "checkpoints" / ckpt.name / name)
        with pytest.raises(Exception) as refused:
            main([*args[:args.index("--output_dir") + 1], str(copy), *args[args.index("--output_dir") + 2:],
                  "--resume", "true"])
        assert not marker.exists(), f"the payload in {name} ran"
        assert name in str(refused.value) and "weights_only" in str(refused.value), refused.value


def test_resume_runs_no_pickled_code(tiny_target_dir, sd_dir, tmp_path):
    args = base_args(tiny_target_dir, sd_dir, tmp_path / "run", "--max_steps", "4", "--checkpoint_every", "2",
                     "--stop_after_steps", "2")
    medusa_main(args)
    resume_with_payloads(tmp_path / "run", args, tmp_path)


def test_resume_cli_refuses_a_payload_in_one_line(tiny_target_dir, sd_dir, tmp_path):
    args = base_args(tiny_target_dir, sd_dir, tmp_path / "run", "--max_steps", "4", "--checkpoint_every", "2",
                     "--stop_after_steps", "2")
    medusa_main(args)
    marker = tmp_path / "ran"
    torch.save(Payload(marker), tmp_path / "run" / "checkpoints" / "step-2" / "optimizer.bin")
    proc = cli("train/medusa.py", *args, "--resume", "true")
    assert_one_line_error(proc, "optimizer.bin", "weights_only")
    assert not marker.exists()


# ------------------------------------------------------------------------------------------ 3. a full disk


def test_full_disk_while_checkpointing_keeps_the_last_checkpoint(tiny_target_dir, sd_dir, tmp_path, monkeypatch):
    """torch.save raising ENOSPC (monkeypatched) at the step-4 checkpoint: named with its path, step-2 kept, no
    partial folder; --resume then finishes with the weights of an uninterrupted run."""
    from headstart.train.cli import CheckpointError

    common = ["--max_steps", "6", "--checkpoint_every", "2"]
    medusa_main(base_args(tiny_target_dir, sd_dir, tmp_path / "full", *common))
    real_save = torch.save

    def save(obj, f, *a, **kw):
        if ".step-4" in str(f):
            Path(f).write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", save)
    out = tmp_path / "cut"
    with pytest.raises(CheckpointError, match=r"step-4: no space left on device.*step-2 is kept.*--resume"):
        medusa_main(base_args(tiny_target_dir, sd_dir, out, *common))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]
    monkeypatch.setattr(torch, "save", real_save)
    medusa_main(base_args(tiny_target_dir, sd_dir, out, *common, "--resume", "true"))
    full, resumed = heads_state(tmp_path / "full"), heads_state(out)
    assert all(torch.equal(full[k], resumed[k]) for k in full)


def test_full_disk_at_the_final_save_keeps_the_heads(tiny_target_dir, sd_dir, tmp_path, monkeypatch):
    """No checkpoints, the heads save fails with ENOSPC (monkeypatched safetensors writer): the heads are written to
    the system temp dir instead and the error says where; no partial heads dir is left."""
    import safetensors.torch

    from headstart.train.cli import CheckpointError

    out = tmp_path / "run"
    real = safetensors.torch.save_model

    def save_model(model, filename, *a, **kw):
        if str(out) in str(filename):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(model, filename, *a, **kw)

    monkeypatch.setattr(safetensors.torch, "save_model", save_model)
    with pytest.raises(CheckpointError, match=r"no space left on device\. It was written to (\S+) instead") as err:
        medusa_main(base_args(tiny_target_dir, sd_dir, out, "--max_steps", "2"))
    spare = Path(str(err.value).split("written to ")[1].split(" instead")[0])
    try:
        assert load_heads(spare).config.num_heads == 3 and (spare / "metrics.json").is_file()
        assert not (out / "heads").exists() and not (out / ".heads.tmp").exists()
    finally:
        shutil.rmtree(spare, ignore_errors=True)


def test_full_tmpfs_while_checkpointing_is_named(tiny_target_dir, sd_dir, tiny_disk):
    from headstart.train.cli import CheckpointError

    out = tiny_disk / "run"
    with pytest.raises(CheckpointError, match=r"could not write checkpoint .*: no space left on device") as err:
        medusa_main(base_args(tiny_target_dir, sd_dir, out, "--max_steps", "8", "--checkpoint_every", "1",
                              "--keep_checkpoints", "3"))
    done = [p for p in (out / "checkpoints").iterdir()]
    assert done and all((p / "trainer_state.json").is_file() for p in done), (err.value, done)


# ------------------------------------------------------------------------------------------ 4. --tree, heads' target


@pytest.fixture(scope="module")
def heads_dir(tiny_target_dir, tmp_path_factory):
    _, _, info = load_target(str(tiny_target_dir))
    path = tmp_path_factory.mktemp("heads")
    MedusaHeads(MedusaConfig(hidden_size=info.hidden_size, vocab_size=info.vocab_size, num_heads=2,
                             target=info.to_dict())).save_pretrained(path)
    return path


@pytest.mark.parametrize("tree, words", [
    ("[1, 2]", "not a non-empty list of ranks"),
    ("[[0], [99999]]", "rank 99999"),
    ("[[0], [0, 0], [0, 0, 0]]", "3 deep, but the heads draft only 2"),
    ("[[-1]]", "non-negative integer ranks"),
    ("[[0, 1]]", "no parent [0]"),
    ("[[0.5]]", "non-negative integer ranks"),
])
def test_bad_trees_are_one_clear_error(heads_dir, tree, words):
    from headstart.inference.speculator import Speculator

    with pytest.raises(SpeculatorError, match=r"tree .*" + __import__("re").escape(words)):
        Speculator.from_pretrained(heads_dir, tree=tree)


def test_generate_cli_bad_tree_and_missing_target_exit_2(heads_dir, tmp_path, capsys):
    from headstart.inference.generate import main

    assert main(["--heads", str(heads_dir), "--prompt", "hi", "--tree", "[1, 2]"]) == 2
    assert "not a non-empty list of ranks" in capsys.readouterr().err
    gone = tmp_path / "gone"
    shutil.copytree(heads_dir, gone)
    config = json.loads((gone / "config.json").read_text())
    config["target"]["name"] = str(tmp_path / "no-such-model")
    (gone / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadsLoadError, match=r"named in .*config\.json could not be loaded.*--target"):
        load_heads_and_target(gone)
    assert main(["--heads", str(gone), "--prompt", "hi"]) == 2
    assert "--target" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ 5. self-distillation


def test_num_prompts_0_is_a_config_error_that_writes_nothing(tiny_target_dir, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 4, turns=1)
    out = tmp_path / "sd"
    with pytest.raises(ConfigError, match="--num_prompts must be at least 1"):
        run_selfdistill(tiny_cfg(tiny_target_dir, prompts, out, num_prompts=0))
    assert not out.exists()
    proc = cli("train/selfdistill.py", "--target", tiny_target_dir, "--prompts", prompts, "--output_dir", out,
               "--num_prompts", "0")
    assert_one_line_error(proc, "--num_prompts")
    assert not out.exists()


def test_a_failed_run_does_not_lock_its_output_dir(tiny_target_dir, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"id": "a", "turns": []}\n')
    out = tmp_path / "sd"
    with pytest.raises(ValueError, match="gave no usable rows"):
        run_selfdistill(tiny_cfg(tiny_target_dir, str(empty), out, max_turns=1, num_prompts=8))
    prompts = write_prompts(tmp_path / "p.jsonl", 2, turns=1)  # other settings: nothing was written, so accepted
    run_selfdistill(tiny_cfg(tiny_target_dir, prompts, out, max_turns=1, max_new_tokens=4, num_prompts=2))
    assert (out / "dataset").is_dir()


def test_non_utf8_prompts_file_is_named(tmp_path):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes('{"id": "a", "turns": ["caf\u00e9"]}\n'.encode("latin-1"))
    with pytest.raises(PromptSourceError, match=r"latin1\.jsonl is not UTF-8"):
        load_prompts(str(bad))


def test_a_second_run_on_a_locked_output_dir_is_refused(tiny_target_dir, tmp_path):
    """Another run holds the lock (taken here as a run's main process takes it): this one refuses, writes nothing."""
    out = tmp_path / "sd"
    out.mkdir()
    prompts = write_prompts(tmp_path / "p.jsonl", 2, turns=1)
    with open(out / ".headstart.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("12345")
        held.flush()
        with pytest.raises(OutputDirError, match=r"another headstart run \(pid 12345\) is writing"):
            run_selfdistill(tiny_cfg(tiny_target_dir, prompts, out, max_turns=1, max_new_tokens=4))
    assert sorted(p.name for p in out.iterdir()) == [".headstart.lock"]
    run_selfdistill(tiny_cfg(tiny_target_dir, prompts, out, max_turns=1, max_new_tokens=4))  # free again
    assert (out / "dataset").is_dir()


# ------------------------------------------------------------------------------------------ 6. server URLs


def test_server_url_with_v1_works_and_a_404_names_the_url(tiny_target_dir):
    from fake_openai import FakeServer
    from headstart.train.engines import EngineError
    from headstart.train.openai_engine import OpenAIEngine

    _, tokenizer, _ = load_target(str(tiny_target_dir))
    server = FakeServer(tiny_target_dir).start()
    try:
        def engine(url):
            cfg = tiny_cfg(tiny_target_dir, "", "unused", backend="openai", server_url=[url])
            return OpenAIEngine(cfg, tokenizer, {tokenizer.eos_token_id})

        for url in (server.url + "/v1", server.url + "/v1/"):
            assert engine(url).servers[0].url == server.url
        with pytest.raises(EngineError, match=rf"{server.url}/api/v1/models answered 404 Not Found.*base URL"):
            engine(server.url + "/api")
    finally:
        server.stop()


# ------------------------------------------------------------------------------------------ 7. training config


def test_bad_learning_rates_and_output_dir_are_config_errors(tmp_path):
    """Refused by name before any target loads (the target here does not exist)."""
    from headstart.train.medusa import check_config

    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rate: [0.003]\n")
    with pytest.raises(ConfigError, match="learning_rate must be a number"):
        parse_config(MedusaTrainConfig, ["--config", str(recipe)])
    recipe.write_text("learning_rate: -0.003\n")
    with pytest.raises(ConfigError, match="learning_rate must be a number >= 0"):
        medusa_main(["--config", str(recipe), "--target", str(tmp_path / "no-such-target")])
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(ConfigError, match="output_dir .*a-file is a file"):
        check_config(parse_config(MedusaTrainConfig, ["--output_dir", str(a_file)]))
    proc = cli("train/medusa.py", "--learning_rate", "-0.003", "--target", tmp_path / "no-such-target")
    assert_one_line_error(proc, "learning_rate")


# ------------------------------------------------------------------------------------------ 1 and 2 on the embedded target


def test_embedded_target_export_into_run_refused_and_resume_runs_no_code(tmp_path):
    """SmolLM2-135M, 2 steps, tiny synthetic data: `headstart.heads.export RUN/heads RUN --overwrite` exits 2 and leaves the run
    byte for byte; a payload in every pickle-format file of its last checkpoint does not run on --resume."""
    from headstart.heads.export import main as export_main

    sd = write_selfdistilled(tmp_path / "sd", "smollm2-135m", num_rows=8)
    run = tmp_path / "run"
    args = ["--target", "smollm2-135m", "--data_dir", str(sd), "--output_dir", str(run), "--num_heads", "1",
            "--share_lm_head", "true", "--per_device_batch_size", "2", "--eval_rows", "2", "--max_length", "32",
            "--max_steps", "2", "--checkpoint_every", "1"]
    medusa_main(args)
    before = tree_of(run)
    assert export_main([str(run / "heads"), str(run), "--format", "vllm", "--overwrite"]) == 2
    assert export_main([str(run / "heads"), str(run / "heads"), "--format", "vllm", "--overwrite"]) == 2
    assert tree_of(run) == before
    resume_with_payloads(run, args, tmp_path)
