"""The target's features from vLLM, written as headstart's on-disk feature cache (docs/training.md, "Features from
vLLM"), so a target served by a (tensor-parallel) vLLM engine never runs in the trainer.

    # 1. headstart's venv: the rows, their token ids and the request (cache.json, rows.safetensors); no target forward
    python train/eagle.py --config RECIPE --feature_cache_dir runs/cache --feature_cache_writer vllm --build_cache_only true
    # 2. vLLM's venv (imports vllm, torch, safetensors, the standard library and train/feature_shards.py): the shards
    python scripts/vllm_features.py --cache_dir runs/cache [--target DIR_OR_HUB_ID] [--tensor_parallel_size N]
    # 3. headstart's venv again: the same command without --build_cache_only trains from the cache

How: vLLM prefills every row (max_tokens 1, no prefix caching, no chunked prefill, eager) with hooks on the target's
decoder (the model's `model`, vLLM's EagleModelMixin): its own aux hidden-state hook `_maybe_add_hidden_state`
gives tap j = hidden_states + residual before layer j (vLLM aux id j = HF `hidden_states[j]`), and the decoder's
output is the final-norm state (HF `hidden_states[L]`). A forward holds whole rows, each starting at position 0; a
row's states are found by its token ids. Tensor-parallel ranks hold the same states: rank 0 writes the shard.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # train/feature_shards.py

import torch  # noqa: E402

from headstart.train.feature_shards import read_rows, rows_sha256, shard_path, write_shard  # noqa: E402

CAPTURE = "_headstart_features"  # the decoder's attribute that holds the captured forwards


# ------------------------------------------------------------------- inside vLLM's workers (collective_rpc)


def decoder_of(model):
    """The module whose forward runs the layers (vLLM's EagleModelMixin: Llama, Qwen2/3, Mistral, ...)."""
    decoder = getattr(model, "model", model)
    if not hasattr(decoder, "_maybe_add_hidden_state"):
        raise RuntimeError(f"{type(model).__name__}: vLLM has no aux hidden-state hook for this architecture "
                           "(it supports no EAGLE-3 draft); compute the features with headstart instead")
    return decoder


def install_hooks(model, taps: list[int]) -> None:
    """Record each forward's token ids, positions, taps (HF indices < L) and final-norm output, on the CPU."""
    from vllm.distributed import get_pp_group

    if get_pp_group().world_size > 1:
        raise RuntimeError("pipeline parallelism splits the layers over ranks: use tensor parallelism only")
    decoder = decoder_of(model)
    setattr(decoder, CAPTURE, [])
    add_aux, forward = decoder._maybe_add_hidden_state, decoder.forward

    def record_tap(aux_hidden_states, layer_idx, hidden_states, residual):
        if layer_idx in taps:
            value = hidden_states + residual if residual is not None else hidden_states  # what vLLM's aux hook takes
            getattr(decoder, CAPTURE)[-1]["taps"][layer_idx] = value.to("cpu", torch.float32, copy=True)
        return add_aux(aux_hidden_states, layer_idx, hidden_states, residual)

    def recording_forward(*args, **kwargs):  # vLLM's compile wrapper calls forward itself: module hooks never run
        input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        positions = kwargs["positions"] if "positions" in kwargs else args[1]
        getattr(decoder, CAPTURE).append({"input_ids": input_ids.to("cpu", copy=True),  # the runner reuses buffers
                                          "positions": positions.to("cpu", copy=True), "taps": {}})
        output = forward(*args, **kwargs)
        getattr(decoder, CAPTURE)[-1]["final"] = output.to("cpu", torch.float32, copy=True)
        return output

    decoder._maybe_add_hidden_state = record_tap
    decoder.forward = recording_forward


def take_captured(model) -> list[dict]:
    decoder = decoder_of(model)
    captured = getattr(decoder, CAPTURE)
    setattr(decoder, CAPTURE, [])
    return captured


# ------------------------------------------------------------------------------------- rows out of the forwards


def rows_from_forwards(forwards: list[dict], rows: list[list[int]], feature_layers: list[int], num_layers: int,
                       taps_are_final: bool) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
    """Each row's (taps [T, n*h] or None, final [T, h]) from the captured forwards. A row starts at position 0 and
    is found by its token ids (the longest row that matches; padding after the last row matches none); the first
    forward that holds a row wins; rows with the same ids get the same states."""
    by_ids: dict[tuple, list[int]] = {}
    for r, ids in enumerate(rows):
        by_ids.setdefault(tuple(ids), []).append(r)
    lengths = sorted({len(ids) for ids in rows}, reverse=True)
    found: dict[int, tuple] = {}
    for fwd in forwards:
        ids, positions = fwd["input_ids"].tolist(), fwd["positions"].tolist()
        for start in (i for i, p in enumerate(positions) if p == 0):
            for n in lengths:
                if start + n > len(ids) or positions[start + n - 1] != n - 1:
                    continue
                same = by_ids.get(tuple(ids[start : start + n]))
                if same is None:
                    continue
                if same[0] not in found:
                    window = slice(start, start + n)
                    final = fwd["final"][window]
                    # tap L is HF hidden_states[L], the final-norm state; below L, vLLM's aux state j
                    taps = None if taps_are_final else torch.cat(
                        [final if j == num_layers else fwd["taps"][j][window] for j in feature_layers], dim=-1)
                    found.update({r: (taps, final) for r in same})
                break
    missing = [r for r in range(len(rows)) if r not in found]
    if missing:
        raise RuntimeError(f"rows {missing[:8]} were in no forward as a whole (prefix caching or chunked prefill on?)")
    return [found[r] for r in range(len(rows))]


def write_captured_shard(model, path: str, rows: list[list[int]], feature_layers: list[int], num_layers: int,
                         taps_are_final: bool, dtype: str) -> int:
    """In each worker: take the captured forwards; tensor-parallel rank 0 writes the shard. Returns the tokens."""
    from vllm.distributed import get_tensor_model_parallel_rank

    per_row = rows_from_forwards(take_captured(model), rows, feature_layers, num_layers, taps_are_final)
    if get_tensor_model_parallel_rank() == 0:
        write_shard(Path(path), per_row, getattr(torch, dtype))
    return sum(final.shape[0] for _, final in per_row)


# ------------------------------------------------------------------------------------------------ the driver


def check_request(meta: dict, rows: list[list[int]], hf_config) -> None:
    identity, request = meta["identity"], meta["vllm_request"]
    if rows_sha256(rows) != identity["rows_sha256"] or len(rows) != identity["rows"]:
        raise SystemExit("rows.safetensors does not hold the rows cache.json was written for: write the request again")
    text = hf_config.get_text_config()
    dims = (text.hidden_size, text.num_hidden_layers)
    if dims != (request["hidden_size"], request["num_hidden_layers"]):
        raise SystemExit(f"vLLM's target has hidden size and layers {dims}; the cache is for "
                         f"{(request['hidden_size'], request['num_hidden_layers'])}: pass the trainer's target")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache_dir", required=True, help="the feature_cache_dir the trainer wrote the request in")
    parser.add_argument("--target", help="the model vLLM loads (default: the trainer's, from cache.json)")
    parser.add_argument("--dtype", help="vLLM's dtype (default: the trainer's target dtype, from cache.json)")
    parser.add_argument("--tensor_parallel_size", type=int, default=1, help="GPUs vLLM shards the target over")
    parser.add_argument("--gpu_memory_utilization", type=float, default=0.3, help="vLLM's share of (GPU) memory")
    parser.add_argument("--max_num_batched_tokens", type=int, default=16384, help="tokens per forward (>= longest row)")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the hooks travel to the workers pickled,
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # which import
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cache_dir = Path(args.cache_dir)
    meta = json.loads((cache_dir / "cache.json").read_text())
    if "vllm_request" not in meta:
        raise SystemExit(f"{cache_dir}/cache.json has no vllm_request: write it with feature_cache_writer vllm")
    identity, request = meta["identity"], meta["vllm_request"]
    rows = read_rows(cache_dir)
    longest = max(len(ids) for ids in rows)
    llm = LLM(model=args.target or request["target"], dtype=args.dtype or request["target_dtype"],
              tensor_parallel_size=args.tensor_parallel_size, gpu_memory_utilization=args.gpu_memory_utilization,
              max_model_len=longest + 1, max_num_batched_tokens=max(args.max_num_batched_tokens, longest + 1),
              enable_prefix_caching=False, enable_chunked_prefill=False, enforce_eager=True, seed=0)
    check_request(meta, rows, llm.llm_engine.model_config.hf_config)
    layers, num_layers = identity["feature_layers"], request["num_hidden_layers"]
    taps = [j for j in layers if j < num_layers]
    # collective_rpc sends a callable cloudpickled (by value: these functions live in __main__); apply_model's
    # argument goes to the workers by plain pickle, which cannot carry them
    llm.collective_rpc(lambda worker: install_hooks(worker.get_model(), taps))
    S = identity["shard_rows"]
    shards = range((len(rows) + S - 1) // S)
    todo = [k for k in shards if not shard_path(cache_dir, k).is_file()]
    print(f"{cache_dir}: {len(rows)} rows, {len(shards)} shards, {len(todo)} to write", flush=True)
    for k in todo:
        shard_rows = rows[k * S : (k + 1) * S]
        llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in shard_rows],
                     SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        path = str(shard_path(cache_dir, k))
        llm.collective_rpc(lambda worker: write_captured_shard(worker.get_model(), path, shard_rows, layers, num_layers,
                                                               request["taps_are_final"], identity["dtype"]))
        print(f"shard {k} written", flush=True)


if __name__ == "__main__":
    main()
