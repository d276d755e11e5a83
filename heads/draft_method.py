"""What a drafting method declares, once: everything loading, training, decoding, calibration, the benchmark, the
exports and the engine checks need to know about it. Each method's heads module declares one `DraftMethod`
(heads/medusa.py, heads/eagle.py, heads/dflash.py) and heads/methods.py registers it; the rest of headstart asks
`headstart.heads.methods.method_of(config or name)` and never checks a method's name.

heads/ imports neither train/ nor inference/ (docs/design.md), so what lives there is named by a reference,
"package.module:attribute", imported on first use (`resolve`); a callable stands in for a reference where the method
is defined outside the package (a test's toy method).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Union

Ref = Union[str, Callable]  # "package.module:attribute", or the callable itself


def resolve(ref: Ref) -> Callable:
    """The callable a reference names (imported on first use), or the callable given."""
    if callable(ref):
        return ref
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def _none(config: Any) -> None:
    return None


def _false(config: Any) -> bool:
    return False


def _one_per_token(k: int) -> int:
    return k


def _nothing(config: Any) -> dict:
    return {}


@dataclass(frozen=True)
class DraftMethod:
    title: str  # what it is in messages: "Medusa heads", "an EAGLE draft"
    card_name: str  # what an exported model card calls it: "Medusa-1", "EAGLE-3"
    names: tuple[str, ...]  # the config.method values it covers; names[0] names its benchmark rows
    config_class: type  # the heads config dataclass (config.json), with a `method` field
    module_class: type  # the heads module built from the config (model.safetensors)
    # (heads, model, shape, project) -> an inference/tree.py Proposer. shape: a static Tree, or for a dynamic tree a
    # DynamicTreeConfig; project: the target's draft-vocabulary lm_head rows when scores_target_rows, else None
    proposer: Ref
    # (config, draft_vocab_fraction) -> {tree nodes (0: any size): draft cost in one-token target steps}, the prior
    # the adaptive policy charges until `--tree auto` measures the draft (inference/adapt.py)
    draft_prior: Ref
    trainer: str | None = None  # the module whose main(argv) `headstart train --method NAME` runs
    train_config: str | None = None  # the name of the trainer module's config dataclass (its recipes' fields)
    dynamic_tree: bool = False  # True: the draft grows its own tree each step (EAGLE); False: it fills a static tree
    max_depth: Callable[[Any], int | None] = _none  # a static tree's deepest node it drafts; None: any depth
    scores_target_rows: Callable[[Any], bool] = _false  # drafts through the target's lm_head (heads.draft_lm_head_weight)
    # True: calibration times a fresh proposer per tree size; False: one call scores every depth whatever the tree
    # (Medusa heads: inference/calibrate.py times that call once)
    timed_per_tree: bool = True
    engine_chain: Callable[[Any], int | None] = _none  # the chain an engine must serve (fixed by the draft); None: chosen
    engine_draft_forwards: Callable[[int], int] = _one_per_token  # the draft's forwards per engine step of a chain of k
    formats: tuple[str, ...] = ()  # the export formats (heads/export.py FORMATS) an engine loads it in
    refusals: dict[str, str] = field(default_factory=dict)  # format -> why it is not in `formats` ("{fmt}": the format)
    # (heads, ExportRequest) -> (engine config, tensors, conversion notes) for vllm / sglang / speculators
    # (heads/export_formats.py)
    engine_export: Ref | None = None
    gguf_export: Ref | None = None  # (heads, target) -> heads/export_gguf.py GgufDraft, for llamacpp
    llamacpp_spec_type: str | None = None  # llama-server's --spec-type for that GGUF draft ("draft-eagle3")
    bench_info: Callable[[Any], dict] = _nothing  # what the benchmark records of the heads beside their tree

    def refusal(self, fmt: str) -> str:
        """Why `fmt` cannot hold these heads (for a format not in `formats`)."""
        reason = self.refusals.get(fmt)
        if reason is not None:
            return reason.format(fmt=fmt)
        usable = ", ".join(self.formats) or "none"
        return f"{fmt} has no drafter for {self.title} (the formats that load them: {usable})"
