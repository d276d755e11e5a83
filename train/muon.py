"""Muon for a draft's weight matrices, AdamW for the rest, in one optimizer (EAGLE-3's `optimizer: muon`).

Muon (Jordan et al. 2024; speculators trains its EAGLE-3 drafts with it): a 2-D parameter's update is its Nesterov
momentum made orthogonal by a quintic Newton-Schulz iteration (the update's singular values pushed towards 1), scaled
by 0.2 x sqrt(max(rows, cols)) so its RMS matches a typical AdamW update's and one learning rate serves both, with
decoupled weight decay. Groups marked `"muon": True` take it (their tensors must be 2-D); every other group takes torch's
AdamW update (its functional `adamw`, the same state). The iteration runs in bf16 where the device multiplies bf16
natively (a GPU with bf16, a CPU with AVX512-BF16 or AMX: about half the fp32 iteration's time, as Muon's authors and
`torch.optim.Muon` run it) and in fp32 elsewhere, where bf16 matmuls are emulated and several times slower
(`precision`: auto | float32 | bfloat16).
One optimizer, so the learning-rate schedule, accelerate and the checkpoints see its param_groups as AdamW's.
"""

from __future__ import annotations

import math

import torch
from torch.optim.adamw import adamw

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # quintic Newton-Schulz, steepest at zero (Muon's published values)
NS_STEPS = 5
MUON_MOMENTUM = 0.95
MUON_WEIGHT_DECAY = 0.1  # speculators' Muon default, as run in docs/heads_training.md


PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def native_bf16_matmul(device: torch.device) -> bool:
    """The device multiplies bf16 matrices in hardware: a CUDA GPU with bf16; a CPU with AVX512-BF16 or AMX (oneDNN's
    bf16 kernels elsewhere convert to fp32 and are slower than fp32)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return False


def check_precision(precision: str, name: str = "muon precision") -> None:
    """Raises ValueError naming `name` unless `precision` is auto, float32 or bfloat16."""
    if precision != "auto" and precision not in PRECISIONS:
        raise ValueError(f"{name} must be auto, float32 or bfloat16, got {precision!r}")


def iteration_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The Newton-Schulz iteration's dtype: `precision` float32 or bfloat16, or auto (bf16 where native_bf16_matmul)."""
    check_precision(precision)
    if precision == "auto":
        return torch.bfloat16 if native_bf16_matmul(device) else torch.float32
    return PRECISIONS[precision]


def orthogonalise(update: torch.Tensor, steps: int = NS_STEPS, eps: float = 1e-7,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[m, n] -> the same shape with singular values near 1 (roughly U V^T of its SVD), iterated in `dtype`,
    returned in fp32."""
    x = update.to(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + eps)  # spectral norm <= Frobenius norm <= 1: inside the iteration's basin
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.T  # [m, m], m the short side
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).float()


class MuonAdamW(torch.optim.Optimizer):
    def __init__(self, param_groups: list[dict], lr: float, betas: tuple[float, float], weight_decay: float,
                 eps: float = 1e-8, precision: str = "float32"):
        for group in param_groups:
            if group.get("muon"):
                shapes = {tuple(p.shape) for p in group["params"] if p.ndim != 2}
                if shapes:
                    raise ValueError(f"Muon takes 2-D weight matrices only, got tensors of shape {sorted(shapes)}")
                group.setdefault("weight_decay", MUON_WEIGHT_DECAY)
            group.setdefault("muon", False)
        super().__init__(param_groups, {"lr": lr, "betas": betas, "weight_decay": weight_decay, "eps": eps})
        first = next(p for group in self.param_groups for p in group["params"])
        self.iteration_dtype = iteration_dtype(precision, first.device)  # the Newton-Schulz iteration's

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["muon"]:
                self._muon_step(group, params)
            else:
                self._adamw_step(group, params)
        return None

    def _muon_step(self, group: dict, params: list[torch.Tensor]) -> None:
        lr = group["lr"]
        for p in params:
            state = self.state[p]
            if not state:
                state["momentum"] = torch.zeros_like(p)
            buf = state["momentum"]
            p.mul_(1 - lr * group["weight_decay"])
            buf.mul_(MUON_MOMENTUM).add_(p.grad)
            nesterov = p.grad + MUON_MOMENTUM * buf
            scale = 0.2 * math.sqrt(max(p.shape))
            p.add_(orthogonalise(nesterov, dtype=self.iteration_dtype).to(p.dtype), alpha=-lr * scale)

    def _adamw_step(self, group: dict, params: list[torch.Tensor]) -> None:
        """torch's own AdamW update (its functional form), with its state names, so the group is AdamW exactly."""
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros(())
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adamw(params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
              [], [s["step"] for s in states], amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
              weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
