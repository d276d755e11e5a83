"""The heads directory: the unit users save, push, pull and load (local path or Hub id).

    config.json        the module's config dataclass (method, target name / fingerprint / dims, method fields)
    model.safetensors  head / draft weights only (never the target's embeddings or lm_head)
    README.md, metrics.json, ngram.safetensors, tree.json, adapter/ (Medusa-2 LoRA): written beside them by the
    trainers (tree.json by `--tree auto`)

`HeadsModule.save_pretrained` writes the first two; `read_config` and `load_state` read them back strictly: a
missing, extra or mis-shaped tensor is refused with its name. heads/load.py builds the module from them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from torch import nn

from heads.output_dir import honour_umask

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
ADAPTER_DIR = "adapter"


class HeadsLoadError(RuntimeError):
    """A heads directory that cannot be used: missing/corrupt files, or heads trained for another target."""


class HeadsModule(nn.Module):
    """Base of MedusaHeads and EagleDraft: a `config` dataclass and weights, saved as a heads directory."""

    config: Any

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
    if want.get("fingerprint") and got.get("fingerprint") and want["fingerprint"] != got["fingerprint"]:
        raise HeadsLoadError(
            f"{where} were trained on target {want.get('name')!r} with weight fingerprint {want['fingerprint']}, but the "
            f"given target {got.get('name')!r} has fingerprint {got['fingerprint']}: other weights (another checkpoint, "
            "quantisation or fine-tune). Their drafts would rarely be accepted; load the target they were trained on "
            "(omit the target to load the one the heads name), or train heads for this target."
        )


def load_state(module: nn.Module, heads_dir: Path) -> nn.Module:
    """Load heads_dir/model.safetensors into `module`, strictly: every tensor the module has, with its shape, and no
    other. HeadsLoadError names the missing, extra or mis-shaped tensors (or the missing / corrupt file)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights = heads_dir / WEIGHTS_NAME
    if not weights.is_file():
        raise HeadsLoadError(f"{heads_dir} has no {WEIGHTS_NAME}: the weights are missing (interrupted save or upload?)")
    try:
        state = load_file(weights)
    except (SafetensorError, OSError, ValueError) as err:
        raise HeadsLoadError(f"{weights} is corrupt or truncated ({err}); re-download or re-train the heads") from err
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    reshaped = sorted(f"{k} {tuple(state[k].shape)} (config.json gives {tuple(expected[k].shape)})"
                      for k in set(state) & set(expected) if state[k].shape != expected[k].shape)
    problems = [f"{label}: {', '.join(names)}" for label, names in
                (("missing tensor(s)", missing), ("unexpected tensor(s)", extra), ("shape mismatch", reshaped)) if names]
    if problems:
        raise HeadsLoadError(f"{weights} does not match its {CONFIG_NAME}: {'; '.join(problems)}. Re-save the heads "
                             "directory from its training run (config.json and model.safetensors come as a pair)")
    module.load_state_dict(state, strict=True)
    return module


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

