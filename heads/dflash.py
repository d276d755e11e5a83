"""DFlash draft (z-lab, Chen et al. 2026): a few decoder layers that draft a whole block in one forward.

The draft reads the target's hidden states at several layers (`feature_layers`, HF `hidden_states` indices: [0] is
the embedding output, [i + 1] layer i's output), fused per position: ctx = hidden_norm(fc(cat(taps))) [.., h].
A block is [anchor, mask x (block_size - 1)] at positions p .. p + block_size - 1, where the anchor x_p is the last
token known to be the target's (at inference the bonus token) and p is the first position whose target features are
not known yet. Tokens are embedded with the target's embedding, except `mask_token_id`, which gets the draft's own
trained `mask_embedding` (vLLM reads it from `mask_embedding.pt`). In every draft layer the block's queries attend to
  keys/values of the context: k_norm(k_proj(ctx_s)), v_proj(ctx_s) for every position s < p (the layer's own
    projections of the same fused context; the context has no residual stream of its own), and
  keys/values of the whole block (bidirectional inside the block), or with `block_causal` of block slots 0..j only,
with RoPE at absolute positions. With `sliding_window` W > 0 a query at position q sees only the context positions s
with q - s < W (standard sliding-window attention, as vLLM's `dflash_config.use_swa` and llama.cpp's
`attention.sliding_window` run it; W >= block_size, so the whole block stays in view). Block slot j
(1 .. block_size - 1) then predicts the token at position p + j through `norm` and the target's frozen lm_head (no
shift: slot j's output scores x_{p+j}); slot 0's is unused.
The layers are Qwen3 decoder layers (q_norm / k_norm per head) of the target's width; embeddings and lm_head are the
target's and are not stored.

Tensor names follow vLLM's DFlash loader (model_executor/models/qwen3_dflash.py): `fc`, `hidden_norm`,
`layers.{i}.self_attn.{q,k,v,o}_proj`, `layers.{i}.self_attn.{q,k}_norm`, `layers.{i}.mlp.{gate,up,down}_proj`,
`layers.{i}.{input,post_attention}_layernorm`, `norm` (and `mask_embedding`, exported as its own file). With `draft_vocab_size` > 0 the draft scores only a draft
vocabulary, in training and at inference: the `token_map` buffer [Vd] lists its target ids (the most frequent
target-written tokens, increasing), and logits are the target lm_head's rows of them (`draft_lm_head_weight`); an
export ships those rows as the draft's lm_head with vLLM's `d2t` offsets.

    draft = DFlashDraft(dflash_config_for(model, num_layers=2, block_size=8, mask_token_id=m))
    ctx_kv = draft.context_kv(draft.fuse(taps), ctx_positions)      # taps [B, S, n*h] -> per layer keys, values
    embeds = draft.embed_block(tokens, target_embeds)               # [B, Q, h]: mask tokens get mask_embedding
    out = draft(embeds, positions, ctx_kv, mask)                    # [B, Q, h]
    logits = draft.logits(out, draft.draft_lm_head_weight(lm_head_weight))  # [B, Q, Vd]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, apply_rotary_pos_emb

from headstart.heads.draft_method import DraftMethod
from headstart.heads.draft_vocab import DraftVocabHeads

DEFAULT_TAPS = 5  # target layers read by default (z-lab's released drafts read five)


@dataclass
class DFlashConfig:
    hidden_size: int
    vocab_size: int
    method: str = "dflash"
    num_layers: int = 2  # draft decoder layers
    block_size: int = 8  # anchor + block_size - 1 drafted tokens per forward
    mask_token_id: int = 0  # the target token id fed at the block's drafted slots
    feature_layers: list[int] = field(default_factory=list)  # HF hidden_states indices the draft reads
    layer_config: dict = field(default_factory=dict)  # Qwen3Config fields of the draft layers (the target's width)
    draft_vocab_size: int = 0  # > 0: the draft scores only these many target ids (`token_map`); 0: all of them
    # True: block slot j attends to block slots 0..j only (speculators' DFlash default; a slot's guess then does not
    # depend on how many slots follow it); False: to the whole block. Absent from a config.json: False (older drafts)
    block_causal: bool = False
    # > 0: every draft layer sees only the context positions s with q - s < sliding_window from a query at q (the
    # recent context; the block stays in view); 0: the whole context. Absent from a config.json: 0 (older drafts)
    sliding_window: int = 0
    target: dict = field(default_factory=dict)  # headstart.heads.target.TargetInfo.to_dict() of the target

    def __post_init__(self):
        if self.method != "dflash":
            raise ValueError(f"a DFlash config has method 'dflash', got {self.method!r}")
        if self.num_layers < 1 or self.block_size < 2:
            raise ValueError(f"num_layers must be >= 1 and block_size >= 2, got {self.num_layers}, {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} must be a target token id in 0..{self.vocab_size - 1}")
        if not self.feature_layers:
            raise ValueError("feature_layers is empty: the draft needs at least one target layer to read")
        if self.sliding_window and self.sliding_window < self.block_size:
            raise ValueError(f"sliding_window {self.sliding_window} must be 0 (the whole context) or >= block_size "
                             f"{self.block_size}, so the block stays in view")


def default_feature_layers(num_hidden_layers: int, taps: int = DEFAULT_TAPS) -> list[int]:
    """z-lab's rule: layers 1 .. L-3 evenly spaced (layer outputs), as HF hidden_states indices (+1)."""
    n, L = min(taps, num_hidden_layers), num_hidden_layers
    if n == 1:
        return [L // 2 + 1]
    return sorted({int(round(1 + i * (L - 4) / (n - 1))) + 1 for i in range(n)})


def dflash_config_for(model, num_layers: int = 2, block_size: int = 8, mask_token_id: int = 0,
                      feature_layers: list[int] | None = None, draft_vocab_size: int = 0,
                      target_info: Any = None, block_causal: bool = False, sliding_window: int = 0) -> DFlashConfig:
    """A DFlashConfig whose layers have the target's width (hidden, heads, MLP, RoPE, norm eps)."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    rope = getattr(text, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(text, "rope_theta", 10000.0)}
    layer_config = {
        "hidden_size": text.hidden_size, "intermediate_size": text.intermediate_size,
        "num_attention_heads": text.num_attention_heads,
        "num_key_value_heads": getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
        "head_dim": head_dim, "rms_norm_eps": text.rms_norm_eps, "hidden_act": "silu",
        "max_position_embeddings": text.max_position_embeddings, "rope_parameters": dict(rope),
        "num_hidden_layers": num_layers, "vocab_size": text.vocab_size, "attention_bias": False,
    }
    return DFlashConfig(
        hidden_size=text.hidden_size, vocab_size=text.vocab_size, num_layers=num_layers, block_size=block_size,
        mask_token_id=mask_token_id,
        feature_layers=list(feature_layers) if feature_layers else default_feature_layers(text.num_hidden_layers),
        layer_config=layer_config, draft_vocab_size=draft_vocab_size, block_causal=block_causal,
        sliding_window=sliding_window,
        target=target_info.to_dict() if hasattr(target_info, "to_dict") else dict(target_info or {}),
    )


def in_window(query_positions: torch.Tensor, key_positions: torch.Tensor, sliding_window: int) -> torch.Tensor:
    """query_positions [..., Q], key_positions [S] -> bool [..., Q, S]: the context key at s is in the query at q's
    sliding window (q - s < sliding_window; everything when sliding_window is 0)."""
    if not sliding_window:
        return torch.ones(*query_positions.shape, key_positions.numel(), dtype=torch.bool, device=query_positions.device)
    return (query_positions[..., None] - key_positions) < sliding_window


class DFlashAttention(nn.Module):
    """Block queries over [context keys ; block keys] under the caller's mask (heads/dflash.py's docstring)."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.q_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S, h] (fused context, or the normed block) -> keys, values [B, kv_heads, S, d], keys rotated."""
        B, S, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, S, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.kv_heads, self.head_dim).transpose(1, 2)
        k, _ = apply_rotary_pos_emb(k, k, cos, sin)
        return k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context_kv: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, Q, h] (normed block), cos/sin [B, Q, d], context_kv ([B, kvh, S, d] x 2), mask bool [B, 1, Q, S + Q]
        (True = attend; None: everything) -> [B, Q, h]."""
        B, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, Q, self.heads, self.head_dim)).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        k, v = self.keys_values(x, cos, sin)
        k = torch.cat([context_kv[0], k], dim=2)
        v = torch.cat([context_kv[1], v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.heads * self.head_dim))


class DFlashLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, cos, sin, context_kv, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context_kv, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraft(DraftVocabHeads):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        layer_config = Qwen3Config(**config.layer_config)
        h, n = config.hidden_size, len(config.feature_layers)
        self.fc = nn.Linear(n * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=layer_config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(layer_config) for _ in range(config.num_layers))
        self.norm = Qwen3RMSNorm(h, eps=layer_config.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(h))  # the mask token's input embedding (set from the target)
        self.rotary_emb = Qwen3RotaryEmbedding(layer_config)
        self.init_draft_vocab()  # token_map (heads/draft_vocab.py)

    def embed_block(self, tokens: torch.Tensor, target_embeds: torch.Tensor) -> torch.Tensor:
        """tokens [..., Q] and their target embeddings [..., Q, h] -> the draft's input: mask tokens replaced by
        mask_embedding (as vLLM does: by token id, wherever it occurs)."""
        is_mask = (tokens == self.config.mask_token_id)[..., None]
        return torch.where(is_mask, self.mask_embedding.to(target_embeds.dtype), target_embeds)

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """The target's tapped hidden states [..., n*h] (feature_layers order) -> context features [..., h]."""
        return self.hidden_norm(self.fc(taps))

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, S] -> cos, sin [B, S, d] in x's dtype."""
        return self.rotary_emb(x, position_ids=positions)

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the keys and values of context features ctx [B, S, h] at positions [B, S]."""
        cos, sin = self.rope(ctx, positions)
        return [layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers]

    def forward(self, block_embeds: torch.Tensor, positions: torch.Tensor,
                context_kv: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor | None = None) -> torch.Tensor:
        """block_embeds [B, Q, h] (embed_block's: the blocks' tokens), positions [B, Q], context_kv (context_kv() or a
        decode-time cache), mask bool [B, 1, Q, S + Q] (True = attend; None: all) -> [B, Q, h], before `norm`."""
        cos, sin = self.rope(block_embeds, positions)
        x = block_embeds
        for layer, kv in zip(self.layers, context_kv):
            x = layer(x, cos, sin, kv, mask)
        return x

    def decode_mask(self, context_len: int, device: torch.device | str = "cpu", first: int = 0) -> torch.Tensor | None:
        """The attention mask of one block at positions context_len .. context_len + Bk - 1 after the cached context
        positions first .. context_len - 1 at inference: None (everything) for a bidirectional block that sees all of
        them; else bool [1, 1, Bk, context_len - first + Bk]: the context in each slot's sliding window, the block
        (with block_causal slots 0..j only)."""
        cfg, Bk = self.config, self.config.block_size
        if not cfg.block_causal and (not cfg.sliding_window or context_len + Bk <= first + cfg.sliding_window):
            return None
        block = torch.ones(Bk, Bk, dtype=torch.bool, device=device)
        if cfg.block_causal:
            block = block.tril()
        queries = torch.arange(context_len, context_len + Bk, device=device)
        context = in_window(queries, torch.arange(first, context_len, device=device), cfg.sliding_window)
        return torch.cat([context, block], dim=1)[None, None]

    def logits(self, out: torch.Tensor, scored_weight: torch.Tensor) -> torch.Tensor:
        """out [..., h] -> logits [..., Vd] through `norm` and the rows of the target's lm_head the draft scores
        (`draft_lm_head_weight(lm_head_weight)`, [Vd, h])."""
        return self.norm(out) @ scored_weight.t()


# The one declaration of DFlash (heads/draft_method.py), registered in heads/methods.py.
DFLASH = DraftMethod(
    title="a DFlash draft", card_name="DFlash", names=("dflash",), config_class=DFlashConfig, module_class=DFlashDraft,
    proposer="headstart.inference.dflash:dflash_proposer", draft_prior="headstart.inference.dflash:draft_prior",
    trainer="headstart.train.dflash", train_config="DFlashTrainConfig",
    max_depth=lambda config: config.block_size - 1,  # the block's slots after the root
    scores_target_rows=lambda config: True,
    engine_chain=lambda config: config.block_size - 1,  # it drafts its whole block at once
    engine_draft_forwards=lambda k: 1,  # one forward per block
    formats=("vllm", "llamacpp"),
    refusals={fmt: ("headstart exports DFlash drafts for vLLM only (method: dflash); {fmt} is not checked against a "
                    "loader: use --format vllm") for fmt in ("sglang", "speculators")},
    engine_export="headstart.heads.export_formats:dflash_export",
    gguf_export="headstart.heads.export_gguf:dflash_gguf", llamacpp_spec_type="draft-dflash",
    bench_info=lambda config: {"method": "dflash", "block_size": config.block_size},
)
