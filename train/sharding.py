"""Sharded training (FSDP) on any machine, and the full state of a trained model, for train/loop.py and the trainers.

accelerate selects FSDP only for processes on an accelerator: launched with an FSDP config on a CPU-only machine, its
processes come up as MULTI_CPU (gloo) and would train unsharded, as DDP, without a word. torch's FSDP2 (`fully_shard`)
runs on gloo CPU processes, so `enable_fsdp_on_cpu` turns accelerate's state to FSDP there: the same code path as on
GPUs (recipes/accelerate/fsdp.yaml).

Under FSDP each process holds a shard of every tensor of the prepared model. `full_state` gathers the trainable
tensors and the buffers (what training changes; not the frozen target weights Medusa-2 carries): the checkpoints, the
end-of-training evaluation and the heads directory read it, so they hold the same tensors whatever the launcher and
the number of processes.
"""

from __future__ import annotations

import os
from typing import Callable

import torch
from accelerate import Accelerator
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from headstart.train.config import ConfigError


def enable_fsdp_on_cpu(accelerator: Accelerator) -> None:
    """Under an FSDP launch (ACCELERATE_USE_FSDP) of gloo CPU processes, switch accelerate's state from MULTI_CPU to
    FSDP with the launcher's FSDP_* settings; anything else is left as it is."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return
    if accelerator.distributed_type != DistributedType.MULTI_CPU:
        return
    if os.environ.get("FSDP_VERSION", "1") != "2":
        raise ConfigError("FSDP on CPU processes needs fsdp_version: 2 (torch's FSDP1 needs GPUs); "
                          "recipes/accelerate/fsdp.yaml sets it")
    plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* variables the launcher set
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    PartialState().distributed_type = DistributedType.FSDP  # an AcceleratorState made later copies PartialState's
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin


def use_cpu_flag() -> bool:
    """Accelerator(cpu=...): True on a machine without CUDA (accelerate's MULTI_CPU gloo processes need it), except
    under a DeepSpeed launch, which accelerate sets up only with cpu=False."""
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    return not torch.cuda.is_available() and not deepspeed


def count_deepspeed_processes_on_cpu(accelerator: Accelerator) -> None:
    """Under DeepSpeed on CPU processes accelerate finds no accelerator backend and counts one process in each, while
    DeepSpeed's own gloo group holds them all: take the count and ranks from that group."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED or accelerator.device.type != "cpu":
        return
    if not torch.distributed.is_initialized():
        return
    for state in (PartialState(), accelerator.state):
        state.num_processes = torch.distributed.get_world_size()
        state.process_index = torch.distributed.get_rank()
        state.local_process_index = int(os.environ.get("LOCAL_RANK", 0))


def describe_sharding(accelerator: Accelerator, model: nn.Module) -> str:
    """One line: how the prepared model's trainable parameters are held by this process."""
    from torch.distributed.tensor import DTensor

    trainable = [p for p in model.parameters() if p.requires_grad]
    total = sum(p.numel() for p in trainable)
    if accelerator.num_processes == 1:
        return f"1 process ({accelerator.distributed_type.value}): it holds all {total:,} trainable parameters"
    if accelerator.distributed_type != DistributedType.FSDP:
        return (f"{accelerator.num_processes} processes ({accelerator.distributed_type.value}): each holds all "
                f"{total:,} trainable parameters")
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in trainable)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return (f"FSDP{accelerator.state.fsdp_plugin.fsdp_version} over {accelerator.num_processes} processes: process "
            f"{accelerator.process_index} holds {local:,} of the {total:,} trainable parameters"
            + (f" (and a shard of the {frozen:,} frozen ones)" if frozen else ""))


def frozen_names(model: nn.Module) -> set[str]:
    """State-dict names of the model's frozen parameters, tied aliases included (a tied lm_head: named_parameters,
    and so `ignore_frozen_params`, list a shared weight under one name only); DDP's `module.` prefix dropped."""
    return {name.removeprefix("module.") for name, t in model.state_dict(keep_vars=True).items()
            if isinstance(t, nn.Parameter) and not t.requires_grad}


def trained_keys(model: nn.Module) -> set[str]:
    """The state-dict names `full_state` returns for a model (prepared or plain), without gathering anything."""
    return set(get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))) - frozen_names(model)


def full_state(model: nn.Module, main_only: bool = False) -> dict[str, torch.Tensor]:
    """The model's trainable tensors and persistent buffers, full (gathered under FSDP), by their plain names.
    Every process takes part; main_only: only the main process gets them (on the CPU), the others an empty dict."""
    options = StateDictOptions(full_state_dict=True, ignore_frozen_params=True, cpu_offload=main_only)
    frozen = frozen_names(model)
    return {name: t for name, t in get_model_state_dict(model, options=options).items() if name not in frozen}


def load_full_state(model: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Load what `full_state` returned into a model (prepared: each process keeps its shard; or plain). Every trained
    tensor and buffer must be there, and nothing else: a ValueError names the difference."""
    expected = trained_keys(model)
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"{where} does not fit this model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                         f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))  # keys checked above


def plain_model(accelerator: Accelerator, prepared: nn.Module, rebuild: Callable[[], nn.Module]) -> nn.Module:
    """The trained model with whole tensors of its own on every process, for evaluation and saving: the unwrapped
    module, or a fresh `rebuild()` of it with the trained tensors loaded: under FSDP (whose module holds shards, so
    they are gathered) and DeepSpeed (whose parameters are views into its flat buffers, which safetensors refuses)."""
    if accelerator.distributed_type == DistributedType.FSDP:
        state = full_state(prepared)
    elif accelerator.distributed_type == DistributedType.DEEPSPEED:  # ZeRO-2: each process holds whole parameters
        state = full_state(accelerator.unwrap_model(prepared))
    else:
        return accelerator.unwrap_model(prepared)
    fresh = rebuild()
    load_full_state(fresh, state, "the gathered state")
    return fresh
