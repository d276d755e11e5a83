"""Grouped-query attention for tree verification on CPU, without copying the key/value heads.

transformers' `sdpa` attention copies each key/value head num_key_value_groups times (`repeat_kv`) whenever it
gets a mask and more than one query token: exactly the tree-verify forward. torch's SDPA reads grouped heads itself
(`enable_gqa=True`). `gqa_sdpa(model)` switches an `sdpa` target to that path for one call; it gives the same
values (tests/test_infer_generate.py checks them equal), and on SmolLM2-135M (9 query heads over 3 key/value heads)
with 2 CPU cores a 3-token tree step drops from 42.7 to 41.2 ms over a 300-token cache, 51.5 to 42.3 ms over
1000 tokens and 67.2 to 52.9 ms over 1800 (medians of 20, interleaved: `python -m inference.attention`; the gain
grows with the cache, and with other load on the memory bus: 55.1 -> 51.4 ms at 300 tokens on a busier moment).

On CUDA the fused SDPA kernels take no arbitrary mask with grouped heads, so there the switch is a no-op.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

GQA_SDPA = "headstart_gqa_sdpa"
ENABLED = True  # False: gqa_sdpa leaves the model alone (for timing the plain path)


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
def gqa_sdpa(model, device: torch.device | str):
    """Run `model` with gqa_sdpa_attention inside the block when it uses `sdpa` on CPU; otherwise unchanged."""
    config = model.config
    if not ENABLED or torch.device(device).type != "cpu" or getattr(config, "_attn_implementation", None) != "sdpa":
        yield
        return
    config._attn_implementation = GQA_SDPA
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"


def main() -> None:
    """Time a 3-token tree step of the embedded target, sdpa vs gqa_sdpa (interleaved), over 300/1000/1800-token caches."""
    import importlib

    from transformers import DynamicCache

    from heads.target import load_target
    from inference.generate import compact_cache, target_forward
    from inference.tree import tree_from_choices

    switch = importlib.import_module("inference.attention")  # the module target_forward reads (not this __main__)
    model, _, _ = load_target("smollm2-135m", "float32")
    tree = tree_from_choices([[0], [1]])
    for prefix in (300, 1000, 1800):
        ids = torch.randint(100, 40000, (1, prefix), generator=torch.Generator().manual_seed(0))
        mask = tree.attention_mask(prefix, dtype=torch.float32, device="cpu")
        positions = tree.position_ids(prefix, device="cpu")
        cache = DynamicCache()
        times: dict[bool, list[float]] = {False: [], True: []}
        with torch.no_grad():
            target_forward(model, ids, cache)
            for _ in range(20):
                for enabled in times:
                    switch.ENABLED = enabled
                    t0 = time.perf_counter()
                    target_forward(model, ids[:, :3], cache, mask, positions)
                    times[enabled].append(time.perf_counter() - t0)
                    compact_cache(cache, prefix, [])
        switch.ENABLED = True
        sdpa, gqa = (1000 * sorted(times[k])[len(times[k]) // 2] for k in (False, True))
        print(f"{prefix}-token cache: sdpa {sdpa:.1f} ms, {GQA_SDPA} {gqa:.1f} ms per 3-token tree step "
              f"(median of 20, {torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
