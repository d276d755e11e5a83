"""Self-distillation generation speed on the hf backend: tokens/s by batch size and method, on chat and code prompts.

    python -m headstart.train.bench_selfdistill --num_prompts 96 --repeats 2 --threads 1

Methods, interleaved (every repeat runs each method at each of its batch sizes once, in turn):
- `generate`: transformers `generate` over fixed left-padded batches of the length-sorted prompts (the hf engine
  before packed decoding, at selfdistill's `batch_size` 16); finished rows keep stepping until the longest of their
  batch ends.
- `packed`: inference/packed_decode.py (the hf engine now): continuous batching, `batch size` rows decoded together
  (selfdistill's `hf_rows`, 128 by default; 64 before).
- `packed_no_prefix`: the same without sharing the prompts' common start (each prompt's every token through the
  linear layers, as before 2026-12-05).
Each method's answers are compared with `generate` at the first batch size; the prompts are the first user turns, the
order is selfdistill's (length-sorted). Timings on a shared machine: read the spread, and the machine's load printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from transformers import GenerationConfig

from headstart.heads.chat import render_chat, stop_token_ids
from headstart.heads.prompts import load_prompts
from headstart.heads.target import load_target
from headstart.inference.packed_decode import PackedDecoder


def cut_at_stop(tokens: list[int], stop_ids: set[int]) -> list[int]:
    for j, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: j + 1]
    return tokens


@torch.no_grad()
def generate_padded(model, prompts: list[list[int]], pad_id: int, stop_ids: set[int], max_new_tokens: int,
                    batch_size: int) -> list[list[int]]:
    """Greedy answers by transformers `generate` over consecutive left-padded batches of `batch_size` prompts."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id,
                              eos_token_id=sorted(stop_ids))
    answers = []
    for s in range(0, len(prompts), batch_size):
        batch = prompts[s: s + batch_size]
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])  # (B, W)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])  # (B, W)
        out = model.generate(input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device),
                             generation_config=config)  # (B, W + new)
        answers += [cut_at_stop(row[width:].tolist(), stop_ids) for row in out]
    return answers


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m", help="alias, Hub id, local dir or .gguf file")
    parser.add_argument("--prompts", default="chitchat:train+pycode:train", help="prompt source spec (heads/prompts.py)")
    parser.add_argument("--num_prompts", type=int, default=96, help="the first N prompts of the source")
    parser.add_argument("--max_new_tokens", type=int, default=128, help="tokens generated per answer")
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[64, 128], help="packed: rows decoded together")
    parser.add_argument("--generate_batch_sizes", type=int, nargs="+", default=[16], help="generate: rows a batch")
    parser.add_argument("--methods", nargs="+", default=["generate", "packed"],
                        choices=["generate", "packed", "packed_no_prefix"], help="the decoding methods compared")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per method and batch size")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer, _ = load_target(args.target, dtype="float32", device="cpu")
    stop_ids = set(stop_token_ids(tokenizer, model.generation_config))
    rows = load_prompts(args.prompts, limit=args.num_prompts).rows
    order = sorted(range(len(rows)), key=lambda i: (len(rows[i].turns[0]), i))  # as train/selfdistill.py
    prompts = [render_chat(tokenizer, [{"role": "user", "content": rows[i].turns[0]}], True) for i in order]
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, torch threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")

    decoders = {"packed": PackedDecoder(model, args.max_new_tokens, stop_ids),
                "packed_no_prefix": PackedDecoder(model, args.max_new_tokens, stop_ids, share_prefix=False)}
    sizes = {"generate": args.generate_batch_sizes, "packed": args.batch_sizes, "packed_no_prefix": args.batch_sizes}
    runs = {(m, b): [] for m in args.methods for b in sizes[m]}
    reference = None
    for repeat in range(args.repeats):
        for decoding, batch_size in runs:
            start = time.perf_counter()
            if decoding == "generate":
                answers = generate_padded(model, prompts, tokenizer.pad_token_id, stop_ids, args.max_new_tokens,
                                          batch_size)
            else:
                decoders[decoding].max_rows = batch_size
                answers = decoders[decoding].generate(prompts, seeds=list(range(len(prompts))))
            seconds = time.perf_counter() - start
            tokens = sum(map(len, answers))
            reference = reference or answers
            same = sum(a == r for a, r in zip(answers, reference))
            runs[(decoding, batch_size)].append(tokens / seconds)
            print(f"repeat {repeat} {decoding:16s} batch {batch_size:4d}: {tokens} tokens in {seconds:.1f} s, "
                  f"{tokens / seconds:.1f} tok/s; answers equal to the first run's {same}/{len(prompts)}; "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"\n{'method':16s} batch  tok/s (median, min-max over repeats)")
    for (decoding, batch_size), rates in runs.items():
        print(f"{decoding:16s} {batch_size:5d}  {statistics.median(rates):7.1f} ({min(rates):.1f}-{max(rates):.1f})")


if __name__ == "__main__":
    main()
