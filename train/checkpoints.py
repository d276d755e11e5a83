"""Checkpoints and the heads directory on disk, for train/loop.py: each written to a temporary folder and renamed when
complete; resuming unpickles no code (docs/safety.md); a full disk is named as such, and the last complete checkpoint
is kept.

A checkpoint holds the same files whatever the launcher and the number of processes (plain, DDP or FSDP; DeepSpeed
aside): the trained tensors gathered whole (train/sharding.py), AdamW's state by parameter name, each process's RNG
state and trainer_state.json. So a run can resume with another number of processes, at the same global batch.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import torch
from accelerate import Accelerator
from accelerate.checkpointing import load_accelerator_state, save_accelerator_state
from accelerate.utils import DistributedType
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

from headstart.heads.output_dir import disk_full, honour_umask
from headstart.train.cli import CheckpointError
from headstart.train.config import TrainRunConfig
from headstart.train.sharding import full_state, load_full_state

PICKLE_SUFFIXES = (".bin", ".pkl", ".pt", ".pth")  # torch.save files: optimizer.bin, random_states_N.pkl, DeepSpeed's
LAYOUT = "full-v1"  # trainer_state.json "layout": model.safetensors + optimizer.bin by name + RNG ("deepspeed": its own)


def latest_checkpoint(output_dir: Path) -> Path | None:
    done = [p for p in (output_dir / "checkpoints").glob("step-*") if (p / "trainer_state.json").is_file()]
    return max(done, key=lambda p: int(p.name.split("-")[1]), default=None)


def save_checkpoint(accelerator: Accelerator, output_dir: Path, step: int, cfg: TrainRunConfig, scheduler, model,
                    optimizer, global_batch: int) -> None:
    """The training state (`write_state`) plus trainer_state.json (step, config, LR scheduler state, process count,
    global batch, layout), written into checkpoints/.step-N.tmp and renamed to step-N when complete; only then are
    checkpoints beyond keep_checkpoints removed. A full disk is a CheckpointError."""
    root = output_dir / "checkpoints"
    ckpt, tmp = root / f"step-{step}", root / f".step-{step}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save
    accelerator.wait_for_everyone()
    try:
        layout = write_state(accelerator, tmp, model, optimizer)
        if accelerator.is_main_process:
            state = {"step": step, "config": asdict(cfg), "scheduler": scheduler.state_dict(), "layout": layout,
                     "num_processes": accelerator.num_processes, "global_batch": global_batch}
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
    except Exception as err:  # torch.save and safetensors raise RuntimeError / their own types
        full = disk_full(err, tmp)
        if full is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        kept = latest_checkpoint(output_dir)
        raise CheckpointError(
            f"could not write checkpoint {ckpt}: {full}. "
            + (f"The last complete checkpoint {kept} is kept: free space and rerun with --resume"
               if kept else "No earlier checkpoint exists: free space and rerun")) from err
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        honour_umask(tmp)  # safetensors writes 0600, whatever the umask
        shutil.rmtree(ckpt, ignore_errors=True)  # an incomplete folder of that step from an earlier run
        os.replace(tmp, ckpt)
        old = sorted((p for p in root.glob("step-*") if (p / "trainer_state.json").is_file()),
                     key=lambda p: int(p.name.split("-")[1]))
        for path in old[: max(0, len(old) - cfg.keep_checkpoints)]:
            shutil.rmtree(path, ignore_errors=True)
    accelerator.wait_for_everyone()


def write_state(accelerator: Accelerator, folder: Path, model, optimizer) -> str:
    """Write the model's trained tensors (model.safetensors), AdamW's full state keyed by parameter name
    (optimizer.bin) and each process's RNG state (random_states_<process>.pkl); returns the layout. Under DeepSpeed,
    its engine's own files (accelerate's save_state: one partition per process)."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        accelerator.save_state(str(folder))
        return "deepspeed"
    weights = full_state(model, main_only=True)  # every process takes part in the gathers
    adamw = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    folder.mkdir(parents=True, exist_ok=True)
    if accelerator.is_main_process:
        save_file({name: t.contiguous() for name, t in weights.items()}, str(folder / "model.safetensors"))
        torch.save(adamw, folder / "optimizer.bin")
    save_accelerator_state(str(folder), [], [], [], [], accelerator.process_index, accelerator.step)  # the RNG file
    return LAYOUT


def check_pickles(ckpt: Path) -> None:
    """Every torch.save file in a checkpoint must be plain data: torch.load(weights_only=True) (with accelerate's
    numpy globals for the RNG state; mmap: the tensors themselves are not read here) refuses anything that would run
    code when unpickled. CheckpointError names the file."""
    from accelerate.utils.other import load

    for file in sorted(p for p in ckpt.rglob("*") if p.is_file() and p.suffix in PICKLE_SUFFIXES):
        if file.name.startswith("custom_checkpoint_"):
            raise CheckpointError(
                f"{file}: accelerate unpickles custom_checkpoint_*.pkl with weights_only=False, which can run code, and "
                "headstart writes none (older versions kept the LR schedule there). Resume from a checkpoint this "
                "version wrote, or start without --resume")
        try:
            load(str(file), map_location="cpu", mmap=True)
        except Exception as err:  # UnpicklingError, or a file torch cannot read as its format
            raise CheckpointError(
                f"{file} is not plain tensor data (torch.load(weights_only=True) refused it: "
                f"{str(err).splitlines()[0][:200]}); headstart does not unpickle code from a checkpoint. Delete "
                f"{ckpt} to resume from an older checkpoint, or start without --resume") from err


def load_checkpoint(accelerator: Accelerator, ckpt: Path, scheduler, model, optimizer, global_batch: int) -> int:
    """Restore what save_checkpoint wrote (weights, optimizer, RNG, LR schedule) into the prepared model and optimizer;
    returns its step. Another number of processes than the checkpoint's is fine at the same global batch (DeepSpeed
    aside). Nothing is unpickled with code: check_pickles first, then every load with weights_only=True
    (docs/safety.md)."""
    state = json.loads((ckpt / "trainer_state.json").read_text())
    if "scheduler" not in state or "layout" not in state:
        raise CheckpointError(f"{ckpt} was written by an older headstart (its files are laid out otherwise). "
                              "Start without --resume")
    if state["global_batch"] != global_batch:
        raise CheckpointError(
            f"{ckpt} was trained at a global batch of {state['global_batch']} rows per optimizer step "
            f"({state['num_processes']} process(es)), this run takes {global_batch} ({accelerator.num_processes} "
            "process(es)): resume with per_device_batch_size x processes x gradient_accumulation_steps = "
            f"{state['global_batch']}, so that each step sees the rows it would have seen")
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    if (state["layout"] == "deepspeed") != deepspeed:
        raise CheckpointError(f"{ckpt} was written {'under' if state['layout'] == 'deepspeed' else 'without'} "
                              f"DeepSpeed: resume it {'under DeepSpeed' if state['layout'] == 'deepspeed' else 'without'}")
    if state["layout"] == "deepspeed" and state["num_processes"] != accelerator.num_processes:
        raise CheckpointError(f"{ckpt} holds DeepSpeed's partitions for {state['num_processes']} processes: resume it "
                              f"with {state['num_processes']}")
    rng = ckpt / f"random_states_{accelerator.process_index}.pkl"
    if state["num_processes"] == accelerator.num_processes and not rng.is_file():
        # accelerate would go on silently without it: the resumed run would draw other numbers
        raise CheckpointError(f"{ckpt} has no {rng.name}: the checkpoint is incomplete; delete it to resume from an "
                              "older one")
    check_pickles(ckpt)
    if deepspeed:
        accelerator.load_state(str(ckpt), load_kwargs={"weights_only": True})
    else:
        try:
            load_full_state(model, load_file(str(ckpt / "model.safetensors")), f"{ckpt}/model.safetensors")
        except ValueError as err:  # another method's or shape's checkpoint in this output_dir
            raise CheckpointError(f"{err}: resume with the config that wrote it, or start without --resume") from err
        adamw = torch.load(ckpt / "optimizer.bin", map_location="cpu", weights_only=True)
        set_optimizer_state_dict(model, optimizer, adamw, options=StateDictOptions(full_state_dict=True))
        if rng.is_file():  # with more processes than the checkpoint's, the new ones keep their seeded streams
            load_accelerator_state(str(ckpt), [], [], [], [], accelerator.process_index,
                                   load_kwargs={"weights_only": True})
    if state["num_processes"] != accelerator.num_processes:
        accelerator.print(f"{ckpt} was written by {state['num_processes']} process(es), resumed by "
                          f"{accelerator.num_processes}: same rows per step; only random draws (dropout) differ")
    scheduler.load_state_dict(state["scheduler"])
    return int(state["step"])


def write_dir(final: Path, write: Callable[[Path], Any], latest: Path | None = None) -> None:
    """write(folder) into a temporary sibling of `final`, renamed to `final` when complete (an older `final` is
    replaced only then). On a full disk the folder is written to the system temp dir instead, and CheckpointError
    says where it went (or that it could not be written, and what is left to resume from)."""
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        write(tmp)
        honour_umask(tmp)  # safetensors writes 0600
    except Exception as err:  # see save_checkpoint
        full = disk_full(err, tmp)
        if full is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        spare = Path(tempfile.mkdtemp(prefix=f"headstart-{final.name}-"))
        try:
            write(spare)
        except Exception as spare_err:
            shutil.rmtree(spare, ignore_errors=True)
            left = (f"the last checkpoint {latest} is kept: free space and rerun with --resume" if latest else
                    "no checkpoint was kept (checkpoint_every 0): free space and rerun")
            raise CheckpointError(f"could not write {final}: {full}; nor {spare} ({spare_err}); {left}") from err
        honour_umask(spare)
        raise CheckpointError(f"could not write {final}: {full}. It was written to {spare} instead: move that folder to "
                              f"{final} once there is space") from err
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
