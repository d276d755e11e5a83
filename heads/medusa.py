"""Medusa heads (Cai et al. 2024): K extra decoding heads on the target's last hidden state.

Head k (k = 1..K) reads the target's final-norm hidden state at position t and predicts token
t + k + 1 (the target's own lm_head predicts t + 1). Each head is L residual blocks
`x + SiLU(W x + b)` (W zero-initialised, so a block starts as the identity; the blocks are distinct
modules, unlike the reference's `[ResBlock] * L`) followed by a Linear(h, V) initialised from the
target's lm_head, or the target's frozen lm_head itself when `share_lm_head` is set.

Tensor names match vLLM's MedusaModel loader: `blocks.{k}.layers.{l}.weight/bias`, `lm_heads.{k}.weight`.

With `draft_vocab_size` > 0 the heads score only a draft vocabulary (heads/draft_vocab.py): the `token_map` buffer [Vd] lists its
target ids (the most frequent target-written tokens of the training data, increasing ids; vLLM calls the same
tensor `token_map` and the size `truncated_vocab_size`). Logits are then [.., Vd] and index the draft vocabulary;
`to_target_ids` maps them back. A head's candidates can only be draft-vocabulary tokens, which loses little, and
its lm_head matmul reads Vd rows instead of V, in training and at inference (docs/measured.md
gives the time saved on SmolLM2).

A heads directory (local or on the Hub) holds `config.json` (this module's `MedusaConfig`: method, target
name/fingerprint/dims), `model.safetensors` (head weights only), `README.md`, `metrics.json` and, for Medusa-2,
`adapter/` (the target's LoRA adapter; the heads read the adapter-merged target). Load it with heads/load.py:
`load_heads(dir_or_id, target_info)` (heads only, refuses another target) or `load_heads_and_target(dir_or_id)`
(heads plus the target, adapter merged when there is one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from headstart.heads.draft_method import DraftMethod
from headstart.heads.draft_vocab import DraftVocabHeads


@dataclass
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head
    share_lm_head: bool = False  # use the target's frozen lm_head instead of one per head
    target: dict = field(default_factory=dict)  # headstart.heads.target.TargetInfo.to_dict() of the (base) target
    method: str = "medusa"  # "medusa" (Medusa-1, frozen target) or "medusa2" (target LoRA-tuned jointly)
    adapter: bool = False  # True: the heads need the target with the LoRA adapter in `adapter/` merged
    draft_vocab_size: int = 0  # > 0: heads score only these many target tokens (`token_map`); 0: all of them


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


class MedusaHeads(DraftVocabHeads):
    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(MedusaBlockStack(config.hidden_size, config.num_layers) for _ in range(config.num_heads))
        out_size = config.draft_vocab_size or config.vocab_size
        if config.share_lm_head:
            self.lm_heads = None
        else:
            self.lm_heads = nn.ModuleList(nn.Linear(config.hidden_size, out_size, bias=False) for _ in range(config.num_heads))
        self.init_draft_vocab()

    @torch.no_grad()
    def init_lm_heads_from(self, lm_head_weight: torch.Tensor) -> None:
        """Copy the target's lm_head [V, h] (its draft-vocabulary rows) into every head's own lm_head."""
        if self.lm_heads is None:
            return
        for head in self.lm_heads:
            head.weight.copy_(self.draft_lm_head_weight(lm_head_weight))

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, h] -> per-head features [K, B, T, h]."""
        return torch.stack([block(hidden) for block in self.blocks])

    def forward(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [B, T, h] (target's final-norm hidden states) -> logits [K, B, T, V] (V = Vd with a draft vocabulary).

        `lm_head_weight` [V, h] is the target's lm_head weight, required when `share_lm_head`.
        """
        feats = self.features(hidden)  # [K, B, T, h]
        if self.lm_heads is None:
            if lm_head_weight is None:
                raise ValueError("these Medusa heads share the target's lm_head: pass lm_head_weight")
            return feats @ self.draft_lm_head_weight(lm_head_weight).t()  # one matmul over all heads: [K, B, T, V]
        return torch.stack([head(f) for head, f in zip(self.lm_heads, feats)])


# The one declaration of Medusa-1/2 (heads/draft_method.py), registered in heads/methods.py.
MEDUSA = DraftMethod(
    title="Medusa heads", card_name="Medusa-1", names=("medusa", "medusa2"), config_class=MedusaConfig, module_class=MedusaHeads,
    proposer="headstart.inference.medusa:medusa_proposer", draft_prior="headstart.inference.medusa:draft_prior",
    trainer="headstart.train.medusa", train_config="MedusaTrainConfig",
    max_depth=lambda config: config.num_heads,  # one head per depth
    scores_target_rows=lambda config: config.share_lm_head,
    timed_per_tree=False,  # medusa_logits scores every head at once
    engine_draft_forwards=lambda k: 0,  # the heads read the target's hidden state inside its verify pass
    formats=("vllm",),
    refusals={fmt: ("{fmt} has no Medusa drafter (SGLang runs EAGLE / EAGLE-3 only; the speculators format read by "
                    "vLLM 0.32 has eagle3 / peagle / dflash): use --format vllm for Medusa heads")
              for fmt in ("sglang", "speculators")}
    | {"llamacpp": ("llama.cpp has no Medusa drafter (its --spec-type values are draft-simple, draft-eagle3, "
                    "draft-mtp, draft-dflash, draft-dspark and n-gram modes): serve Medusa heads with --format vllm, "
                    "or train EAGLE-3 or DFlash heads for llama.cpp")},
    engine_export="headstart.heads.export_formats:medusa_export",
    bench_info=lambda config: {"num_heads": config.num_heads},
)
