"""EAGLE's training-time test: the draft unrolled on its own outputs, each step seeing exactly the keys a tree node
of that depth sees at inference (train/eagle.py trains it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from headstart.heads.eagle import EagleDraft


def ttt_mask(key_valid: torch.Tensor, step: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, T, (step+1)*T] for unrolled step `step` over the keys of steps 0..step (concatenated).

    Query t sees step 0's keys at positions s <= t - step (the true prefix of its chain's root) and, for
    1 <= j <= step, step j's key at s = t - step + j (its ancestors in the chain, itself last). key_valid [B, T] bool
    blocks padded keys (a query's own key stays visible, so no row is fully masked).
    """
    B, T = key_valid.shape
    t = torch.arange(T, device=key_valid.device)[:, None]
    s = torch.arange(T, device=key_valid.device)[None, :]
    allowed = torch.cat([s <= t - step] + [s == t - step + j for j in range(1, step + 1)], dim=1)  # [T, (step+1)T]
    allowed = allowed[None] & key_valid.repeat(1, step + 1)[:, None, :]  # [B, T, (step+1)T]
    allowed[:, :, step * T :] |= torch.eye(T, dtype=torch.bool, device=key_valid.device)
    mask = torch.zeros(B, 1, T, (step + 1) * T, dtype=dtype, device=key_valid.device)
    return mask.masked_fill(~allowed[:, None], torch.finfo(dtype).min)


def unroll(draft: EagleDraft, embeds: torch.Tensor, features: torch.Tensor, key_valid: torch.Tensor,
           steps: int) -> list[torch.Tensor]:
    """Run the draft `steps` times, each step on the previous step's outputs shifted by one position.

    embeds [B, T, h] (embedding of x_{t+1} at t), features [B, T, h] (fused f_t), key_valid [B, T] -> `steps` x [B, T, h];
    step i's output at t is the depth-(i+1) draft state of the chain rooted at t - i (valid for t >= i).
    """
    B, T, _ = embeds.shape
    position_ids = torch.arange(T, device=embeds.device).expand(B, T)
    device_type = embeds.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else embeds.dtype
    cache = DynamicCache()
    outs = []
    for i in range(steps):
        out = draft(embeds, features, position_ids, ttt_mask(key_valid, i, dtype), cache)  # [B, T, h]
        outs.append(out)
        features = F.pad(out[:, :-1], (0, 0, 1, 0))  # step i+1 at t reads step i's output at t-1
    return outs


class UnrolledDraft(nn.Module):
    """The draft and its unroll as one module, so DDP sees one forward per backward."""

    def __init__(self, draft: EagleDraft):
        super().__init__()
        self.draft = draft

    def forward(self, embeds: torch.Tensor, taps: torch.Tensor, key_valid: torch.Tensor, select: torch.Tensor,
                steps: int, lm_head_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> outputs [S, N, h] and logits [S, N, draft_vocab] at the N positions of `select` [B, T] (bool)."""
        dtype = self.draft.fc.weight.dtype  # the target's features and embeddings may be bf16
        outs = unroll(self.draft, embeds.to(dtype), self.draft.fuse(taps.to(dtype)), key_valid, steps)
        selected = torch.stack([o[select] for o in outs])  # [S, N, h]
        if lm_head_weight is None:
            return selected, self.draft.logits(selected)
        return selected, self.draft.logits(selected.to(lm_head_weight.dtype), lm_head_weight)  # EAGLE-1: the target's
