"""EAGLE draft models (Li et al. 2024, 2025): one decoder layer that drafts from the target's features.

EAGLE-1 (`method="eagle"`): the feature f_t is the target's final-norm hidden state at position t. The draft at
position t reads fc(cat(embed(x_{t+1}), f_t)) (2h -> h), runs one decoder layer of the target's own family
(without its input layernorm) and predicts f_{t+1}; the target's frozen lm_head turns that into logits for x_{t+2}.

EAGLE-3 (`method="eagle3"`): the feature is fc(cat(hidden_states[i] for i in feature_layers)) (3h -> h; HF
indexing: hidden_states[0] is the embedding output, [i] the input of layer i; default low/mid/high taps 2, L//2,
L-3). The layer's attention reads cat(input_layernorm(embed), hidden_norm(feature)) (2h into q/k/v); its output
is fed back as the next step's feature, and `norm` + the draft's own `lm_head` give logits over a reduced draft
vocabulary (the most frequent target tokens): draft id i is target id i + d2t[i]; t2d marks the target ids that
have a draft id. Three optional RMSNorms (the flags of vllm-project/speculators' Eagle3 config, same meaning):
  norm_before_fc        fc(input_norm(cat(taps))): one RMSNorm over the n*h concatenated taps
  norm_before_residual  the residual around the attention is hidden_norm(feature) instead of the raw feature
  norm_output           the fed-back feature is norm(output) (the state the lm_head reads) instead of the pre-norm
                        output
All three off is the architecture of heads saved before these flags existed (their config.json lacks them).

Tensor names follow vLLM's loaders: `fc.*`, `input_norm` (norm_before_fc), `layers.0.*` (the decoder layer;
`hidden_norm` for EAGLE-3), `norm`, `lm_head`, `d2t`. The target's embeddings (and, for EAGLE-1, its lm_head) are
not stored: they are the target's.

    draft = EagleDraft(eagle_config_for(model, "eagle3", draft_vocab_size=8192))
    feats = draft.fuse(taps)                          # [B, T, n*h] -> [B, T, h]
    out = draft(embeds, feats, position_ids, mask, cache)   # [B, T, h]: the predicted next features
    logits = draft.logits(out, lm_head_weight)        # [B, T, draft_vocab]
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from headstart.heads.directory import HeadsModule
from headstart.heads.draft_method import DraftMethod
from headstart.heads.draft_vocab import (check_token_ids, d2t_offsets, draft_labels, t2d_mask, target_to_draft,
                                          token_map_from_d2t, token_map_of)

METHODS = ("eagle", "eagle3")
NORM_FLAGS = ("norm_before_fc", "norm_before_residual", "norm_output")  # EagleConfig's EAGLE-3 norm options


@dataclass
class EagleConfig:
    hidden_size: int
    vocab_size: int
    method: str = "eagle"  # "eagle" (EAGLE-1) or "eagle3"
    draft_vocab_size: int = 0  # EAGLE-3's reduced vocabulary; EAGLE-1 uses the target's (0 -> vocab_size)
    feature_layers: list[int] = field(default_factory=list)  # HF hidden_states indices the draft reads
    layer_config: dict = field(default_factory=dict)  # the target's text config (builds the decoder layer)
    target: dict = field(default_factory=dict)  # headstart.heads.target.TargetInfo.to_dict() of the target
    # EAGLE-3's optional RMSNorms (module docstring); absent from a config.json = False = the original architecture
    norm_before_fc: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown EAGLE method {self.method!r}; use one of {METHODS}")
        if not self.draft_vocab_size:
            self.draft_vocab_size = self.vocab_size
        if self.method == "eagle" and self.draft_vocab_size != self.vocab_size:
            raise ValueError("EAGLE-1 drafts over the target's whole vocabulary (it uses the target's lm_head); "
                             "a reduced draft_vocab_size needs method: eagle3")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in 1..{self.vocab_size}, got {self.draft_vocab_size}")
        flags = [n for n in NORM_FLAGS if getattr(self, n)]
        if self.method == "eagle" and flags:
            raise ValueError(f"{', '.join(flags)}: EAGLE-3 draft options; EAGLE-1 has no fused taps, hidden_norm or own "
                             "norm. Set them false, or use method: eagle3")


def default_feature_layers(method: str, num_hidden_layers: int) -> list[int]:
    """EAGLE-1: the final-norm output (HF hidden_states[L]); EAGLE-3: inputs of layers 2, L//2, L-3."""
    n = num_hidden_layers
    if method == "eagle":
        return [n]
    taps = [min(2, n - 1), n // 2, max(n - 3, 0)]
    return taps


def eagle_config_for(model, method: str = "eagle", draft_vocab_size: int = 0, feature_layers: list[int] | None = None,
                     target_info: Any = None, **norms: bool) -> EagleConfig:
    """An EagleConfig sized for `model` (a transformers causal LM); `norms`: EAGLE-3's NORM_FLAGS (default off)."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layer_config = text.to_dict()
    layer_config["num_hidden_layers"] = 1
    if layer_config.get("layer_types"):
        layer_config["layer_types"] = layer_config["layer_types"][:1]
    layer_config.pop("quantization_config", None)
    return EagleConfig(
        hidden_size=text.hidden_size, vocab_size=text.vocab_size, method=method, draft_vocab_size=draft_vocab_size,
        feature_layers=list(feature_layers) if feature_layers else default_feature_layers(method, text.num_hidden_layers),
        layer_config=layer_config, target=target_info.to_dict() if hasattr(target_info, "to_dict") else dict(target_info or {}),
        **norms,
    )


def _family_classes(layer_config: PretrainedConfig) -> tuple[type, type]:
    """The target family's decoder layer and rotary embedding classes, found next to its causal LM class."""
    lm_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(layer_config)]
    module = sys.modules[lm_class.__module__]
    layer = [getattr(module, n) for n in dir(module) if n.endswith("DecoderLayer")]
    rotary = [getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding")]
    if len(layer) != 1 or len(rotary) != 1:
        raise ValueError(f"cannot find one decoder layer and one rotary embedding class for {layer_config.model_type!r}; "
                         "EAGLE here supports decoder-only families with rotary positions (llama, qwen2, qwen3, mistral)")
    return layer[0], rotary[0]


class EagleDraft(HeadsModule):
    def __init__(self, config: EagleConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        layer_config = AutoConfig.for_model(**config.layer_config)
        layer_config._attn_implementation = "sdpa"  # an explicit 4D mask is always passed
        layer_class, rotary_class = _family_classes(layer_config)
        layer = layer_class(layer_config, layer_idx=0)
        self.rotary_emb = rotary_class(layer_config)
        if config.method == "eagle":
            self.fc = nn.Linear(2 * h, h, bias=True)
            del layer.input_layernorm  # the first (only) layer reads fc's output directly
        else:
            n = len(config.feature_layers)
            if config.norm_before_fc:
                self.input_norm = type(layer.input_layernorm)(n * h, eps=layer_config.rms_norm_eps)
            self.fc = nn.Linear(n * h, h, bias=False)
            attn = layer.self_attn
            for name in ("q_proj", "k_proj", "v_proj"):  # attention reads cat(embed, feature): 2h inputs
                old = getattr(attn, name)
                setattr(attn, name, nn.Linear(2 * h, old.out_features, bias=old.bias is not None))
            layer.hidden_norm = type(layer.input_layernorm)(h, eps=layer_config.rms_norm_eps)
            self.norm = type(layer.input_layernorm)(h, eps=layer_config.rms_norm_eps)
            self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool) if config.draft_vocab_size ==
                                 config.vocab_size else torch.zeros(config.vocab_size, dtype=torch.bool))
        self.layers = nn.ModuleList([layer])
        # the attention's cache argument: `cache` in transformers >= 5.2x, `past_key_values` before
        params = inspect.signature(type(layer.self_attn).forward).parameters
        self._cache_arg = next((n for n in ("cache", "past_key_values", "past_key_value") if n in params), "cache")

    @property
    def is_eagle3(self) -> bool:
        return self.config.method == "eagle3"

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """The target's tapped hidden states [..., n*h] (concatenated in feature_layers order) -> feature [..., h]."""
        if not self.is_eagle3:
            return taps
        return self.fc(self.input_norm(taps) if self.config.norm_before_fc else taps)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """embeds [B, T, h] (target embedding of x_{t+1}), features [B, T, h] (f_t, fused or fed back),
        position_ids [B, T], attention_mask additive [B, 1, T, past + T] (None: causal without a cache)
        -> [B, T, h]: the predicted f_{t+1} (EAGLE-1) / the output fed back as a feature (EAGLE-3: pre-norm, or
        norm(output) with norm_output)."""
        layer = self.layers[0]
        if attention_mask is None:
            attention_mask = causal_mask(embeds.shape[1], embeds.dtype, embeds.device)
        if self.is_eagle3:
            normed = layer.hidden_norm(features)
            residual = normed if self.config.norm_before_residual else features
            x = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)  # [B, T, 2h]
        else:
            x = self.fc(torch.cat([embeds, features], dim=-1))  # [B, T, h]
            residual = x
        position_embeddings = self.rotary_emb(residual, position_ids=position_ids)
        attn, _ = layer.self_attn(hidden_states=x, position_embeddings=position_embeddings,
                                  attention_mask=attention_mask, **{self._cache_arg: cache})
        x = residual + attn
        out = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(out) if self.is_eagle3 and self.config.norm_output else out

    def logits(self, out: torch.Tensor, lm_head_weight: torch.Tensor | None = None) -> torch.Tensor:
        """out [..., h] (forward's output) -> logits [..., draft_vocab_size] (EAGLE-1: the target's lm_head, pass its
        weight [V, h]). EAGLE-3: lm_head(norm(out)); with norm_output forward has applied the norm already."""
        if self.is_eagle3:
            return self.lm_head(out if self.config.norm_output else self.norm(out))
        if lm_head_weight is None:
            raise ValueError("EAGLE-1 drafts through the target's lm_head: pass lm_head_weight")
        return out @ lm_head_weight.t()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft vocabulary ids -> target vocabulary ids (identity for EAGLE-1)."""
        return draft_ids + self.d2t[draft_ids] if self.is_eagle3 else draft_ids

    def check_state(self, state: dict) -> None:
        """The loaded d2t must map the draft vocabulary to distinct, increasing target ids (decoding reads them)."""
        if not self.is_eagle3:
            return
        d2t = state["d2t"]
        if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
            raise ValueError(f"d2t must hold integer offsets, not {d2t.dtype}")
        check_token_ids(token_map_from_d2t(d2t), self.config.vocab_size, "d2t (draft id + offset)")

    @torch.no_grad()
    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Use these target ids (draft_vocab_size of them, distinct) as the draft vocabulary, in increasing order:
        the d2t and t2d buffers (heads/draft_vocab.py)."""
        ids = token_map_of(target_ids, self.config.draft_vocab_size).to(self.d2t.device)
        self.d2t.copy_(d2t_offsets(ids))
        self.t2d.copy_(t2d_mask(ids, self.config.vocab_size))

    def to_draft_labels(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target ids -> (draft vocabulary ids, in-vocabulary mask); out-of-vocabulary labels become 0 (EAGLE-1: the
        ids themselves, all in)."""
        if not self.is_eagle3:
            return labels, torch.ones_like(labels, dtype=torch.bool)
        return draft_labels(target_to_draft(token_map_from_d2t(self.d2t), self.config.vocab_size), labels)


def causal_mask(length: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """Additive causal mask [1, 1, T, T]."""
    blocked = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)
    return torch.zeros(length, length, dtype=dtype, device=device).masked_fill(blocked, torch.finfo(dtype).min)[None, None]


# The declarations of EAGLE-1 and EAGLE-3 (heads/draft_method.py), registered in heads/methods.py: one draft module
# and trainer, two engine layouts.
EAGLE = DraftMethod(
    title="an EAGLE draft", card_name="EAGLE-1", names=("eagle",), config_class=EagleConfig, module_class=EagleDraft,
    proposer="headstart.inference.eagle:eagle_proposer", draft_prior="headstart.inference.eagle:draft_prior",
    trainer="headstart.train.eagle", train_config="EagleTrainConfig", dynamic_tree=True,
    formats=("vllm", "sglang"),
    refusals={"speculators": ("vLLM 0.32's speculators reader takes eagle3 (and peagle / dflash) only, not EAGLE-1: "
                              "use --format vllm for EAGLE-1 heads"),
              "llamacpp": ("llama.cpp runs EAGLE-3 drafts (--spec-type draft-eagle3), not EAGLE-1: serve these heads "
                           "with --format vllm, or train method: eagle3 for llama.cpp")},
    engine_export="headstart.heads.export_formats:eagle1_export",
    bench_info=lambda config: {"method": config.method},
)
EAGLE3 = replace(EAGLE, names=("eagle3",), card_name="EAGLE-3", formats=("vllm", "sglang", "speculators", "llamacpp"), refusals={},
                 engine_export="headstart.heads.export_formats:eagle3_export",
                 gguf_export="headstart.heads.export_gguf:eagle3_gguf", llamacpp_spec_type="draft-eagle3")
