"""The `openai` backend of self-distillation (train/engines.py): OpenAI-compatible servers (`vllm serve`, SGLang).

Every prompt of a call is in flight at once (up to `max_in_flight` threads sharing one httpx connection pool,
connections kept alive), spread over the servers at `server_url` by load, sent as token ids to /v1/completions with
`return_token_ids`; a failed request is retried with backoff on the least loaded live server, and a server that
fails `max_retries` times in a row is dropped for the run (its prompts go to the others). Every reply is checked
before its ids are used (completion_token_ids: 1 to max_tokens integer ids inside the target's vocabulary, a finish
reason of "stop" or "length"); a bad reply counts as a failure, and a prompt that gets `max_retries` bad replies ends
the run with the server's problem named, so no row is ever built from one. `request_timeout_s` is a total deadline
per request (RequestDeadline), not a per-read timeout that a server sending a byte at a time would never trip.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import httpcore
import httpx
from headstart.heads.target import EMBEDDED_ALIAS
from headstart.train.engines import EngineError, target_model_dir

TOKENIZER_PROBE = "Hello, world! def f(x):\n    return x ** 2  # café, 東京, 🙂"
SERVE_COMMAND = "python -m vllm.entrypoints.openai.api_server --model DIR --port PORT  (or `vllm serve DIR`)"
# the fixes a bad /v1/completions reply names
SERVE_TOKEN_IDS = ("serve the target with vLLM >= 0.10.2 or SGLang (servers that return the generated token_ids), or "
                   "use --backend vllm / hf")
SERVE_TARGET = "the server runs another model or tokenizer than the target: serve the target's own model directory"
RESTART = "restart it (vLLM >= 0.10.2 or SGLang serving the target)"
FINISH_REASONS = ("stop", "length")


class _Retryable(Exception):
    """A failure worth retrying (connection lost, timeout, 5xx, 429, a bad reply)."""


class BadReply(_Retryable):
    """A /v1/completions reply that cannot be the target's completion: its message names the problem, `fix` the
    remedy."""

    def __init__(self, problem: str, fix: str):
        super().__init__(problem)
        self.fix = fix


def _excerpt(value, limit: int = 80) -> str:
    """A reply's value as one short line, for an error message."""
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def completion_token_ids(reply, vocab_size: int, max_tokens: int) -> list[int]:
    """The generated token ids of a /v1/completions reply's first choice, each number checked: 1 to max_tokens ids,
    each an integer in [0, vocab_size), and finish_reason "stop" or "length". BadReply names what is wrong."""
    choices = reply.get("choices") if isinstance(reply, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise BadReply(f"a reply without choices ({_excerpt(reply)})", SERVE_TOKEN_IDS)
    choice = choices[0]
    ids = choice.get("token_ids")
    if ids is None:
        raise BadReply("a choice with no token_ids", SERVE_TOKEN_IDS)
    if not isinstance(ids, list):
        raise BadReply(f"token_ids that are not a list ({_excerpt(ids)})", SERVE_TOKEN_IDS)
    for token in ids:
        if type(token) is not int:  # JSON floats, strings and booleans are not token ids
            raise BadReply(f"a token id that is not an integer ({token!r})", SERVE_TOKEN_IDS)
        if not 0 <= token < vocab_size:
            raise BadReply(f"token id {token}, outside the target's vocabulary (ids 0..{vocab_size - 1})", SERVE_TARGET)
    finish_reason = choice.get("finish_reason")
    if not ids:
        raise BadReply(f"an empty completion (no token ids, finish_reason {finish_reason!r})", RESTART)
    if len(ids) > max_tokens:
        raise BadReply(f"{len(ids)} token ids for max_tokens {max_tokens}", SERVE_TOKEN_IDS)
    if finish_reason not in FINISH_REASONS:
        raise BadReply(f"finish_reason {finish_reason!r} (expected {' or '.join(map(repr, FINISH_REASONS))})", RESTART)
    return ids


class _DeadlineStream(httpcore.NetworkStream):
    """A connection whose every read and write is bounded by the deadline of the request its thread is making."""

    def __init__(self, stream: httpcore.NetworkStream, deadline: "RequestDeadline"):
        self.stream, self.deadline = stream, deadline

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self.stream.read(max_bytes, self.deadline.cap(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.stream.write(buffer, self.deadline.cap(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self.stream.close()

    def start_tls(self, ssl_context, server_hostname=None, timeout=None) -> httpcore.NetworkStream:
        timeout = self.deadline.cap(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self.stream.start_tls(ssl_context, server_hostname, timeout), self.deadline)

    def get_extra_info(self, info: str):
        return self.stream.get_extra_info(info)


class RequestDeadline(httpcore.NetworkBackend):
    """A total deadline per request. httpx's timeouts bound each connect, read and write on its own, so a server
    that sends a byte at a time never trips them; this network backend caps each one by the time left until the
    deadline of the request its thread is making (set by `within`), and fails it once none is left. `clock` is
    injectable (tests decide deadlines without the wall clock)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.backend = httpcore.SyncBackend()
        self.local = threading.local()  # .deadline: this thread's request's deadline on `clock`, or None

    @contextlib.contextmanager
    def within(self, seconds: float):
        self.local.deadline = self.clock() + seconds
        try:
            yield
        finally:
            self.local.deadline = None

    def cap(self, timeout: float | None, timeout_error: type) -> float | None:
        deadline = getattr(self.local, "deadline", None)
        if deadline is None:
            return timeout
        left = deadline - self.clock()
        if left <= 0:
            raise timeout_error("the request's deadline passed")
        return left if timeout is None else min(timeout, left)

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None) -> httpcore.NetworkStream:
        stream = self.backend.connect_tcp(host, port, self.cap(timeout, httpcore.ConnectTimeout), local_address,
                                          socket_options)
        return _DeadlineStream(stream, self)

    def connect_unix_socket(self, path, timeout=None, socket_options=None) -> httpcore.NetworkStream:
        stream = self.backend.connect_unix_socket(path, self.cap(timeout, httpcore.ConnectTimeout), socket_options)
        return _DeadlineStream(stream, self)

    def sleep(self, seconds: float) -> None:
        self.backend.sleep(seconds)


def deadline_client(max_connections: int, deadline: RequestDeadline) -> httpx.Client:
    """An httpx client (one connection pool, thread-safe) whose connections keep `deadline`'s per-request deadlines."""
    transport = httpx.HTTPTransport(limits=httpx.Limits(max_connections=max_connections,
                                                        max_keepalive_connections=max_connections))
    transport._pool._network_backend = deadline  # httpx takes no network backend of its own; its httpcore pool does
    return httpx.Client(transport=transport)


def _http_json(client: httpx.Client, deadline: RequestDeadline, url: str, payload: dict | None, timeout: float):
    """GET (payload None) or POST JSON within `timeout` seconds in all; httpx.HTTPStatusError for 4xx, _Retryable for
    what another try may fix."""
    try:
        with deadline.within(timeout):
            if payload is None:
                response = client.get(url, timeout=timeout)
            else:
                response = client.post(url, json=payload, timeout=timeout)
        if response.status_code >= 500 or response.status_code == 429:
            raise _Retryable(f"HTTP {response.status_code}")
        response.raise_for_status()
        return response.json()
    except httpx.TimeoutException as err:
        raise _Retryable(f"no complete reply within {timeout:g} s") from err
    except (httpx.RequestError, ValueError) as err:  # refused/reset, a cut-off or non-JSON body
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
    last_error: Optional[_Retryable] = None


def _failure(server: Server) -> str:
    """What went wrong with a server last, for an error message."""
    if isinstance(server.last_error, BadReply):
        return f"{server.url} answered /v1/completions with {server.last_error}"
    return f"{server.url}: {server.last_error}"


class OpenAIEngine:
    def __init__(self, cfg, tokenizer, eos_ids: set[int], clock: Callable[[], float] = time.monotonic):
        if not cfg.server_url:
            raise EngineError("--backend openai needs --server_url URL [URL ...] (servers started with "
                              f"`{SERVE_COMMAND}`)")
        self.cfg, self.eos_ids = cfg, sorted(eos_ids)
        self.vocab_size = len(tokenizer)  # a generated id must be one the tokenizer can decode
        self.servers = [Server(base_url(url)) for url in cfg.server_url]
        self.lock = threading.Lock()
        # one connection pool for every thread (httpx.Client is thread-safe): a connection per request in flight
        self.deadline = RequestDeadline(clock)
        self.client = deadline_client(cfg.max_in_flight, self.deadline)
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
        models = _http_json(self.client, self.deadline, f"{server.url}/v1/models", None, timeout=30)
        listed = models.get("data") if isinstance(models, dict) else None
        if not isinstance(listed, list) or not all(isinstance(m, dict) for m in listed):
            raise EngineError(f"{server.url}/v1/models answered {_excerpt(models)}, not a list of models under "
                              "\"data\": pass the base URL of an OpenAI-compatible server started with "
                              f"`{SERVE_COMMAND}`")
        served = next((m for m in listed if _names_target(m, self.cfg.target)), None)
        if served is None:
            raise EngineError(
                f"{server.url} serves {[m.get('id') for m in listed]}, not the target {self.cfg.target!r}: start it "
                "with the target's weights (`--model DIR`; for the embedded target DIR is "
                f"{target_model_dir(EMBEDDED_ALIAS) if self.cfg.target == EMBEDDED_ALIAS else 'its directory'}), or "
                f"name it `--served-model-name {Path(self.cfg.target).name}` if it is the target")
        server.model = served["id"]
        context = served.get("max_model_len")
        if context is not None and (type(context) is not int or context < 1):
            raise EngineError(f"{server.url} lists {server.model} with max_model_len {context!r}, not a positive "
                              f"integer: serve the target with `{SERVE_COMMAND}`")
        if context is not None and context < self.cfg.max_length:
            raise EngineError(f"{server.url} serves {server.model} with a context of {context} tokens, less than "
                              f"--max_length {self.cfg.max_length}: pass --max_length {context} or restart the "
                              f"server with --max-model-len {self.cfg.max_length}")
        self._check_tokenizer(server, tokenizer)
        probe = self._complete(server, tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"][:4], 1, seed=0)
        choices = probe.get("choices") if isinstance(probe, dict) else None
        if choices and isinstance(choices[0], dict) and "token_ids" not in choices[0]:
            raise EngineError(f"{server.url} returns no token ids for /v1/completions with \"return_token_ids\": true, "
                              "which self-distillation needs to build exact rows: serve with vLLM >= 0.10.2 (or a "
                              "server that returns token_ids), or use --backend vllm / hf")
        try:
            completion_token_ids(probe, self.vocab_size, 1)
        except BadReply as err:
            raise EngineError(f"{server.url} answered a probe completion with {err}: {err.fix}") from err

    def _check_tokenizer(self, server: Server, tokenizer) -> None:
        """Where the server exposes /tokenize (vLLM, SGLang), its ids for a probe must be the local tokenizer's."""
        payload = {"model": server.model, "prompt": TOKENIZER_PROBE, "add_special_tokens": False}
        try:
            answer = _http_json(self.client, self.deadline, f"{server.url}/tokenize", payload, timeout=30)
        except httpx.HTTPStatusError:
            return  # not exposed
        theirs = answer.get("tokens") if isinstance(answer, dict) else None
        ours = tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
        if theirs != ours:
            count = len(theirs) if isinstance(theirs, list) else 0
            raise EngineError(f"{server.url} serves {server.model} with another tokenizer than the target "
                              f"{self.cfg.target!r} ({count} tokens for a probe text, {len(ours)} here): "
                              "serve the target's own model directory")

    # --- requests

    def _complete(self, server: Server, prompt: list[int], max_tokens: int, seed: int):
        """One /v1/completions request: the reply as parsed, unchecked (completion_token_ids checks it). A refusal
        (4xx) is an EngineError; _Retryable passes through."""
        payload = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens,
                   "temperature": self.cfg.temperature, "top_p": self.cfg.top_p, "seed": seed,
                   "stop_token_ids": self.eos_ids, "return_token_ids": True, "skip_special_tokens": False}
        try:
            return _http_json(self.client, self.deadline, f"{server.url}/v1/completions", payload,
                              timeout=self.cfg.request_timeout_s)
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
                bad = next((s.last_error for s in self.servers if isinstance(s.last_error, BadReply)), None)
                fix = (f"{bad.fix}, then rerun the same command" if bad else
                       "restart them and rerun the same command (any --server_url); a server too slow for "
                       f"--request_timeout_s {self.cfg.request_timeout_s:g} (a total deadline per request) may need a "
                       "larger one or a lower --max_in_flight")
                raise EngineError(f"every server failed ({'; '.join(_failure(s) for s in self.servers)}): {fix}: "
                                  "finished batches are kept and the run continues")
            server = min(live, key=lambda s: s.in_flight)
            server.in_flight += 1
            return server

    def _one(self, prompt: list[int], seed: int) -> list[int]:
        """The checked ids of one prompt's completion, retried on failures; a prompt that gets max_retries bad replies
        is an EngineError (a bad reply is never a row)."""
        attempt, bad_replies = 0, 0
        while True:
            server = self._pick()
            try:
                ids = completion_token_ids(self._complete(server, prompt, self.cfg.max_new_tokens, seed),
                                           self.vocab_size, self.cfg.max_new_tokens)
            except _Retryable as err:
                with self.lock:
                    server.in_flight -= 1
                    server.failures += 1
                    server.last_error = err
                    if server.failures >= self.cfg.max_retries and server.alive:
                        server.alive = False
                        print(f"server {server.url} failed {server.failures} times in a row ({err}); "
                                 "its prompts go to the other servers")
                if isinstance(err, BadReply):
                    bad_replies += 1
                    if bad_replies >= self.cfg.max_retries:
                        raise EngineError(f"{_failure(server)} ({bad_replies} tries of one prompt): {err.fix}, then "
                                          "rerun the same command: finished batches are kept") from err
                time.sleep(min(8.0, 0.25 * 2 ** attempt))  # backoff
                attempt += 1
                continue
            with self.lock:
                server.in_flight -= 1
                server.failures = 0
            return ids

    def generate(self, prompts: list[list[int]], seeds: list[int],
                 on_answers: Optional[Callable[[int], object]] = None) -> list[list[int]]:
        """on_answers(1): told as each answer arrives (progress)."""
        futures = [self.pool.submit(self._one, p, seed) for p, seed in zip(prompts, seeds)]
        try:
            for future in concurrent.futures.as_completed(futures):
                future.result()  # the first failure ends the call
                if on_answers is not None:
                    on_answers(1)
            return [f.result() for f in futures]
        finally:
            for f in futures:
                f.cancel()
