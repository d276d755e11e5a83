"""A fake OpenAI-compatible server for the openai backend's tests: a tiny HF model answers greedily, one prompt at a time.

    server = FakeServer(model_dir).start()            # in a thread of this process; server.url
    server.stop()
    python tests/fake_openai.py MODEL_DIR [--die_after N]   # in a process of its own; prints "PORT <port>"

It serves what train/engines.py asks of vLLM: GET /v1/models (id = the model directory, `max_model_len`), POST
/tokenize and POST /v1/completions (prompt as token ids, `stop_token_ids`, `return_token_ids`). Switches for the
bad-input tests: another model name, no /tokenize, another tokenizer, no token ids, a smaller context (exposed or
only enforced), `die_after`: SIGKILL itself when request N+1 of /v1/completions arrives, and `reply`: a malformed
completion (REPLY_MODES) from completion request `bad_from` on (request 0 is the client's probe), among them `drip`:
the reply sent one byte every `drip_s` seconds, forever (`dripped` counts the bytes sent).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

import torch


@dataclass
class FakeSettings:
    name: Optional[str] = None  # served model id; None: the model directory (as vLLM serves --model DIR)
    max_model_len: int = 1024
    expose_max_model_len: bool = True
    tokenize: bool = True  # serve /tokenize
    tokenizer_shift: int = 0  # > 0: /tokenize answers other ids (another tokenizer)
    token_ids: bool = True  # return token_ids
    die_after: int = -1  # >= 0: SIGKILL this process when completion request die_after + 1 arrives
    reply: str = "good"  # one of REPLY_MODES: what completion requests from number bad_from on (0 = the first) get
    bad_from: int = 1
    drip_s: float = 0.01  # reply "drip": seconds between bytes


# malformed completions: how each mode changes a good reply's first choice (the ids it would have returned: `ids`)
REPLY_MODES = {
    "good": lambda choice, ids: choice,
    "oov": lambda choice, ids: {**choice, "token_ids": [60000, 123456] + ids},  # outside any tiny vocabulary
    "empty": lambda choice, ids: {**choice, "token_ids": [], "text": "", "finish_reason": "stop"},
    "no_choices": None,  # "choices": []
    "no_token_ids": lambda choice, ids: {k: v for k, v in choice.items() if k != "token_ids"},
    "null_token_ids": lambda choice, ids: {**choice, "token_ids": None},
    "string_token_ids": lambda choice, ids: {**choice, "token_ids": [str(t) for t in ids]},
    "negative_token_ids": lambda choice, ids: {**choice, "token_ids": [-1] + ids},
    "aborted": lambda choice, ids: {**choice, "finish_reason": "abort"},
    "drip": None,  # handled by the request handler
}


class FakeServer:
    def __init__(self, model_dir: str, settings: FakeSettings | None = None, port: int = 0):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_dir, self.settings = str(model_dir), settings or FakeSettings()
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.lock = threading.Lock()  # one generate at a time (torch threads are shared)
        self.completions = 0
        self.dripped = 0  # bytes sent by "drip" replies
        self.stopped = threading.Event()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def start(self) -> "FakeServer":
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def reply_mode(self) -> str:
        """Count a completion request; the reply mode it gets (SIGKILL here when die_after says so)."""
        s = self.settings
        with self.lock:
            self.completions += 1
            if 0 <= s.die_after < self.completions:
                os.kill(os.getpid(), signal.SIGKILL)
            return s.reply if self.completions > s.bad_from else "good"

    @torch.no_grad()
    def complete(self, body: dict, mode: str = "good") -> tuple[int, dict]:
        s = self.settings
        prompt = body["prompt"]
        if len(prompt) + body["max_tokens"] > s.max_model_len:
            return 400, {"error": {"message": f"This model's maximum context length is {s.max_model_len} tokens. "
                                              f"However, you requested {len(prompt) + body['max_tokens']} tokens."}}
        stops = set(body.get("stop_token_ids") or [])
        ids = torch.tensor([prompt])  # (1, P)
        with self.lock:  # greedy, as HF generate computes it for an unpadded prompt
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=body["max_tokens"], eos_token_id=sorted(stops) or None,
                                      pad_token_id=self.tokenizer.pad_token_id)  # (1, P + new)
        new = out[0, len(prompt):].tolist()
        for j, token in enumerate(new):
            if token in stops:
                new = new[: j + 1]
                break
        finished = "stop" if new and new[-1] in stops else "length"
        choice = {"index": 0, "text": self.tokenizer.decode(new), "finish_reason": finished}
        if s.token_ids and body.get("return_token_ids"):
            choice["token_ids"] = new
        choices = [] if mode == "no_choices" else [REPLY_MODES[mode](choice, new)]
        return 200, {"object": "text_completion", "model": body["model"], "choices": choices}

    def drip(self, wfile) -> None:
        """A reply sent one byte every drip_s seconds, forever: the headers of a large body, then the body."""
        reply = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n{"
        sent = 0
        while not self.stopped.wait(self.settings.drip_s):
            try:
                wfile.write(reply[sent: sent + 1] if sent < len(reply) else b" ")
                wfile.flush()
            except OSError:  # the client gave up
                return
            sent += 1
            with self.lock:
                self.dripped += 1

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, code: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                s = server.settings
                if self.path != "/v1/models":
                    return self._send(404, {"error": {"message": "not found"}})
                card = {"id": s.name or server.model_dir, "object": "model", "root": s.name or server.model_dir}
                if s.expose_max_model_len:
                    card["max_model_len"] = s.max_model_len
                self._send(200, {"object": "list", "data": [card]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                s = server.settings
                if self.path == "/v1/completions":
                    mode = server.reply_mode()
                    if mode == "drip":
                        self.close_connection = True
                        return server.drip(self.wfile)
                    return self._send(*server.complete(body, mode))
                if self.path == "/tokenize" and s.tokenize:
                    ids = server.tokenizer(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))
                    return self._send(200, {"tokens": [i + s.tokenizer_shift for i in ids["input_ids"]]})
                self._send(404, {"error": {"message": "not found"}})

        return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--die_after", type=int, default=-1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    server = FakeServer(args.model_dir, FakeSettings(die_after=args.die_after))
    print(f"PORT {server.httpd.server_address[1]}", flush=True)
    server.httpd.serve_forever()


if __name__ == "__main__":
    main()
