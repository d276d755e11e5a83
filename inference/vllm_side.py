"""The vLLM venv's side of the vLLM engine check (inference/vllm_check.py runs this file by path with that venv's
python): vLLM runs the prompts with and without an export and reports outputs, counters and timings as JSON. It
imports only vllm and the standard library.

vLLM 0.32's CPU build normalises every DFlash layer's context keys with layer 0's k_norm (its rms_norm kernel reads
one weight row); for a draft whose layers differ, `--per_layer_k_norm` replaces that one method by a per-layer loop
of the same kernel, in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set by vllm_check.py), and the run records it.

    # one vLLM run
    python inference/vllm_side.py run --target DIR --prompts prompts.json --max_new_tokens 64 --out run.json \
        [--draft DIR --method eagle3 --k 3 [--no_weights_track] [--per_layer_k_norm]]
    # the speed mode's side: both engines in one process, prompts alternated, --rounds rounds
    python inference/vllm_side.py speed-run --target DIR --prompts prompts.json --max_new_tokens 96 --out run.json \
        --draft DIR --method eagle3 --k 3 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Callable

ENGINES = ("without", "with")  # the speed mode's two engines: the target alone, the target with the draft


def engine_kwargs(args: argparse.Namespace, draft: bool, kv_cache_bytes: int | None = None) -> dict:
    """vLLM's LLM(...) arguments: the target in fp32, eager, seeded; with `draft`, the export as a chain of args.k;
    `kv_cache_bytes` fixes the KV cache's size (two engines in one process: not a share of the memory each)."""
    kwargs = dict(model=args.target, dtype="float32", gpu_memory_utilization=0.3, disable_log_stats=False,
                  max_model_len=args.max_model_len, seed=0, enforce_eager=True)
    if kv_cache_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
    if draft:
        kwargs["speculative_config"] = {"method": args.method, "model": args.draft, "num_speculative_tokens": args.k}
    if args.no_weights_track:
        kwargs["model_loader_extra_config"] = {"enable_weights_track": False}
    return kwargs


def spec_counters(llm) -> dict:
    """vLLM's spec-decode counters so far (vllm:spec_decode_num_drafts, ..._num_accepted_tokens, ..._per_pos)."""
    counters = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            counters[metric.name] = getattr(metric, "values", None) or getattr(metric, "value", None)
    return counters


def run_vllm(args: argparse.Namespace) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = json.loads(Path(args.prompts).read_text())
    if args.per_layer_k_norm:
        patch_dflash_context_k_norm()
    start = time.perf_counter()
    llm = LLM(**engine_kwargs(args, bool(args.draft)))
    loaded = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    done = time.perf_counter()
    result = {"outputs": [list(o.outputs[0].token_ids) for o in outputs], "load_s": round(loaded - start, 1),
              "generate_s": round(done - loaded, 1), "draft": args.draft, "method": args.method, "k": args.k,
              "per_layer_k_norm": args.per_layer_k_norm}
    counters = spec_counters(llm)
    result["counters"] = counters
    drafts = counters.get("vllm:spec_decode_num_drafts")
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens")
    if drafts:
        result["mean_acceptance_length"] = 1.0 + accepted / drafts
        result["accepted_per_pos"] = counters.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    return result


def interleaved_order(num_prompts: int, rounds: int) -> list[tuple[int, int, str]]:
    """(round, prompt, engine) in the order the speed mode generates: every prompt by both engines back to back, the
    engine that goes first alternating from one prompt to the next (over the rounds too), so neither engine always
    runs first on a warmer or busier machine."""
    order = []
    for r in range(rounds):
        for i in range(num_prompts):
            pair = ENGINES if (r * num_prompts + i) % 2 == 0 else ENGINES[::-1]
            order += [(r, i, engine) for engine in pair]
    return order


def measure_interleaved(generate: Callable[[str, int], list[int]], num_prompts: int, rounds: int,
                        clock: Callable[[], float] = time.perf_counter) -> dict:
    """Run `generate(engine, prompt)` (one prompt alone; returns its generated token ids) in `interleaved_order`,
    timing each call with `clock`. {"rounds": {engine: [{"tokens", "seconds"} per round]}, "outputs": {engine: the
    first round's token ids per prompt}, "rounds_agree": {engine: whether every round generated those same ids}}."""
    rounds_out = {engine: [{"tokens": 0, "seconds": 0.0} for _ in range(rounds)] for engine in ENGINES}
    outputs = {engine: [None] * num_prompts for engine in ENGINES}
    agree = {engine: True for engine in ENGINES}
    for r, i, engine in interleaved_order(num_prompts, rounds):
        start = clock()
        tokens = list(generate(engine, i))
        seconds = clock() - start
        rounds_out[engine][r]["tokens"] += len(tokens)
        rounds_out[engine][r]["seconds"] += seconds
        if r == 0:
            outputs[engine][i] = tokens
        elif tokens != outputs[engine][i]:
            agree[engine] = False
    return {"rounds": rounds_out, "outputs": outputs, "rounds_agree": agree}


def speed_vllm(args: argparse.Namespace) -> dict:
    """The speed mode's vLLM side: both engines in this process (the target alone first, then with the draft), a
    warm-up generation each, then `measure_interleaved` over --rounds; the draft engine's spec-decode counters over
    the timed rounds."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = json.loads(Path(args.prompts).read_text())
    if args.per_layer_k_norm:
        patch_dflash_context_k_norm()
    # batch 1 within max_model_len: a KV cache of 1 GiB holds it for the targets this check runs
    engines = {engine: LLM(**engine_kwargs(args, engine == "with", kv_cache_bytes=1 << 30)) for engine in ENGINES}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)

    def generate(engine: str, i: int, sampling=params) -> list[int]:
        out = engines[engine].generate([TokensPrompt(prompt_token_ids=prompts[i])], sampling, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    warm_up = SamplingParams(temperature=0.0, max_tokens=min(8, args.max_new_tokens))
    for engine in ENGINES:
        generate(engine, 0, warm_up)
    before = spec_counters(engines["with"])
    measured = measure_interleaved(generate, len(prompts), args.rounds)
    after = spec_counters(engines["with"])
    spec = {}
    for name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens"):
        if after.get(name) is not None:
            spec[name.removeprefix("vllm:spec_decode_")] = after[name] - (before.get(name) or 0)
    return {**measured, "version": vllm.__version__, "draft": args.draft, "method": args.method, "k": args.k,
            "per_layer_k_norm": args.per_layer_k_norm, **spec}


def patch_dflash_context_k_norm() -> None:
    """vLLM 0.32 CPU: DFlashQwen3Model._normalize_context_k passes all layers' k_norm weights [L, d] to one rms_norm
    call, whose CPU kernel applies row 0 to every layer; normalise layer by layer instead (the engine must run in
    this process: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    import torch
    from vllm import _custom_ops as ops
    from vllm.model_executor.models import qwen3_dflash

    def normalize_context_k(self, all_k):
        out = torch.empty_like(all_k)
        for i in range(all_k.shape[0]):
            ops.rms_norm(out[i], all_k[i].contiguous(), self._k_norm_weights[i].contiguous(), self._rms_norm_eps)
        return out

    qwen3_dflash.DFlashQwen3Model._normalize_context_k = normalize_context_k


def add_vllm_side_args(parser: argparse.ArgumentParser, max_new_tokens: int, draft_required: bool) -> None:
    """The flags `run` and `speed-run` (the vLLM venv's side) share: the target, prompts, output and the draft."""
    parser.add_argument("--target", required=True, help="the target as a plain HF dir")
    parser.add_argument("--prompts", required=True, help="JSON list of prompt token id lists")
    parser.add_argument("--max_new_tokens", type=int, default=max_new_tokens, help="tokens generated per prompt")
    parser.add_argument("--max_model_len", type=int, default=1024, help="vLLM's max_model_len")
    parser.add_argument("--out", required=True, help="write the run's figures to this JSON file")
    parser.add_argument("--draft", required=draft_required, default=None,
                        help="an export directory" + ("" if draft_required else " (default: no draft)"))
    parser.add_argument("--method", required=draft_required, default=None,
                        help="vLLM's speculative method for --draft, e.g. eagle3")
    parser.add_argument("--k", type=int, default=3, help="vLLM's num_speculative_tokens")
    parser.add_argument("--no_weights_track", action="store_true",
                        help="turn off vLLM's weights tracking (drafts with a token_map)")
    parser.add_argument("--per_layer_k_norm", action="store_true", help="DFlash on vLLM 0.32 CPU: see the docstring")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    run = sub.add_parser("run", help="one vLLM run")
    add_vllm_side_args(run, max_new_tokens=64, draft_required=False)
    srun = sub.add_parser("speed-run", help="the speed mode's vLLM side: both engines, interleaved")
    add_vllm_side_args(srun, max_new_tokens=96, draft_required=True)
    srun.add_argument("--rounds", type=int, default=2, help="rounds over the prompts (the fastest one counts)")
    args = parser.parse_args(argv)
    result = run_vllm(args) if args.mode == "run" else speed_vllm(args)
    Path(args.out).write_text(json.dumps(result))
    print(json.dumps({k: v for k, v in result.items() if k != "outputs"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
