"""Tree speculative decoding with Medusa heads or an EAGLE draft: the decode loop, the `Speculator`, and a CLI.

One decode step is a ladder of small functions:
    propose (draft a tree of candidate tokens; or a chain found in the context, inference/lookup.py) ->
    verify (one target forward over the whole tree, explicit 4D mask) -> accept (greedy / lossless sampling /
    typical) -> compact the KV cache.

    spec = Speculator.from_pretrained("path/to/heads")           # loads the target named by the heads
    out = spec.generate(input_ids, max_new_tokens=128)            # greedy: identical to model.generate
    out.tokens, out.stats.tau

CLI (applies the chat template, streams the text, prints tau and tokens/s):
    python -m inference.generate --heads DIR_OR_ID --prompt "Hi!" --max_new_tokens 64 [--temperature 0.7] \
        [--tree auto|default|PATH] [--no_lookup]
"""

from __future__ import annotations

import argparse
import copy
import functools
import inspect
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Protocol, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from inference.attention import gqa_sdpa
from inference.eagle import EagleProposer, dynamic_config_from_choices
from inference.lookup import LookupConfig, chain_draft, lookup_continuation
from inference.tree import (DEFAULT_ACCURACY, DynamicTreeConfig, Tree, best_choices, build_dynamic_tree, default_choices,
                            expected_accept_length, static_tree_tokens, tree_from_choices)
from inference.verify import greedy_accept, sample_accept, target_probs, typical_accept

TREE_FILE = "tree.json"
# Tree sizes timed by `--tree auto`. The small ones matter on CPUs, where a forward over 2-3 tokens costs little more
# than one (measured here, 300-token cache: 1/2/3/4/8 tokens = 49/55/58/75/92 ms) but 4+ tokens cost much more.
CALIBRATION_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
DEFAULT_EAGLE_TREE = DynamicTreeConfig(topk=4, depth=4, total_tokens=8)  # as many nodes as the default Medusa tree


class SpeculatorError(ValueError):
    """Bad input to the speculator; the message names the problem and the fix."""


# ---------------------------------------------------------------------------------------------
# Target forward with a tree mask, and the KV cache


@functools.lru_cache(maxsize=None)
def _forward_kwargs(base_model_type: type) -> tuple[str, bool]:
    """Name of the cache argument ('cache' in transformers >= 5.2x, else 'past_key_values') and whether
    the model still takes `cache_position` (transformers 5.24's decoders do not: the cache tracks it)."""
    params = inspect.signature(base_model_type.forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"
    return cache_arg, "cache_position" in params


def target_forward(model: PreTrainedModel, input_ids: torch.Tensor, cache: DynamicCache,
                   attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                   last_only: bool = False, feature_layers: Sequence[int] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Run the target on input_ids [1, T] appending to `cache`.

    Returns (logits [T, V] (or [1, V] with last_only), hidden [T, h] (or [1, h]), taps [T, n*h] or None):
    hidden is the decoder's final-norm output, the Medusa heads' input; taps (only with feature_layers, for
    EAGLE) concatenates HF hidden_states[i] for i in feature_layers at every position. attention_mask: None
    (causal) or an additive float mask [1, 1, T, past + T], passed through unchanged by transformers' mask builders.
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
    with gqa_sdpa(model, input_ids.device):  # tree masks on CPU: no copies of the key/value heads
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


# ---------------------------------------------------------------------------------------------
# Proposers: anything that drafts a tree from the target's last hidden state


@dataclass
class DraftInput:
    hidden: torch.Tensor  # [h] target's final-norm hidden state at the last token in the cache
    root: int  # the token the target chose after it (node 0 of the tree; not in the cache yet)
    context: list[int]  # every token so far (prompt + emitted), the root included
    features: torch.Tensor | None = None  # [k, n*h] the proposer's feature_layers taps of the k target cache
    # entries added since its last call (the prompt, then each accepted path); None unless it has feature_layers


class Proposer(Protocol):
    def __call__(self, draft: DraftInput) -> tuple[Tree, torch.Tensor]:
        """-> (tree, tokens [N]) with tokens[0] == draft.root."""


class MedusaProposer:
    """Static Medusa tree: node at depth d, rank r gets head d-1's rank-r token."""

    def __init__(self, heads: torch.nn.Module, tree: Tree, lm_head_weight: torch.Tensor | None = None):
        num_heads = heads.config.num_heads
        if tree.max_depth > num_heads:
            raise SpeculatorError(f"the tree is {tree.max_depth} deep but the heads have only {num_heads} heads; "
                                  f"use a tree of depth <= {num_heads}")
        self.heads = heads
        self.tree = tree
        # the rows of the shared lm_head the heads score (their draft vocabulary), sliced once
        self.lm_head_weight = heads.draft_lm_head_weight(lm_head_weight) if lm_head_weight is not None else None
        self.topk = max(tree.ranks) + 1

    @torch.no_grad()
    def __call__(self, draft: DraftInput) -> tuple[Tree, torch.Tensor]:
        if self.tree.max_depth == 0:  # a root-only tree: plain decoding (what `auto` picks when drafting never pays)
            return self.tree, torch.tensor([draft.root], dtype=torch.long)
        logits = medusa_logits(self.heads, draft.hidden, self.tree.max_depth, self.lm_head_weight)  # [depth, Vd]
        topk_tokens = self.heads.to_target_ids(logits.topk(self.topk, dim=-1).indices)  # [depth, k] target ids
        return self.tree, static_tree_tokens(self.tree, draft.root, topk_tokens)


# draft(draft_input, tokens [n], parents, frontier) -> log-probs [F, V] of the token after each frontier
# node of the partial tree (node 0 = draft_input.root); e.g. an EAGLE draft model.
DynamicDraftFn = Callable[[DraftInput, torch.Tensor, list[int], list[int]], torch.Tensor]


class DynamicTreeProposer:
    """EAGLE-2 style dynamic tree around any draft callable (see inference.tree.build_dynamic_tree).

    Lossless sampling needs the draft to be deterministic given the context (it is then q = 1 on the tree).
    """

    def __init__(self, draft: DynamicDraftFn, config: DynamicTreeConfig | None = None):
        self.draft = draft
        self.config = config or DynamicTreeConfig()

    @torch.no_grad()
    def __call__(self, draft: DraftInput) -> tuple[Tree, torch.Tensor]:
        return build_dynamic_tree(draft.root, lambda tokens, parents, frontier: self.draft(draft, tokens, parents, frontier),
                                  self.config)


def medusa_logits(heads: torch.nn.Module, hidden: torch.Tensor, depth: int,
                  lm_head_weight: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [h] -> logits [depth, V] of the first `depth` heads only (a full-vocabulary head is costly).

    lm_head_weight: the shared lm_head rows the heads score ([Vd, h] with a draft vocabulary: `draft_lm_head_weight`);
    the logits index those rows.
    """
    feats = torch.stack([heads.blocks[k](hidden) for k in range(depth)])  # [depth, h]
    if heads.lm_heads is None:
        if lm_head_weight is None:
            raise SpeculatorError("these Medusa heads share the target's lm_head: pass lm_head_weight")
        return feats @ lm_head_weight.t()  # one matmul for all heads
    return torch.stack([heads.lm_heads[k](feats[k]) for k in range(depth)])


# ---------------------------------------------------------------------------------------------
# The decode loop


@dataclass
class GenerateStats:
    new_tokens: int = 0
    decode_forwards: int = 0  # target forward passes after the prefill (one per tree)
    lookup_steps: int = 0  # of those, steps that verified a chain found in the context instead of the heads' tree
    accept_hist: list[int] = field(default_factory=list)  # accept_hist[a] = steps that kept a drafted tokens
    tree_size: int = 0  # nodes of the last tree (root included)
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0  # target tree forward + acceptance + cache compaction
    total_s: float = 0.0

    @property
    def tau(self) -> float:
        """Tokens generated per decode-phase target forward (bonus included; the prefill and its token excluded)."""
        return (self.new_tokens - 1) / self.decode_forwards if self.decode_forwards else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else float("nan")

    def to_dict(self) -> dict:
        return dict(asdict(self), tau=self.tau, tokens_per_s=self.tokens_per_s)


@dataclass
class GenerateOutput:
    tokens: list[int]  # new tokens only (a stop token, when hit, is the last one)
    stats: GenerateStats
    stopped: bool = False  # True when a stop token ended the output


@dataclass
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    acceptance: str = "auto"  # auto (greedy at T=0, lossless sampling otherwise) | typical (lossy, opt-in)
    posterior_threshold: float = 0.09  # typical acceptance only
    posterior_alpha: float = 0.3


def _choose_first(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> int:
    """The target's own token from logits [V] (after the prefill)."""
    if cfg.temperature <= 0:
        return int(logits.argmax())
    return int(torch.multinomial(target_probs(logits, cfg.temperature, cfg.top_p), 1, generator=generator))


def _accept(tree: Tree, tokens: list[int], logits: torch.Tensor, cfg: SamplingConfig,
            generator: torch.Generator | None) -> tuple[list[int], int]:
    if cfg.acceptance == "typical" and cfg.temperature > 0:
        return typical_accept(tree.children, tokens, logits, cfg.temperature, cfg.posterior_threshold,
                              cfg.posterior_alpha, generator)
    if cfg.temperature <= 0:
        return greedy_accept(tree.children, tokens, logits)
    return sample_accept(tree.children, tokens, target_probs(logits, cfg.temperature, cfg.top_p), generator)


def check_context(model: PreTrainedModel, prompt_len: int, max_new_tokens: int) -> None:
    """Raise SpeculatorError when the prompt, or prompt + new tokens, exceeds the target's context.

    (Drafted nodes past the last kept token may sit a few positions beyond; RoPE handles that.)"""
    if max_new_tokens <= 0:
        raise SpeculatorError(f"max_new_tokens must be a positive integer, got {max_new_tokens}; pass e.g. max_new_tokens=128")
    if prompt_len == 0:
        raise SpeculatorError("the prompt is empty: pass at least one token")
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and prompt_len >= limit:
        raise SpeculatorError(f"the prompt has {prompt_len} tokens but the target's context "
                              f"(max_position_embeddings) is {limit}: shorten the prompt to under {limit} tokens")
    if limit is not None and prompt_len + max_new_tokens > limit:
        raise SpeculatorError(f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the target's "
                              f"context (max_position_embeddings) of {limit} tokens: lower max_new_tokens to at most "
                              f"{limit - prompt_len} or shorten the prompt")
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    uses_window = window is not None and (not layer_types or "sliding_attention" in layer_types) \
        and getattr(config, "use_sliding_window", True)
    if uses_window and prompt_len + max_new_tokens > window:
        raise SpeculatorError(f"prompt + max_new_tokens ({prompt_len + max_new_tokens}) exceeds the target's sliding "
                              f"window ({window}); tree decoding here supports sequences within the window only: "
                              "lower max_new_tokens or shorten the prompt")


@torch.no_grad()
def speculative_generate(
    model: PreTrainedModel,
    proposer: Proposer,
    input_ids: torch.Tensor | Sequence[int],
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    stop_token_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
    lookup: LookupConfig | None = None,
) -> GenerateOutput:
    """Speculative decoding at batch 1. input_ids: [L] or [1, L]. Returns the new tokens and stats.

    on_tokens(new_ids) is called after every step with the tokens it emitted (streaming).
    lookup: also draft from the context (inference/lookup.py): a step whose context ends in a repeated n-gram
    verifies what followed it, instead of calling the proposer.
    """
    sampling = sampling or SamplingConfig()
    if sampling.acceptance not in ("auto", "typical"):
        raise SpeculatorError(f"unknown acceptance {sampling.acceptance!r}; use 'auto' (lossless) or 'typical' (lossy)")
    if sampling.temperature < 0 or not 0 < sampling.top_p <= 1:
        raise SpeculatorError(f"temperature must be >= 0 and top_p in (0, 1], got {sampling.temperature}, {sampling.top_p}")
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() > 2 or (ids.dim() == 2 and ids.shape[0] != 1):
        raise SpeculatorError(f"input_ids of shape {tuple(ids.shape)}: speculative decoding here runs one sequence "
                              "at a time; pass [L] or [1, L] and loop over prompts")
    ids = ids.reshape(-1).cpu()
    check_context(model, ids.numel(), max_new_tokens)
    stops = set(int(t) for t in stop_token_ids)
    stats = GenerateStats()
    start = time.perf_counter()

    feature_layers = getattr(proposer, "feature_layers", None)  # an EAGLE draft reads these target taps
    if hasattr(proposer, "reset"):
        proposer.reset()
    cache = DynamicCache()
    logits, hidden, taps = target_forward(model, ids[None].to(device), cache, last_only=True,
                                          feature_layers=feature_layers)  # [1, V], [1, h], [L, n*h]
    root = _choose_first(logits[0], sampling, generator)
    hidden_last = hidden[0]
    prefix_len = ids.numel()
    context = ids.tolist() + [root]
    emitted = [root]
    stats.prefill_s = time.perf_counter() - start
    if on_tokens is not None:
        on_tokens([root])
    stopped = root in stops

    while not stopped and len(emitted) < max_new_tokens:
        t0 = time.perf_counter()
        chain = lookup_continuation(context, lookup) if lookup is not None and lookup.num_tokens > 0 else []
        if chain:
            tree, tokens = chain_draft(root, chain)
            stats.lookup_steps += 1
        else:
            tree, tokens = proposer(DraftInput(hidden=hidden_last, root=root, context=context, features=taps))
            taps = None  # handed over
        t1 = time.perf_counter()
        mask = tree.attention_mask(prefix_len, dtype=dtype, device=device)  # [1, 1, N, prefix_len + N]
        positions = tree.position_ids(prefix_len, device=device)  # [1, N]
        logits, hidden, tree_taps = target_forward(model, tokens[None].to(device), cache, mask, positions,
                                                   feature_layers=feature_layers)  # [N, V], [N, h], [N, n*h]
        token_list = tokens.tolist()
        path, bonus = _accept(tree, token_list, logits, sampling, generator)
        compact_cache(cache, prefix_len, path)
        t2 = time.perf_counter()
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        stats.decode_forwards += 1
        while len(stats.accept_hist) < len(path):
            stats.accept_hist.append(0)
        stats.accept_hist[len(path) - 1] += 1
        stats.tree_size = tree.size

        prefix_len += len(path)
        hidden_last = hidden[path[-1]]
        if tree_taps is not None:  # the accepted nodes are the new cache entries; kept until the proposer runs
            taps = tree_taps[path] if taps is None else torch.cat([taps, tree_taps[path]])
        new = [token_list[i] for i in path[1:]] + [bonus]
        step_out: list[int] = []
        for tok in new:
            if len(emitted) >= max_new_tokens:
                break
            emitted.append(tok)
            step_out.append(tok)
            if tok in stops:
                stopped = True
                break
        context.extend(new)
        root = bonus
        if on_tokens is not None and step_out:
            on_tokens(step_out)

    stats.new_tokens = len(emitted)
    stats.total_s = time.perf_counter() - start
    return GenerateOutput(tokens=emitted, stats=stats, stopped=stopped)


# ---------------------------------------------------------------------------------------------
# Tree size by measurement


@dataclass
class TreeCalibration:
    choices: list[list[int]]
    expected_accept_length: float
    step_ms: dict[int, float]  # tree size (root included) -> fastest forward ms over the repeats, monotone fit
    raw_step_ms: dict[int, float]  # the same before the fit
    draft_ms: float
    expected_tokens_per_s: dict[int, float]
    accuracy_source: str  # "heads" (measured, from the heads directory) or "default prior"
    prefix_len: int
    device: str
    choices_by_size: dict[int, list[list[int]]] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"choices": self.choices, "expected_accept_length": self.expected_accept_length,
                "step_ms": {str(k): v for k, v in self.step_ms.items()},
                "raw_step_ms": {str(k): v for k, v in self.raw_step_ms.items()}, "draft_ms": self.draft_ms,
                "expected_tokens_per_s": {str(k): v for k, v in self.expected_tokens_per_s.items()},
                "accuracy_source": self.accuracy_source, "prefix_len": self.prefix_len, "device": self.device}


def monotone_fit(times: dict[int, float]) -> dict[int, float]:
    """Least-squares non-decreasing fit of step time vs tree size (pool adjacent violators).

    A bigger tree never costs less; on a busy machine a small size can still time slower than a bigger
    one, which would make big trees look cheap. Pooling such inversions removes that noise.
    """
    sizes = sorted(times)
    blocks: list[list[float]] = []  # [mean, count]
    for size in sizes:
        blocks.append([times[size], 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, c2), (m1, c1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    fitted: dict[int, float] = {}
    i = 0
    for mean, count in blocks:
        for _ in range(int(count)):
            fitted[sizes[i]] = mean
            i += 1
    return fitted


def _time_ms(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


@torch.no_grad()
def calibrate_tree(model: PreTrainedModel, heads: torch.nn.Module, accuracy: Sequence[Sequence[float]] | None = None,
                   sizes: Sequence[int] = CALIBRATION_SIZES, prefix_len: int = 256, repeats: int = 3,
                   lm_head_weight: torch.Tensor | None = None,
                   draft_for: Callable[[list[list[int]]], Callable[[], None]] | None = None) -> TreeCalibration:
    """Pick the tree size maximising expected tokens/s = expected accepted length / (verify + draft time).

    The draft is timed once with all Medusa heads, or, with `draft_for(choices) -> run` (EAGLE: drafting
    a dynamic tree of that size and depth), per size.

    Each size n is timed as one tree forward of n tokens over a cache of `prefix_len` tokens (the best
    tree of n nodes for `accuracy`, so the mask is the real one), `repeats` rounds over all sizes, fastest
    time kept; accuracy[d][r] is the per-(depth, rank) acceptance rate, DEFAULT_ACCURACY (a documented
    prior, see inference/tree.py) when None. About (sizes x repeats) target forwards: a few seconds on CPU.
    """
    source = "heads" if accuracy is not None else "default prior"
    accuracy = [list(row) for row in (accuracy if accuracy is not None else DEFAULT_ACCURACY)]
    accuracy = accuracy[: getattr(heads.config, "num_heads", len(accuracy))]
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    vocab = model.get_output_embeddings().weight.shape[0]
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    limit = getattr(config, "max_position_embeddings", 4096) or 4096
    prefix_len = max(1, min(prefix_len, limit - max(sizes) - 1))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, prefix_len), generator=gen).to(device)
    cache = DynamicCache()
    _, hidden, _ = target_forward(model, prompt, cache, last_only=True)
    steps: dict[int, Callable[[], None]] = {}
    per_size_choices: dict[int, list[list[int]]] = {}
    for n in sizes:
        choices = best_choices(accuracy, n - 1)
        tree = tree_from_choices(choices)
        tokens = torch.randint(0, vocab, (1, tree.size), generator=gen).to(device)
        mask = tree.attention_mask(prefix_len, dtype=dtype, device=device)
        positions = tree.position_ids(prefix_len, device=device)

        def step(tokens=tokens, mask=mask, positions=positions) -> None:
            target_forward(model, tokens, cache, mask, positions)
            compact_cache(cache, prefix_len, [])  # back to the prefix: every timing sees the same cache

        steps[tree.size] = step
        per_size_choices[tree.size] = choices
    # rounds over all sizes, keeping each size's fastest time: robust to other load on the machine
    for step in steps.values():
        step()  # warm-up
    if draft_for is None:
        draft_weight = heads.draft_lm_head_weight(lm_head_weight) if lm_head_weight is not None else None
        drafts = {None: lambda: medusa_logits(heads, hidden[0], len(accuracy), draft_weight)}
    else:
        drafts = {size: draft_for(per_size_choices[size]) for size in steps}
    draft_times = {key: math.inf for key in drafts}
    step_ms = {size: math.inf for size in steps}
    for _ in range(repeats):
        for key, run in drafts.items():
            draft_times[key] = min(draft_times[key], _time_ms(run))
        for size, step in steps.items():
            step_ms[size] = min(step_ms[size], _time_ms(step))
    raw_step_ms = dict(step_ms)
    step_ms = monotone_fit(step_ms)
    expected: dict[int, float] = {}
    for size in steps:
        draft_ms = draft_times[None] if draft_for is None else draft_times[size]
        cost = step_ms[size] + (draft_ms if size > 1 else 0.0)  # a one-node "tree" is plain decoding: no draft
        expected[size] = 1000.0 * expected_accept_length(per_size_choices[size], accuracy) / cost
    best = max(expected, key=lambda s: expected[s])
    choices = per_size_choices[best]
    draft_ms = draft_times[None] if draft_for is None else draft_times[best]
    return TreeCalibration(choices=choices, expected_accept_length=expected_accept_length(choices, accuracy),
                           step_ms=step_ms, raw_step_ms=raw_step_ms, draft_ms=draft_ms, expected_tokens_per_s=expected,
                           accuracy_source=source, prefix_len=prefix_len, device=str(device),
                           choices_by_size=per_size_choices)


def read_accuracy(heads_dir: Path) -> list[list[float]] | None:
    """Per-(depth, rank) acceptance rates recorded in the heads directory, or None.

    Rows = heads (depth 1, 2, ...), columns = ranks. Read from `tree.json` ("accuracy"), else from the
    training metrics in `metrics.json` ("rank_accuracy": P(the true token is head k's rank-r guess), as
    train/medusa.py writes it). Used as the Medusa paper does: a path's acceptance probability is the
    product of its nodes' rates (heads treated as independent).
    """
    for name, key in ((TREE_FILE, "accuracy"), ("metrics.json", "rank_accuracy"), ("metrics.json", "accuracy")):
        file = heads_dir / name
        if not file.is_file():
            continue
        try:
            data = json.loads(file.read_text())
        except json.JSONDecodeError:
            continue
        acc = data.get(key) if isinstance(data, dict) else None
        if isinstance(acc, list) and acc and all(isinstance(row, list) and row for row in acc):
            return [[float(a) for a in row] for row in acc]
    return None


# ---------------------------------------------------------------------------------------------
# Speculator: heads + target + tree


def _resolve_heads_dir(heads: str | Path) -> Path:
    path = Path(heads).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SpeculatorError(f"heads directory {path} has no config.json: pass a directory written by "
                                  "MedusaHeads.save_pretrained (e.g. the output_dir of train/medusa.py)")
        return path
    name = str(heads)
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise SpeculatorError(f"heads {name!r} not found: no such directory, and not a Hub repo id (owner/name). "
                              "Pass the output directory of train/medusa.py or a Hub id like 'user/smollm2-medusa'")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name))
    except Exception as err:  # offline without a cached copy, unknown repo, auth
        raise SpeculatorError(f"could not get heads {name!r} from the Hugging Face Hub or its local cache "
                              f"({err.__class__.__name__}). Check the id, or download them elsewhere "
                              f"(`hf download {name} --local-dir DIR`) and pass DIR") from err


def _merge_adapter(model: PreTrainedModel, heads_dir: Path) -> PreTrainedModel:
    from heads.medusa import ADAPTER_DIR, HeadsLoadError, merge_adapter

    try:
        return merge_adapter(model, heads_dir / ADAPTER_DIR)
    except HeadsLoadError as err:
        raise SpeculatorError(f"{err}; re-download the heads directory with its adapter/ folder") from err


class Speculator:
    """Draft heads (Medusa or EAGLE-1/3) + their target + a tree. `generate` is lossless unless acceptance='typical'.

    Medusa heads draft a static tree (`self.tree`); an EAGLE draft grows a dynamic tree of `self.dynamic`'s
    size each step. For Medusa-2 heads (config.adapter) the target is the LoRA-merged one: outputs equal *its*
    greedy decoding / distribution (a target you pass in is copied first, never modified).
    """

    def __init__(self, model: PreTrainedModel, heads: torch.nn.Module, tokenizer=None,
                 choices: Sequence[Sequence[int]] | None = None, heads_dir: Path | None = None, lookup: bool = True):
        self.model = model
        self.heads = heads
        self.tokenizer = tokenizer
        self.heads_dir = heads_dir
        self.lookup = lookup  # also draft from repeats in the context (inference/lookup.py), with the tree's node count
        self.is_eagle = str(heads.config.method).startswith("eagle")
        self.max_depth = DEFAULT_EAGLE_TREE.depth if self.is_eagle else heads.config.num_heads
        if self.is_eagle:
            self.dynamic = DEFAULT_EAGLE_TREE if choices is None else dynamic_config_from_choices([list(c) for c in choices])
            self.tree = None
            self.lm_head_weight = None
        else:
            choices = default_choices(heads.config.num_heads) if choices is None else choices
            choices = [list(c) for c in choices if len(c) <= heads.config.num_heads]
            self.tree = tree_from_choices(choices)
            self.lm_head_weight = model.get_output_embeddings().weight if heads.config.share_lm_head else None

    @property
    def tree_size(self) -> int:
        """Nodes per verification (root included): the static tree's, or the dynamic tree's total."""
        return self.dynamic.total_tokens if self.is_eagle else self.tree.size

    def make_proposer(self) -> Proposer:
        if self.is_eagle:
            return EagleProposer(self.heads, self.model, self.dynamic)
        return MedusaProposer(self.heads, self.tree, self.lm_head_weight)

    @classmethod
    def from_pretrained(cls, heads: str | Path, target: PreTrainedModel | str | None = None, tokenizer=None,
                        tree: str | Sequence[Sequence[int]] | None = None, dtype: str | torch.dtype = "float32",
                        device: str | torch.device = "cpu") -> "Speculator":
        """Load heads (local dir or Hub id) and their target.

        target: None (load the target named in the heads' config with heads.target.load_target), a name/path
        for load_target, or a loaded model (checked against the heads' recorded fingerprint).
        tree: None (the heads dir's tree.json if any, else the default), "default", "auto" (calibrate on
        this device and write tree.json), a path to a JSON file with "choices", or a list of choices.
        """
        from heads.eagle import heads_method, load_eagle_draft
        from heads.medusa import MedusaHeads
        from heads.target import fingerprint, load_target

        heads_dir = _resolve_heads_dir(heads)
        try:
            if heads_method(heads_dir).startswith("eagle"):
                heads_module = load_eagle_draft(heads_dir)
            else:
                heads_module = MedusaHeads.from_pretrained(str(heads_dir))
        except Exception as err:
            raise SpeculatorError(f"could not load the heads in {heads_dir} ({err.__class__.__name__}: "
                                  f"{str(err).splitlines()[0][:200] if str(err) else ''}); re-download or re-train them") from err
        recorded = heads_module.config.target or {}
        if target is None:
            if not recorded.get("name"):
                raise SpeculatorError(f"{heads_dir}/config.json names no target: pass target=... (a model or its path)")
            model, tok, info = load_target(recorded["name"], dtype, device)
            tokenizer = tokenizer or tok
            got_fp = info.fingerprint
            target_name = recorded["name"]
        elif isinstance(target, (str, Path)):
            model, tok, info = load_target(str(target), dtype, device)
            tokenizer = tokenizer or tok
            got_fp = info.fingerprint
            target_name = str(target)
        else:
            model = target
            got_fp = fingerprint(model)
            target_name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        want_fp = recorded.get("fingerprint")
        if want_fp and want_fp != got_fp:
            raise SpeculatorError(
                f"the heads in {heads} were trained on target {recorded.get('name')!r} (fingerprint {want_fp}), "
                f"but the given target {target_name!r} has fingerprint {got_fp}: different weights. Fix: load the "
                f"target the heads were trained on (omit target= to load {recorded.get('name')!r}), or train heads "
                "for this target with train/medusa.py or train/eagle.py")
        hidden = model.get_output_embeddings().weight.shape[1]
        if heads_module.config.hidden_size != hidden:
            raise SpeculatorError(f"the heads expect hidden size {heads_module.config.hidden_size}, the target has {hidden}: "
                                  "these heads belong to another model; load the target they were trained on")
        if getattr(heads_module.config, "adapter", False):  # Medusa-2: the heads read the LoRA-tuned target
            model = _merge_adapter(model if isinstance(target, (str, Path)) or target is None else copy.deepcopy(model),
                                   heads_dir)
        heads_module = heads_module.to(device=next(model.parameters()).device, dtype=next(model.parameters()).dtype).eval()
        spec = cls(model, heads_module, tokenizer, choices=None, heads_dir=heads_dir)
        spec.set_tree(tree)
        return spec

    def set_tree(self, tree: str | Sequence[Sequence[int]] | None) -> None:
        """See `from_pretrained` for the accepted values (EAGLE: also a DynamicTreeConfig)."""
        if isinstance(tree, DynamicTreeConfig):
            if not self.is_eagle:
                raise SpeculatorError("a dynamic tree needs an EAGLE draft; Medusa heads take tree choices")
            self.dynamic = tree
            return
        saved = self.heads_dir / TREE_FILE if self.heads_dir is not None else None
        if tree is None:
            if saved is not None and saved.is_file():
                tree = str(saved)
            else:
                tree = "default"
        if tree == "default":
            if self.is_eagle:
                self.dynamic = DEFAULT_EAGLE_TREE
                return
            choices = default_choices(self.heads.config.num_heads)
        elif tree == "auto":
            self.calibrate()
            return
        elif isinstance(tree, (str, Path)):
            file = Path(tree)
            if not file.is_file():
                raise SpeculatorError(f"tree {tree!r} is not 'auto', 'default' or an existing JSON file with 'choices'")
            try:
                choices = json.loads(file.read_text())["choices"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise SpeculatorError(f"{file} is not a tree file: it needs a JSON object with a 'choices' list") from err
        else:
            choices = tree
        choices = [list(c) for c in choices if len(c) <= self.max_depth]
        if self.is_eagle:
            self.dynamic = dynamic_config_from_choices(choices)
        else:
            self.tree = tree_from_choices(choices)

    def calibrate(self, sizes: Sequence[int] = CALIBRATION_SIZES, prefix_len: int = 256,
                  repeats: int = 3) -> TreeCalibration:
        """Time the target on this device, choose the tree, store it as tree.json in the heads dir."""
        accuracy = read_accuracy(self.heads_dir) if self.heads_dir is not None else None
        draft_for = self._eagle_draft_timer(prefix_len) if self.is_eagle else None
        if self.is_eagle and accuracy is not None:
            accuracy = accuracy[: self.max_depth]
        calib = calibrate_tree(self.model, self.heads, accuracy, sizes, prefix_len, repeats, self.lm_head_weight,
                               draft_for)
        if self.heads_dir is not None:
            record = calib.to_json()
            if accuracy is not None:
                record["accuracy"] = accuracy
            try:
                (self.heads_dir / TREE_FILE).write_text(json.dumps(record, indent=1))
            except OSError as err:  # a read-only Hub cache: keep the choice in memory only
                print(f"note: could not write {self.heads_dir / TREE_FILE} ({err})", file=sys.stderr)
        if self.is_eagle:
            self.dynamic = dynamic_config_from_choices(calib.choices)
        else:
            self.tree = tree_from_choices(calib.choices)
        return calib

    def _eagle_draft_timer(self, prefix_len: int) -> Callable[[list[list[int]]], Callable[[], None]]:
        """draft_for(choices) -> a callable drafting one dynamic tree of that shape after a prefix_len context."""
        vocab = self.model.get_output_embeddings().weight.shape[0]
        device = next(self.model.parameters()).device
        context = torch.randint(0, vocab, (prefix_len + 1,), generator=torch.Generator().manual_seed(1)).tolist()
        _, hidden, taps = target_forward(self.model, torch.tensor([context[:-1]], device=device), DynamicCache(),
                                         feature_layers=self.heads.config.feature_layers)

        def draft_for(choices: list[list[int]]) -> Callable[[], None]:
            proposer = EagleProposer(self.heads, self.model, dynamic_config_from_choices(choices))
            proposer(DraftInput(hidden=hidden[-1], root=context[-1], context=context, features=taps))  # commit
            return lambda: proposer(DraftInput(hidden=hidden[-1], root=context[-1], context=context))

        return draft_for

    def generate(self, input_ids: torch.Tensor | Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, acceptance: str = "auto", seed: int | None = None,
                 stop_token_ids: Sequence[int] | None = None, on_tokens: Callable[[list[int]], None] | None = None,
                 proposer: Proposer | None = None, lookup: bool | None = None) -> GenerateOutput:
        """Decode up to max_new_tokens after input_ids ([L] or [1, L]).

        temperature 0: greedy, token-identical to model.generate(do_sample=False) in fp32.
        temperature > 0: lossless sampling (acceptance='auto') or Medusa typical acceptance ('typical', lossy).
        stop_token_ids: default the target's generation_config.eos_token_id. on_tokens: streaming callback.
        lookup: draft from repeats in the context too (default self.lookup); chains get the tree's node count.
        """
        if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise SpeculatorError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if stop_token_ids is None:
            eos = getattr(self.model.generation_config, "eos_token_id", None)
            stop_token_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        proposer = proposer or self.make_proposer()
        sampling = SamplingConfig(temperature=temperature, top_p=top_p, acceptance=acceptance)
        use_lookup = self.lookup if lookup is None else lookup
        chain = LookupConfig(num_tokens=self.tree_size - 1) if use_lookup and self.tree_size > 1 else None
        return speculative_generate(self.model, proposer, input_ids, max_new_tokens, sampling, stop_token_ids,
                                    generator, on_tokens, chain)


# ---------------------------------------------------------------------------------------------
# Streaming text and the CLI


class TextStream:
    """on_tokens callback that decodes incrementally and writes only the new text."""

    def __init__(self, tokenizer, write: Callable[[str], None] | None = None):
        self.tokenizer = tokenizer
        self.write = write or (lambda s: print(s, end="", flush=True))
        self.ids: list[int] = []
        self.text = ""

    def __call__(self, new_ids: list[int]) -> None:
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the next tokens
            return
        self.write(text[len(self.text):])
        self.text = text

    def end(self) -> None:
        """Write whatever is still held back (an output that ends inside a multi-byte character)."""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        self.write(text[len(self.text):])
        self.text = text


def chat_input_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as a user turn with the target's chat template (plain encoding if it has none)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(prompt)["input_ids"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inference.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", required=True, help="heads directory or Hub id")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--tree", default=None, help="auto | default | PATH to a JSON with 'choices' "
                                                      "(default: the heads' tree.json if present)")
    parser.add_argument("--target", default=None, help="target name/path (default: the one named by the heads)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (on a busy machine 1 is often faster)")
    parser.add_argument("--typical", action="store_true", help="Medusa typical acceptance (lossy)")
    parser.add_argument("--no_lookup", action="store_true", help="draft with the heads only, never from repeats in the "
                                                                 "context (inference/lookup.py)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        spec = Speculator.from_pretrained(args.heads, target=args.target, tree=args.tree, dtype=args.dtype,
                                          device=args.device)
        ids = chat_input_ids(spec.tokenizer, args.prompt)
        stream = TextStream(spec.tokenizer)
        out = spec.generate(ids, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            acceptance="typical" if args.typical else "auto", seed=args.seed, on_tokens=stream,
                            lookup=not args.no_lookup)
        stream.end()
    except SpeculatorError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    s = out.stats
    print(f"\n\n{s.new_tokens} tokens, tau {s.tau:.2f} (tokens per target forward), {s.tokens_per_s:.1f} tokens/s, "
          f"tree {spec.tree_size} nodes, {s.lookup_steps} of {s.decode_forwards} steps drafted from the context, draft {s.draft_s:.2f} s, verify {s.verify_s:.2f} s, prefill {s.prefill_s:.2f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
