"""Output directories (issue 45, cases 1-4, 16, 21): headstart writes only into a new or empty directory or one of its own
runs of the same kind, never through a symbolic link, one run at a time, with the user's umask; nothing outside the
output directory changes, and a full disk is one line."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from headstart.heads.export import export_heads
from headstart.heads.export import main as export_main
from headstart.heads.medusa import MedusaConfig, MedusaHeads
from headstart.heads.output_dir import (LOCK_FILE, MANIFEST, OutputDirError, check_output_dir, claim_output_dir, export_subdir,
                              write_file)
from headstart.heads.target import load_target
from test_medusa_train import base_args, heads_state, write_selfdistilled
from test_safety import heads_dir  # noqa: F401  (a fixture: 2-head Medusa on the tiny target)
from test_selfdistill import tiny_cfg, write_prompts
from headstart.train.loop import train_run_kind
from headstart.train.selfdistill import run_selfdistill

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def tree_of(root: Path) -> dict[str, bytes | str]:
    """Every file (bytes), link (its target) and folder under root."""
    found = {}
    for p in sorted(root.rglob("*")):
        key = str(p.relative_to(root))
        found[key] = f"-> {os.readlink(p)}" if p.is_symlink() else p.read_bytes() if p.is_file() else "dir"
    return found


def repo_like(root: Path) -> Path:
    """A stand-in for a checkout of the repository (a copy: the real one is never written): heads/ and train/
    packages, docs, README.md."""
    for name in ("__init__.py", "medusa.py", "export.py", "load.py"):
        (root / "heads").mkdir(parents=True, exist_ok=True)
        (root / "heads" / name).write_text(f"# heads/{name} of the repository\n")
    (root / "train").mkdir()
    (root / "train" / "medusa.py").write_text("# train/medusa.py\n")
    (root / "docs").mkdir()
    (root / "docs" / "safety.md").write_text("# safety\n")
    (root / "README.md").write_text("# headstart\n")
    return root


def unrelated(root: Path) -> Path:
    """A user's folder whose names collide with what the runs write: dataset/train.csv, config.json, README.md, an
    export.json of their own, results.json, heads/."""
    root.mkdir(parents=True)
    (root / "dataset").mkdir()
    (root / "dataset" / "train.csv").write_text("a,b\n1,2\n")
    (root / "config.json").write_text('{"mine": true}\n')
    (root / "README.md").write_text("my notes\n")
    (root / "export.json").write_text('{"exported_by": "me"}\n')
    (root / "results.json").write_text("{}\n")
    (root / "heads").mkdir()
    (root / "heads" / "keep.txt").write_text("keep\n")
    return root


@pytest.fixture(scope="module")
def sd_dir(tiny_target_dir, tmp_path_factory):
    return write_selfdistilled(tmp_path_factory.mktemp("sd"), tiny_target_dir)


# ------------------------------------------------------------------------------------- 1. nothing outside changes


def every_cli(tiny_target_dir, sd_dir, heads_dir, prompts):
    """(name, run(out)) for each CLI with its output flag set to `out`; run returns the exit code (2: refused)."""
    from headstart.inference.bench.run import main as bench_main
    from headstart.train.dflash import main as dflash_main
    from headstart.train.eagle import main as eagle_main
    from headstart.train.medusa import main as medusa_main

    def raises(fn):
        def run(out):
            try:
                fn(out)
            except OutputDirError:
                return 2
            return 0
        return run

    train = ["--target", str(tiny_target_dir), "--data_dir", str(sd_dir), "--max_steps", "1"]
    return [
        ("selfdistill", raises(lambda out: run_selfdistill(tiny_cfg(tiny_target_dir, prompts, out, max_turns=1,
                                                                   max_new_tokens=4)))),
        ("medusa", raises(lambda out: medusa_main(base_args(tiny_target_dir, sd_dir, out, "--max_steps", "1")))),
        ("eagle", raises(lambda out: eagle_main([*train, "--output_dir", str(out)]))),
        ("dflash", raises(lambda out: dflash_main([*train, "--output_dir", str(out)]))),
        ("export", lambda out: export_main([str(heads_dir), str(out), "--format", "vllm", "--overwrite"])),
        ("bench", lambda out: bench_main(["--heads", str(heads_dir), "--prompts", prompts, "--num_prompts", "1",
                                          "--max_new_tokens", "2", "--output", str(out)])),
    ]


def test_no_cli_changes_a_folder_of_unrelated_files_or_the_repository(tiny_target_dir, sd_dir, heads_dir, tmp_path,
                                                                      capsys):
    """Each CLI with its output flag on a folder of a user's files, and on (a copy of) the repository root: refused
    with one line naming entries in the way, every file byte-identical, nothing added."""
    prompts = write_prompts(tmp_path / "p.jsonl", 2, turns=1)
    folders = [unrelated(tmp_path / "mine"), repo_like(tmp_path / "repo")]
    before = {folder: tree_of(folder) for folder in folders}
    for name, run in every_cli(tiny_target_dir, sd_dir, heads_dir, prompts):
        for folder in folders:
            capsys.readouterr()
            assert run(folder) == 2, (name, folder)
            for other in folders:
                assert tree_of(other) == before[other], (name, folder)
    err = capsys.readouterr().err.strip().splitlines()  # the last CLI's (bench's) message
    assert err[-1].startswith("error: ") and "not empty" in err[-1] and "README.md" in err[-1], err


def test_a_trainer_from_the_repository_root_with_output_dir_dot_exits_2(tiny_target_dir, sd_dir, tmp_path):
    """The issue's command: `python train/medusa.py ... --output_dir .` from the repository root (a copy) replaced
    heads/. Now: exit 2, one line naming heads, every file as it was."""
    root = repo_like(tmp_path / "repo")
    before = tree_of(root)
    proc = subprocess.run([sys.executable, str(REPO / "train" / "medusa.py"),
                           *base_args(tiny_target_dir, sd_dir, ".", "--max_steps", "1")],
                          cwd=root, env=ENV, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "heads" in last and "not a headstart train:medusa run" in last, last
    assert tree_of(root) == before


def test_selfdistill_keeps_a_users_dataset_folder(tiny_target_dir, tmp_path):
    """An output_dir holding dataset/train.csv: refused, the file kept; a new folder beside it is written, the
    folder's other files untouched."""
    prompts = write_prompts(tmp_path / "p.jsonl", 2, turns=1)
    mine = tmp_path / "mine"
    (mine / "dataset").mkdir(parents=True)
    (mine / "dataset" / "train.csv").write_text("a,b\n")
    with pytest.raises(OutputDirError, match=r"not empty and not a headstart selfdistill run .*dataset"):
        run_selfdistill(tiny_cfg(tiny_target_dir, prompts, mine, max_turns=1, max_new_tokens=4))
    assert tree_of(mine) == {"dataset": "dir", "dataset/train.csv": b"a,b\n"}
    run_selfdistill(tiny_cfg(tiny_target_dir, prompts, mine / "sd", max_turns=1, max_new_tokens=4))
    assert (mine / "dataset" / "train.csv").read_text() == "a,b\n"
    manifest = json.loads((mine / "sd" / MANIFEST).read_text())
    assert manifest["kind"] == "selfdistill" and "dataset" in manifest["entries"]
    assert not (mine / "sd" / LOCK_FILE).exists()  # released at the end


def test_earlier_versions_runs_are_adopted_and_others_refused(tmp_path):
    """Directories without a manifest: an earlier version's run of the same kind (only its names, one marker) is
    adopted; extra files, no marker, or another kind's manifest are refused by name."""
    kind = train_run_kind("medusa")
    old = tmp_path / "old"
    (old / "checkpoints" / "step-2").mkdir(parents=True)
    (old / "checkpoints" / "step-2" / "trainer_state.json").write_text("{}")
    (old / "heads").mkdir()
    assert check_output_dir(old, kind)["kind"] == "train:medusa"
    with claim_output_dir(old, kind):
        pass
    assert {"checkpoints", "heads"} <= set(json.loads((old / MANIFEST).read_text())["entries"])
    (old / "notes.txt").write_text("mine")  # beside a run headstart owns: allowed, never touched
    check_output_dir(old, kind)
    with pytest.raises(OutputDirError, match="holds a headstart train:medusa run, not a train:eagle3 one"):
        check_output_dir(old, train_run_kind("eagle3"))
    no_marker = tmp_path / "no-marker"
    (no_marker / "heads").mkdir(parents=True)
    with pytest.raises(OutputDirError, match=r"not a headstart train:medusa run \(it holds heads but no train_log.jsonl"):
        check_output_dir(no_marker, kind)
    link = tmp_path / "link"
    link.mkdir()
    (link / "train_log.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    with pytest.raises(OutputDirError, match="symbolic links .*train_log.jsonl"):
        check_output_dir(link, kind)


# ------------------------------------------------------------------------------------- 2. no writes through links


def test_tree_auto_never_writes_through_a_linked_tree_json(heads_dir, tmp_path, capsys):
    """tree.json a link to a file outside the heads dir: calibration keeps its tree in memory, says why in one
    note; the file it points at and the link stay as they were."""
    from conftest import tiny_model
    from headstart.inference.speculator import Speculator

    heads = tmp_path / "heads"
    shutil.copytree(heads_dir, heads)
    bashrc = tmp_path / "bashrc"
    bashrc.write_text("export PATH=/usr/bin\n")
    (heads / "tree.json").symlink_to(bashrc)
    with pytest.raises(OutputDirError, match="tree.json is a symbolic link"):
        write_file(heads / "tree.json", "{}")
    model = tiny_model("llama", vocab_size=128, seed=1)
    spec = Speculator(model, MedusaHeads(MedusaConfig(hidden_size=64, vocab_size=128, num_heads=2)).eval(),
                      heads_dir=heads, tree="default")
    calib = spec.calibrate(sizes=(1, 2, 4), prefix_len=8, repeats=3,
                           timer=lambda kind, size, run: 2.0 if kind == "draft" else 40.0 + size)
    assert calib.choices is not None
    note = capsys.readouterr().err
    assert "could not write" in note and "tree.json is a symbolic link" in note, note
    assert bashrc.read_text() == "export PATH=/usr/bin\n" and (heads / "tree.json").is_symlink()


# ------------------------------------------------------------------------------------- 3. one run at a time


def test_a_second_trainer_on_a_held_output_dir_is_refused_and_the_first_runs_heads_kept(tiny_target_dir, sd_dir,
                                                                                         tmp_path):
    """While a trainer holds the output_dir (its lock, taken here as start_run takes it), a second trainer exits with
    one line and writes nothing; once it is free, a rerun of the same kind proceeds."""
    from headstart.train.medusa import main as medusa_main

    out = tmp_path / "run"
    medusa_main(base_args(tiny_target_dir, sd_dir, out, "--max_steps", "2"))
    first = heads_state(out)
    before = tree_of(out)
    with claim_output_dir(out, train_run_kind("medusa")):
        with pytest.raises(OutputDirError, match=rf"another headstart run \(pid {os.getpid()}\) is writing"):
            medusa_main(base_args(tiny_target_dir, sd_dir, out, "--max_steps", "3", "--seed", "1"))
        assert all(torch.equal(first[k], v) for k, v in heads_state(out).items())
    assert tree_of(out) == before
    medusa_main(base_args(tiny_target_dir, sd_dir, out, "--max_steps", "3", "--seed", "1"))  # free again: reruns
    assert not (out / LOCK_FILE).exists()


# ------------------------------------------------------------------------------------- 4. --overwrite


def test_overwrite_replaces_only_what_an_earlier_export_wrote(heads_dir, tmp_path):
    """A folder with an export.json headstart did not write (and the user's config.json, README.md): refused even with
    --overwrite. An earlier export: --overwrite replaces the files its manifest lists, a user's file stays; an
    earlier version's export (no manifest, only export files) is adopted."""
    mine = tmp_path / "mine"
    mine.mkdir()
    for name, text in (("export.json", '{"by": "me"}'), ("config.json", '{"mine": 1}'), ("README.md", "mine")):
        (mine / name).write_text(text)
    before = tree_of(mine)
    assert export_main([str(heads_dir), str(mine), "--format", "vllm", "--overwrite"]) == 2
    assert tree_of(mine) == before

    out = export_heads(heads_dir, tmp_path / "export", "vllm")
    (out / "NOTES.md").write_text("mine")
    export_heads(heads_dir, out, "vllm", overwrite=True)
    assert (out / "NOTES.md").read_text() == "mine"
    assert set(json.loads((out / MANIFEST).read_text())["entries"]) == {"README.md", "config.json", "export.json",
                                                                         "model.safetensors"}
    with pytest.raises(OutputDirError, match="export:vllm run, not a export:sglang one"):
        export_heads(heads_dir, out, "sglang", overwrite=True)
    (out / MANIFEST).unlink()  # as an earlier version left it, but with the user's NOTES.md: refused
    with pytest.raises(OutputDirError, match="NOTES.md"):
        export_heads(heads_dir, out, "vllm", overwrite=True)
    (out / "NOTES.md").unlink()  # only export files: adopted
    export_heads(heads_dir, out, "vllm", overwrite=True)
    assert (out / MANIFEST).is_file()


# ------------------------------------------------------------------------------------- 16. a full disk: one line


def fill(disk: Path) -> None:
    """Write until the filesystem is full."""
    with open(disk / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as err:
            assert err.errno == errno.ENOSPC


def test_a_full_disk_at_the_start_is_one_line_and_leaves_no_lock_file(tiny_target_dir, heads_dir, tiny_disk,
                                                                      tmp_path, capsys):
    """Self-distillation and export on a full disk: exit 2 with one line naming it; no empty lock file, nothing
    half-written left."""
    prompts = write_prompts(tmp_path / "p.jsonl", 2, turns=1)
    fill(tiny_disk)
    proc = subprocess.run([sys.executable, str(REPO / "train" / "selfdistill.py"), "--target", str(tiny_target_dir),
                           "--prompts", prompts, "--output_dir", str(tiny_disk / "sd"), "--max_turns", "1",
                           "--max_new_tokens", "4", "--device", "cpu"],
                          env=ENV, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "no space left on device" in proc.stderr.strip().splitlines()[-1]
    assert sorted(p.name for p in (tiny_disk / "sd").iterdir()) == []
    assert export_main([str(heads_dir), str(tiny_disk / "export"), "--format", "vllm"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "no space left on device" in last, last
    assert [p.name for p in (tiny_disk / "export").iterdir()] == []


def test_a_full_disk_while_self_distilling_is_one_line_and_keeps_the_batches(tiny_target_dir, tmp_path, monkeypatch):
    """The disk fills after the first batch: OutputDirError naming it (one line, exit 2 under run_main), the batch
    written is kept, the lock is released and gone; a rerun resumes."""
    import headstart.train.selfdistill as sd

    prompts = write_prompts(tmp_path / "p.jsonl", 6, turns=1)
    out = tmp_path / "sd"
    real = sd._write_json_atomic
    writes = []

    def fills_up(path, payload):
        writes.append(path.name)
        if len(writes) > 2:  # run.json, the first batch
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, payload)

    monkeypatch.setattr(sd, "_write_json_atomic", fills_up)
    cfg = tiny_cfg(tiny_target_dir, prompts, out, max_turns=1, max_new_tokens=4, batch_size=2, prompts_per_call=2)
    with pytest.raises(OutputDirError, match=r"could not write .*sd: no space left on device; free space and rerun"):
        run_selfdistill(cfg)
    assert [p.name for p in (out / "parts").iterdir()] == ["batch_000000.json"] and not (out / LOCK_FILE).exists()
    monkeypatch.setattr(sd, "_write_json_atomic", real)
    run_selfdistill(cfg)
    assert (out / "dataset").is_dir()


# ------------------------------------------------------------------------------------- 21. the user's umask


def test_files_get_the_users_umask(tiny_target_dir, sd_dir, tmp_path, monkeypatch):
    """Under umask 022: heads, n-gram table, checkpoints, exports, feature shards and the target cache are 0644 / 0755,
    not safetensors' 0600 and mkdtemp's 0700."""
    import headstart.heads.target as target_module
    from headstart.train.feature_shards import write_shard
    from headstart.train.medusa import main as medusa_main

    old = os.umask(0o022)
    try:
        out = tmp_path / "run"
        medusa_main(base_args(tiny_target_dir, sd_dir, out, "--max_steps", "2", "--checkpoint_every", "1"))
        exported = export_heads(out / "heads", tmp_path / "export", "vllm")
        write_shard(tmp_path / "shard-00000.safetensors", [(None, torch.zeros(3, 4))], torch.float32)
        # the embedded target's cache, written from a (stand-in) GGUF load
        model, tokenizer, _ = load_target(str(tiny_target_dir))
        monkeypatch.setenv("HEADSTART_CACHE", str(tmp_path / "cache"))
        monkeypatch.setattr(target_module, "embedded_gguf_path", lambda: tmp_path / "stand-in.gguf")
        monkeypatch.setattr(target_module, "_load_gguf", lambda path, dtype: (model, tokenizer))
        cached = target_module.embedded_local_dir()
    finally:
        os.umask(old)
    files = [*out.rglob("*.safetensors"), *(out / "checkpoints").rglob("*"), exported / "model.safetensors",
             tmp_path / "shard-00000.safetensors", *cached.rglob("*")]
    assert any(p.name == "ngram.safetensors" for p in files) and any(p.suffix == ".pkl" for p in files)
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in files}
    assert all(mode == ("0o755" if (tmp_path / p).is_dir() else "0o644") for p, mode in modes.items()), modes
    assert oct(cached.stat().st_mode & 0o777) == "0o755"


def test_a_trainer_refuses_its_data_dir_as_output_dir(tiny_target_dir, sd_dir):
    """Refused before anything is read or self-distilled: the trainer's files go into a folder of their own."""
    from headstart.train.config import ConfigError
    from headstart.train.medusa import main as medusa_main

    before = tree_of(sd_dir)
    with pytest.raises(ConfigError, match="output_dir and data_dir are one directory"):
        medusa_main(base_args(tiny_target_dir, sd_dir, sd_dir, "--max_steps", "1"))
    assert tree_of(sd_dir) == before


@pytest.mark.parametrize("module", ["headstart.inference.acceptance", "headstart.inference.replay"])
def test_a_linked_output_file_is_refused_before_the_run(tmp_path, capsys, module):
    """--output of the acceptance and replay tables never writes through a link: refused (exit 2) before any heads or
    prompts are read, the file the link points to unchanged."""
    import importlib

    outside = tmp_path / "bashrc"
    outside.write_text("export PATH=/usr/bin\n")
    link = tmp_path / "table.json"
    link.symlink_to(outside)
    main = importlib.import_module(module).main
    assert main(["--heads", str(tmp_path / "no-heads"), "--prompts", "mix:heldout", "--output", str(link)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "symbolic link" in err[0] and str(link) in err[0]
    assert outside.read_text() == "export PATH=/usr/bin\n" and link.is_symlink()


def test_generate_writes_nothing_but_its_heads_tree_json(tiny_target_dir, heads_dir, tmp_path, monkeypatch, capsys):
    """generate has no output directory: run from a folder of a user's files (and a copy of the repository), with
    --tree auto, it changes nothing there; in the heads directory it adds tree.json and nothing else."""
    from headstart.inference.generate import main as generate_main

    heads = tmp_path / "heads-copy"
    shutil.copytree(heads_dir, heads)
    heads_before = tree_of(heads)
    for folder in (unrelated(tmp_path / "mine"), repo_like(tmp_path / "repo")):
        before = tree_of(folder)
        monkeypatch.chdir(folder)
        assert generate_main(["--heads", str(heads), "--target", str(tiny_target_dir), "--prompt", "hi",
                              "--max_new_tokens", "3", "--tree", "auto"]) == 0
        assert tree_of(folder) == before
    after = tree_of(heads)
    assert set(after) - set(heads_before) == {"tree.json"}
    assert {k: v for k, v in after.items() if k != "tree.json"} == heads_before


def test_the_llamacpp_check_refuses_an_output_directory_holding_someone_elses_files(tmp_path, heads_dir, capsys):
    """Before any export or server: a --output holding a user's results.json is refused in one line and kept."""
    from headstart.inference import llamacpp_check

    out = tmp_path / "mine"
    out.mkdir()
    (out / "results.json").write_text("my results")
    code = llamacpp_check.main(["--heads", str(heads_dir), "--target_gguf", str(tmp_path / "target.gguf"),
                                "--server", sys.executable, "--output", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err
    assert "not a headstart engine-check:llamacpp run" in err
    assert tree_of(out) == {"results.json": b"my results"}


def test_engine_checks_give_each_heads_dir_its_own_export(tmp_path):
    """Two heads dirs of one run name, or heads dirs not called `heads`, never share an export folder (one would
    replace the other's export while the results still name both)."""
    out = tmp_path / "check"
    names = [export_subdir(out, n, d, "vllm").name
             for n, d in enumerate([tmp_path / "runs/a/heads", tmp_path / "old/a/heads", "w64h", "nowin"], 1)]
    assert names == ["export-1-a-vllm", "export-2-a-vllm", "export-3-w64h-vllm", "export-4-nowin-vllm"]
