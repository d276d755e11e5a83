"""Train Medusa heads on the target's own generations (Medusa-1: frozen target; Medusa-2: LoRA-tuned target).

CPU (2 cores, the embedded SmolLM2-135M; self-distils the recipe's broad mix of prompts first if data_dir is empty):
    python train/medusa.py --config recipes/smollm2-135m/medusa.yaml --output_dir runs/medusa-smollm2
    python train/medusa.py --config recipes/smollm2-135m/medusa2.yaml --output_dir runs/medusa2-smollm2 \
        --init_heads_from runs/medusa-smollm2/heads                       (Medusa-2 from the Medusa-1 heads)
Single GPU:
    accelerate launch --num_processes 1 train/medusa.py --config recipes/llama-3.1-8b-instruct/medusa.yaml \
        --output_dir runs/medusa-llama8b
Multi-GPU (DDP; or recipes/accelerate/deepspeed-zero2.yaml, fsdp.yaml):
    accelerate launch --config_file recipes/accelerate/multi-gpu.yaml train/medusa.py \
        --config recipes/llama-3.1-8b-instruct/medusa.yaml --output_dir runs/medusa-llama8b
Preempted? Run the same command with --resume: it continues from the newest checkpoint in DIR/checkpoints.
The run itself (data, schedule, resume, logging, checkpoints, heads directory) is train/loop.py's.

Head k (1-based) reads the target's last hidden state (after the final norm, HF `hidden_states[-1]`) at position
t and learns token t+k+1, weighted 0.8^k. Only positions whose label token the target wrote (loss_mask = 1) are
supervised: never user turns, and a real end-of-turn token stays supervised even though pad = eos.
The loss is a mean over supervised tokens of the whole global batch (all processes, all accumulation steps), so
N processes x batch b give the same loss and gradients as 1 process x batch N*b.
Medusa-1's features come online, from memory or from an offline cache on disk (train/features.py; the same cache
an EAGLE-1 run on the same rows writes). Medusa-2 adds LoRA to the target and the loss KL(original target || tuned target) + heads_weight * heads loss,
after `medusa2_warmup_steps` heads-only steps; the adapter is saved in DIR/heads/adapter.

Output: DIR/heads (config.json, model.safetensors, README.md, metrics.json, ngram.safetensors [, adapter/]),
DIR/checkpoints, DIR/train_log.jsonl (one line per optimizer step). Load the heads with
`headstart.heads.load.load_heads_and_target(DIR/heads)` (the target too, the adapter merged) or
`headstart.heads.load.load_heads(DIR/heads, target_info)`.
metrics.json (held-out rows = the last `eval_rows` rows of the dataset): `top1`, `top5` [K]; `rank_accuracy` [K][10]
(P(the ground-truth token is exactly head k's rank-r prediction), for choosing a sparse tree); `eval_positions` [K];
`target_top1` (the target's own next-token accuracy there, near 1 on greedy data); `greedy_agreement` (Medusa-2: share
of identical greedy next tokens, tuned vs original target); plus method, target, steps, rows, timings and the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn

from headstart.heads.directory import ADAPTER_DIR
from headstart.heads.draft_vocab import coverage, most_frequent_tokens
from headstart.heads.load import load_heads
from headstart.heads.medusa import MedusaConfig, MedusaHeads
from headstart.heads.target import load_target
from headstart.train.card import CardText, heads_card
from headstart.train.cli import run_main
from headstart.train.config import ConfigError, TrainRunConfig, check_number, check_run_config, parse_config
from headstart.train.data import shifted_labels, supervised_token_counts
from headstart.train.evaluate import SlotScores, evaluate_slots
from headstart.train.features import final_hidden, open_feature_source
from headstart.train.loop import Run, accumulate, end_run, finish_run, start_run, train
from headstart.train.sharding import plain_model


@dataclass
class MedusaTrainConfig(TrainRunConfig):
    output_dir: str = "runs/medusa"  # where the heads directory, checkpoints and train_log.jsonl go
    learning_rate: float = 1e-3  # heads (residual blocks; also their own lm_heads unless lm_head_learning_rate is set)
    # heads
    method: str = "medusa"  # medusa (Medusa-1, frozen target) | medusa2 (LoRA on the target, trained jointly)
    num_heads: int = 4  # heads: head k drafts the token k+1 positions after the target's next token
    num_layers: int = 1  # residual blocks per head
    share_lm_head: bool = False  # True: heads use the target's frozen lm_head (fewer weights, lower accuracy)
    draft_vocab_size: int = 0  # > 0: heads score only this many most frequent target-written tokens (faster)
    head_decay: float = 0.8  # head k's loss weight is head_decay ** k
    # Medusa-1: the target's own distribution as labels (its logits at the position before the label, restricted to
    # the draft vocabulary): loss = (1 - soft_label_weight) * CE(token) + soft_label_weight * soft-CE(target probs)
    soft_label_weight: float = 0.0  # in [0, 1]: the soft term's weight (Medusa-1; 0 = the token alone)
    # Medusa-1 with soft labels: also supervise positions whose label is not target-written (prompt and user turns),
    # with the soft term alone (the target's distribution is known there; the token is not the target's)
    supervise_prompt: bool = False  # soft labels on prompt and user-turn positions too (needs soft_label_weight > 0)
    init_heads_from: Optional[str] = None  # start from trained heads (e.g. Medusa-1 heads before Medusa-2)
    lm_head_learning_rate: Optional[float] = None  # the heads' own lm_heads (initialised from the target's)
    optimizer: str = "adamw"  # adamw | muon: Muon on the residual blocks' weight matrices, AdamW on the rest (train/muon.py)
    # Medusa-2 (the feature caches need Medusa-1: a frozen target)
    lora_r: int = 16  # Medusa-2: LoRA rank
    lora_alpha: int = 32  # Medusa-2: LoRA scale (alpha / r multiplies the update)
    lora_dropout: float = 0.0  # Medusa-2: LoRA dropout, in [0, 1)
    lora_target_modules: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # Medusa-2: modules LoRA wraps
    target_learning_rate: float = 1e-4  # Medusa-2: the LoRA weights' learning rate
    medusa2_warmup_steps: int = 0  # Medusa-2: heads-only steps before the target is tuned
    medusa2_heads_weight: float = 0.2  # Medusa-2: lambda in loss = KL(original || tuned) + lambda * heads loss


def check_config(cfg: MedusaTrainConfig) -> None:
    check_run_config(cfg, ("medusa", "medusa2"))
    if cfg.optimizer not in ("adamw", "muon"):
        raise ConfigError(f"optimizer must be adamw or muon, got {cfg.optimizer!r}")
    if cfg.num_heads < 1:
        raise ConfigError(f"num_heads must be >= 1, got {cfg.num_heads}")
    if cfg.draft_vocab_size < 0:
        raise ConfigError(f"draft_vocab_size must be >= 0 (0 = the full vocabulary), got {cfg.draft_vocab_size}")
    check_number(cfg, "num_layers", 1)
    check_number(cfg, "head_decay", 0, above=True)
    check_number(cfg, "lora_r", 1)
    check_number(cfg, "lora_alpha", 0, above=True)
    check_number(cfg, "lora_dropout", 0, high=1, below=True)
    check_number(cfg, "medusa2_warmup_steps", 0)
    check_number(cfg, "medusa2_heads_weight", 0)
    if (cfg.feature_cache or cfg.feature_cache_dir) and cfg.method == "medusa2":
        raise ConfigError("feature_cache and feature_cache_dir need a frozen target: use them with method medusa only")
    check_number(cfg, "soft_label_weight", 0, high=1)
    if (cfg.soft_label_weight or cfg.supervise_prompt) and cfg.method == "medusa2":
        raise ConfigError("soft_label_weight and supervise_prompt are Medusa-1 options (method medusa)")
    if cfg.supervise_prompt and cfg.soft_label_weight == 0:
        raise ConfigError("supervise_prompt needs soft labels: set soft_label_weight > 0")


# ----------------------------------------------------------------------------------------------------
# model pieces


class Medusa2Model(nn.Module):
    """LoRA-wrapped target + heads as one module, so DDP/FSDP/DeepSpeed see every trained weight. Every use of the
    target goes through forward (FSDP gathers a unit's weights there); FSDP makes each of the target's decoder layers
    a unit of its own (transformers' `_no_split_modules`), the rest (embeddings, final norm, lm_head, heads) one more."""

    def __init__(self, target, heads: MedusaHeads):
        super().__init__()
        self.target = target
        self.heads = heads
        self._no_split_modules = target._no_split_modules  # read by accelerate's TRANSFORMER_BASED_WRAP

    def forward(self, input_ids, attention_mask, select, tune_target=True):
        """-> target logits [N0, V] at `select[0]` positions, head logits [K, 1, N, V] at `select[1]` positions (None
        when select[1] is None: the target alone, e.g. the original one under `target.disable_adapter()`). No output
        is a view of another tensor: FSDP2 hooks its backward on the outputs."""
        out = self.target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
        if select[1] is None:
            return out.logits[select[0]], None
        hidden = out.hidden_states[-1]  # [B, T, h], after the final norm
        if not tune_target:
            hidden = hidden.detach()
        shared = self.target.get_output_embeddings().weight if self.heads.config.share_lm_head else None  # frozen
        return out.logits[select[0]], self.heads(hidden[select[1]][None], shared)


def head_targets(batch: dict, num_heads: int, supervise_prompt: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions any head supervises, and per-head labels/validity there.

    -> union [B, T] bool, labels [K, N], valid [K, N] (label target-written), soft_valid [K, N] (label position is
    real text: with supervise_prompt, where the soft term applies; else = valid). N = union.sum(); head k (0-based)
    uses offset k + 2.
    """
    per_head = [shifted_labels(batch["input_ids"], batch["loss_mask"], k + 2) for k in range(num_heads)]
    per_head_soft = [shifted_labels(batch["input_ids"], batch["attention_mask"], k + 2)[1] for k in range(num_heads)] \
        if supervise_prompt else [v for _, v in per_head]
    union = torch.stack(per_head_soft).any(0)
    labels = torch.stack([lab[union] for lab, _ in per_head])
    valid = torch.stack([v[union] for _, v in per_head])
    soft_valid = torch.stack([v[union] for v in per_head_soft])
    return union, labels, valid, soft_valid


def target_probs(hidden: torch.Tensor, union: torch.Tensor, lm_head_weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The target's distribution over each head's label: softmax of its logits one position before the label.

    hidden [B, T, h] (final norm), union [B, T], lm_head_weight [V', h] (draft rows) -> probs [K, N, V'] (0 where
    the label position is past the row's end)."""
    B, T, _ = hidden.shape
    rows, cols = union.nonzero(as_tuple=True)  # [N]
    at = torch.stack([(cols + k + 1).clamp(max=T - 1) for k in range(num_heads)])  # [K, N]: head k's label is t+k+2
    needed = torch.zeros(B, T, dtype=torch.bool, device=hidden.device)
    needed[rows.expand_as(at), at] = True  # each position's distribution computed once, shared by the heads
    slot = needed.flatten().cumsum(0).view(B, T) - 1  # position -> its row of `probs`
    probs = torch.softmax(hidden[needed].float() @ lm_head_weight.float().t(), -1)  # [M, V']
    inside = torch.stack([cols + k + 1 < T for k in range(num_heads)])  # [K, N]
    return probs[slot[rows.expand_as(at), at]] * inside[..., None]


def head_weights(decay: float, num_heads: int, device) -> torch.Tensor:
    """[K]: head k's (0-based) loss weight decay ** (k + 1)."""
    return torch.tensor([decay ** (k + 1) for k in range(num_heads)], device=device)


def weighted_head_ce(head_logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, denom: torch.Tensor,
                     decay: float, soft: tuple[torch.Tensor, torch.Tensor, float] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """sum_k decay^(k+1) * sum CE_k / denom_k.  head_logits [K, N, V] -> (loss, per-head summed hard CE [K],
    per-head summed soft CE [K] or None).

    soft = (probs [K, N, V], soft_valid [K, N], w): CE_k = (1 - w) * CE(label) on valid + w * soft-CE(probs) on
    soft_valid. The hard CE sums (on valid) are the logged loss, comparable across runs."""
    ce_sums, loss_sums, soft_sums = [], [], []
    for k in range(head_logits.shape[0]):
        ce = F.cross_entropy(head_logits[k].float(), labels[k], reduction="none")  # [N]
        ce_sums.append((ce * valid[k]).sum())
        if soft is None:
            loss_sums.append(ce_sums[-1])
            continue
        probs, soft_valid, w = soft
        soft_ce = -(probs[k] * F.log_softmax(head_logits[k].float(), -1)).sum(-1)  # [N]
        soft_sums.append((soft_ce * soft_valid[k]).sum())
        loss_sums.append((1 - w) * ce_sums[-1] + w * soft_sums[-1])
    ce_sums, loss_sums = torch.stack(ce_sums), torch.stack(loss_sums)
    return ((head_weights(decay, len(ce_sums), ce_sums.device) * loss_sums / denom.clamp(min=1)).sum(), ce_sums.detach(),
            torch.stack(soft_sums).detach() if soft_sums else None)


def kl_original_tuned(orig_logits: torch.Tensor, tuned_logits: torch.Tensor) -> torch.Tensor:
    """Summed KL(p_orig || p_tuned) over positions: [N, V], [N, V] -> scalar."""
    logp_orig = F.log_softmax(orig_logits.float(), -1)
    logp_tuned = F.log_softmax(tuned_logits.float(), -1)
    return (logp_orig.exp() * (logp_orig - logp_tuned)).sum()


# ----------------------------------------------------------------------------------------------------
# evaluation


def evaluate(target, heads: MedusaHeads, all_rows: list[dict], ids: list[int], cfg: MedusaTrainConfig,
             accelerator: Accelerator, pad_id: int, original=None) -> dict:
    """Per-head ranks of the ground-truth token on the held-out rows all_rows[ids] (train/evaluate.py), and the
    target's own next-token accuracy there. `original`: a context manager factory giving the untuned target
    (Medusa-2) for greedy agreement."""
    K = cfg.num_heads
    lm_head_weight = target.get_output_embeddings().weight

    def score(batch: dict) -> SlotScores:
        hidden = final_hidden(target, batch["input_ids"], batch["attention_mask"])
        union, labels, valid, _ = head_targets(batch, K)
        labels, in_vocab = heads.to_draft_labels(labels)  # a token the heads cannot draft: a miss
        # autocast as in training: under FSDP or DeepSpeed `heads` is a rebuilt fp32 copy without accelerate's autocast
        # wrapper, and a bf16 target's shared lm_head met its fp32 features (found on the first GPU run)
        with accelerator.autocast():
            logits = heads(hidden[union][None].to(next(heads.parameters()).dtype), lm_head_weight)[:, 0].float()  # [K, N, V]
        # the target's own next-token accuracy on the same data (near 1 for greedy self-distilled rows)
        labels0, valid0 = shifted_labels(batch["input_ids"], batch["loss_mask"], 1)
        pred = (hidden[valid0] @ lm_head_weight.t()).argmax(-1)
        ratios = {"target_top1": ((pred == labels0[valid0]).sum(), valid0.sum())}
        if original is not None:
            with original():
                orig_pred = (final_hidden(target, batch["input_ids"], batch["attention_mask"])[valid0] @ lm_head_weight.t()).argmax(-1)
            ratios["greedy_agreement"] = ((orig_pred == pred).sum(), valid0.sum())
        return SlotScores(logits, labels, in_vocab, valid, ratios=ratios)

    names = ("target_top1", "greedy_agreement") if original is not None else ("target_top1",)
    return evaluate_slots(score, all_rows, ids, cfg.per_device_batch_size, accelerator, pad_id, K, ratios=names)


# ----------------------------------------------------------------------------------------------------
# output


def model_card(cfg: MedusaTrainConfig, info, stats: dict, metrics: dict) -> str:
    method = "Medusa-2 (LoRA-tuned target, adapter in `adapter/`)" if cfg.method == "medusa2" else "Medusa-1 (frozen target)"
    vocab = (f", draft vocabulary of {cfg.draft_vocab_size} tokens (coverage {stats['draft_vocab_coverage_heldout']:.3f} "
             "of the held-out tokens)") if cfg.draft_vocab_size else ""
    lines = [f"Target's own next-token top-1 on the same positions: {metrics['target_top1']:.3f}"]
    if "greedy_agreement" in metrics:
        lines.append(f"Greedy agreement, tuned vs original target: {metrics['greedy_agreement']:.3f}")
    return heads_card(cfg, info, stats, metrics, CardText(
        title="Medusa heads", slot="head", lines=lines,
        method=f"{method}, {cfg.num_heads} heads x {cfg.num_layers} residual block(s), "
               f"{'shared' if cfg.share_lm_head else 'own'} lm_head{vocab}",
        table_caption="head k predicts the token k+1 positions after the target's next token"))


# ----------------------------------------------------------------------------------------------------


def with_lora(target, cfg: MedusaTrainConfig):
    """Medusa-2: the target with cfg's LoRA adapter (peft), only the adapter trainable."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=[m.strip() for m in cfg.lora_target_modules.split(",") if m.strip()])
    return get_peft_model(target, lora)


def build_heads(run: Run, cfg: MedusaTrainConfig, lm_head_weight: torch.Tensor) -> MedusaHeads:
    """New heads (lm_heads from the target's, draft vocabulary = the most frequent target-written tokens), or the
    heads of `init_heads_from` (their draft vocabulary kept); the draft vocabulary's coverage goes into run.stats."""
    info = run.info
    heads = MedusaHeads(MedusaConfig(hidden_size=info.hidden_size, vocab_size=info.vocab_size, num_heads=cfg.num_heads,
                                     num_layers=cfg.num_layers, share_lm_head=cfg.share_lm_head, target=info.to_dict(),
                                     method=cfg.method, adapter=cfg.method == "medusa2",
                                     draft_vocab_size=cfg.draft_vocab_size))
    counts = supervised_token_counts(run.train_rows, info.vocab_size) if cfg.draft_vocab_size else None
    if cfg.init_heads_from:
        start = load_heads(cfg.init_heads_from, info)
        shape = ("num_heads", "num_layers", "share_lm_head", "draft_vocab_size")
        if not isinstance(start, MedusaHeads) or any(getattr(start.config, k) != getattr(cfg, k) for k in shape):
            raise ConfigError(f"init_heads_from {cfg.init_heads_from}: its {'/'.join(shape)} "
                              f"{'/'.join(str(getattr(start.config, k, '-')) for k in shape)} differ from this config's "
                              f"{'/'.join(str(getattr(cfg, k)) for k in shape)}")
        heads.load_state_dict(start.state_dict())  # weights and token_map
    else:
        if cfg.draft_vocab_size:
            heads.set_draft_vocab(most_frequent_tokens(counts, cfg.draft_vocab_size))
        heads.init_lm_heads_from(lm_head_weight)
    if cfg.draft_vocab_size:
        held = supervised_token_counts(run.eval_rows, info.vocab_size)
        covered, covered_held = coverage(counts, heads.token_map), coverage(held, heads.token_map)
        run.stats["draft_vocab_coverage"] = round(covered, 4)
        run.stats["draft_vocab_coverage_heldout"] = round(covered_held, 4)
        run.accelerator.print(f"draft vocabulary: {cfg.draft_vocab_size} of {info.vocab_size} target tokens cover {covered:.4f} of the "
                f"target-written training tokens, {covered_held:.4f} of the held-out ones")
    return heads.to(run.accelerator.device)


def block_groups(heads, cfg: MedusaTrainConfig) -> list[dict]:
    """The residual blocks' parameter groups: one AdamW group, or with optimizer muon their weight matrices in a Muon
    group and their biases in an AdamW one."""
    params = list(heads.blocks.named_parameters())
    if cfg.optimizer != "muon":
        return [{"params": [p for _, p in params], "lr": cfg.learning_rate}]
    return [{"params": [p for _, p in params if p.ndim == 2], "lr": cfg.learning_rate, "muon": True},
            {"params": [p for _, p in params if p.ndim != 2], "lr": cfg.learning_rate}]


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(MedusaTrainConfig, argv)
    check_config(cfg)
    medusa2 = cfg.method == "medusa2"
    run = start_run(cfg, find_unused_parameters=medusa2)  # Medusa-2 warmup: the LoRA weights get no gradient
    accelerator, target, K = run.accelerator, run.target, cfg.num_heads
    # Medusa-1's features: the frozen target's final hidden state (feature_layers [L], the cache EAGLE-1 reads too)
    source = open_feature_source(cfg, target, run.info, run.train_rows + run.eval_rows, [run.info.num_hidden_layers],
                                 accelerator)
    if cfg.build_cache_only:
        end_run(accelerator, run.claim)
        return {"feature_cache_dir": cfg.feature_cache_dir, **source.identity}
    lm_head_weight = target.get_output_embeddings().weight  # [V, h], frozen
    shared = lm_head_weight if cfg.share_lm_head else None
    heads = build_heads(run, cfg, lm_head_weight)
    groups = block_groups(heads, cfg)
    if heads.lm_heads is not None:
        lm_head_lr = cfg.lm_head_learning_rate if cfg.lm_head_learning_rate is not None else cfg.learning_rate
        groups.append({"params": list(heads.lm_heads.parameters()), "lr": lm_head_lr})
    if medusa2:
        target = with_lora(target, cfg)
        target.train()
        groups.append({"params": [p for p in target.parameters() if p.requires_grad], "lr": cfg.target_learning_rate})

    def step_fn(model, micro: list[dict], step: int) -> dict:
        tune_target = medusa2 and step >= cfg.medusa2_warmup_steps
        # denominators: supervised tokens per head (+ the target's own term) over the whole global step
        counts = torch.zeros(K + 1, device=accelerator.device)
        # positions per head the loss is averaged over: target-written labels, or with supervise_prompt every label
        supervised = "attention_mask" if cfg.supervise_prompt else "loss_mask"
        loss_counts = torch.zeros(K, device=accelerator.device)
        for batch in micro:
            for k in range(K + 1):
                counts[k] += shifted_labels(batch["input_ids"], batch["loss_mask"], k + 1)[1].sum()
            for k in range(K):
                loss_counts[k] += shifted_labels(batch["input_ids"], batch[supervised], k + 2)[1].sum()
        counts = accelerator.reduce(counts, "sum")
        loss_counts = accelerator.reduce(loss_counts, "sum")

        def micro_loss(batch: dict) -> tuple[torch.Tensor, dict]:
            union, labels, valid, soft_valid = head_targets(batch, K, cfg.supervise_prompt)
            labels, in_vocab = heads.to_draft_labels(labels)  # out-of-vocabulary tokens: no loss (denominators keep them)
            valid = valid & in_vocab
            if not medusa2:
                with torch.no_grad():
                    _, hidden = source.batch(batch)  # [B, T, h]
                    soft = None
                    if cfg.soft_label_weight:
                        rows = lm_head_weight if heads.token_map is None else lm_head_weight[heads.token_map]
                        soft = (target_probs(hidden, union, rows, K), soft_valid, cfg.soft_label_weight)
                loss, ce, soft_ce = weighted_head_ce(model(hidden[union][None], shared)[:, 0], labels, valid,
                                                     loss_counts, cfg.head_decay, soft)
                return loss, {"ce": ce} if soft_ce is None else {"ce": ce, "soft_ce": soft_ce}
            valid0 = shifted_labels(batch["input_ids"], batch["loss_mask"], 1)[1]
            if tune_target:  # the original target's logits: the same module, its adapter off
                with torch.no_grad(), accelerator.unwrap_model(model).target.disable_adapter():
                    orig0, _ = model(batch["input_ids"], batch["attention_mask"], (valid0, None))
            tuned0, head_logits = model(batch["input_ids"], batch["attention_mask"], (valid0, union), tune_target)
            loss, ce, _ = weighted_head_ce(head_logits[:, 0], labels, valid, counts[1:], cfg.head_decay)
            if not tune_target:
                return loss, {"ce": ce}
            kl = kl_original_tuned(orig0, tuned0) / counts[0].clamp(min=1)
            return kl + cfg.medusa2_heads_weight * loss, {"ce": ce, "kl": kl.detach()}

        sums = accumulate(accelerator, model, micro, micro_loss)
        # the exact global loss: per-head mean CE over all supervised tokens of the step
        head_ce = accelerator.reduce(sums["ce"], "sum") / counts[1:].clamp(min=1)
        heads_loss = float((head_weights(cfg.head_decay, K, head_ce.device) * head_ce).sum())
        fields = {"loss": heads_loss, "heads_loss": heads_loss, "head_ce": [round(float(c), 6) for c in head_ce]}
        if "soft_ce" in sums:  # per head, over the positions the soft term covers
            soft_ce = accelerator.reduce(sums["soft_ce"], "sum") / loss_counts.clamp(min=1)
            fields["head_soft_ce"] = [round(float(c), 6) for c in soft_ce]
        if medusa2:
            fields["kl"] = float(accelerator.reduce(sums["kl"], "sum")) if tune_target else 0.0
            if tune_target:
                fields["loss"] = fields["kl"] + cfg.medusa2_heads_weight * heads_loss
        return fields

    trained = train(run, Medusa2Model(target, heads) if medusa2 else heads, groups, step_fn)
    if not trained.finished:
        return {"step": trained.step}

    def rebuild() -> nn.Module:  # under FSDP or DeepSpeed: an unsharded copy (Medusa-2: the target again)
        fresh = MedusaHeads(heads.config).to(accelerator.device)
        if not medusa2:
            return fresh
        base = load_target(cfg.target, run.dtype, accelerator.device)[0].requires_grad_(False)
        return Medusa2Model(with_lora(base, cfg), fresh)

    trained_model = plain_model(accelerator, trained.model, rebuild).eval()
    heads = trained_model.heads if medusa2 else trained_model
    if medusa2:
        target = trained_model.target
    all_rows = run.train_rows + run.eval_rows
    metrics = evaluate(target, heads, all_rows, list(range(len(run.train_rows), len(all_rows))), cfg, accelerator,
                       run.pad_id, original=target.disable_adapter if medusa2 else None)

    def save(heads_dir: Path) -> None:
        heads.save_pretrained(heads_dir)
        if medusa2:
            target.save_pretrained(heads_dir / ADAPTER_DIR)  # the LoRA adapter the heads read the target with

    return finish_run(run, trained, metrics, save, model_card, "head")


if __name__ == "__main__":
    run_main(main)
