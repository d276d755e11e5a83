"""Grouped-query attention for tree verification on CPU, without copying the key/value heads.

transformers' `sdpa` attention copies each key/value head num_key_value_groups times (`repeat_kv`) whenever it
gets a mask and more than one query token: exactly the tree-verify forward. torch's SDPA reads grouped heads itself
(`enable_gqa=True`). `gqa_sdpa(model, device)` switches an `sdpa` target to that path for one call: the same values
(tests/test_infer_generate.py checks them equal) with less memory traffic, which grows with the cache.
`headstart.inference.forward.target_forward(..., gqa=False)` runs the plain path instead (`python -m headstart.inference.forward`
times both).

On CUDA the fused SDPA kernels take no arbitrary mask with grouped heads, so there the switch is a no-op.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

GQA_SDPA = "headstart_gqa_sdpa"


def gqa_sdpa_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention; a masked multi-token query on grouped heads goes to SDPA with enable_gqa.

    query [B, Hq, T, D], key/value [B, Hkv, S, D], attention_mask [B or 1, 1, T, S] -> ([B, T, Hq, D], None).
    """
    groups = getattr(module, "num_key_value_groups", 1)
    plain = kwargs.get("position_bias") is None and kwargs.get("softcap") is None and not kwargs.get("output_attentions")
    if groups > 1 and attention_mask is not None and query.shape[2] > 1 and plain:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask[:, :, :, : key.shape[-2]],
                                             dropout_p=dropout, scale=scaling, enable_gqa=True)  # [B, Hq, T, D]
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


AttentionInterface.register(GQA_SDPA, gqa_sdpa_attention)
AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)  # the same masks as sdpa


@contextlib.contextmanager
def attention_implementation(model, name: str):
    """Run `model`'s attention through the registered implementation `name` inside the block, and restore the one it
    had after. transformers' attention layers look the implementation up in the model's config at every call, so a
    switch scoped to one forward is how that forward takes another path while the model stays as it was for every
    other caller (HF `generate`, training)."""
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def gqa_sdpa(model, device: torch.device | str) -> contextlib.AbstractContextManager:
    """Run `model` with gqa_sdpa_attention inside the block when it uses `sdpa` on CPU; otherwise unchanged."""
    if torch.device(device).type != "cpu" or getattr(model.config, "_attn_implementation", None) != "sdpa":
        return contextlib.nullcontext()
    return attention_implementation(model, GQA_SDPA)
