"""The decode loop: speculative decoding at batch 1, lossless unless typical acceptance is asked for.

Each step is a ladder of small functions:
    propose (a proposer drafts a tree of candidate tokens; or a chain found in the context, inference/lookup.py;
             or, adaptive, what inference/adapt.py's policy expects to pay most: plain, heads, lookup or both) ->
    verify (one target forward over the whole tree, explicit 4D mask, inference/forward.py) ->
    accept (greedy / lossless sampling / typical, inference/verify.py) -> compact the KV cache to the accepted path.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from headstart.inference.adapt import AdaptivePolicy
from headstart.inference.forward import compact_cache, target_forward
from headstart.inference.lookup import LookupConfig, chain_draft, lookup_continuation
from headstart.inference.tree import DraftInput, Proposer, Tree
from headstart.inference.verify import greedy_accept, sample_accept, target_probs, typical_accept


class SpeculatorError(ValueError):
    """Bad input to the speculator; the message names the problem and the fix."""


@dataclass
class GenerateStats:
    new_tokens: int = 0
    decode_forwards: int = 0  # target forward passes after the prefill (one per tree)
    lookup_steps: int = 0  # of those, steps that verified a chain found in the context instead of the heads' tree
    accept_hist: list[int] = field(default_factory=list)  # accept_hist[a] = steps that kept a drafted tokens
    tree_size: int = 0  # nodes of the last tree (root included)
    proposals: dict[str, int] = field(default_factory=dict)  # adaptive: steps per plan kind (plain/heads/lookup/both)
    step_sizes: dict[int, int] = field(default_factory=dict)  # adaptive: steps per verified tree size
    # a fixed tree drafted by a proposer with a confidence head: per drafted step, (c_1 .. along its rank-0 chain,
    # how many nodes of that chain were accepted)
    confidence_steps: list[tuple[list[float], int]] = field(default_factory=list)
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
    logits: list[torch.Tensor] | None = None  # keep_logits: per token, the target's logits [V] that chose it


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
    probs = target_probs(logits, cfg.temperature, cfg.top_p).cpu()  # [V]; `generator` is a CPU generator
    return int(torch.multinomial(probs, 1, generator=generator))


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
    exact: bool = False,
    keep_logits: bool = False,
    policy: AdaptivePolicy | None = None,
) -> GenerateOutput:
    """Speculative decoding at batch 1. input_ids: [L] or [1, L]. Returns the new tokens and stats.

    on_tokens(new_ids) is called after every step with the tokens it emitted (streaming).
    lookup: also draft from the context (inference/lookup.py): a step whose context ends in a repeated n-gram
    verifies what followed it, instead of calling the proposer.
    exact: verify each tree node with a one-token step's attention (inference/forward.py): greedy output stays
    plain greedy's in half precision where the device's matmul is row-invariant; slower.
    keep_logits: also return, per emitted token, the target's logits row that chose it (analysis, not timing).
    policy: adaptive drafting (inference/adapt.py): each step verifies what the policy chooses (`lookup` unused);
    the proposer must be `resizable`.
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

    feature_layers = proposer.feature_layers  # the target taps the draft reads (EAGLE, DFlash)
    proposer.reset()
    cache = DynamicCache()
    logits, hidden, taps = target_forward(model, ids[None].to(device), cache, last_only=True,
                                          feature_layers=feature_layers)  # [1, V], [1, h], [L, n*h]
    root = _choose_first(logits[0], sampling, generator)
    hidden_last = hidden[0]
    prefix_len = ids.numel()
    context = ids.tolist() + [root]
    emitted = [root]
    kept = [logits[0]] if keep_logits else None
    stats.prefill_s = time.perf_counter() - start
    if on_tokens is not None:
        on_tokens([root])
    stopped = root in stops

    while not stopped and len(emitted) < max_new_tokens:
        t0 = time.perf_counter()
        confidence: list[float] = []  # this step's draft's confidence head, when it has one
        if policy is not None:
            plan = policy.plan(context)
            heads_tree = heads_tokens = None
            if plan.heads_choices:
                proposer.resize(plan.heads_choices)
                heads_tree, heads_tokens = proposer(DraftInput(hidden=hidden_last, root=root, context=context,
                                                               features=taps))
                taps = None  # handed over
            tree, tokens, keys = policy.build(plan, root, heads_tree, heads_tokens)
            stats.lookup_steps += plan.lookup_depth > 0
        else:
            chain = lookup_continuation(context, lookup) if lookup is not None and lookup.num_tokens > 0 else []
            if chain:
                tree, tokens = chain_draft(root, chain)
                stats.lookup_steps += 1
            else:
                tree, tokens = proposer(DraftInput(hidden=hidden_last, root=root, context=context, features=taps))
                taps = None  # handed over
                confidence = list(proposer.confidence)
        t1 = time.perf_counter()
        if tree.size == 1:  # a plain step: the one-token forward plain decoding runs (no mask), nothing to drop
            logits, hidden, tree_taps = target_forward(model, tokens[None].to(device), cache,
                                                       feature_layers=feature_layers)  # [1, V], [1, h], [1, n*h]
        else:
            mask = tree.attention_mask(prefix_len, dtype=dtype, device=device)  # [1, 1, N, prefix_len + N]
            positions = tree.position_ids(prefix_len, device=device)  # [1, N]
            logits, hidden, tree_taps = target_forward(model, tokens[None].to(device), cache, mask, positions,
                                                       feature_layers=feature_layers,
                                                       exact=exact)  # [N, V], [N, h], [N, n*h]
        token_list = tokens.tolist()
        path, bonus = _accept(tree, token_list, logits, sampling, generator)
        if tree.size > 1:
            compact_cache(cache, prefix_len, path)
        t2 = time.perf_counter()
        if policy is not None:
            policy.observe(plan, tree, keys, path)
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        stats.decode_forwards += 1
        while len(stats.accept_hist) < len(path):
            stats.accept_hist.append(0)
        stats.accept_hist[len(path) - 1] += 1
        stats.tree_size = tree.size
        if confidence:
            on_chain = 0  # accepted nodes along the rank-0 chain the confidences are of
            while on_chain + 1 < len(path) and tree.ranks[path[on_chain + 1]] == 0:
                on_chain += 1
            stats.confidence_steps.append((confidence, on_chain))

        prefix_len += len(path)
        hidden_last = hidden[path[-1]]
        if tree_taps is not None:  # the accepted nodes are the new cache entries; kept until the proposer runs
            taps = tree_taps[path] if taps is None else torch.cat([taps, tree_taps[path]])
        new = [token_list[i] for i in path[1:]] + [bonus]
        step_out: list[int] = []
        for node, tok in zip(path, new):  # token tok was chosen by the logits at tree node `node`
            if len(emitted) >= max_new_tokens:
                break
            emitted.append(tok)
            step_out.append(tok)
            if kept is not None:
                kept.append(logits[node].clone())  # a copy: a view would keep the whole [N, V] step alive
            if tok in stops:
                stopped = True
                break
        context.extend(new)
        root = bonus
        if on_tokens is not None and step_out:
            on_tokens(step_out)

    if policy is not None:
        stats.proposals = dict(policy.kinds)
        stats.step_sizes = dict(sorted(policy.sizes.items()))
    stats.new_tokens = len(emitted)
    stats.total_s = time.perf_counter() - start
    return GenerateOutput(tokens=emitted, stats=stats, stopped=stopped, logits=kept)
