"""The benchmark's methods (inference/bench/run.py): each runs one prompt timed (`run`) or again untimed with its logits
(`trace`, for the near-tie analysis). HF's `generate` for vanilla greedy and prompt-lookup decoding, counted with a
forward hook on the target; the Speculator for draft heads, counted by its own stats."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from transformers import GenerationConfig, PreTrainedModel

from headstart.heads.directory import ADAPTER_DIR, check_target
from headstart.heads.load import merge_adapter
from headstart.inference.bench.inputs import HeadsEntry
from headstart.inference.forward import sync
from headstart.inference.speculator import Speculator
from headstart.inference.tree import tree_choices

LOOKUP_SUFFIX = " +lookup"  # the heads with chains from the context drafted too
FIXED_SUFFIX = " fixed"  # the heads' fixed tree every step (--adaptive both: beside the adaptive rows)
EXACT_SUFFIX = " exact"  # the heads verifying each tree node with a one-token step's attention
FLOAT32_SUFFIX = " float32 draft"  # the heads' float32 draft (--draft_int8 both: beside the int8 rows)


@dataclass
class Run:
    tokens: list[int]
    seconds: float  # wall, prefill included
    decode_forwards: int | None  # target forwards after the one that reads the prompt; None = not counted
    draft_s: float | None
    verify_s: float
    prefill_s: float  # the target forward that reads the prompt
    step_s: float  # target forwards after it (heads: tree forwards + acceptance + cache compaction)
    accept_hist: list[int] = field(default_factory=list)
    lookup_steps: int = 0  # heads: steps that verified a chain from the context (inference/lookup.py)
    proposals: dict[str, int] = field(default_factory=dict)  # adaptive heads: steps per plan kind (inference/adapt.py)
    mismatch: dict | None = None  # differs from vanilla: the near-tie analysis at the first difference (near_tie)


@dataclass
class Method:
    name: str
    kind: str  # vanilla | prompt_lookup | a drafting method's first name (heads/methods.py): medusa, eagle3...
    run: Callable[[list[int], int], Run]
    info: dict = field(default_factory=dict)  # heads dir, tree...
    trace: Callable[[list[int], int], tuple[list[int], torch.Tensor]] | None = None  # untimed rerun: tokens, logits


class ForwardMeter:
    """Counts the target's top-level forward calls (what HF `generate` makes) and the time spent in them.

    The Speculator calls `model.base_model` directly, so its forwards are not seen here (it counts its own).
    """

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.device = device
        self.calls = 0
        self.seconds = 0.0
        self.first_s = 0.0  # the first call: the one that reads the prompt
        self._t0 = 0.0
        self._handles = [model.register_forward_pre_hook(self._pre), model.register_forward_hook(self._post)]

    def _pre(self, module, args):
        sync(self.device)
        self._t0 = time.perf_counter()

    def _post(self, module, args, output):
        sync(self.device)
        dt = time.perf_counter() - self._t0
        self.seconds += dt
        if self.calls == 0:
            self.first_s = dt
        self.calls += 1

    def reset(self) -> None:
        self.calls, self.seconds, self.first_s = 0, 0.0, 0.0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


@contextlib.contextmanager
def plain_generation_config(model, stops: Sequence[int], pad_id: int | None):
    """Swap in a bare GenerationConfig so HF greedy is the target's plain argmax: transformers merges the model's
    own generation_config (repetition_penalty, no_repeat_ngram_size...) even into an explicitly passed one."""
    saved = model.generation_config
    model.generation_config = GenerationConfig(eos_token_id=list(stops) or None, pad_token_id=pad_id,
                                               bos_token_id=saved.bos_token_id)
    try:
        yield saved
    finally:
        model.generation_config = saved


def altered_generation_fields(config) -> dict:
    """Fields of the target's own generation_config that change greedy output (neutralised here, reported)."""
    checks = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0,
              "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None,
              "forced_bos_token_id": None, "forced_eos_token_id": None, "min_new_tokens": None, "min_length": 0,
              "sequence_bias": None}
    out = {}
    for name, neutral in checks.items():
        value = getattr(config, name, neutral)
        if value not in (neutral, None) and not (name == "min_length" and value == 0):
            out[name] = value
    return out


def hf_method(kind: str, model: PreTrainedModel, meter: ForwardMeter, device: torch.device, pad_id: int | None,
              prompt_lookup_num_tokens: int | None = None) -> Method:
    """HF greedy `generate` on the target: kind "vanilla", or "prompt_lookup" with prompt_lookup_num_tokens (HF's
    prompt-lookup decoding). The method is named after its kind."""
    extra = {"prompt_lookup_num_tokens": prompt_lookup_num_tokens} if prompt_lookup_num_tokens else {}

    @torch.no_grad()
    def run(ids: list[int], max_new_tokens: int) -> Run:
        input_ids = torch.tensor([ids], device=device)
        meter.reset()
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=pad_id, **extra)
        sync(device)
        seconds = time.perf_counter() - t0
        tokens = out[0, len(ids):].tolist()
        decode = max(meter.calls - 1, 0)
        forwards = dict(prefill_s=meter.first_s, step_s=meter.seconds - meter.first_s)
        if kind == "vanilla":
            return Run(tokens, seconds, decode, draft_s=0.0, verify_s=seconds, **forwards)
        return Run(tokens, seconds, decode, draft_s=None, verify_s=meter.seconds, **forwards)

    @torch.no_grad()
    def trace(ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
        input_ids = torch.tensor([ids], device=device)
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=pad_id, output_logits=True,
                             return_dict_in_generate=True, **extra)
        return out.sequences[0, len(ids):].tolist(), torch.cat(out.logits).float()  # [n, V]

    info = {"prompt_lookup_num_tokens": prompt_lookup_num_tokens} if prompt_lookup_num_tokens else {}
    return Method(name=kind, kind=kind, run=run, trace=trace, info=info)


def speculator_for(entry: HeadsEntry, model: PreTrainedModel, tokenizer, target_info, tree: str | None) -> Speculator:
    """A Speculator over the heads find_heads loaded and the benchmark's target, as Speculator.from_pretrained builds
    one after loading: the target checked against the heads' recorded fingerprint, Medusa-2's LoRA adapter merged
    (into `model` itself: the benchmark owns it and runs every method on the merged model), the heads moved to the
    target's device and dtype, then the tree (`tree`: see Speculator.from_pretrained). Raises HeadsLoadError or
    SpeculatorError naming the problem."""
    check_target(entry.heads.config, target_info, where=f"the heads in {entry.path}")
    if entry.adapter:
        model = merge_adapter(model, entry.path / ADAPTER_DIR)
    weight = next(model.parameters())
    heads = entry.heads.to(device=weight.device, dtype=weight.dtype)
    return Speculator(model, heads, tokenizer, tree=tree, heads_dir=entry.path)


def heads_method(entry: HeadsEntry, spec: Speculator, stops: Sequence[int], device: torch.device, lookup: bool,
                 exact: bool = False, adaptive: bool = True, suffix_fixed: bool = False, draft_int8: bool = True,
                 suffix_float32: bool = False) -> Method:
    """The heads alone, or (lookup) with chains from the context drafted too (inference/lookup.py); exact: each
    tree node verified with a one-token step's attention (inference/forward.py); adaptive: each step verifies
    what inference/adapt.py's policy chooses (off: the fixed tree; rows '... fixed' when both are run); draft_int8:
    the draft from its int8 copies (inference/int8_draft.py; off: float32, rows '... float32 draft' when both)."""
    def run(ids: list[int], max_new_tokens: int) -> Run:
        spec.use_draft_int8(draft_int8)
        sync(device)
        t0 = time.perf_counter()
        out = spec.generate(ids, max_new_tokens, stop_token_ids=list(stops), lookup=lookup, exact=exact,
                            adaptive=adaptive)
        sync(device)
        seconds = time.perf_counter() - t0
        s = out.stats
        return Run(list(out.tokens), seconds, s.decode_forwards, draft_s=s.draft_s, verify_s=s.verify_s + s.prefill_s,
                   prefill_s=s.prefill_s, step_s=s.verify_s, accept_hist=list(s.accept_hist),
                   lookup_steps=s.lookup_steps, proposals=dict(s.proposals))

    def trace(ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
        spec.use_draft_int8(draft_int8)
        out = spec.generate(ids, max_new_tokens, stop_token_ids=list(stops), lookup=lookup, exact=exact,
                            keep_logits=True, adaptive=adaptive)
        return list(out.tokens), torch.stack(out.logits)  # [n, V]

    name = (entry.label + (LOOKUP_SUFFIX if lookup else "") + (EXACT_SUFFIX if exact else "")
            + (FIXED_SUFFIX if suffix_fixed and not adaptive else "")
            + (FLOAT32_SUFFIX if suffix_float32 and not draft_int8 else ""))
    spec.use_draft_int8(draft_int8)
    info = {"heads_dir": str(entry.path), "lookup": lookup, "exact": exact, "adaptive": adaptive,
            "draft": spec.draft_weights,
            "draft_vocab_size": spec.heads.config.draft_vocab_size}
    method = spec.method  # the heads' declaration (heads/methods.py)
    if method.dynamic_tree:
        dyn = spec.dynamic
        info["tree"] = {"dynamic": True, "size": dyn.total_tokens, "depth": dyn.depth, "topk": dyn.topk}
    else:
        tree = spec.tree
        info["tree"] = {"size": tree.size, "depth": tree.max_depth, "choices": tree_choices(tree)}
    info.update(method.bench_info(spec.heads.config))
    return Method(name=name, kind=method.names[0], run=run, trace=trace, info=info)
