"""Train Medusa heads on the target's own generations (Medusa-1: frozen target; Medusa-2: LoRA-tuned target).

CPU (2 cores, the embedded SmolLM2-135M; self-distils 256 chitchat conversations first if data_dir is empty):
    python train/medusa.py --config recipes/smollm2-135m/medusa.yaml --output_dir runs/medusa-smollm2
Single GPU:
    accelerate launch --num_processes 1 train/medusa.py --config recipes/llama-3.1-8b-instruct/medusa.yaml \
        --output_dir runs/medusa-llama8b
Multi-GPU (DDP; or recipes/accelerate/deepspeed-zero2.yaml, fsdp.yaml):
    accelerate launch --config_file recipes/accelerate/multi-gpu.yaml train/medusa.py \
        --config recipes/llama-3.1-8b-instruct/medusa.yaml --output_dir runs/medusa-llama8b
Preempted? Run the same command with --resume: it continues from the newest checkpoint in DIR/checkpoints.

Head k (1-based) reads the target's last hidden state (after the final norm, HF `hidden_states[-1]`) at position
t and learns token t+k+1, weighted 0.8^k. Only positions whose label token the target wrote (loss_mask = 1) are
supervised: never user turns, and a real end-of-turn token stays supervised even though pad = eos.
The loss is a mean over supervised tokens of the whole global batch (all processes, all accumulation steps), so
N processes x batch b give the same loss and gradients as 1 process x batch N*b.
Medusa-2 adds LoRA to the target and the loss KL(original target || tuned target) + heads_weight * heads loss,
after `medusa2_warmup_steps` heads-only steps; the adapter is saved in DIR/heads/adapter.

Output: DIR/heads (config.json, model.safetensors, README.md, metrics.json [, adapter/]), DIR/checkpoints,
DIR/train_log.jsonl (one line per optimizer step). Load the heads with `heads.medusa.load_medusa(DIR/heads)`.
metrics.json (held-out rows = the last `eval_rows` rows of the dataset): `top1`, `top5` [K]; `rank_accuracy` [K][10]
(P(the ground-truth token is exactly head k's rank-r prediction), for choosing a sparse tree); `eval_positions` [K];
`target_top1` (the target's own next-token accuracy there, ~1 on greedy data); `greedy_agreement` (Medusa-2: share of
identical greedy next tokens, tuned vs original target); plus method, target, steps, rows, timings and the config.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, set_seed
from torch import nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

from heads.eagle import most_frequent_tokens
from heads.directory import ADAPTER_DIR, push_heads_dir
from heads.load import load_heads
from heads.medusa import MedusaConfig, MedusaHeads
from heads.target import load_target
from train.config import ConfigError, TrainRunConfig, check_run_config, parse_config
from train.data import (DataError, check_columns, collate, pad_features, shard_epoch, shifted_labels, split_eval,
                        supervised_token_counts, truncate_rows)


@dataclass
class MedusaTrainConfig(TrainRunConfig):
    output_dir: str = "runs/medusa"
    learning_rate: float = 1e-3  # heads (residual blocks; also their own lm_heads unless lm_head_learning_rate is set)
    # heads
    method: str = "medusa"  # medusa (Medusa-1, frozen target) | medusa2 (LoRA on the target, trained jointly)
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head
    share_lm_head: bool = False  # True: heads use the target's frozen lm_head (fewer weights, lower accuracy)
    draft_vocab_size: int = 0  # > 0: heads score only this many most frequent target-written tokens (faster)
    head_decay: float = 0.8  # head k's loss weight is head_decay ** k
    init_heads_from: Optional[str] = None  # start from trained heads (e.g. Medusa-1 heads before Medusa-2)
    lm_head_learning_rate: Optional[float] = None  # the heads' own lm_heads (initialised from the target's)
    # Medusa-2 (feature_cache needs Medusa-1: a frozen target)
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    target_learning_rate: float = 1e-4  # the LoRA weights
    medusa2_warmup_steps: int = 0  # heads-only steps before the target is tuned
    medusa2_heads_weight: float = 0.2  # lambda: loss = KL(original || tuned) + lambda * heads loss


def check_config(cfg: MedusaTrainConfig) -> None:
    if cfg.method not in ("medusa", "medusa2"):
        raise ConfigError(f"method must be 'medusa' or 'medusa2', got {cfg.method!r}")
    check_run_config(cfg)
    if cfg.num_heads < 1:
        raise ConfigError(f"num_heads must be >= 1, got {cfg.num_heads}")
    if cfg.draft_vocab_size < 0:
        raise ConfigError(f"draft_vocab_size must be >= 0 (0 = the full vocabulary), got {cfg.draft_vocab_size}")
    if cfg.feature_cache and cfg.method == "medusa2":
        raise ConfigError("feature_cache needs a frozen target: use it with method medusa only")


# ----------------------------------------------------------------------------------------------------
# data


def ensure_data(cfg: MedusaTrainConfig):
    """(dataset, meta) from cfg.data_dir; self-distils first (on all processes) when there is none yet."""
    from train.selfdistill import SelfDistillConfig, load_selfdistilled, run_selfdistill

    data_dir = Path(cfg.data_dir)
    if not (data_dir / "dataset").is_dir() or not (data_dir / "meta.json").is_file():
        argv = ["--config", cfg.selfdistill_recipe] if cfg.selfdistill_recipe else []
        argv += ["--target", cfg.target, "--output_dir", str(data_dir)]
        if cfg.num_prompts is not None:
            argv += ["--num_prompts", str(cfg.num_prompts)]
        print(f"{data_dir} holds no self-distilled dataset: running train/selfdistill.py {' '.join(argv)}")
        run_selfdistill(parse_config(SelfDistillConfig, argv))
    try:
        return load_selfdistilled(data_dir)
    except Exception as err:  # datasets cannot even open a 0-row dataset saved in 0 shards
        raise DataError(f"could not read the self-distilled dataset in {data_dir}/dataset: it is empty or corrupt "
                        f"({err.__class__.__name__}: {err})") from err


def prepare_rows(dataset, meta: dict, target_info, cfg: MedusaTrainConfig):
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
    train, dropped_train = truncate_rows(columns.select(train_idx), cfg.max_length, min_supervised=1)
    held, dropped_eval = truncate_rows(columns.select(eval_idx), cfg.max_length, min_supervised=1)
    if not train:
        raise DataError(f"{cfg.data_dir}: no training row has a target-written token within max_length={cfg.max_length}")
    stats = {"rows": len(dataset), "train_rows": len(train), "eval_rows": len(held),
             "dropped_rows_no_supervised_tokens": dropped_train + dropped_eval}
    return train, held, stats


# ----------------------------------------------------------------------------------------------------
# model pieces


def final_hidden(target, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The target's last hidden state after the final norm (= HF `hidden_states[-1]`), without the lm_head: [B, T, h]."""
    return target.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state


class Medusa2Model(nn.Module):
    """LoRA-wrapped target + heads as one module, so DDP/FSDP/DeepSpeed see every trained weight."""

    def __init__(self, target, heads: MedusaHeads):
        super().__init__()
        self.target = target
        self.heads = heads

    def forward(self, input_ids, attention_mask, select, lm_head_weight=None, tune_target=True):
        """-> target logits [N0, V] at `select[0]` positions, head logits [K, N, V] at `select[1]` positions."""
        out = self.target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
        hidden = out.hidden_states[-1]  # [B, T, h], after the final norm
        if not tune_target:
            hidden = hidden.detach()
        head_logits = self.heads(hidden[select[1]][None], lm_head_weight)[:, 0]
        return out.logits[select[0]], head_logits


def head_targets(batch: dict, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions any head supervises, and per-head labels/validity there.

    -> union [B, T] bool, labels [K, N], valid [K, N] (N = union.sum()); head k (0-based) uses offset k + 2.
    """
    per_head = [shifted_labels(batch["input_ids"], batch["loss_mask"], k + 2) for k in range(num_heads)]
    union = torch.stack([v for _, v in per_head]).any(0)
    labels = torch.stack([lab[union] for lab, _ in per_head])
    valid = torch.stack([v[union] for _, v in per_head])
    return union, labels, valid


def weighted_head_ce(head_logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, denom: torch.Tensor,
                     decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_k decay^(k+1) * sum_valid CE_k / denom_k.  head_logits [K, N, V] -> (loss, per-head summed CE [K])."""
    ce_sums = []
    for k in range(head_logits.shape[0]):
        ce = F.cross_entropy(head_logits[k].float(), labels[k], reduction="none")  # [N]
        ce_sums.append((ce * valid[k]).sum())
    ce_sums = torch.stack(ce_sums)
    weights = torch.tensor([decay ** (k + 1) for k in range(len(ce_sums))], device=ce_sums.device)
    return (weights * ce_sums / denom.clamp(min=1)).sum(), ce_sums.detach()


def kl_original_tuned(orig_logits: torch.Tensor, tuned_logits: torch.Tensor) -> torch.Tensor:
    """Summed KL(p_orig || p_tuned) over positions: [N, V], [N, V] -> scalar."""
    logp_orig = F.log_softmax(orig_logits.float(), -1)
    logp_tuned = F.log_softmax(tuned_logits.float(), -1)
    return (logp_orig.exp() * (logp_orig - logp_tuned)).sum()


# ----------------------------------------------------------------------------------------------------
# evaluation


@torch.no_grad()
def evaluate(target, heads: MedusaHeads, rows: list[dict], cfg: MedusaTrainConfig, accelerator: Accelerator,
             pad_id: int, original=None) -> dict:
    """Per-head rank histogram of the ground-truth token on held-out rows (sharded over processes, then summed).

    `original`: a context manager factory giving the untuned target (Medusa-2) for greedy agreement.
    """
    K, R = cfg.num_heads, 10
    rank_counts = torch.zeros(K, R + 1, device=accelerator.device)  # last column: rank >= 10
    target_counts = torch.zeros(3, device=accelerator.device)  # target top-1 hits, positions, greedy agreements
    lm_head_weight = target.get_output_embeddings().weight
    mine = rows[accelerator.process_index :: accelerator.num_processes]
    for start in range(0, len(mine), cfg.per_device_batch_size):
        batch = {k: v.to(accelerator.device) for k, v in collate(mine[start : start + cfg.per_device_batch_size], pad_id).items()}
        hidden = final_hidden(target, batch["input_ids"], batch["attention_mask"])
        union, labels, valid = head_targets(batch, K)
        labels, in_vocab = heads.to_draft_labels(labels)
        logits = heads(hidden[union][None].to(next(heads.parameters()).dtype), lm_head_weight)[:, 0].float()  # [K, N, V]
        truth = logits.gather(-1, labels[..., None])  # [K, N, 1]
        rank = (logits > truth).sum(-1).clamp(max=R).masked_fill(~in_vocab, R)  # [K, N]; a token the heads cannot draft: a miss
        for k in range(K):
            rank_counts[k] += torch.bincount(rank[k][valid[k]], minlength=R + 1).float()
        # the target's own next-token accuracy on the same data (near 1 for greedy self-distilled rows)
        labels0, valid0 = shifted_labels(batch["input_ids"], batch["loss_mask"], 1)
        pred = (hidden[valid0] @ lm_head_weight.t()).argmax(-1)
        target_counts[0] += (pred == labels0[valid0]).sum()
        target_counts[1] += valid0.sum()
        if original is not None:
            with original():
                orig_pred = (final_hidden(target, batch["input_ids"], batch["attention_mask"])[valid0] @ lm_head_weight.t()).argmax(-1)
            target_counts[2] += (orig_pred == pred).sum()
    rank_counts = accelerator.reduce(rank_counts, "sum")
    target_counts = accelerator.reduce(target_counts, "sum")
    totals = rank_counts.sum(-1).clamp(min=1)
    rank_acc = rank_counts[:, :R] / totals[:, None]  # [K, 10]: P(ground truth is exactly the rank-r prediction)
    out = {
        "top1": [round(float(a), 4) for a in rank_acc[:, 0]],
        "top5": [round(float(a), 4) for a in rank_acc[:, :5].sum(-1)],
        "rank_accuracy": [[round(float(a), 5) for a in row] for row in rank_acc],
        "eval_positions": [int(t) for t in rank_counts.sum(-1)],
        "target_top1": round(float(target_counts[0] / target_counts[1].clamp(min=1)), 4),
    }
    if original is not None:
        out["greedy_agreement"] = round(float(target_counts[2] / target_counts[1].clamp(min=1)), 4)
    return out


# ----------------------------------------------------------------------------------------------------
# output


def model_card(cfg: MedusaTrainConfig, info, stats: dict, metrics: dict) -> str:
    method = "Medusa-2 (LoRA-tuned target, adapter in `adapter/`)" if cfg.method == "medusa2" else "Medusa-1 (frozen target)"
    rows = "\n".join(f"| {k + 1} | {t1:.3f} | {t5:.3f} |" for k, (t1, t5) in enumerate(zip(metrics["top1"], metrics["top5"])))
    extra = f"\nGreedy agreement, tuned vs original target: {metrics['greedy_agreement']:.3f}\n" if "greedy_agreement" in metrics else ""
    return f"""---
library_name: headstart
tags: [medusa, speculative-decoding]
---
# Medusa heads for `{info.name}`

- Method: {method}, {cfg.num_heads} heads x {cfg.num_layers} residual block(s), {"shared" if cfg.share_lm_head else "own"} lm_head{f", draft vocabulary of {cfg.draft_vocab_size} tokens (coverage {stats['draft_vocab_coverage_heldout']:.3f} of the held-out tokens)" if cfg.draft_vocab_size else ""}
- Target: `{info.name}` ({info.model_type}, hidden {info.hidden_size}, vocab {info.vocab_size}, fingerprint `{info.fingerprint}`)
- Data: self-distilled conversations from `{cfg.data_dir}`: {stats['train_rows']} training rows, {stats['eval_rows']} held out (the last rows), max_length {cfg.max_length}
- Training: {metrics['steps']} optimizer steps, global batch {metrics['global_batch']} rows, lr {cfg.learning_rate}, cosine with {cfg.warmup_ratio:.0%} warmup

Held-out accuracy (head k predicts the token k+1 positions after the target's next token):

| head | top-1 | top-5 |
|---|---|---|
{rows}

Target's own next-token top-1 on the same positions: {metrics['target_top1']:.3f}
{extra}
```python
from heads.medusa import load_medusa
heads, model, tokenizer, info = load_medusa("THIS_DIR_OR_REPO")
```
"""


def save_heads(heads_dir: Path, heads: MedusaHeads, lora_target, cfg, info, stats: dict, metrics: dict) -> None:
    heads_dir.mkdir(parents=True, exist_ok=True)
    heads.save_pretrained(heads_dir)
    if lora_target is not None:
        lora_target.save_pretrained(heads_dir / ADAPTER_DIR)
    (heads_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    (heads_dir / "README.md").write_text(model_card(cfg, info, stats, metrics))


# ----------------------------------------------------------------------------------------------------
# checkpoints


def latest_checkpoint(output_dir: Path) -> Path | None:
    done = [p for p in (output_dir / "checkpoints").glob("step-*") if (p / "trainer_state.json").is_file()]
    return max(done, key=lambda p: int(p.name.split("-")[1]), default=None)


def save_checkpoint(accelerator: Accelerator, output_dir: Path, step: int, cfg: MedusaTrainConfig) -> None:
    ckpt = output_dir / "checkpoints" / f"step-{step}"
    accelerator.save_state(str(ckpt))
    if accelerator.is_main_process:  # written last: marks the checkpoint complete
        (ckpt / "trainer_state.json").write_text(json.dumps({"step": step, "config": asdict(cfg)}, indent=2))
        old = sorted((output_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
        for path in old[: max(0, len(old) - cfg.keep_checkpoints)]:
            shutil.rmtree(path, ignore_errors=True)
    accelerator.wait_for_everyone()


def setup_wandb_mode() -> None:
    """wandb offline when there is no network (runs sync later with `wandb sync`)."""
    if "WANDB_MODE" in os.environ:
        return
    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    if not offline:
        try:
            socket.create_connection(("api.wandb.ai", 443), timeout=3).close()
        except OSError:
            offline = True
    if offline:
        os.environ["WANDB_MODE"] = "offline"


# ----------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(MedusaTrainConfig, argv)
    check_config(cfg)
    output_dir = Path(cfg.output_dir)
    medusa2 = cfg.method == "medusa2"

    # 1. data: self-distil first if data_dir is empty (this starts accelerate's state, so it comes first)
    dataset, meta = ensure_data(cfg)
    cuda_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if cfg.report_to == "wandb":
        setup_wandb_mode()
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),  # accelerate's MULTI_CPU (gloo) needs cpu=True; otherwise each process runs alone
        mixed_precision="bf16" if cuda_bf16 else "no",
        log_with=None if cfg.report_to == "none" else cfg.report_to,
        project_dir=str(output_dir),
        # Medusa-2 warmup trains heads only: the LoRA weights get no gradient then
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=medusa2)],
    )
    set_seed(cfg.seed)
    log = accelerator.print
    output_dir.mkdir(parents=True, exist_ok=True)

    # 2. target (frozen; Medusa-2 wraps it with LoRA)
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if cuda_bf16 else "float32")
    target, tokenizer, info = load_target(cfg.target, dtype, accelerator.device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    train_rows, eval_rows, stats = prepare_rows(dataset, meta, info, cfg)
    log(f"target {info.name} ({info.fingerprint}); {stats}")

    # 3. heads, initialised from the target's lm_head
    heads = MedusaHeads(MedusaConfig(hidden_size=info.hidden_size, vocab_size=info.vocab_size, num_heads=cfg.num_heads,
                                     num_layers=cfg.num_layers, share_lm_head=cfg.share_lm_head, target=info.to_dict(),
                                     method=cfg.method, adapter=medusa2, draft_vocab_size=cfg.draft_vocab_size))
    if cfg.draft_vocab_size:
        counts = supervised_token_counts(train_rows, info.vocab_size)
        heads.set_draft_vocab(most_frequent_tokens(counts, cfg.draft_vocab_size))
        held = supervised_token_counts(eval_rows, info.vocab_size)
        covered = int(counts[heads.token_map].sum()) / max(int(counts.sum()), 1)
        covered_held = int(held[heads.token_map].sum()) / max(int(held.sum()), 1)
        stats["draft_vocab_coverage"] = round(covered, 4)
        stats["draft_vocab_coverage_heldout"] = round(covered_held, 4)
        log(f"draft vocabulary: {cfg.draft_vocab_size} of {info.vocab_size} target tokens cover {covered:.4f} of the "
            f"target-written training tokens, {covered_held:.4f} of the held-out ones")
    lm_head_weight = target.get_output_embeddings().weight  # [V, h], frozen
    heads.init_lm_heads_from(lm_head_weight)
    if cfg.init_heads_from:
        start = load_heads(cfg.init_heads_from, info)
        shape = ("num_heads", "num_layers", "share_lm_head", "draft_vocab_size")
        if any(getattr(start.config, k) != getattr(cfg, k) for k in shape):
            raise ConfigError(f"init_heads_from {cfg.init_heads_from}: its {'/'.join(shape)} "
                              f"{'/'.join(str(getattr(start.config, k)) for k in shape)} differ from this config's")
        heads.load_state_dict(start.state_dict())
    heads.to(accelerator.device)
    if medusa2:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=[m.strip() for m in cfg.lora_target_modules.split(",") if m.strip()])
        target = get_peft_model(target, lora)
        target.train()
        model = Medusa2Model(target, heads)
    else:
        model = heads
    lm_head_lr = cfg.lm_head_learning_rate if cfg.lm_head_learning_rate is not None else cfg.learning_rate
    groups = [{"params": list(heads.blocks.parameters()), "lr": cfg.learning_rate}]
    if heads.lm_heads is not None:
        groups.append({"params": list(heads.lm_heads.parameters()), "lr": lm_head_lr})
    if medusa2:
        groups.append({"params": [p for p in target.parameters() if p.requires_grad], "lr": cfg.target_learning_rate})

    # 4. schedule: fixed global batches; N processes x batch b == 1 process x batch N*b
    global_batch = cfg.per_device_batch_size * accelerator.num_processes
    accum = cfg.gradient_accumulation_steps
    steps_per_epoch = (len(train_rows) // global_batch) // accum
    if steps_per_epoch == 0:
        raise DataError(f"{len(train_rows)} training rows are fewer than one optimizer step needs "
                        f"({global_batch} rows per batch x {accum} accumulation steps)")
    total_steps = cfg.max_steps if cfg.max_steps > 0 else cfg.num_epochs * steps_per_epoch
    fused = accelerator.device.type in ("cpu", "cuda")  # fused AdamW: ~6x faster steps on CPU for 100M+ head weights
    optimizer = torch.optim.AdamW(groups, weight_decay=cfg.weight_decay, fused=fused)
    scheduler = get_cosine_schedule_with_warmup(optimizer, math.ceil(cfg.warmup_ratio * total_steps), total_steps)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)  # stepped by us once per optimizer step, saved with the state

    def epoch_loader(epoch: int) -> DataLoader:
        order = torch.randperm(len(train_rows), generator=torch.Generator().manual_seed(cfg.seed + epoch)).tolist()
        mine = shard_epoch(order, cfg.per_device_batch_size, accelerator.num_processes, accelerator.process_index)
        return DataLoader(mine, batch_size=cfg.per_device_batch_size, shuffle=False,
                          collate_fn=lambda idx: {**collate([train_rows[i] for i in idx], pad_id), "rows": torch.tensor(idx)})

    # 5. resume
    step = 0
    if cfg.resume:
        ckpt = latest_checkpoint(output_dir)
        if ckpt is None:
            log(f"--resume: no checkpoint in {output_dir}/checkpoints, starting from step 0")
        else:
            accelerator.load_state(str(ckpt))  # weights, optimizer, scheduler, RNG states
            step = json.loads((ckpt / "trainer_state.json").read_text())["step"]
            log(f"resumed from {ckpt} (step {step})")
    if cfg.report_to != "none":
        accelerator.init_trackers("headstart-medusa", config={k: (v if v is not None else "") for k, v in asdict(cfg).items()},
                                  init_kwargs={"wandb": {"dir": str(output_dir)}} if cfg.report_to == "wandb" else {})

    # 6. train
    cache: dict[int, torch.Tensor] = {}  # row index -> [T_i, h] target hidden states (feature_cache)

    def features(batch: dict) -> torch.Tensor:
        """Medusa-1 features [B, T, h] from the frozen target, computed or read from the per-row cache."""
        if not cfg.feature_cache:
            return final_hidden(target, batch["input_ids"], batch["attention_mask"])
        out = []
        for b, row in enumerate(batch["rows"].tolist()):
            if row not in cache:  # one unpadded row at a time: the same values whichever batch it comes in
                n = int(batch["attention_mask"][b].sum())
                cache[row] = final_hidden(target, batch["input_ids"][b : b + 1, :n], batch["attention_mask"][b : b + 1, :n])[0]
            out.append(cache[row])
        return pad_features(out, batch["input_ids"].shape[1])

    log_file = open(output_dir / "train_log.jsonl", "a") if accelerator.is_main_process else None
    bar = tqdm(total=total_steps, initial=step, desc=cfg.method, disable=not accelerator.is_main_process)
    start_time, tokens_seen, start_step = time.perf_counter(), 0, step
    stop_at = min(total_steps, cfg.stop_after_steps) if cfg.stop_after_steps > 0 else total_steps
    while step < stop_at:
        epoch = step // steps_per_epoch
        loader = accelerator.skip_first_batches(epoch_loader(epoch), (step % steps_per_epoch) * accum)
        batches = iter(loader)
        for _ in range(step % steps_per_epoch, steps_per_epoch):
            micro = [{k: v.to(accelerator.device) for k, v in next(batches).items()} for _ in range(accum)]
            tune_target = medusa2 and step >= cfg.medusa2_warmup_steps
            # denominators: supervised tokens per head (+ the target's own term) over the whole global step
            counts = torch.zeros(cfg.num_heads + 1, device=accelerator.device)
            for batch in micro:
                for k in range(cfg.num_heads + 1):
                    counts[k] += shifted_labels(batch["input_ids"], batch["loss_mask"], k + 1)[1].sum()
            counts = accelerator.reduce(counts, "sum")
            # DDP averages gradients over processes: scale by the process count so the result is the global mean
            scale = accelerator.num_processes
            ce_total = torch.zeros(cfg.num_heads, device=accelerator.device)
            kl_total = torch.zeros((), device=accelerator.device)
            for i, batch in enumerate(micro):
                union, labels, valid = head_targets(batch, cfg.num_heads)
                labels, in_vocab = heads.to_draft_labels(labels)  # out-of-vocabulary tokens: no loss (denominators keep them)
                valid = valid & in_vocab
                last = i == accum - 1
                with accelerator.no_sync(model) if not last else contextlib.nullcontext():
                    if medusa2:
                        valid0 = shifted_labels(batch["input_ids"], batch["loss_mask"], 1)[1]
                        tuned0, head_logits = model(batch["input_ids"], batch["attention_mask"], (valid0, union),
                                                    lm_head_weight if cfg.share_lm_head else None, tune_target)
                        loss, ce_sums = weighted_head_ce(head_logits, labels, valid, counts[1:], cfg.head_decay)
                        if tune_target:
                            with torch.no_grad(), accelerator.unwrap_model(model).target.disable_adapter():
                                orig0 = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                               use_cache=False).logits[valid0]
                            kl = kl_original_tuned(orig0, tuned0) / counts[0].clamp(min=1)
                            loss = kl + cfg.medusa2_heads_weight * loss
                            kl_total += kl.detach()
                    else:
                        with torch.no_grad():
                            hidden = features(batch)
                        head_logits = model(hidden[union][None], lm_head_weight if cfg.share_lm_head else None)[:, 0]
                        loss, ce_sums = weighted_head_ce(head_logits, labels, valid, counts[1:], cfg.head_decay)
                    accelerator.backward(loss * scale)
                ce_total += ce_sums
                tokens_seen += int(batch["attention_mask"].sum())
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            # logging: the exact global loss (per-head mean CE over all supervised tokens of the step)
            head_ce = accelerator.reduce(ce_total, "sum") / counts[1:].clamp(min=1)
            weights = torch.tensor([cfg.head_decay ** (k + 1) for k in range(cfg.num_heads)], device=head_ce.device)
            heads_loss = float((weights * head_ce).sum())
            kl_value = float(accelerator.reduce(kl_total, "sum")) if tune_target else 0.0
            record = {"step": step, "loss": heads_loss if not tune_target else kl_value + cfg.medusa2_heads_weight * heads_loss,
                      "heads_loss": heads_loss, "head_ce": [round(float(c), 6) for c in head_ce],
                      "lr": scheduler.get_last_lr()[0], "seconds": round(time.perf_counter() - start_time, 1), "grad_norm": float(grad_norm) if grad_norm is not None else None}  # None under DeepSpeed
            if medusa2:
                record["kl"] = kl_value
            if log_file:
                log_file.write(json.dumps(record) + "\n")
                log_file.flush()
            tok_s = tokens_seen * accelerator.num_processes / (time.perf_counter() - start_time)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{tok_s:.0f}")
            if cfg.report_to != "none" and (step % cfg.log_every == 0 or step == total_steps):
                accelerator.log({**{k: v for k, v in record.items() if k != "head_ce"},
                                 **{f"head{k + 1}_ce": c for k, c in enumerate(record["head_ce"])}, "tokens_per_s": tok_s},
                                step=step)
            if cfg.checkpoint_every > 0 and step % cfg.checkpoint_every == 0:
                save_checkpoint(accelerator, output_dir, step, cfg)
            if step >= stop_at:
                break
    bar.close()
    if log_file:
        log_file.close()
    train_seconds = time.perf_counter() - start_time
    if step < total_steps:  # stopped early on purpose (stop_after_steps): no heads dir, like a preempted run
        log(f"stopped after step {step} of {total_steps}; continue with --resume")
        accelerator.end_training()
        return {"step": step}

    # 7. held-out accuracy, heads directory, push
    unwrapped = accelerator.unwrap_model(model)
    heads = unwrapped.heads if medusa2 else unwrapped
    heads.eval()
    if medusa2:
        unwrapped.target.eval()
        metrics = evaluate(unwrapped.target, heads, eval_rows, cfg, accelerator, pad_id,
                           original=unwrapped.target.disable_adapter)
    else:
        metrics = evaluate(target, heads, eval_rows, cfg, accelerator, pad_id)
    metrics.update({"method": cfg.method, "target": info.to_dict(), "steps": step, "global_batch": global_batch * accum,
                    "epochs": round(step / steps_per_epoch, 3), **stats, "data_dir": cfg.data_dir,
                    "train_seconds": round(train_seconds, 1),
                    "train_tokens_per_s": round(tokens_seen * accelerator.num_processes / max(train_seconds, 1e-9), 1),
                    "steps_this_run": step - start_step, "config": asdict(cfg)})
    heads_dir = output_dir / "heads"
    if accelerator.is_main_process:
        save_heads(heads_dir, heads, unwrapped.target if medusa2 else None, cfg, info, stats, metrics)
        log(f"heads written to {heads_dir}; held-out top-1 per head {metrics['top1']}, top-5 {metrics['top5']}")
        if cfg.push_to_hub:
            push_heads_dir(heads_dir, cfg.push_to_hub)
    if cfg.report_to != "none":
        accelerator.log({f"eval/head{k + 1}_top1": a for k, a in enumerate(metrics["top1"])}, step=step)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return metrics


if __name__ == "__main__":
    try:
        main()
    except (ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
