"""Medusa heads (Cai et al. 2024): K extra decoding heads on the target's last hidden state.

Head k (k = 1..K) reads the target's final-norm hidden state at position t and predicts token
t + k + 1 (the target's own lm_head predicts t + 1). Each head is L residual blocks
`x + SiLU(W x + b)` (W zero-initialised, so a block starts as the identity; the blocks are distinct
modules, unlike the reference's `[ResBlock] * L`) followed by a Linear(h, V) initialised from the
target's lm_head, or the target's frozen lm_head itself when `share_lm_head` is set.

Tensor names match vLLM's MedusaModel loader: `blocks.{k}.layers.{l}.weight/bias`, `lm_heads.{k}.weight`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from huggingface_hub import PyTorchModelHubMixin
from torch import nn


@dataclass
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head
    share_lm_head: bool = False  # use the target's frozen lm_head instead of one per head
    target: dict = field(default_factory=dict)  # heads.target.TargetInfo.to_dict()
    method: str = "medusa"


class MedusaBlockStack(nn.Module):
    def __init__(self, hidden_size: int, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_layers))
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHeads(nn.Module, PyTorchModelHubMixin, library_name="headstart", tags=["medusa", "speculative-decoding"]):
    def __init__(self, config: MedusaConfig | dict):
        super().__init__()
        if isinstance(config, dict):  # as read back from config.json by from_pretrained
            config = MedusaConfig(**config)
        self.config = config
        self.blocks = nn.ModuleList(MedusaBlockStack(config.hidden_size, config.num_layers) for _ in range(config.num_heads))
        if config.share_lm_head:
            self.lm_heads = None
        else:
            self.lm_heads = nn.ModuleList(
                nn.Linear(config.hidden_size, config.vocab_size, bias=False) for _ in range(config.num_heads)
            )

    @torch.no_grad()
    def init_lm_heads_from(self, lm_head_weight: torch.Tensor) -> None:
        """Copy the target's lm_head [V, h] into every head's own lm_head."""
        if self.lm_heads is None:
            return
        for head in self.lm_heads:
            head.weight.copy_(lm_head_weight)

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, h] -> per-head features [K, B, T, h]."""
        return torch.stack([block(hidden) for block in self.blocks])

    def forward(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [B, T, h] (target's final-norm hidden states) -> logits [K, B, T, V].

        `lm_head_weight` [V, h] is the target's lm_head weight, required when `share_lm_head`.
        """
        feats = self.features(hidden)  # [K, B, T, h]
        if self.lm_heads is None:
            if lm_head_weight is None:
                raise ValueError("these Medusa heads share the target's lm_head: pass lm_head_weight")
            return feats @ lm_head_weight.t()  # one matmul over all heads: [K, B, T, V]
        return torch.stack([head(f) for head, f in zip(self.lm_heads, feats)])
