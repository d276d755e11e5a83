"""The run train/medusa.py, train/eagle.py and train/dflash.py share: data, accelerator, frozen target, schedule,
resumable epochs, the optimizer-step loop (log, checkpoint, early stop) and the end (metrics, heads directory, push).
A script keeps what is its method's own: its model and parameter groups, one optimizer step's losses, its per-slot
scores for the held-out evaluation (train/evaluate.py) and its model card's text (train/card.py).

    run = start_run(cfg)                                 # data (self-distilled first if missing), target, rows
    trained = train(run, model, param_groups, step_fn)   # step_fn(model, micro, step) -> log fields
    if trained.finished:                                 # else stopped early on purpose (stop_after_steps)
        finish_run(run, trained, evaluate(...), save, model_card, "head")

Each optimizer step takes gradient_accumulation_steps global batches drawn from one seeded permutation per epoch
(headstart.train.data.shard_epoch): N processes x batch b see the batches of 1 process x batch N*b, and a resumed run
(weights, optimizer, RNG; the LR schedule in trainer_state.json), with any number of processes at the same global
batch, sees those of the uninterrupted run. Checkpoints and the heads directory are written by train/checkpoints.py;
under FSDP (train/sharding.py) both hold the gathered tensors.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, DistributedType, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

from headstart.heads.directory import push_heads_dir
from headstart.heads.export import ExportError, export_and_push
from headstart.heads.output_dir import OutputDirError, RunKind, check_output_dir, claim_output_dir
from headstart.heads.target import load_target
from headstart.inference.ngram import NGRAM_FILE, NgramTable
from headstart.train.checkpoints import latest_checkpoint, load_checkpoint, save_checkpoint, write_dir
from headstart.train.config import ConfigError, TrainRunConfig, build_config
from headstart.train.data import DataError, check_columns, collate, shard_epoch, split_eval, truncate_rows
from headstart.train.muon import MuonAdamW
from headstart.train.sharding import count_deepspeed_processes_on_cpu, describe_sharding, enable_fsdp_on_cpu, use_cpu_flag

# ----------------------------------------------------------------------------------------------------
# data, accelerator, frozen target; the log


def ensure_data(cfg: TrainRunConfig):
    """(dataset, meta) from cfg.data_dir; self-distils first (on all processes) when there is none yet."""
    from headstart.train.selfdistill import SelfDistillConfig, load_selfdistilled, run_selfdistill

    data_dir = Path(cfg.data_dir)
    already_there = (data_dir / "dataset").is_dir() and (data_dir / "meta.json").is_file()
    if not already_there:
        overrides = {"target": cfg.target, "output_dir": str(data_dir)}
        if cfg.num_prompts is not None:
            overrides["num_prompts"] = cfg.num_prompts
        distill = build_config(SelfDistillConfig, cfg.selfdistill_recipe, **overrides)
        if distill.backend == "vllm" and int(os.environ.get("LOCAL_WORLD_SIZE", 1)) > 1:
            raise ConfigError("self-distilling with backend vllm under several processes gives each process's engine "
                              "GPUs of its own only from train/selfdistill.py's entry point: run it first, then train "
                              f"on its output_dir ({data_dir})")
        print(f"{data_dir} holds no self-distilled dataset: self-distilling first (train/selfdistill.py, recipe "
              f"{cfg.selfdistill_recipe or 'none'}, {overrides})")
        run_selfdistill(distill)
    try:
        dataset, meta = load_selfdistilled(data_dir)
    except Exception as err:  # datasets cannot even open a 0-row dataset saved in 0 shards
        raise DataError(f"could not read the self-distilled dataset in {data_dir}/dataset: it is empty or corrupt "
                        f"({err.__class__.__name__}: {err})") from err
    if already_there and cfg.num_prompts is not None and len(dataset) != cfg.num_prompts:
        print(f"{data_dir} already holds {len(dataset)} self-distilled rows: num_prompts {cfg.num_prompts} applies only "
              "to an empty data_dir (--train_rows trains on fewer of them)")
    return dataset, meta


def prepare_rows(dataset, meta: dict, target_info, cfg: TrainRunConfig):
    """Check the data against the target; split off held-out rows; truncate. Returns (train rows, eval rows, stats)."""
    if len(dataset) == 0:
        raise DataError(f"{cfg.data_dir}: the self-distilled dataset is empty (0 rows): nothing to train on")
    check_columns(dataset.column_names)
    wrote = (meta or {}).get("target", {})
    if wrote.get("fingerprint") and wrote["fingerprint"] != target_info.fingerprint:
        raise DataError(
            f"{cfg.data_dir} was written by target {wrote.get('name')!r} (fingerprint {wrote['fingerprint']}), not by "
            f"{target_info.name!r} (fingerprint {target_info.fingerprint}): self-distilled data must come from the "
            "target being trained on. Self-distil again with this target or pass the right --target."
        )
    eval_rows = cfg.eval_rows if cfg.eval_rows >= 0 else max(1, round(0.05 * len(dataset)))
    train_idx, eval_idx = split_eval(len(dataset), eval_rows)
    if cfg.train_rows > 0:
        train_idx = train_idx[: cfg.train_rows]
    columns = dataset.select_columns(["input_ids", "loss_mask"])
    train_rows, dropped_train = truncate_rows(columns.select(train_idx), cfg.max_length, min_supervised=1)
    held, dropped_eval = truncate_rows(columns.select(eval_idx), cfg.max_length, min_supervised=1)
    if not train_rows:
        raise DataError(f"{cfg.data_dir}: no training row has a target-written token within max_length={cfg.max_length}")
    stats = {"rows": len(dataset), "train_rows": len(train_rows), "eval_rows": len(held),
             "dropped_rows_no_supervised_tokens": dropped_train + dropped_eval}
    return train_rows, held, stats


@dataclass
class Run:
    cfg: TrainRunConfig
    accelerator: Accelerator
    output_dir: Path
    dtype: str  # the target's
    target: Any  # frozen (Medusa-2 wraps it with LoRA afterwards)
    info: Any  # headstart.heads.target.TargetInfo
    pad_id: int
    train_rows: list[dict]
    eval_rows: list[dict]
    stats: dict
    claim: Any = None  # headstart.heads.output_dir.OutputDirClaim: the output_dir's lock, released when the run ends


def train_run_kind(method: str) -> RunKind:
    """What a trainer writes in its output_dir (heads-<format>: export_and_push's sibling of heads/; wandb and
    headstart-<method>: the trackers' files), and what marks a directory without a manifest as an earlier run's."""
    return RunKind(f"train:{method}",
                   names=("heads", ".heads.tmp", ".heads.old", "checkpoints", "train_log.jsonl", ".train_log.jsonl.tmp",
                          "heads-vllm", "heads-sglang", "heads-speculators", "wandb", f"headstart-{method}"),
                   markers=("train_log.jsonl", "checkpoints/step-*/trainer_state.json", "heads/config.json"))


def start_run(cfg: TrainRunConfig, find_unused_parameters: bool = False) -> Run:
    """Data first (self-distilling starts accelerate's state), then the accelerator, the frozen target and the rows.
    The output_dir is checked first and claimed (locked) once the accelerator says which process is the main one."""
    output_dir = Path(cfg.output_dir)
    if output_dir.resolve() == Path(cfg.data_dir).resolve():
        raise ConfigError(f"output_dir and data_dir are one directory ({output_dir}): a trainer writes into a folder "
                          "of its own; pass another --output_dir")
    check_output_dir(output_dir, train_run_kind(cfg.method))  # refused before any data is self-distilled
    dataset, meta = ensure_data(cfg)
    cuda_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if cuda_bf16 else "float32")
    accelerator = Accelerator(
        cpu=use_cpu_flag(),  # accelerate's MULTI_CPU (gloo) needs cpu=True; otherwise each process runs alone
        mixed_precision="bf16" if cuda_bf16 or dtype in ("bfloat16", "bf16") else "no",  # fp32 heads, bf16 target
        log_with=None if cfg.report_to == "none" else cfg.report_to,
        project_dir=str(output_dir),
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=find_unused_parameters)],
    )
    enable_fsdp_on_cpu(accelerator)  # an FSDP launch on a CPU machine shards for real (train/sharding.py)
    count_deepspeed_processes_on_cpu(accelerator)
    set_seed(cfg.seed)
    claim = claim_output_dir(output_dir, train_run_kind(cfg.method), accelerator.is_main_process)
    target, tokenizer, info = load_target(cfg.target, dtype, accelerator.device)
    target.requires_grad_(False)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    train_rows, eval_rows, stats = prepare_rows(dataset, meta, info, cfg)
    accelerator.print(f"target {info.name} ({info.fingerprint}); {stats}")
    return Run(cfg, accelerator, output_dir, dtype, target, info, pad_id, train_rows, eval_rows, stats, claim)


def wandb_init_kwargs(output_dir: Path) -> dict:
    """wandb.init's arguments: its files under output_dir; offline when there is no network and WANDB_MODE does not
    say otherwise (runs sync later with `wandb sync`)."""
    kwargs = {"dir": str(output_dir)}
    if "WANDB_MODE" in os.environ:
        return kwargs
    try:
        if os.environ.get("HF_HUB_OFFLINE") != "1":
            socket.create_connection(("api.wandb.ai", 443), timeout=3).close()
            return kwargs
    except OSError:
        pass
    return {**kwargs, "mode": "offline"}


def open_log(path: Path, step: int):
    """train_log.jsonl for appending from `step` on: records past it (the steps a resumed run replays, or an earlier
    run's) are dropped first, so each step is logged once."""
    if path.is_file():
        kept = []
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
            if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
                kept.append(line + "\n")
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
    return open(path, "a")


# ----------------------------------------------------------------------------------------------------
# the loop


def accumulate(accelerator: Accelerator, model, items: list, loss_fn: Callable) -> dict[str, torch.Tensor]:
    """Forward and backward every micro-batch of one optimizer step (gradients sync on the last one only); returns
    this process's sums of loss_fn(item) -> (loss, {name: detached sum}). A loss is its share of the global mean (over
    global denominators); DDP averages gradients over processes, so it is scaled by their count."""
    sums: dict[str, torch.Tensor] = {}
    for i, item in enumerate(items):
        with accelerator.no_sync(model) if i < len(items) - 1 else contextlib.nullcontext():
            loss, parts = loss_fn(item)
            accelerator.backward(loss * accelerator.num_processes)
        for name, value in parts.items():
            sums[name] = sums[name] + value if name in sums else value
    return sums


class NonFiniteLoss(DataError):
    """A training step whose loss or gradient norm is NaN or infinite: the run stops there, before the weights take
    it (a step's loss is a global mean, so every process stops at the same step)."""


def check_finite_step(step: int, loss: float, grad_norm, cfg: TrainRunConfig) -> None:
    """NonFiniteLoss (one line: the step, the value, the likely causes and fixes) unless `loss` and `grad_norm`
    (None under DeepSpeed) are finite."""
    norm = None if grad_norm is None else float(grad_norm)
    if math.isfinite(loss) and (norm is None or math.isfinite(norm)):
        return
    what = f"the loss is {loss}" if not math.isfinite(loss) else f"the gradient norm is {norm}"
    source = (f"the feature cache {cfg.feature_cache_dir} (delete it to compute it again)" if cfg.feature_cache_dir
              else f"the target's features or the rows in {cfg.data_dir}")
    raise NonFiniteLoss(f"step {step}: {what}; nothing was written as finished heads. Likely causes: non-finite values "
                        f"in {source}, or a learning rate too high for these weights (lower --learning_rate "
                        f"{cfg.learning_rate:g} or --max_grad_norm {cfg.max_grad_norm:g}); earlier checkpoints are kept")


@dataclass
class Trained:
    model: Any  # as prepared by accelerate (unwrap it for evaluation)
    step: int
    steps_per_epoch: int
    global_batch: int  # rows per optimizer step, all processes and accumulation steps
    seconds: float
    tokens_seen: int  # this process, this run
    start_step: int
    finished: bool  # False: stopped early on purpose (stop_after_steps), the run is ended, no heads directory


def train(run: Run, model, param_groups: list[dict], step_fn: Callable, betas: tuple[float, float] = (0.9, 0.999),
          schedule: str = "cosine") -> Trained:
    """AdamW (Muon for groups marked "muon", train/muon.py) + a cosine (or with schedule "linear" linear to 0)
    schedule with warmup over `param_groups`, resumed from the newest checkpoint with --resume.

    step_fn(model, micro, step) runs one optimizer step's forwards and backwards (see `accumulate`) on `micro` (the
    gradient_accumulation_steps batches of this process, on its device) and returns the step's log fields (global
    means; "loss" among them). Every log_every steps the record goes to the tracker, a list field as name/1, name/2...
    Stops early after stop_after_steps (as if preempted: no heads directory) and then ends the run.
    """
    cfg, accelerator = run.cfg, run.accelerator
    log = accelerator.print
    accum = cfg.gradient_accumulation_steps
    global_batch = cfg.per_device_batch_size * accelerator.num_processes
    steps_per_epoch = (len(run.train_rows) // global_batch) // accum
    if steps_per_epoch == 0:
        raise DataError(f"{len(run.train_rows)} training rows are fewer than one optimizer step needs "
                        f"({global_batch} rows per batch x {accum} accumulation steps)")
    total_steps = cfg.max_steps if cfg.max_steps > 0 else cfg.num_epochs * steps_per_epoch
    if any(group.get("muon") for group in param_groups):  # optimizer muon (train/muon.py): EAGLE-3, Medusa
        if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
            raise ConfigError("optimizer muon orthogonalises whole weight matrices, which FSDP and DeepSpeed shard: "
                              "use optimizer adamw with them, or plain data parallel (accelerate launch --multi_gpu)")
        optimizer = MuonAdamW(param_groups, lr=cfg.learning_rate, betas=betas, weight_decay=cfg.weight_decay,
                              precision=cfg.muon_precision)
        log(f"Muon's Newton-Schulz iteration in {str(optimizer.iteration_dtype).removeprefix('torch.')}")
    else:
        optimizer = torch.optim.AdamW(param_groups, lr=cfg.learning_rate, betas=betas, weight_decay=cfg.weight_decay,
                                      fused=accelerator.device.type in ("cpu", "cuda"))
    make_schedule = get_linear_schedule_with_warmup if schedule == "linear" else get_cosine_schedule_with_warmup
    scheduler = make_schedule(optimizer, math.ceil(cfg.warmup_ratio * total_steps), total_steps)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:  # no dataloader is prepared to tell it
        accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = cfg.per_device_batch_size
    model, optimizer = accelerator.prepare(model, optimizer)  # the scheduler, stepped by us, is saved as JSON
    log(describe_sharding(accelerator, model))

    def epoch_loader(epoch: int) -> DataLoader:
        order = torch.randperm(len(run.train_rows), generator=torch.Generator().manual_seed(cfg.seed + epoch)).tolist()
        mine = shard_epoch(order, cfg.per_device_batch_size, accelerator.num_processes, accelerator.process_index)
        return DataLoader(mine, batch_size=cfg.per_device_batch_size, shuffle=False,
                          collate_fn=lambda idx: {**collate([run.train_rows[i] for i in idx], run.pad_id),
                                                  "rows": torch.tensor(idx)})

    step = 0
    if cfg.resume:
        ckpt = latest_checkpoint(run.output_dir)
        if ckpt is None:
            log(f"--resume: no checkpoint in {run.output_dir}/checkpoints, starting from step 0")
        else:
            # weights (buffers too), optimizer, scheduler, RNG; written by any number of processes
            step = load_checkpoint(accelerator, ckpt, scheduler, model, optimizer, global_batch * accum)
            log(f"resumed from {ckpt} (step {step})")
    if cfg.report_to != "none":
        hparams = {k: ("" if v is None else str(v) if isinstance(v, list) else v) for k, v in asdict(cfg).items()}
        accelerator.init_trackers(f"headstart-{cfg.method}", config=hparams,
                                  init_kwargs={"wandb": wandb_init_kwargs(run.output_dir)} if cfg.report_to == "wandb" else {})

    log_file = open_log(run.output_dir / "train_log.jsonl", step) if accelerator.is_main_process else None
    bar = tqdm(total=total_steps, initial=step, desc=cfg.method, disable=not accelerator.is_main_process)
    start_time, tokens_seen, start_step = time.perf_counter(), 0, step
    stop_at = min(total_steps, cfg.stop_after_steps) if cfg.stop_after_steps > 0 else total_steps
    while step < stop_at:
        epoch = step // steps_per_epoch
        batches = iter(accelerator.skip_first_batches(epoch_loader(epoch), (step % steps_per_epoch) * accum))
        for _ in range(step % steps_per_epoch, steps_per_epoch):
            host = [next(batches) for _ in range(accum)]
            tokens_seen += sum(int(batch["attention_mask"].sum()) for batch in host)  # counted on the host: no sync
            micro = [{k: v if k == "rows" else v.to(accelerator.device) for k, v in b.items()} for b in host]
            try:
                fields = step_fn(model, micro, step)
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                check_finite_step(step + 1, fields["loss"], grad_norm, cfg)  # before the weights take the step
            except Exception:
                bar.close()  # an error's line starts a line of its own, not the progress bar's
                raise
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            record = {"step": step, **fields, "lr": scheduler.get_last_lr()[0],
                      "seconds": round(time.perf_counter() - start_time, 1),
                      "grad_norm": float(grad_norm) if grad_norm is not None else None}  # None under DeepSpeed
            if log_file:
                log_file.write(json.dumps(record) + "\n")
                log_file.flush()
            tok_s = tokens_seen * accelerator.num_processes / (time.perf_counter() - start_time)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{tok_s:.0f}")
            if cfg.report_to != "none" and (step % cfg.log_every == 0 or step == total_steps):
                accelerator.log({**{k: v for k, v in record.items() if not isinstance(v, list)}, "tokens_per_s": tok_s,
                                 **{f"{k}/{i + 1}": x for k, v in record.items() if isinstance(v, list) for i, x in enumerate(v)}},
                                step=step)
            if cfg.checkpoint_every > 0 and step % cfg.checkpoint_every == 0:
                save_checkpoint(accelerator, run.output_dir, step, cfg, scheduler, model, optimizer, global_batch * accum)
            if step >= stop_at:
                break
    bar.close()
    if log_file:
        log_file.close()
    trained = Trained(model, step, steps_per_epoch, global_batch * accum,
                      time.perf_counter() - start_time, tokens_seen, start_step, step >= total_steps)
    if not trained.finished:  # like a preempted run
        log(f"stopped after step {step} of {total_steps}; continue with --resume")
        end_run(accelerator, run.claim)
    return trained


# ----------------------------------------------------------------------------------------------------
# heads directory, push


def finish_run(run: Run, trained: Trained, metrics: dict, save: Callable[[Path], Any], model_card: Callable,
               unit: str) -> dict:
    """Add the run's facts to `metrics`; write the heads directory (save(heads_dir), README.md = model_card(cfg, info,
    stats, metrics), metrics.json), push it if asked, log held-out top-1 per `unit` (head, depth); end the run."""
    cfg, accelerator = run.cfg, run.accelerator
    metrics.update({"method": cfg.method, "target": run.info.to_dict(), "steps": trained.step,
                    "global_batch": trained.global_batch, "epochs": round(trained.step / trained.steps_per_epoch, 3),
                    **run.stats, "data_dir": cfg.data_dir, "train_seconds": round(trained.seconds, 1),
                    "train_tokens_per_s": round(trained.tokens_seen * accelerator.num_processes / max(trained.seconds, 1e-9), 1),
                    "steps_this_run": trained.step - trained.start_step, "config": asdict(cfg)})
    heads_dir = run.output_dir / "heads"
    if accelerator.is_main_process:
        def write(folder: Path) -> None:
            save(folder)
            NgramTable.build(run.train_rows).save(folder / NGRAM_FILE)  # the target's phrases, drafted with lookup
            (folder / "README.md").write_text(model_card(cfg, run.info, run.stats, metrics))
            (folder / "metrics.json").write_text(json.dumps(metrics, indent=2))

        write_dir(heads_dir, write, latest_checkpoint(run.output_dir))
        accelerator.print(f"heads written to {heads_dir}; held-out top-1 per {unit} {metrics['top1']}, top-5 {metrics['top5']}")
        if cfg.push_to_hub:
            push(heads_dir, cfg.push_to_hub, cfg.push_format)
    if cfg.report_to != "none":
        accelerator.log({f"eval/{unit}{k + 1}_top1": a for k, a in enumerate(metrics["top1"])}, step=trained.step)
    accelerator.wait_for_everyone()
    end_run(accelerator, run.claim)
    return metrics


def push(heads_dir: Path, repo_id: str, fmt: str) -> None:
    """Upload the heads directory, or its export for a serving engine; a refusal or failure keeps the local copies."""
    if fmt == "headstart":
        push_heads_dir(heads_dir, repo_id)
        return
    try:
        export_and_push(heads_dir, repo_id, fmt)
    except (ExportError, OutputDirError) as err:
        print(f"not pushed: the {fmt} export was refused ({err}); the heads are kept in {heads_dir}")


def end_run(accelerator: Accelerator, claim=None) -> None:
    """Finish the trackers; a process group ends with its process (run_main). Not accelerator.end_training(): a gloo
    group's destructor (run where the last reference goes, e.g. DDP's reducer freed) joins its worker thread holding
    the GIL, and a worker still freeing a finished collective's tensors waits for the GIL: a process hung at exit."""
    for tracker in accelerator.trackers:
        tracker.finish()
    if claim is not None:
        claim.release()  # the output_dir's lock
