"""Medusa heads (Cai et al. 2024): K extra decoding heads on the target's last hidden state.

Head k (k = 1..K) reads the target's final-norm hidden state at position t and predicts token
t + k + 1 (the target's own lm_head predicts t + 1). Each head is L residual blocks
`x + SiLU(W x + b)` (W zero-initialised, so a block starts as the identity; the blocks are distinct
modules, unlike the reference's `[ResBlock] * L`) followed by a Linear(h, V) initialised from the
target's lm_head, or the target's frozen lm_head itself when `share_lm_head` is set.

Tensor names match vLLM's MedusaModel loader: `blocks.{k}.layers.{l}.weight/bias`, `lm_heads.{k}.weight`.

With `draft_vocab_size` > 0 the heads score only a draft vocabulary: the `token_map` buffer [Vd] lists its
target ids (the most frequent target-written tokens of the training data, increasing ids; vLLM calls the same
tensor `token_map` and the size `truncated_vocab_size`). Logits are then [.., Vd] and index the draft vocabulary;
`to_target_ids` maps them back. A head's candidates can only be draft-vocabulary tokens, which loses little, and
its lm_head matmul reads Vd rows instead of V: for SmolLM2 (V = 49152) 8192 rows cut the draft from ~5 ms to
under 1 ms a step on 2 CPU cores, and training 3-5x.

A heads directory (local or on the Hub) holds `config.json` (this module's `MedusaConfig`: method, target
name/fingerprint/dims), `model.safetensors` (head weights only), `README.md`, `metrics.json` and, for Medusa-2,
`adapter/` (the target's LoRA adapter; the heads read the adapter-merged target). Load it with
`load_medusa_heads(dir_or_id, target_info)` (heads only, refuses another target) or
`load_medusa(dir_or_id, target)` (heads plus the target, adapter merged when there is one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from huggingface_hub import PyTorchModelHubMixin
from torch import nn


@dataclass
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head
    share_lm_head: bool = False  # use the target's frozen lm_head instead of one per head
    target: dict = field(default_factory=dict)  # heads.target.TargetInfo.to_dict() of the (base) target
    method: str = "medusa"  # "medusa" (Medusa-1, frozen target) or "medusa2" (target LoRA-tuned jointly)
    adapter: bool = False  # True: the heads need the target with the LoRA adapter in `adapter/` merged
    draft_vocab_size: int = 0  # > 0: heads score only these many target tokens (`token_map`); 0: all of them


class MedusaBlockStack(nn.Module):
    def __init__(self, hidden_size: int, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_layers))
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class MedusaHeads(nn.Module, PyTorchModelHubMixin, library_name="headstart", tags=["medusa", "speculative-decoding"]):
    def __init__(self, config: MedusaConfig | dict):
        super().__init__()
        if isinstance(config, dict):  # as read back from config.json by from_pretrained
            config = MedusaConfig(**config)
        self.config = config
        if not 0 <= config.draft_vocab_size <= config.vocab_size:
            raise ValueError(f"draft_vocab_size {config.draft_vocab_size} must be in [0, vocab_size {config.vocab_size}]")
        self.blocks = nn.ModuleList(MedusaBlockStack(config.hidden_size, config.num_layers) for _ in range(config.num_heads))
        out_size = config.draft_vocab_size or config.vocab_size
        if config.share_lm_head:
            self.lm_heads = None
        else:
            self.lm_heads = nn.ModuleList(nn.Linear(config.hidden_size, out_size, bias=False) for _ in range(config.num_heads))
        if config.draft_vocab_size:
            self.register_buffer("token_map", torch.arange(config.draft_vocab_size))  # draft id -> target id
            self.register_buffer("target_to_draft", torch.full((config.vocab_size,), -1), persistent=False)
            self.set_draft_vocab(self.token_map)
        else:
            self.token_map = None

    @torch.no_grad()
    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Score only these target ids (draft_vocab_size distinct ones); set before init_lm_heads_from."""
        ids = torch.unique(target_ids.long()).to(self.token_map.device)  # sorted
        if ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"need {self.config.draft_vocab_size} distinct target ids, got {ids.numel()}")
        self.token_map.copy_(ids)
        self.target_to_draft.fill_(-1)
        self.target_to_draft[ids] = torch.arange(ids.numel(), device=ids.device)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.token_map is not None:  # the non-persistent inverse map follows the loaded token_map
            self.set_draft_vocab(self.token_map)

    def draft_lm_head_weight(self, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """The target's lm_head [V, h] -> the rows the shared-lm_head heads score: [Vd, h] (or [V, h])."""
        return lm_head_weight if self.token_map is None else lm_head_weight[self.token_map]

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Indices into these heads' logits -> target token ids."""
        return draft_ids if self.token_map is None else self.token_map[draft_ids]

    def to_draft_labels(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Target ids -> (indices into the logits, in-vocabulary mask); out-of-vocabulary labels become 0."""
        if self.token_map is None:
            return labels, torch.ones_like(labels, dtype=torch.bool)
        draft = self.target_to_draft[labels]
        return draft.clamp(min=0), draft >= 0

    @torch.no_grad()
    def init_lm_heads_from(self, lm_head_weight: torch.Tensor) -> None:
        """Copy the target's lm_head [V, h] (its draft-vocabulary rows) into every head's own lm_head."""
        if self.lm_heads is None:
            return
        for head in self.lm_heads:
            head.weight.copy_(self.draft_lm_head_weight(lm_head_weight))

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, h] -> per-head features [K, B, T, h]."""
        return torch.stack([block(hidden) for block in self.blocks])

    def forward(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [B, T, h] (target's final-norm hidden states) -> logits [K, B, T, V] (V = Vd with a draft vocabulary).

        `lm_head_weight` [V, h] is the target's lm_head weight, required when `share_lm_head`.
        """
        feats = self.features(hidden)  # [K, B, T, h]
        if self.lm_heads is None:
            if lm_head_weight is None:
                raise ValueError("these Medusa heads share the target's lm_head: pass lm_head_weight")
            return feats @ self.draft_lm_head_weight(lm_head_weight).t()  # one matmul over all heads: [K, B, T, V]
        return torch.stack([head(f) for head, f in zip(self.lm_heads, feats)])


# ----------------------------------------------------------------------------------------------------
# Loading a heads directory (local path or Hub id)

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
ADAPTER_DIR = "adapter"


class HeadsLoadError(RuntimeError):
    """A heads directory that cannot be used: missing/corrupt files, or heads trained for another target."""


def resolve_heads_dir(dir_or_id: str | Path, revision: str | None = None) -> Path:
    """A local heads directory, or a Hub repo id downloaded (or found in the local Hub cache when offline)."""
    path = Path(dir_or_id).expanduser()
    if path.is_dir():
        return path
    name = str(dir_or_id)
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise HeadsLoadError(f"heads {name!r}: no such directory, and not a Hub repo id (owner/name)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, revision=revision))
    except Exception as err:  # offline without a cached copy, unknown repo, auth...
        raise HeadsLoadError(
            f"could not get heads {name!r} from the Hugging Face Hub or the local Hub cache "
            f"({err.__class__.__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}). Without network, "
            f"download them elsewhere (`hf download {name} --local-dir DIR`) and pass DIR."
        ) from err


def read_heads_config(heads_dir: Path, config_class: type, methods: tuple[str, ...], what: str):
    """heads_dir/config.json as `config_class`, if its `method` is one of `methods`; HeadsLoadError otherwise."""
    file = heads_dir / CONFIG_NAME
    if not file.is_file():
        raise HeadsLoadError(f"{heads_dir} has no {CONFIG_NAME}: not a heads directory written by headstart")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise HeadsLoadError(f"{file} is not valid JSON ({err})") from err
    if not isinstance(raw, dict) or raw.get("method") not in methods:
        raise HeadsLoadError(f"{file} does not describe {what} (method={raw.get('method') if isinstance(raw, dict) else None!r})")
    unknown = sorted(set(raw) - {f.name for f in fields(config_class)})
    if unknown:
        raise HeadsLoadError(f"{file} has unknown key(s) {unknown}: written by a newer headstart?")
    try:
        return config_class(**raw)
    except (TypeError, ValueError) as err:
        raise HeadsLoadError(f"{file}: {err}") from err


def read_medusa_config(heads_dir: Path) -> MedusaConfig:
    return read_heads_config(heads_dir, MedusaConfig, ("medusa", "medusa2"), "Medusa heads")


def check_target(config: MedusaConfig, target_info: Any, where: str = "these heads") -> None:
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
            "quantisation or fine-tune). Their drafts would rarely be accepted; load the target they were trained on."
        )


def load_medusa_heads(
    dir_or_id: str | Path,
    target_info: Any = None,
    *,
    revision: str | None = None,
    device: str | torch.device = "cpu",
) -> MedusaHeads:
    """Load Medusa heads from a local directory or Hub id; with `target_info`, refuse heads of another target.

    For Medusa-2 heads (`config.adapter`), the target must have the adapter in `adapter/` merged: use `load_medusa`.
    """
    heads_dir = resolve_heads_dir(dir_or_id, revision)
    config = read_medusa_config(heads_dir)
    if target_info is not None:
        check_target(config, target_info, where=f"the heads in {dir_or_id}")
    return load_weights(MedusaHeads(config), heads_dir).to(device).eval()


def load_weights(module: nn.Module, heads_dir: Path) -> nn.Module:
    """Load heads_dir/model.safetensors into `module` (strict); HeadsLoadError names a missing/corrupt/mismatched file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights = heads_dir / WEIGHTS_NAME
    if not weights.is_file():
        raise HeadsLoadError(f"{heads_dir} has no {WEIGHTS_NAME}: the weights are missing (interrupted save or upload?)")
    try:
        state = load_file(weights)
    except (SafetensorError, OSError, ValueError) as err:
        raise HeadsLoadError(f"{weights} is corrupt or truncated ({err}); re-download or re-train the heads") from err
    try:
        module.load_state_dict(state, strict=True)
    except (RuntimeError, ValueError, IndexError) as err:
        raise HeadsLoadError(f"{weights} does not match its {CONFIG_NAME}: {str(err).splitlines()[0]}") from err
    return module


def load_medusa(
    dir_or_id: str | Path,
    target: Any = None,
    *,
    revision: str | None = None,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
):
    """Heads plus the target they need: returns (heads, model, tokenizer, target_info).

    `target`: None (load the target named in the heads' config), a name/path for `heads.target.load_target`, or an
    already loaded (model, tokenizer, TargetInfo). The target is checked against the recorded fingerprint; when the
    heads directory has `adapter/` (Medusa-2), the LoRA adapter is merged into the returned model.
    """
    from heads.target import load_target

    heads_dir = resolve_heads_dir(dir_or_id, revision)
    config = read_medusa_config(heads_dir)
    if target is None:
        if not config.target.get("name"):
            raise HeadsLoadError(f"{heads_dir}/{CONFIG_NAME} names no target: pass one")
        target = config.target["name"]
    model, tokenizer, info = load_target(target, dtype, device) if isinstance(target, (str, Path)) else target
    heads = load_medusa_heads(heads_dir, info, device=device)
    if config.adapter:
        model = merge_adapter(model, heads_dir / ADAPTER_DIR)
    return heads.to(dtype=next(model.parameters()).dtype), model, tokenizer, info


def merge_adapter(model, adapter_dir: Path):
    """The target with the Medusa-2 LoRA adapter merged in (eval mode, no grad)."""
    if not (adapter_dir / "adapter_config.json").is_file():
        raise HeadsLoadError(f"these heads need the target's LoRA adapter, but {adapter_dir} has no adapter_config.json")
    from peft import PeftModel

    try:
        merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    except Exception as err:
        raise HeadsLoadError(f"could not load the LoRA adapter in {adapter_dir}: {err}") from err
    merged.eval()
    merged.requires_grad_(False)
    return merged


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
