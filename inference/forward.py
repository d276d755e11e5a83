"""The target's forward pass for tree verification, and the KV cache it appends to.

`target_forward` runs the decoder over new tokens (a prompt, or a whole tree under its 4D mask) and returns the
logits, the final-norm hidden states the Medusa heads read and, for EAGLE, the feature taps. `compact_cache`
keeps the accepted tree nodes and drops the rest. `python -m inference.forward [--target T]` times a step by
tokens verified, and the two attention paths (`gqa=True` / `False`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import time
from typing import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from inference.attention import gqa_sdpa


@functools.lru_cache(maxsize=None)
def _forward_kwargs(base_model_type: type) -> tuple[str, bool]:
    """Name of the cache argument ('cache' in transformers >= 5.2x, else 'past_key_values') and whether
    the model still takes `cache_position` (transformers 5.24's decoders do not: the cache tracks it)."""
    params = inspect.signature(base_model_type.forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"
    return cache_arg, "cache_position" in params


def target_forward(model: PreTrainedModel, input_ids: torch.Tensor, cache: DynamicCache,
                   attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                   last_only: bool = False, feature_layers: Sequence[int] | None = None, gqa: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Run the target on input_ids [1, T] appending to `cache`.

    Returns (logits [T, V] (or [1, V] with last_only), hidden [T, h] (or [1, h]), taps [T, n*h] or None):
    hidden is the decoder's final-norm output, the Medusa heads' input; taps (only with feature_layers, for
    EAGLE) concatenates HF hidden_states[i] for i in feature_layers at every position. attention_mask: None
    (causal) or an additive float mask [1, 1, T, past + T], passed through unchanged by transformers' mask builders.
    gqa: an `sdpa` target on CPU reads its grouped key/value heads in place (inference/attention.py); False runs
    transformers' own path (same values).
    """
    cache_arg, takes_cache_position = _forward_kwargs(type(model.base_model))
    past = cache.get_seq_length()
    kwargs = {cache_arg: cache, "use_cache": True}
    if position_ids is None:
        position_ids = torch.arange(past, past + input_ids.shape[1], device=input_ids.device)[None]
    if takes_cache_position:
        kwargs["cache_position"] = torch.arange(past, past + input_ids.shape[1], device=input_ids.device)
    if feature_layers:
        kwargs["output_hidden_states"] = True
    with gqa_sdpa(model, input_ids.device) if gqa else contextlib.nullcontext():
        out = model.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
    hidden = out.last_hidden_state[0]  # [T, h]
    taps = torch.cat([out.hidden_states[i][0] for i in feature_layers], dim=-1) if feature_layers else None
    if last_only:
        hidden = hidden[-1:]
    logits = model.get_output_embeddings()(hidden)  # [T, V]
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits.float(), hidden, taps


def compact_cache(cache: DynamicCache, prefix_len: int, keep: Sequence[int]) -> None:
    """Keep the tree nodes `keep` (tree indices, in order) after the first `prefix_len` cache entries,
    moved to contiguous positions prefix_len .. prefix_len + len(keep) - 1; drop every other node."""
    new_len = prefix_len + len(keep)
    contiguous = list(keep) == list(range(len(keep)))
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        if not contiguous:
            idx = torch.tensor(keep, dtype=torch.long, device=layer.keys.device) + prefix_len
            layer.keys[:, :, prefix_len:new_len] = layer.keys.index_select(2, idx)  # [B, H, len(keep), D]
            layer.values[:, :, prefix_len:new_len] = layer.values.index_select(2, idx)
        layer.keys = layer.keys[:, :, :new_len]
        layer.values = layer.values[:, :, :new_len]


@torch.no_grad()
def main(argv: list[str] | None = None) -> None:
    """Time the target's tree forward here: a step's cost by tokens verified (chains, 256-token cache), and a 3-token
    tree step with gqa=False vs gqa=True over 300 / 1000 / 1800-token caches; medians of --repeats, run in turns."""
    from heads.target import load_target
    from inference.tree import tree_from_choices

    parser = argparse.ArgumentParser(prog="python -m inference.forward", description=main.__doc__)
    parser.add_argument("--target", default="smollm2-135m", help="name or path (heads/target.py)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (on a busy machine 1 is steadier)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _, _ = load_target(args.target, args.dtype)
    vocab = model.get_output_embeddings().weight.shape[0]

    def medians(prefix: int, steps: dict[str, tuple[list[list[int]], bool]]) -> dict[str, float]:
        """label -> (tree choices, gqa): median ms of that tree's verify forward after a `prefix`-token cache."""
        ids = torch.randint(0, vocab, (1, prefix + 8), generator=torch.Generator().manual_seed(0))
        cache, times = DynamicCache(), {label: [] for label in steps}
        target_forward(model, ids[:, :prefix], cache)
        trees = {label: (tree_from_choices(choices), gqa) for label, (choices, gqa) in steps.items()}
        for _ in range(args.repeats):
            for label, (tree, gqa) in trees.items():
                mask, positions = tree.attention_mask(prefix), tree.position_ids(prefix)
                t0 = time.perf_counter()
                target_forward(model, ids[:, prefix: prefix + tree.size], cache, mask, positions, gqa=gqa)
                times[label].append(1000 * (time.perf_counter() - t0))
                compact_cache(cache, prefix, [])
        return {label: sorted(t)[len(t) // 2] for label, t in times.items()}

    threads = f"{torch.get_num_threads()} threads, medians of {args.repeats}"
    by_size = medians(256, {str(n): ([[0] * d for d in range(1, n)], True) for n in (1, 2, 3, 4, 8)})
    print(f"256-token cache, ms by tokens verified: {' / '.join(by_size)} tokens: "
          f"{' / '.join(f'{ms:.1f}' for ms in by_size.values())} ms ({threads})")
    for prefix in (300, 1000, 1800):
        ms = medians(prefix, {"sdpa": ([[0], [1]], False), "gqa": ([[0], [1]], True)})
        print(f"{prefix}-token cache, 3-token tree step: sdpa {ms['sdpa']:.1f} ms, gqa {ms['gqa']:.1f} ms ({threads})")


if __name__ == "__main__":
    main()
