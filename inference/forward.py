"""The target's forward pass for tree verification, and the KV cache it appends to.

`target_forward` runs the decoder over new tokens (a prompt, or a whole tree under its 4D mask) and returns the
logits, the final-norm hidden states the Medusa heads read and, for EAGLE, the feature taps. `compact_cache`
keeps the accepted tree nodes and drops the rest.

`exact=True` verifies a tree the way plain decoding computes each position: every tree node attends alone, with
the one-token step's own attention call (`sdpa_attention_forward`, no mask) over exactly the keys it sees (prefix +
ancestors, in order). In half precision a masked multi-token attention sums in another order than a one-token step,
so greedy output can differ from plain greedy at near-ties; with `exact` the rest of the forward (linear layers,
norms, RoPE) is row-by-row arithmetic, identical to the one-token step wherever the device's matmul gives a row the
same result whatever the number of rows (`rows_invariant` checks it).

`python -m headstart.inference.forward [--target T]` times a step by tokens verified, and the two attention paths
(`gqa=True` / `False`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import time
from typing import Sequence

import torch
from transformers import AttentionInterface, DynamicCache, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from headstart.inference.attention import attention_implementation, gqa_sdpa
from headstart.inference.cpu_linear import (ALWAYS_ONEDNN, DEFAULT, MKL, ONEDNN, CpuLinear, KernelChoice, linear_kernel,
                                  use_cpu_linears)

ROWWISE_SDPA = "headstart_rowwise_sdpa"


def rowwise_sdpa_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           row_key_positions: Sequence[torch.Tensor] | None = None,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, Hq, T, D], key/value [B, Hkv, S, D] -> ([B, T, Hq, D], None): row t attends to the key positions
    row_key_positions[t] only, through the call a one-token decode step makes (no mask, its own gqa handling).
    Without row_key_positions (a forward that is not a tree step) it is transformers' sdpa attention."""
    if row_key_positions is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    rows = [sdpa_attention_forward(module, query[:, :, t:t + 1], key.index_select(2, idx), value.index_select(2, idx),
                                   None, dropout=dropout, scaling=scaling, **kwargs)[0]  # [B, 1, Hq, D]
            for t, idx in enumerate(row_key_positions)]
    return torch.cat(rows, dim=1), None


AttentionInterface.register(ROWWISE_SDPA, rowwise_sdpa_attention)
AttentionMaskInterface.register(ROWWISE_SDPA, sdpa_mask)


def attended_key_positions(model: PreTrainedModel, attention_mask: torch.Tensor) -> list[torch.Tensor]:
    """Per query row of the additive mask [1, 1, T, S] (0 = attend), the key positions it attends to: T tensors
    [n_t] on the mask's device, for rowwise_sdpa_attention. One device-to-host copy of the mask per call."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation != "sdpa":
        raise ValueError(f"exact verification reproduces sdpa's one-token step; this target's attention is "
                         f"{implementation!r}: load it with attn_implementation='sdpa'")
    allowed = (attention_mask[0, 0] == 0).cpu()  # [T, S]
    return [row.nonzero().squeeze(1).to(attention_mask.device) for row in allowed]


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so a wall-clock timing around it counts that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rows_invariant(model: PreTrainedModel, rows: int = 8) -> bool:
    """Whether this device's matmul gives each row the same bits whatever the number of rows (1 vs `rows`), for
    every linear layer of the target: what `exact=True` needs besides its attention. It depends on the kernel the
    matmul picks for the row count, the thread count and the dtype (e.g. MKL runs one fp32 row as a gemv), so it is
    measured on the loaded model rather than assumed."""
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, CpuLinear)):  # through the module: its kernel may be switched
            weight = module.weight  # [out, in]
            x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight)
            together = module(x)  # [rows, out]
            if not all(torch.equal(module(x[i:i + 1])[0], together[i]) for i in range(rows)):
                return False
    return True


@functools.lru_cache(maxsize=None)
def _forward_kwargs(base_model_type: type) -> tuple[str, bool]:
    """Name of the cache argument ('cache' in transformers >= 5.2x, else 'past_key_values') and whether
    the model still takes `cache_position` (transformers 5.24's decoders do not: the cache tracks it)."""
    params = inspect.signature(base_model_type.forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"
    return cache_arg, "cache_position" in params


def target_forward(model: PreTrainedModel, input_ids: torch.Tensor, cache: DynamicCache,
                   attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                   last_only: bool = False, feature_layers: Sequence[int] | None = None, gqa: bool = True,
                   exact: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Run the target on input_ids [1, T] appending to `cache`.

    Returns (logits [T, V] (or [1, V] with last_only), hidden [T, h] (or [1, h]), taps [T, n*h] or None):
    hidden is the decoder's final-norm output, the Medusa heads' input; taps (only with feature_layers, for
    EAGLE) concatenates HF hidden_states[i] for i in feature_layers at every position. attention_mask: None
    (causal) or an additive float mask [1, 1, T, past + T], passed through unchanged by transformers' mask builders.
    gqa: an `sdpa` target on CPU reads its grouped key/value heads in place (inference/attention.py); False runs
    transformers' own path (same values). exact (with an attention_mask): each row attends alone, as in a
    one-token step (see the module docstring); it overrides gqa.
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
    if exact and attention_mask is not None:
        kwargs["row_key_positions"] = attended_key_positions(model, attention_mask)  # to each attention call
        attention = attention_implementation(model, ROWWISE_SDPA)
    else:
        attention = gqa_sdpa(model, input_ids.device) if gqa else contextlib.nullcontext()
    with attention:
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
    """Time the target's tree forward here: a step's cost by tokens verified (chains of --sizes, over each of
    --caches), and a 3-token tree step with gqa=False vs gqa=True over 300 / 1000 / 1800-token caches; medians of
    --repeats, run in turns (on CUDA synchronised around each timed call)."""
    from headstart.heads.target import load_target
    from headstart.inference.tree import tree_from_choices

    parser = argparse.ArgumentParser(prog="python -m headstart.inference.forward", description=main.__doc__)
    parser.add_argument("--target", default="smollm2-135m", help="name or path (heads/target.py)")
    parser.add_argument("--dtype", default="float32", help="the target's dtype: float32, bfloat16 or float16")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 3, 4, 8], help="tokens verified per step")
    parser.add_argument("--caches", type=int, nargs="+", default=[256],
                        help="cache lengths the sizes are timed over, e.g. 256 1536 (a long prompt)")
    parser.add_argument("--repeats", type=int, default=20, help="timed forwards per size and cache length")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (on a busy machine 1 is steadier)")
    parser.add_argument("--linear", choices=["measured", DEFAULT, ONEDNN, MKL, "both", "all"], default="measured",
                        help="float32 CPU linear kernels: per row count the fastest as measured here (what the "
                             "Speculator runs, inference/cpu_linear.py), or one kernel always (mkl: the default beyond "
                             "its largest packed row count), default then onednn (both), or all four in turn "
                             "(default, onednn, mkl, measured)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model, _, _ = load_target(args.target, args.dtype, device)
    vocab = model.get_output_embeddings().weight.shape[0]

    def medians(prefix: int, steps: dict[str, tuple[list[list[int]], bool]]) -> dict[str, float]:
        """label -> (tree choices, gqa): median ms of that tree's verify forward after a `prefix`-token cache."""
        trees = {label: (tree_from_choices(choices), gqa) for label, (choices, gqa) in steps.items()}
        longest = max(tree.size for tree, _ in trees.values())
        ids = torch.randint(0, vocab, (1, prefix + longest), generator=torch.Generator().manual_seed(0)).to(device)
        cache, times = DynamicCache(), {label: [] for label in steps}
        target_forward(model, ids[:, :prefix], cache)
        for _ in range(args.repeats):
            for label, (tree, gqa) in trees.items():
                mask, positions = tree.attention_mask(prefix, model.dtype, device), tree.position_ids(prefix, device)
                sync(device)
                t0 = time.perf_counter()
                target_forward(model, ids[:, prefix: prefix + tree.size], cache, mask, positions, gqa=gqa)
                sync(device)
                times[label].append(1000 * (time.perf_counter() - t0))
                compact_cache(cache, prefix, [])
        return {label: sorted(t)[len(t) // 2] for label, t in times.items()}

    where = f"{device}, {args.dtype}" if device.type == "cuda" else f"{torch.get_num_threads()} threads, {args.dtype}"
    threads = f"{where}, medians of {args.repeats}"
    use_cpu_linears(model, ALWAYS_ONEDNN)
    layers = [m for m in model.modules() if isinstance(m, CpuLinear)]
    modes = {"all": [DEFAULT, ONEDNN, MKL, "measured"], "both": [DEFAULT, ONEDNN]}.get(args.linear, [args.linear])
    for mode in modes:
        for layer in layers:
            layer.keep_every_copy()
        kernels = KernelChoice.measure(layers) if mode == "measured" else KernelChoice({1: mode})  # {1: k}: k always
        for layer in layers:
            layer.use(kernels)
        for cache_len in args.caches:
            by_size = medians(cache_len, {str(n): ([[0] * d for d in range(1, n)], True) for n in args.sizes})
            print(f"{cache_len}-token cache, ms by tokens verified: {' / '.join(by_size)} tokens: "
                  f"{' / '.join(f'{ms:.1f}' for ms in by_size.values())} ms ({threads}, {linear_kernel(model)} linear "
                  "kernels)")
    for prefix in (300, 1000, 1800):
        ms = medians(prefix, {"sdpa": ([[0], [1]], False), "gqa": ([[0], [1]], True)})
        print(f"{prefix}-token cache, 3-token tree step: sdpa {ms['sdpa']:.1f} ms, gqa {ms['gqa']:.1f} ms ({threads})")


if __name__ == "__main__":
    main()
