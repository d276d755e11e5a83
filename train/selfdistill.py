"""Self-distillation: the target answers every user turn itself, and that becomes the heads' data.

    # CPU, the embedded default (the recipe: 768 prompts of the broad mix, mix:train):
    python train/selfdistill.py --config recipes/smollm2-135m/selfdistill.yaml --output_dir runs/sd
    python train/selfdistill.py --config recipes/smollm2-135m/selfdistill.yaml --device cuda --dtype bfloat16  # a GPU
    # several processes (GPUs, or two CPU processes): batches are sharded, the result is the same
    accelerate launch --multi_gpu --num_processes 2 train/selfdistill.py --config ... --output_dir runs/sd
    # a serving engine (train/engines.py, train/openai_engine.py): vLLM in this process, or OpenAI-compatible servers
    python train/selfdistill.py --config ... --backend vllm --tensor_parallel_size 2
    python train/selfdistill.py --config ... --backend openai --server_url http://host1:8000 http://host2:8000

The target answers turn by turn through its own chat template (heads/chat.py: the renderer inference uses too),
with its earlier answers fed back in multi-turn conversations; greedy (temperature 0) or sampled. Every backend gets
the prompts as token ids and returns the generated token ids; the rows are built from those ids here, the same way
for every backend. Batches are fixed by the prompt order, so the result does not depend on the number of processes;
each finished batch is written to `OUTPUT_DIR/parts/` at once, and a rerun (after a crash or a kill) skips the
batches already there.

Output, in OUTPUT_DIR:
  dataset/    a `datasets` dataset: id, category, conversation [{role, content}], input_ids,
              loss_mask (1 exactly on the tokens the target wrote, its end-of-turn token included),
              num_generated
  meta.json   target name and fingerprint, generation settings, the engine (backend and its settings), counts
              of rows and of skips by reason
  parts/      one JSON file per finished batch (what resume reads)
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from headstart.heads.chat import render_chat, stop_token_ids
from headstart.heads.output_dir import RunKind, claim_output_dir, disk_full_is_one_line, honour_umask, write_file
from headstart.heads.prompts import PromptRow, load_prompts
from headstart.heads.target import load_target, load_target_without_model
from headstart.train.config import ConfigError, check_number, parse_config
from headstart.train.data import DataError
from headstart.train.engines import BACKENDS, EngineError, HFEngine, VLLMEngine, engine_gpus, request_seed

# settings that change the rows: a rerun into the same directory must use the same ones (server URLs, parallelism
# and in-flight counts do not change them)
RESULT_FIELDS = ("target", "prompts", "num_prompts", "max_turns", "max_new_tokens", "max_length", "batch_size",
                 "temperature", "top_p", "seed", "dtype", "system_prompt", "chat_template", "backend")


def make_engine(cfg, model, tokenizer, eos_ids: set[int]):
    """The engine for cfg.backend; `model` is used by hf only (None for the others)."""
    if cfg.backend == "hf":
        return HFEngine(model, cfg, eos_ids)
    if cfg.backend == "vllm":
        return VLLMEngine(cfg, eos_ids)
    if cfg.backend == "openai":
        from headstart.train.openai_engine import OpenAIEngine

        return OpenAIEngine(cfg, tokenizer, eos_ids)
    raise EngineError(f"backend must be one of {', '.join(BACKENDS)}, got {cfg.backend!r}")


@dataclass
class SelfDistillConfig:
    config: Optional[str] = None  # recipe YAML
    target: str = "smollm2-135m"  # alias, Hub id, local dir or .gguf file
    prompts: str = "mix:train"  # the broad mix of task families; see heads/prompts.py for the spec strings
    output_dir: str = "runs/selfdistill"  # where dataset/, meta.json and the finished batches (parts/) go
    num_prompts: Optional[int] = None  # first N rows of the source; None = all
    max_turns: int = 2  # user turns answered per conversation
    max_new_tokens: int = 128  # per answer
    max_length: int = 1024  # tokens per conversation: a turn whose prompt + max_new_tokens exceeds it is not asked
    batch_size: int = 8  # prompts per parts file (and per sampling-seed group); the hf engine's rows do not depend on it
    prompts_per_call: int = 256  # prompts handed to the engine at once (whole batches); does not change the rows
    hf_rows: int = 128  # hf: conversations decoded together (continuous batching); does not change the rows
    hf_cache_gib: float = 4.0  # hf: fewer rows where their key/value cache would need more (long prompts)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling (with temperature > 0); 1 = off
    seed: int = 0  # sampling seed (each batch of prompts gets its own, derived from it)
    dtype: str = "float32"  # the target's dtype (hf, vllm): float32, bfloat16 or float16
    device: Optional[str] = None  # default: accelerate's device for this process
    system_prompt: Optional[str] = None  # None: the chat template's own default
    chat_template: Optional[str] = None  # a Jinja string or .jinja file, for tokenizers that have none
    backend: str = "hf"  # hf (transformers generate here) | vllm (vllm.LLM here) | openai (servers); train/engines.py
    # vllm
    tensor_parallel_size: int = 1  # GPUs per engine; data parallel = several processes (accelerate launch)
    gpu_memory_utilization: float = 0.9  # vLLM's share of (GPU) memory; 0.3 on a CPU machine
    # openai
    server_url: Optional[list[str]] = None  # base URLs of OpenAI-compatible servers serving the target
    max_in_flight: int = 64  # requests in flight at once, over all servers
    max_retries: int = 3  # failures in a row after which a server is dropped for the run
    request_timeout_s: float = 600.0  # openai: seconds a request may take before it counts as a failure


# ---------------------------------------------------------------------------------------------
# the loss mask


def render_with_mask(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], ended_with_eos: list[bool], eos_ids: set[int]
) -> tuple[list[int], list[int]]:
    """Render the whole conversation; loss_mask = 1 on the tokens of each assistant answer, plus the
    end-of-turn token right after an answer that the target ended itself (`ended_with_eos`).

    Returns (input_ids, loss_mask). Raises ValueError when an answer cannot be found in the render.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
    spans, cursor = [], 0  # char spans of the assistant answers, in order
    for message in messages:
        start = text.find(message["content"], cursor)
        if start < 0:
            if message["role"] == "assistant":
                raise ValueError("the chat template altered an answer's text")
            continue  # a user/system text the template rewrote: not needed for the mask
        cursor = start + len(message["content"])
        if message["role"] == "assistant":
            spans.append((start, cursor))
    loss_mask = [0] * len(input_ids)
    token = 0
    for (start, end), with_eos in zip(spans, ended_with_eos):
        while token < len(input_ids) and offsets[token][0] < start:
            token += 1
        while token < len(input_ids) and offsets[token][1] <= end:
            if offsets[token][1] > offsets[token][0]:
                loss_mask[token] = 1
            token += 1
        if with_eos and token < len(input_ids) and input_ids[token] in eos_ids:
            loss_mask[token] = 1
    return input_ids, loss_mask


# ---------------------------------------------------------------------------------------------
# batches of conversations, turn by turn


def prompts_of(row: PromptRow, cfg: SelfDistillConfig) -> int:
    """The prompts (user turns) a conversation may ask of the target: what the progress bar counts."""
    return min(len(row.turns), cfg.max_turns)


def distill_batches(engine, tokenizer, batches: dict[int, list[PromptRow]], cfg: SelfDistillConfig,
                    eos_ids: set[int], progress: Optional[Callable[[int], object]] = None
                    ) -> dict[int, tuple[list[dict], collections.Counter, int]]:
    """Answer up to max_turns user turns of each conversation of several batches (batch index -> its rows) through
    `engine` (train/engines.py): one engine call per turn for all of them. Prompt j asked of batch k at turn t gets
    the seed request_seed(cfg.seed + 1000 * k + t, j), so a batch's rows do not depend on the batches beside it.
    progress(n) is told of every prompt (prompts_of) as it is answered, or as it is left unasked (a conversation
    stopped early). Returns, per batch index, (records, skip counts, tokens generated)."""
    progress = progress or (lambda n: None)
    convs = [(k, i, row) for k, rows in batches.items() for i, row in enumerate(rows)]  # every conversation
    skipped = {k: collections.Counter() for k in batches}
    messages: list[list[dict]] = []
    for _, _, row in convs:
        system = row.system if row.system is not None else cfg.system_prompt
        messages.append([{"role": "system", "content": system}] if system else [])
    ended_with_eos: list[list[bool]] = [[] for _ in convs]
    generated_counts = [0] * len(convs)
    stopped = [False] * len(convs)
    for turn in range(cfg.max_turns):
        active, prompts, seeds = [], [], []
        asked = collections.Counter()  # prompts asked of each batch this turn
        for c, (k, _, row) in enumerate(convs):
            if stopped[c] or turn >= len(row.turns):
                continue
            ids = render_chat(tokenizer, messages[c] + [{"role": "user", "content": row.turns[turn]}], True)
            if len(ids) + cfg.max_new_tokens > cfg.max_length:
                skipped[k]["prompt_too_long" if turn == 0 else "turns_cut_by_max_length"] += 1
                stopped[c] = True
                progress(prompts_of(row, cfg) - turn)  # this turn and the later ones: not asked
                continue
            active.append(c)
            prompts.append(ids)
            seeds.append(request_seed(cfg.seed + 1000 * k + turn, asked[k]))  # the same draws on any rerun
            asked[k] += 1
        if not active:
            break
        answers = engine.generate(prompts, seeds, on_answers=progress)
        for new, c in zip(answers, active):
            k, _, row = convs[c]
            ended = False
            for j, token in enumerate(new):
                if token in eos_ids:
                    new, ended = new[: j + 1], True
                    break
            answer = tokenizer.decode(new[:-1] if ended else new, skip_special_tokens=True).strip()
            if not answer:
                skipped[k]["empty_answer"] += 1
                stopped[c] = True
                progress(prompts_of(row, cfg) - turn - 1)  # the later turns: not asked
                continue
            if not ended:
                skipped[k]["answers_cut_by_max_new_tokens"] += 1  # counted, kept: the target wrote these tokens
            messages[c] += [{"role": "user", "content": row.turns[turn]}, {"role": "assistant", "content": answer}]
            ended_with_eos[c].append(ended)
            generated_counts[c] += len(new)
    records: dict[int, list[dict]] = {k: [] for k in batches}
    generated: collections.Counter = collections.Counter()
    for c, (k, i, row) in enumerate(convs):
        generated[k] += generated_counts[c]
        if not ended_with_eos[c]:
            continue  # no answered turn (its reason is counted above)
        try:
            input_ids, loss_mask = render_with_mask(tokenizer, messages[c], ended_with_eos[c], eos_ids)
        except ValueError:
            skipped[k]["answer_not_found_in_render"] += 1
            continue
        records[k].append({"batch_position": i, "id": row.id, "category": row.category, "conversation": messages[c],
                           "input_ids": input_ids, "loss_mask": loss_mask, "num_generated": generated_counts[c]})
    return {k: (records[k], skipped[k], generated[k]) for k in batches}


# ---------------------------------------------------------------------------------------------
# the run: shard, resume, assemble


# what a self-distillation run writes in its output_dir (.selfdistill.lock: earlier versions' lock), and the files that
# mark a directory without a manifest as an earlier run's (heads/output_dir.py)
SELFDISTILL_RUN = RunKind("selfdistill", names=("run.json", "meta.json", "parts", "dataset", ".dataset.tmp",
                                                ".selfdistill.lock", ".*.tmp"), markers=("run.json", "meta.json"))


def _write_json_atomic(path: Path, payload: dict) -> None:
    write_file(path, json.dumps(payload))


def _check_settings(output_dir: Path, cfg: SelfDistillConfig, is_main: bool) -> None:
    """A rerun into output_dir must use the settings of the run whose batches are there; before any batch is written
    (e.g. an earlier run failed on its prompts or target) the new settings replace the old."""
    settings = {k: getattr(cfg, k) for k in RESULT_FIELDS}
    run_file = output_dir / "run.json"
    if run_file.is_file() and any((output_dir / "parts").glob("batch_*.json")):
        # a setting the run's run.json lacks (a field the config gained later) held its default in that run
        defaults = {f.name: f.default for f in dataclasses.fields(SelfDistillConfig)}
        previous = {k: v for k, v in defaults.items() if k in settings} | json.loads(run_file.read_text())
        differing = sorted(k for k in settings if previous.get(k) != settings[k])
        if differing:
            raise ConfigError(
                f"{output_dir} holds a self-distillation run with other settings ({', '.join(differing)}: "
                f"{[previous.get(k) for k in differing]} there, {[settings[k] for k in differing]} now). "
                "Resume with the same settings, or pass a new --output_dir."
            )
    elif is_main and (not run_file.is_file() or json.loads(run_file.read_text()) != settings):
        output_dir.mkdir(parents=True, exist_ok=True)
        _write_json_atomic(run_file, settings)


def check_selfdistill_config(cfg: SelfDistillConfig) -> None:
    """Flag values that cannot work, refused before anything is loaded or written."""
    if cfg.backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {cfg.backend!r}")
    if cfg.num_prompts is not None and cfg.num_prompts < 1:
        raise ConfigError(f"--num_prompts must be at least 1 (or left out for every row), got {cfg.num_prompts}")
    for name in ("max_turns", "max_new_tokens", "max_length", "batch_size", "prompts_per_call", "hf_rows",
                 "tensor_parallel_size", "max_in_flight", "max_retries"):
        check_number(cfg, name, 1)
    check_number(cfg, "temperature", 0)
    check_number(cfg, "top_p", 0, above=True, high=1)
    check_number(cfg, "hf_cache_gib", 0, above=True)
    check_number(cfg, "gpu_memory_utilization", 0, above=True, high=1)
    check_number(cfg, "request_timeout_s", 0, above=True)
    out = Path(cfg.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output_dir {out} is a file, not a directory: pass another --output_dir")


def load_selfdistilled(output_dir: str | Path):
    """Read a finished self-distillation run: (datasets.Dataset, meta dict)."""
    import datasets

    output_dir = Path(output_dir)
    if not (output_dir / "dataset").is_dir() or not (output_dir / "meta.json").is_file():
        raise FileNotFoundError(f"{output_dir} holds no finished self-distilled dataset (dataset/ and meta.json); "
                                "run `python train/selfdistill.py --output_dir DIR` first")
    return datasets.load_from_disk(str(output_dir / "dataset")), json.loads((output_dir / "meta.json").read_text())


def _load_chat_template(value: str) -> str:
    path = Path(value).expanduser()
    return path.read_text() if value.endswith(".jinja") and path.is_file() else value


def run_selfdistill(cfg: SelfDistillConfig) -> Path:
    """Run (or resume) self-distillation; returns the output directory."""
    from accelerate import Accelerator

    check_selfdistill_config(cfg)
    # without cpu=True accelerate sets up no process group on a machine without GPUs (world size 1 each); an
    # engine backend leaves the GPUs to the engine
    accelerator = Accelerator(cpu=cfg.device == "cpu" or not torch.cuda.is_available() or cfg.backend != "hf")
    output_dir = Path(cfg.output_dir)
    # only a new or empty directory, or an earlier self-distillation run's; a second run on it is refused
    with claim_output_dir(output_dir, SELFDISTILL_RUN, accelerator.is_main_process), \
            disk_full_is_one_line(output_dir, "free space and rerun: the finished batches are kept"):
        return _distill(cfg, accelerator)


def row_cost(turns: list[str], max_new_tokens: int) -> float:
    """A conversation's generation cost, estimated before tokenizing: per answered turn, its prompt (about 4
    characters a token) and max_new_tokens answer tokens, each token weighted by the attention over its context
    (1 + context / 2048: a token over 2,048 tokens of context counts as two; docs/data.md)."""
    cost, context = 0.0, 0.0
    for text in turns:
        prompt = len(text) / 4
        cost += prompt * (1 + (context + prompt / 2) / 2048)
        context += prompt
        cost += max_new_tokens * (1 + (context + max_new_tokens / 2) / 2048)
        context += max_new_tokens
    return cost


def deal_batches(costs: list[float], num_processes: int) -> list[int]:
    """The process of each batch: costliest first, each to the process with the least cost so far, so the processes
    finish together (batch k to process k % N left the long-context batches, which sort last, on one process)."""
    load = [0.0] * num_processes
    owner = [0] * len(costs)
    for k in sorted(range(len(costs)), key=lambda k: (-costs[k], k)):
        process = min(range(num_processes), key=lambda p: (load[p], p))
        owner[k] = process
        load[process] += costs[k]
    return owner


def _distill(cfg: SelfDistillConfig, accelerator) -> Path:
    import datasets

    output_dir = Path(cfg.output_dir)
    _check_settings(output_dir, cfg, accelerator.is_main_process)
    accelerator.wait_for_everyone()
    _check_settings(output_dir, cfg, False)
    if (output_dir / "dataset").is_dir() and (output_dir / "meta.json").is_file():
        accelerator.print(f"{output_dir}/dataset is complete; nothing to do")
        return output_dir

    source = load_prompts(cfg.prompts, limit=cfg.num_prompts)
    if not source.rows:
        raise DataError(f"prompt source {cfg.prompts!r} gave no usable rows (skipped: {dict(source.skipped)})")
    if cfg.backend == "hf":
        model, tokenizer, info = load_target(cfg.target, dtype=cfg.dtype, device=cfg.device or accelerator.device)
        generation_config = model.generation_config
    else:  # the engine or the servers hold the weights: this process reads the tokenizer, stop tokens and fingerprint
        model = None
        tokenizer, generation_config, info = load_target_without_model(cfg.target)
    if cfg.chat_template:
        tokenizer.chat_template = _load_chat_template(cfg.chat_template)
    if not tokenizer.chat_template:
        raise ConfigError(
            f"the tokenizer of target {cfg.target!r} has no chat template, which self-distillation needs to render "
            "conversations. Use the instruct/chat version of the model, or set chat_template in the recipe "
            "(a Jinja string or a path to a .jinja file)."
        )
    eos_ids = set(stop_token_ids(tokenizer, generation_config))
    engine = make_engine(cfg, model, tokenizer, eos_ids)
    del model  # the hf engine holds it

    # fixed batches over a length-sorted order (less padding), dealt to the processes by their estimated cost
    order = sorted(range(len(source.rows)), key=lambda i: (len(source.rows[i].turns[0]), i))
    batches = [order[s: s + cfg.batch_size] for s in range(0, len(order), cfg.batch_size)]
    parts_dir = output_dir / "parts"
    parts_dir.mkdir(parents=True, exist_ok=True)
    costs = [sum(row_cost(source.rows[i].turns[: cfg.max_turns], cfg.max_new_tokens) for i in batch) for batch in batches]
    owner = deal_batches(costs, accelerator.num_processes)
    mine = [k for k in range(len(batches)) if owner[k] == accelerator.process_index]
    todo = [k for k in mine if not (parts_dir / f"batch_{k:06d}.json").is_file()]
    if len(todo) < len(mine):
        accelerator.print(f"resuming: {len(mine) - len(todo)} of {len(mine)} batches already done")
    # the engine gets several batches per call (prompts_per_call), so continuous batching keeps its rows full; the
    # rows do not depend on the grouping
    per_call = max(1, cfg.prompts_per_call // cfg.batch_size)
    groups = [todo[s: s + per_call] for s in range(0, len(todo), per_call)]
    # the bar counts prompts (user turns asked of the target) as they are answered, not engine calls; closed before
    # an error's line is printed
    start, tokens = time.perf_counter(), 0
    with tqdm(total=sum(prompts_of(source.rows[i], cfg) for k in todo for i in batches[k]), unit="prompt",
              desc=f"self-distill [{accelerator.process_index}]", disable=not accelerator.is_local_main_process) as bar:
        for group in groups:
            results = distill_batches(engine, tokenizer, {k: [source.rows[i] for i in batches[k]] for k in group},
                                      cfg, eos_ids, progress=bar.update)
            for k, (records, skipped, generated) in results.items():
                for record in records:
                    record["source_index"] = batches[k][record.pop("batch_position")]
                _write_json_atomic(parts_dir / f"batch_{k:06d}.json", {"records": records, "skipped": dict(skipped),
                                                                      "generated_tokens": generated})
                tokens += generated
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.1f}")
    elapsed = time.perf_counter() - start
    accelerator.wait_for_everyone()

    # every process reads the parts, so all refuse an empty result together (no process left waiting at a barrier)
    records, skipped, generated = [], collections.Counter(source.skipped), 0
    for k in range(len(batches)):
        part = json.loads((parts_dir / f"batch_{k:06d}.json").read_text())
        records += part["records"]
        skipped.update(part["skipped"])
        generated += part["generated_tokens"]
    if not records:
        raise DataError(f"no conversation came out of {len(source.rows)} prompts (skipped: {dict(skipped) or 'none'}): "
                        "nothing to train on, no dataset written. Raise max_new_tokens / max_length or pass other "
                        "--prompts, with a new --output_dir")
    if accelerator.is_main_process:
        records.sort(key=lambda r: r["source_index"])
        dataset = datasets.Dataset.from_list(records)
        tmp = output_dir / ".dataset.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        dataset.save_to_disk(str(tmp))
        honour_umask(tmp)
        shutil.rmtree(output_dir / "dataset", ignore_errors=True)  # an earlier dataset of this run (the claim checked)
        os.replace(tmp, output_dir / "dataset")
        meta = {
            "target": info.to_dict(),
            "generation": {k: getattr(cfg, k) for k in RESULT_FIELDS if k not in ("target", "backend")},
            "engine": engine.describe(),
            "rows": len(records),
            "prompts_read": len(source.rows) + sum(source.skipped.values()),
            "generated_tokens": generated,
            "supervised_tokens": sum(sum(r["loss_mask"]) for r in records),
            "skipped": dict(sorted(skipped.items())),
            "this_run": {"seconds": round(elapsed, 1), "processes": accelerator.num_processes,
                         "generated_tokens_per_s_main_process": round(tokens / elapsed, 1) if elapsed else None},
        }
        _write_json_atomic(output_dir / "meta.json", meta)
        print(f"wrote {len(records)} conversations ({generated} generated tokens; this run "
              f"{meta['this_run']['generated_tokens_per_s_main_process']} tok/s, {cfg.backend}) to "
              f"{output_dir}/dataset; skipped: {dict(skipped) or 'none'}")
    accelerator.wait_for_everyone()
    return output_dir


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(SelfDistillConfig, argv)
    num_local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if cfg.backend == "vllm" and num_local > 1 and torch.cuda.is_available():
        # several processes on this node: each process's vLLM engine on GPUs of its own, set before the engine starts
        os.environ["CUDA_VISIBLE_DEVICES"] = engine_gpus(int(os.environ.get("LOCAL_RANK", 0)), cfg.tensor_parallel_size)
    run_selfdistill(cfg)


if __name__ == "__main__":
    from headstart.train.cli import run_main  # bad flags, files, targets, servers: one line, exit 2

    run_main(main)
