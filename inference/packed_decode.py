"""Continuous batching for the hf backend: many conversations decoded together, each computed as if alone.

    decoder = PackedDecoder(model, max_new_tokens=128, stop_ids={2}, max_rows=128)
    answers = decoder.generate([[1, 2, 3], [1, 4]], seeds=[0, 1])   # -> [[5, 6, 2], [9, 9, 9, 9]]

Each step runs the model once over one packed sequence [1, T]: the last token of every conversation being decoded
and the whole prompt of every conversation admitted this step. The linear layers see all T tokens at once (the
batching that pays on a CPU); attention runs per conversation over its own cache rows, of its exact length, with no
padding. A conversation leaves when it writes a stop token or `max_new_tokens` tokens, and the next prompt takes its
place, so no step is spent on finished rows and no row waits for the longest one of its batch. The rows decoded
together are `max_rows`, fewer where their key/value cache would pass `cache_gib` (long prompts).

Why a row's tokens do not depend on its neighbours (fp32 on the CPU): PyTorch's default (MKL) linear rounds a row
differently by the number of rows beside it (and by thread count), and padding changes the attention's reduction
order. Here every linear layer runs through oneDNN over a weight reordered once (inference/cpu_linear.py's CpuLinear
with oneDNN for every row count), whose result for a row is the same for any 2 or more rows and any thread count (a
one-token step is padded with a dummy token to 2 rows; the lm_head gets at least 2 rows), and attention sees exactly
the row's own keys. So a conversation's tokens are a function of its prompt, its seed and the thread count: not of
the batch, the process count or `max_rows`. (PyTorch's CPU attention rounds a one-token query differently at 1 and 2
threads, so runs at different thread counts can part at a near-tie.) Elsewhere (GPU, bf16) the default kernels run and rows may differ in
near-ties by batch composition.

The prompts of a call share their start (the chat template's system turn and user prefix, or a system prompt of
the user's): that prefix's linear layers run once a call, not once a prompt. The
first prompt admitted computes it in full and leaves each layer's queries, keys and values of the prefix positions;
every later prompt feeds only its own tokens through the linear layers, and each layer's attention gets the prefix's
queries, keys and values put back in front, so it runs over the whole prompt exactly as before. Exact because a
prefix position's states do not depend on the tokens after it, only on how PyTorch's CPU flash attention blocks the
prompt: the queries in blocks of 32, 64 or 256 rows (prompts under 192 tokens, under 768, longer), each block over
the keys up to its end in one 512-key block or more. Where every prefix row's block ends inside the prompt and at
most 512 keys in (`prefix_reusable`), the prefix rows see the same keys in the same vector lanes with zeros past
their own position, and their states are the same bits in every such prompt; other prompts are computed in full.

The model is any transformers causal LM whose attention layers go through transformers' attention interface
(Llama, Qwen2/3, Mistral, Gemma, ...): a custom attention function ("headstart_packed") does the cache writes and
the per-row attention; the first step checks that every layer went through it.
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface

from headstart.inference.cpu_linear import ALWAYS_ONEDNN, CpuLinear, onednn_applies

ATTENTION = "headstart_packed"


class PackedDecodeError(RuntimeError):
    """A target this decoder cannot run exactly; the message names the fix."""


@dataclass
class _Row:
    index: int  # into the prompts of the call
    slot: int  # its rows in the cache tensors
    length: int = 0  # tokens in its cache
    tokens: list[int] = field(default_factory=list)  # generated so far
    generator: torch.Generator | None = None  # sampling only


@dataclass
class _Step:
    """What the attention function needs for one forward: where each token's key goes, and the segments."""

    slots: torch.Tensor  # [T_real] cache slot of each real token
    positions: torch.Tensor  # [T_real] its position in the row
    # (slot, first token in the packing, tokens, row length after, prefix positions put back in front of them)
    segments: list[tuple[int, int, int, int, int]]
    dummy: bool  # one extra token at the end (a one-token step padded to 2 rows)
    cache_slots: int  # rows of the cache tensors
    capacity: int  # positions per slot
    prefix: _Prefix
    cache: dict = field(default_factory=dict)  # layer_idx -> (keys, values) [slots, kv_heads, capacity, head_dim]
    layers_seen: set = field(default_factory=set)


@dataclass
class _Prefix:
    """The start every prompt of a call shares, and each layer's states of its positions once a prompt has run them."""

    tokens: list[int]
    capture_at: int | None = None  # this step: where in the packing the prompt that computes the states starts
    states: dict = field(default_factory=dict)  # layer_idx -> queries [heads, P, d], keys, values [kv_heads, P, d]


def flash_query_block(query_len: int) -> int:
    """The query rows PyTorch's CPU flash attention takes together (fp32, no mask) for a query of this length."""
    return 32 if query_len < 192 else 64 if query_len < 768 else 256


def prefix_reusable(shared: int, length: int) -> bool:
    """Whether a `shared`-token prefix's states inside a prompt of `length` tokens are the bits it has in every
    other such prompt: the query block of each prefix row ends inside the prompt, at most 512 keys in."""
    block = flash_query_block(length)
    blocks_end = -(-shared // block) * block
    return 0 < shared < length and blocks_end <= min(length, 512)


def shared_prefix(prompts: list[list[int]]) -> list[int]:
    """The longest start all prompts share ([] for a single prompt)."""
    if len(prompts) < 2:
        return []
    first, n = prompts[0], min(len(p) for p in prompts)
    for prompt in prompts[1:]:
        n = next((i for i in range(n) if prompt[i] != first[i]), n)
    return first[:n]


def _packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [1, heads, T, d], key/value [1, kv_heads, T, d] of this step's tokens -> attention output [1, T, heads, d].
    Writes the keys/values into each row's cache slot, then attends per row over exactly its own positions."""
    step: _Step = kwargs["packed_step"]
    for name in ("softcap", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise PackedDecodeError(f"the target's attention uses {name!r}, which the hf engine's packed decoding does "
                                    "not implement: use --backend vllm")
    layer = module.layer_idx
    step.layers_seen.add(layer)
    if layer not in step.cache:
        shape = (step.cache_slots, key.shape[1], step.capacity, key.shape[3])
        step.cache[layer] = (key.new_empty(shape), value.new_empty(shape))
    keys, values = step.cache[layer]
    prefix = step.prefix
    if prefix.capture_at is not None:  # a prompt computed in full leaves the prefix's states of this layer
        c, p = prefix.capture_at, len(prefix.tokens)
        prefix.states[layer] = (query[0, :, c:c + p].clone(), key[0, :, c:c + p].clone(), value[0, :, c:c + p].clone())
    real = step.slots.numel()
    keys[step.slots, :, step.positions] = key[0, :, :real].transpose(0, 1)  # [T_real, kv_heads, d]
    values[step.slots, :, step.positions] = value[0, :, :real].transpose(0, 1)
    window = getattr(module, "sliding_window", None)
    outputs = []
    for slot, start, n, end, shared in step.segments:
        rows = query[:, :, start:start + n]  # [1, heads, n, d]
        if shared:  # the prefix's states back in front: the attention runs over the whole prompt
            prefix_queries, prefix_keys, prefix_values = prefix.states[layer]
            keys[slot, :, :shared] = prefix_keys
            values[slot, :, :shared] = prefix_values
            rows = torch.cat([prefix_queries[None], rows], dim=2)  # [1, heads, shared + n, d]
        first = 0
        if window is not None and end > window:
            if rows.shape[2] > 1:
                raise PackedDecodeError(f"a prompt of {end} tokens is longer than the target's sliding window "
                                        f"({window}): lower --max_length below it, or use --backend vllm")
            first = end - window  # kv positions (p - window, p]
        out = F.scaled_dot_product_attention(
            rows, keys[slot:slot + 1, :, first:end], values[slot:slot + 1, :, first:end],
            is_causal=rows.shape[2] > 1, scale=scaling, enable_gqa=True)  # [1, heads, shared + n, d]
        outputs.append(out[:, :, shared:])
    if step.dummy:
        outputs.append(query.new_zeros(1, query.shape[1], 1, value.shape[3]))
    return torch.cat(outputs, dim=2).transpose(1, 2), None


AttentionInterface.register(ATTENTION, _packed_attention)


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """logits [V] -> the same with every token outside the smallest set of probability >= top_p at -inf."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=False)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    remove = cumulative <= 1 - top_p
    remove[-1] = False  # the most likely token always stays
    return logits.masked_fill(remove.scatter(0, order, remove), float("-inf"))


class PackedDecoder:
    def __init__(self, model, max_new_tokens: int, stop_ids: set[int], max_rows: int = 128,
                 temperature: float = 0.0, top_p: float = 1.0, cache_gib: float = 4.0, share_prefix: bool = True):
        self.model = model
        self.max_new_tokens, self.stop_ids, self.max_rows = max_new_tokens, set(stop_ids), max_rows
        self.cache_gib = cache_gib
        self.share_prefix = share_prefix  # the prompts' shared start through the linear layers once a call
        self.temperature, self.top_p = temperature, top_p
        self.device = next(model.parameters()).device
        # the oneDNN twins of the model's linear layers, swapped in for each call only (the model stays as given)
        self.swaps = []  # (parent module, attribute, original, replacement)
        if onednn_applies(model):
            for module in model.modules():
                for name, child in module.named_children():
                    if type(child) is nn.Linear:
                        self.swaps.append((module, name, child, CpuLinear(child, ALWAYS_ONEDNN)))
        self.checked = False

    def rows_for(self, capacity: int) -> int:
        """How many rows to decode together when each keeps `capacity` positions: `max_rows`, fewer where the
        key/value cache of every layer would pass `cache_gib`, at least 1."""
        config = self.model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        element = next(self.model.parameters()).element_size()
        per_row = config.num_hidden_layers * 2 * kv_heads * capacity * head_dim * element  # keys and values
        return max(1, min(self.max_rows, int(self.cache_gib * 2**30 // per_row)))

    @property
    def batch_invariant(self) -> bool:
        return bool(self.swaps)

    @contextlib.contextmanager
    def _packed_model(self):
        before = self.model.config._attn_implementation
        for module, name, _, replacement in self.swaps:
            setattr(module, name, replacement)
        self.model.set_attn_implementation(ATTENTION)
        try:
            yield
        finally:
            self.model.set_attn_implementation(before)
            for module, name, original, _ in self.swaps:
                setattr(module, name, original)

    def _forward(self, step: _Step, ids: list[int], positions: list[int], last: list[int]) -> torch.Tensor:
        """One packed forward -> fp32 logits [len(last), V] at the packing's token indices `last`."""
        if step.dummy:
            ids, positions = ids + ids[-1:], positions + [0]
        keep = last if len(last) > 1 else last * 2  # the lm_head sees >= 2 rows
        logits = self.model(input_ids=torch.tensor([ids], device=self.device),
                            position_ids=torch.tensor([positions], device=self.device), use_cache=False,
                            logits_to_keep=torch.tensor(keep, device=self.device), packed_step=step).logits[0]
        if not self.checked:
            layers = self.model.config.num_hidden_layers
            if len(step.layers_seen) != layers:
                raise PackedDecodeError(f"{len(step.layers_seen)} of the target's {layers} layers went through "
                                        "transformers' attention interface; the hf engine's packed decoding needs all "
                                        "of them (a standard-attention decoder): use --backend vllm")
            self.checked = True
        return logits[: len(last)].float()

    def _pick(self, logits: torch.Tensor, rows: list[_Row]) -> list[int]:
        """logits [R, V] -> the next token of each row: argmax, or a draw from its own generator."""
        if self.temperature == 0:
            return logits.argmax(-1).tolist()
        picked = []
        for row_logits, row in zip(logits, rows):
            probs = _top_p_filter(row_logits / self.temperature, self.top_p).softmax(-1)
            picked.append(int(torch.multinomial(probs, 1, generator=row.generator)))
        return picked

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], seeds: list[int],
                 on_answers: Optional[Callable[[int], object]] = None) -> list[list[int]]:
        """The tokens written after each prompt, ending with the stop token when one was written; on_answers(1) is
        told as each answer is finished (progress)."""
        answers: list[list[int] | None] = [None] * len(prompts)
        queue = collections.deque(range(len(prompts)))
        capacity = max(len(p) for p in prompts) + self.max_new_tokens
        slots = min(self.rows_for(capacity), len(prompts))
        free = list(range(slots))
        live: list[_Row] = []
        cache: dict = {}
        # the exactness argument holds for fp32 on the CPU (oneDNN linears, flash attention); elsewhere all run in full
        prefix = _Prefix(shared_prefix(prompts) if self.share_prefix and self.batch_invariant else [])
        with self._packed_model():
            while queue or live:
                admitted = []
                while queue and free:
                    j = queue.popleft()
                    generator = None
                    if self.temperature > 0:
                        generator = torch.Generator(device=self.device).manual_seed(seeds[j])
                    admitted.append(_Row(j, free.pop(0), generator=generator))
                ids, positions, token_slots, segments, last = [], [], [], [], []
                for row in live:  # one token each: the one written last step
                    segments.append((row.slot, len(ids), 1, row.length + 1, 0))
                    ids.append(row.tokens[-1])
                    positions.append(row.length)
                    token_slots.append(row.slot)
                    last.append(len(ids) - 1)
                prefix.capture_at = None
                for row in admitted:  # the whole prompt, or its tokens after the prefix once the prefix has run
                    prompt = prompts[row.index]
                    shared = 0
                    if prefix_reusable(len(prefix.tokens), len(prompt)):
                        if prefix.states or prefix.capture_at is not None:
                            shared = len(prefix.tokens)
                        else:
                            prefix.capture_at = len(ids)
                    segments.append((row.slot, len(ids), len(prompt) - shared, len(prompt), shared))
                    ids += prompt[shared:]
                    positions += range(shared, len(prompt))
                    token_slots += [row.slot] * (len(prompt) - shared)
                    last.append(len(ids) - 1)
                step = _Step(torch.tensor(token_slots, device=self.device), torch.tensor(positions, device=self.device),
                             segments, dummy=len(ids) == 1, cache_slots=slots, capacity=capacity, prefix=prefix,
                             cache=cache)
                rows = live + admitted
                picked = self._pick(self._forward(step, ids, positions, last), rows)
                live = []
                for row, token, (_, _, _, end, _) in zip(rows, picked, segments):
                    row.length = end
                    row.tokens.append(token)
                    if token in self.stop_ids or len(row.tokens) == self.max_new_tokens:
                        answers[row.index] = row.tokens
                        free.append(row.slot)
                        if on_answers is not None:
                            on_answers(1)
                    else:
                        live.append(row)
        return answers
