"""The one way to load a heads directory (local path or Hub id), strictly: Medusa heads, an EAGLE or a DFlash draft,
any registered method (heads/methods.py).

    heads = load_heads("runs/medusa-smollm2/heads", target_info)            # refuses another target's heads
    heads, model, tokenizer, info = load_heads_and_target("user/repo")      # plus the target the heads name

The config is read and checked (method, known keys, every value's type and bounds), the module built from it on the
meta device (no memory) and compared with model.safetensors' header by name and shape, and only then built and loaded
(heads/directory.py): a config.json that asks for more than its weights hold is refused before anything is allocated. Medusa-2 heads come with the
target's LoRA adapter (`adapter/`), merged into the returned target.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from headstart.heads.directory import (ADAPTER_DIR, HeadsLoadError, check_target, check_weights, load_state, read_config, read_method,
                             resolve_heads_dir)
from headstart.heads.draft_method import DraftMethod
from headstart.heads.methods import UnknownMethodError, method_of

def load_heads(dir_or_id: str | Path, target_info: Any = None, *, revision: str | None = None,
               device: str | torch.device = "cpu") -> torch.nn.Module:
    """The heads module of the directory's method (heads/methods.py: Medusa heads, an EAGLE draft, a DFlash draft...) from a local directory or Hub id, in eval mode; with `target_info`
    (TargetInfo or dict), heads trained for another target are refused."""
    return _load_resolved(resolve_heads_dir(dir_or_id, revision), target_info, device)


def _load_resolved(heads_dir: Path, target_info: Any, device: str | torch.device) -> torch.nn.Module:
    """load_heads once the directory is local."""
    method = draft_method(heads_dir)
    module_class = method.module_class
    config = read_config(heads_dir, method.config_class, method.names, method.title)
    if target_info is not None:
        check_target(config, target_info, where=f"the heads in {heads_dir}")
    try:
        with torch.device("meta"):  # shapes only: checked against the weights file's header before any allocation
            check_weights(module_class(config), heads_dir)
        module = module_class(config)
    except (TypeError, ValueError) as err:
        raise HeadsLoadError(f"{heads_dir}/config.json: {err}") from err
    return load_state(module, heads_dir).to(device).eval()


def draft_method(heads_dir: Path) -> DraftMethod:
    """The registered drafting method (heads/methods.py) that heads_dir/config.json records."""
    name = read_method(heads_dir)
    try:
        return method_of(name)
    except UnknownMethodError as err:
        raise HeadsLoadError(f"{heads_dir}/config.json: {err}") from err


def read_heads_config(heads_dir: Path):
    """heads_dir/config.json as its method's config class, checked (no weights read)."""
    method = draft_method(heads_dir)
    return read_config(heads_dir, method.config_class, method.names, method.title)


def load_heads_and_target(dir_or_id: str | Path, target: Any = None, *, revision: str | None = None,
                          dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu"):
    """Heads plus the target they need: returns (heads, model, tokenizer, target_info).

    `target`: None (load the target named in the heads' config), a name/path for `headstart.heads.target.load_target`, a
    loaded model (its fingerprint is computed; tokenizer None), or a loaded (model, tokenizer, TargetInfo). The
    target is checked against the recorded fingerprint. When the heads directory has `adapter/` (Medusa-2) the
    LoRA adapter is merged into the returned model (a model passed in is copied first, never modified).
    """
    from headstart.heads.target import TargetLoadError

    heads_dir = resolve_heads_dir(dir_or_id, revision)
    named = target is None
    if named:
        target = read_heads_config(heads_dir).target.get("name")
        if not target:
            raise HeadsLoadError(f"{heads_dir}/config.json names no target: pass one (a model or its path)")
    try:
        model, tokenizer, info = resolve_target(target, dtype, device)
    except TargetLoadError as err:
        if not named:
            raise
        raise HeadsLoadError(f"the target {target!r} named in {heads_dir}/config.json could not be loaded ({err}). "
                             "Pass the target these heads were trained on with --target PATH (Python: target=)") from err
    heads = _load_resolved(heads_dir, info, device)
    if getattr(heads.config, "adapter", False):
        owned = isinstance(target, (str, Path))
        model = merge_adapter(model if owned else copy.deepcopy(model), heads_dir / ADAPTER_DIR)
    return heads.to(dtype=next(model.parameters()).dtype), model, tokenizer, info


def resolve_target(target: Any, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu"):
    """(model, tokenizer, TargetInfo) from a name / path (loaded with headstart.heads.target.load_target), a loaded model (its
    fingerprint computed; tokenizer None) or an already loaded (model, tokenizer, TargetInfo)."""
    from headstart.heads.target import load_target, target_info

    if isinstance(target, (str, Path)):
        return load_target(str(target), dtype, device)
    if isinstance(target, tuple):
        return target
    return target, None, target_info(getattr(target.config, "_name_or_path", "") or type(target).__name__, target)


def merge_adapter(model, adapter_dir: Path):
    """The target with the Medusa-2 LoRA adapter merged in (eval mode, no grad)."""
    if not (adapter_dir / "adapter_config.json").is_file():
        raise HeadsLoadError(f"these heads need the target's LoRA adapter, but {adapter_dir} has no adapter_config.json; "
                             "re-download the heads directory with its adapter/ folder")
    from peft import PeftModel

    try:
        merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    except Exception as err:
        raise HeadsLoadError(f"could not load the LoRA adapter in {adapter_dir}: {err}") from err
    merged.eval()
    merged.requires_grad_(False)
    return merged
