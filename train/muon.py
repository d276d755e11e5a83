"""Muon for a draft's weight matrices, AdamW for the rest, in one optimizer (EAGLE-3's `optimizer: muon`).

Muon (Jordan et al. 2024; speculators trains its EAGLE-3 drafts with it): a 2-D parameter's update is its Nesterov
momentum made orthogonal by a quintic Newton-Schulz iteration (the update's singular values pushed towards 1), scaled
by 0.2 x sqrt(max(rows, cols)) so its RMS matches a typical AdamW update's and one learning rate serves both, with
decoupled weight decay. Groups marked `"muon": True` take it (their tensors must be 2-D); every other group takes torch's
AdamW update (its functional `adamw`, the same state). The iteration runs in fp32: PyTorch's own `torch.optim.Muon`
orthogonalises in bf16, which makes a training step several times longer on a CPU without bf16 matmuls.
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


def orthogonalise(update: torch.Tensor, steps: int = NS_STEPS, eps: float = 1e-7) -> torch.Tensor:
    """[m, n] -> the same shape with singular values near 1 (roughly U V^T of its SVD), in fp32."""
    x = update.float()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + eps)  # spectral norm <= Frobenius norm <= 1: inside the iteration's basin
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.T  # [m, m], m the short side
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


class MuonAdamW(torch.optim.Optimizer):
    def __init__(self, param_groups: list[dict], lr: float, betas: tuple[float, float], weight_decay: float,
                 eps: float = 1e-8):
        for group in param_groups:
            if group.get("muon"):
                shapes = {tuple(p.shape) for p in group["params"] if p.ndim != 2}
                if shapes:
                    raise ValueError(f"Muon takes 2-D weight matrices only, got tensors of shape {sorted(shapes)}")
                group.setdefault("weight_decay", MUON_WEIGHT_DECAY)
            group.setdefault("muon", False)
        super().__init__(param_groups, {"lr": lr, "betas": betas, "weight_decay": weight_decay, "eps": eps})

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
            p.add_(orthogonalise(nesterov).to(p.dtype), alpha=-lr * scale)

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
