"""The heads directory: the unit users save, push, pull and load (local path or Hub id).

    config.json        the module's config dataclass (method, target name / fingerprint / dims, method fields)
    model.safetensors  head / draft weights only (never the target's embeddings or lm_head)
    README.md, metrics.json, ngram.safetensors, tree.json, adapter/ (Medusa-2 LoRA): written beside them by the
    trainers (tree.json by `--tree auto`)

`HeadsModule.save_pretrained` writes the first two; `read_config` and `load_state` read them back strictly: a
missing, extra or mis-shaped tensor is refused with its name. heads/load.py builds the module from them.

Every number read from a heads directory passes `checked` (one place for the rule: an int is an int, not a bool, a
string or a float; a float is finite; each within bounds far above any real model and far below what would exhaust
memory) before it is used; config.json's fields by their dataclass type and FIELD_LIMITS, metrics.json's by
`read_metrics`. The weights file's header (names and shapes, no tensor data) is compared with the module built on the
meta device before any memory is allocated for it (`check_weights`).
"""

from __future__ import annotations

import json
import math
import typing
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from torch import nn

from headstart.heads.output_dir import honour_umask

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
ADAPTER_DIR = "adapter"


class HeadsLoadError(RuntimeError):
    """A heads directory that cannot be used: missing/corrupt files, or heads trained for another target."""


# Bounds on what a heads directory may hold: far above any released model, far below what would exhaust memory.
MAX_WIDTH = 1 << 20  # hidden / intermediate sizes, attention heads
MAX_VOCAB = 1 << 22  # vocabulary size, token ids
MAX_TARGET_LAYERS = 1024  # target layers (feature_layers index its hidden_states 0..L)
MAX_DEPTH = 64  # Medusa heads, blocks per head, DFlash draft layers and drafted slots, evaluated depths
MAX_RANKS = 1024  # ranks per depth in recorded accuracies
REWRITE = "re-save the heads directory from its training run, or re-download it"
# config.json fields, by name (the same name means the same thing in every method's config): (lowest, highest)
FIELD_LIMITS = {
    "hidden_size": (1, MAX_WIDTH), "vocab_size": (1, MAX_VOCAB), "num_heads": (1, MAX_DEPTH),
    "num_layers": (1, MAX_DEPTH), "block_size": (2, MAX_DEPTH + 1), "draft_vocab_size": (0, MAX_VOCAB),
    "mask_token_id": (0, MAX_VOCAB - 1), "feature_layers": (0, MAX_TARGET_LAYERS),
}
# integer fields of an EAGLE / DFlash `layer_config` (the target's text config the draft layers are built from)
LAYER_LIMITS = {
    "hidden_size": (1, MAX_WIDTH), "intermediate_size": (1, MAX_WIDTH), "num_attention_heads": (1, MAX_WIDTH),
    "num_key_value_heads": (1, MAX_WIDTH), "head_dim": (1, MAX_WIDTH), "num_hidden_layers": (1, MAX_DEPTH),
    "vocab_size": (1, MAX_VOCAB), "max_position_embeddings": (1, 1 << 27),
}
# the target record's (headstart.heads.target.TargetInfo.to_dict()) integer fields
TARGET_LIMITS = {"hidden_size": (1, MAX_WIDTH), "vocab_size": (1, MAX_VOCAB), "num_hidden_layers": (1, MAX_TARGET_LAYERS)}
KINDS = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string", dict: "a JSON object",
         list: "a JSON list"}


def checked(value: Any, kind: type, where: Path | str, name: str, low: float | None = None,
            high: float | None = None, fix: str = REWRITE) -> Any:
    """`value`, read as field `name` of the file `where`, if it is a `kind` (int: an int, not a bool, string or float;
    float: an int or a finite float, returned as float; bool, str, dict, list) within [low, high]; HeadsLoadError
    naming the file, the field and `fix` otherwise."""
    ok = (isinstance(value, kind) and not (kind is int and isinstance(value, bool)) if kind is not float else
          isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value))
    if not ok:
        raise HeadsLoadError(f"{where}: {name} must be {KINDS[kind]}, got {value!r:.80}; {fix}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise HeadsLoadError(f"{where}: {name} is {value}, outside {low}..{high}; {fix}")
    return float(value) if kind is float else value


def checked_list(values: Any, kind: type, where: Path | str, name: str, low: float | None = None,
                 high: float | None = None, max_len: int = MAX_DEPTH, fix: str = REWRITE) -> list:
    """A JSON list of at most `max_len` values, each `checked` (named name[i])."""
    checked(values, list, where, name, fix=fix)
    if len(values) > max_len:
        raise HeadsLoadError(f"{where}: {name} has {len(values)} entries, more than {max_len}; {fix}")
    return [checked(v, kind, where, f"{name}[{i}]", low, high, fix) for i, v in enumerate(values)]


def check_fields(raw: dict, config_class: type, where: Path | str) -> None:
    """config.json's values checked by their dataclass field type (int, bool, float, str, dict, list[int]) and
    FIELD_LIMITS; the target record's and layer_config's integers by TARGET_LIMITS and LAYER_LIMITS."""
    hints = typing.get_type_hints(config_class)
    for f in fields(config_class):
        if f.name not in raw:
            continue
        kind, (low, high) = hints[f.name], FIELD_LIMITS.get(f.name, (None, None))
        if typing.get_origin(kind) is list:
            checked_list(raw[f.name], typing.get_args(kind)[0], where, f.name, low, high, MAX_TARGET_LAYERS)
        else:
            checked(raw[f.name], kind, where, f.name, low, high)
    for record, limits in (("target", TARGET_LIMITS), ("layer_config", LAYER_LIMITS)):
        for key, (low, high) in limits.items():
            value = raw.get(record, {}).get(key)
            if value is not None:
                checked(value, int, where, f"{record}.{key}", low, high)
    layers = raw.get("target", {}).get("num_hidden_layers")
    for i, layer in enumerate(raw.get("feature_layers", [])):
        if layers is not None and layer > layers:
            raise HeadsLoadError(f"{where}: feature_layers[{i}] is {layer}, but the target has {layers} layers "
                                 f"(hidden_states 0..{layers}); {REWRITE}")


class HeadsModule(nn.Module):
    """Base of MedusaHeads and EagleDraft: a `config` dataclass and weights, saved as a heads directory."""

    config: Any

    def check_state(self, state: dict) -> None:
        """ValueError, naming the tensor, when loaded tensors (of the right names and shapes) hold values this module
        cannot use. Subclasses with token maps check them."""

    def save_pretrained(self, heads_dir: str | Path) -> Path:
        from safetensors.torch import save_model

        heads_dir = Path(heads_dir)
        heads_dir.mkdir(parents=True, exist_ok=True)
        (heads_dir / CONFIG_NAME).write_text(json.dumps(asdict(self.config), indent=2))
        save_model(self, str(heads_dir / WEIGHTS_NAME))
        honour_umask(heads_dir / WEIGHTS_NAME)  # safetensors writes 0600, whatever the umask
        return heads_dir


def resolve_heads_dir(dir_or_id: str | Path, revision: str | None = None) -> Path:
    """A local heads directory, or a Hub repo id downloaded (or found in the local Hub cache when offline)."""
    path = Path(dir_or_id).expanduser()
    if path.is_dir():
        if not (path / CONFIG_NAME).is_file():
            raise HeadsLoadError(f"{path} has no {CONFIG_NAME}: not a heads directory written by headstart "
                                 "(pass the heads/ folder inside a train/medusa.py or train/eagle.py output_dir)")
        return path
    name = str(dir_or_id)
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise HeadsLoadError(f"heads {name!r}: no such directory, and not a Hub repo id (owner/name). Pass the heads/ "
                             "folder of a training run or a Hub id like 'user/smollm2-medusa'")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, revision=revision))
    except Exception as err:  # offline without a cached copy, unknown repo, auth...
        raise HeadsLoadError(
            f"could not get heads {name!r} from the Hugging Face Hub or the local Hub cache "
            f"({err.__class__.__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}). Without network, "
            f"download them elsewhere (`hf download {name} --local-dir DIR`) and pass DIR."
        ) from err


def read_method(heads_dir: Path) -> str:
    """The `method` recorded in heads_dir/config.json ("medusa", "medusa2", "eagle", "eagle3")."""
    return str(_read_json(heads_dir / CONFIG_NAME).get("method", ""))


def _read_json(file: Path) -> dict:
    if not file.is_file():
        raise HeadsLoadError(f"{file.parent} has no {file.name}: not a heads directory written by headstart")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise HeadsLoadError(f"{file} is not valid JSON ({err})") from err
    if not isinstance(raw, dict):
        raise HeadsLoadError(f"{file} must hold a JSON object, got {type(raw).__name__}")
    return raw


def read_config(heads_dir: Path, config_class: type, methods: tuple[str, ...], what: str):
    """heads_dir/config.json as `config_class`, if its `method` is one of `methods`; HeadsLoadError otherwise."""
    file = heads_dir / CONFIG_NAME
    raw = _read_json(file)
    if raw.get("method") not in methods:
        raise HeadsLoadError(f"{file} does not describe {what} (method={raw.get('method')!r})")
    unknown = sorted(set(raw) - {f.name for f in fields(config_class)})
    if unknown:
        raise HeadsLoadError(f"{file} has unknown key(s) {unknown}: written by a newer headstart?")
    check_fields(raw, config_class, file)
    try:
        return config_class(**raw)
    except (TypeError, ValueError) as err:
        raise HeadsLoadError(f"{file}: {err}") from err


def check_target(config: Any, target_info: Any, where: str = "these heads") -> None:
    """Raise HeadsLoadError unless `target_info` (TargetInfo or dict) is the target the heads were trained on."""
    got = target_info.to_dict() if hasattr(target_info, "to_dict") else dict(target_info)
    want = config.target or {}
    if got.get("hidden_size", config.hidden_size) != config.hidden_size or got.get("vocab_size", config.vocab_size) != config.vocab_size:
        raise HeadsLoadError(
            f"{where} were trained for a target with hidden_size={config.hidden_size}, vocab_size={config.vocab_size} "
            f"({want.get('name')!r}); the given target {got.get('name')!r} has hidden_size={got.get('hidden_size')}, "
            f"vocab_size={got.get('vocab_size')}"
        )
    layers = got.get("num_hidden_layers")
    if layers is not None and any(i > layers for i in getattr(config, "feature_layers", [])):
        raise HeadsLoadError(f"{where} read the target's hidden_states {config.feature_layers}, but the given target "
                             f"{got.get('name')!r} has {layers} layers (hidden_states 0..{layers}): pass the target they "
                             "were trained on")
    if want.get("fingerprint") and got.get("fingerprint") and want["fingerprint"] != got["fingerprint"]:
        raise HeadsLoadError(
            f"{where} were trained on target {want.get('name')!r} with weight fingerprint {want['fingerprint']}, but the "
            f"given target {got.get('name')!r} has fingerprint {got['fingerprint']}: other weights (another checkpoint, "
            "quantisation or fine-tune). Their drafts would rarely be accepted; load the target they were trained on "
            "(omit the target to load the one the heads name), or train heads for this target."
        )


def check_weights(module: nn.Module, heads_dir: Path) -> None:
    """Compare heads_dir/model.safetensors' header (tensor names and shapes; no tensor data is read) with `module`'s
    state (built on the meta device, it costs no memory): HeadsLoadError names the missing, extra or mis-shaped
    tensors (or the missing / corrupt file)."""
    from safetensors import SafetensorError, safe_open

    weights = heads_dir / WEIGHTS_NAME
    if not weights.is_file():
        raise HeadsLoadError(f"{heads_dir} has no {WEIGHTS_NAME}: the weights are missing (interrupted save or upload?)")
    try:
        with safe_open(str(weights), framework="pt") as f:
            stored = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except (SafetensorError, OSError, ValueError) as err:
        raise HeadsLoadError(f"{weights} is corrupt or truncated ({err}); re-download or re-train the heads") from err
    expected = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    missing = sorted(set(expected) - set(stored))
    extra = sorted(set(stored) - set(expected))
    reshaped = sorted(f"{k} {stored[k]} (config.json gives {expected[k]})"
                      for k in set(stored) & set(expected) if stored[k] != expected[k])
    problems = [f"{label}: {', '.join(names)}" for label, names in
                (("missing tensor(s)", missing), ("unexpected tensor(s)", extra), ("shape mismatch", reshaped)) if names]
    if problems:
        raise HeadsLoadError(f"{weights} does not match its {CONFIG_NAME}: {'; '.join(problems)}. Re-save the heads "
                             "directory from its training run (config.json and model.safetensors come as a pair)")


def load_state(module: nn.Module, heads_dir: Path) -> nn.Module:
    """Load heads_dir/model.safetensors into `module`, strictly: every tensor the module has, with its shape, and no
    other (check_weights, before any tensor is read), holding values the module can use (`check_state`, e.g. token
    ids inside the vocabulary)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    check_weights(module, heads_dir)
    weights = heads_dir / WEIGHTS_NAME
    try:
        state = load_file(weights)
    except (SafetensorError, OSError, ValueError) as err:
        raise HeadsLoadError(f"{weights} is corrupt or truncated ({err}); re-download or re-train the heads") from err
    check = getattr(module, "check_state", None)
    try:
        if check is not None:
            check(state)
    except ValueError as err:
        raise HeadsLoadError(f"{weights}: {err}; {REWRITE}") from err
    module.load_state_dict(state, strict=True)
    return module


def read_metrics(heads_dir: Path) -> dict:
    """heads_dir/metrics.json ({} when there is none), its figures that headstart reads checked: `top1` / `top5`
    (rates per depth), `rank_accuracy` / `accuracy` (rates per depth and rank), `chain_accepted_tokens`."""
    file = heads_dir / "metrics.json"
    if not file.is_file():
        return {}
    metrics = _read_json(file)
    fix = "delete metrics.json (the heads load without it) or retrain the heads to rewrite it"
    for name in ("top1", "top5"):
        if metrics.get(name) is not None:
            checked_list(metrics[name], float, file, name, 0.0, 1.0, fix=fix)
    for name in ("rank_accuracy", "accuracy"):
        if metrics.get(name) is not None:
            checked_rates(metrics[name], file, name, fix)
    if metrics.get("chain_accepted_tokens") is not None:
        checked(metrics["chain_accepted_tokens"], float, file, "chain_accepted_tokens", 0.0, MAX_DEPTH, fix)
    return metrics


def checked_rates(rows: Any, where: Path | str, name: str, fix: str = REWRITE) -> list[list[float]]:
    """Per-(depth, rank) rates: at most MAX_DEPTH rows of at most MAX_RANKS numbers in 0..1, as floats."""
    checked_list(rows, list, where, name, max_len=MAX_DEPTH, fix=fix)
    return [checked_list(row, float, where, f"{name}[{d}]", 0.0, 1.0, MAX_RANKS, fix) for d, row in enumerate(rows)]


def push_heads_dir(heads_dir: str | Path, repo_id: str, private: bool = False) -> bool:
    """Upload a heads directory (adapter included) to the Hub. On failure keep the local copy, say how to retry."""
    heads_dir = Path(heads_dir)
    try:
        from huggingface_hub import HfApi

        api = HfApi()
        api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(folder_path=str(heads_dir), repo_id=repo_id, repo_type="model")
    except Exception as err:  # no network, no token, no permission...
        first = str(err).splitlines()[0][:300] if str(err) else ""
        print(
            f"push to the Hub failed ({err.__class__.__name__}: {first}).\n"
            f"The heads are kept in {heads_dir}. Retry later with\n"
            f"    hf upload {repo_id} {heads_dir} .        (or: huggingface-cli upload {repo_id} {heads_dir} .)\n"
            f"or in Python: huggingface_hub.HfApi().upload_folder(folder_path='{heads_dir}', repo_id='{repo_id}')"
        )
        return False
    print(f"pushed {heads_dir} to https://huggingface.co/{repo_id}")
    return True

