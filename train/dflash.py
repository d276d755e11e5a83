"""Train a DFlash draft (block-parallel drafting) on the target's own generations (the target stays frozen).

CPU (2 cores, the embedded SmolLM2-135M; self-distils the recipe's prompts first if data_dir is empty):
    python train/dflash.py --config recipes/smollm2-135m/dflash.yaml --output_dir runs/dflash-smollm2
Single GPU:
    accelerate launch --num_processes 1 train/dflash.py --config recipes/smollm2-135m/dflash.yaml \
        --output_dir runs/dflash-smollm2
Multi-GPU (DDP):
    accelerate launch --config_file recipes/accelerate/multi-gpu.yaml train/dflash.py \
        --config recipes/smollm2-135m/dflash.yaml --output_dir runs/dflash-smollm2
Preempted? Run the same command with --resume: it continues from the newest checkpoint in DIR/checkpoints.
The run itself (data, schedule, resume, logging, checkpoints, heads directory) is train/loop.py's.

What one optimizer step sees (heads/dflash.py has the draft): per row, `anchors_per_row` anchor positions p are drawn
(seeded per seed, step and row: the same in any batch layout, process count or resume point) among the positions whose
token and next token the target wrote (with `supervise_prompt`, among all positions: in the prompt a slot is
supervised while the tokens between it and the anchor are the target's greedy choices). Each anchor's block [x_p, mask
x (block_size - 1)] sits at positions p .. p + block_size - 1 and sees the fused target features of positions < p
(strictly: the anchor's own features are not known at inference) and its own block; all of a row's blocks run in one
draft forward. Slot j predicts x_{p+j}, supervised where the target wrote it (or on the greedy path above), weighted
by `slot_weights` (exp(-(j - 1) / loss_decay), or D-PACE): soft cross-entropy against the target's distribution there
(its logits at p + j - 1), cross-entropy on its argmax in the draft vocabulary, or on the data token (`labels`). The
loss is a weighted mean over the whole global batch, so N processes x batch b give 1 process x batch N*b.

Output: DIR/heads (config.json, model.safetensors, README.md, metrics.json, ngram.safetensors), DIR/checkpoints,
DIR/train_log.jsonl.
metrics.json (held-out rows = the last `eval_rows` rows; up to `eval_anchors` evenly spaced anchors per row): per
block slot j = 1..block_size-1, `top1`, `top5`, `rank_accuracy` [j][10] (P(the data token is exactly the draft's
rank-r guess), for sizing trees), `eval_positions`; `chain_accepted_tokens` (mean drafted tokens a greedy chain of
the whole block gets accepted).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn

from headstart.heads.dflash import DFlashDraft, dflash_config_for, in_window
from headstart.heads.draft_vocab import most_frequent_tokens
from headstart.train.card import CardText, heads_card
from headstart.train.eagle import param_groups
from headstart.train.cli import run_main
from headstart.train.config import ConfigError, TrainRunConfig, check_number, check_run_config, parse_config
from headstart.train.data import row_generator, supervised_token_counts
from headstart.train.evaluate import SlotScores, evaluate_slots
from headstart.train.features import FeatureSource, open_feature_source
from headstart.train.from_target import copy_last_layers
from headstart.train.loop import Run, accumulate, end_run, finish_run, start_run, train
from headstart.train.sharding import plain_model


LABELS = ("target_probs", "target_argmax", "data")


@dataclass
class DFlashTrainConfig(TrainRunConfig):
    output_dir: str = "runs/dflash"  # where the heads directory, checkpoints and train_log.jsonl go
    method: str = "dflash"  # dflash (the only method of this script)
    learning_rate: float = 6e-4  # peak learning rate (cosine schedule with warmup)
    warmup_ratio: float = 0.04  # share of the optimizer steps the learning rate warms up over, in [0, 1)
    # draft
    num_layers: int = 2  # draft decoder layers
    block_size: int = 8  # anchor + block_size - 1 drafted tokens
    feature_layers: Optional[list[int]] = None  # HF hidden_states indices; None: five evenly spaced (heads/dflash.py)
    mask_token_id: int = -1  # -1: the lowest target token id that no training row contains
    draft_vocab_size: int = 8192  # the most frequent target-written tokens the draft scores (0: the whole vocabulary)
    init_layers_from_target: bool = False  # start the draft layers from the target's last layers (shapes match)
    init_std: float = 0.0  # > 0: fc and every draft-layer Linear start N(0, init_std) (speculators: 0.02); 0: torch's
    # the mask token's input: trained (the draft's own mask_embedding, trained; mask token = an id no row contains) |
    # target_row (the target's frozen embedding row of the mask token, the pad token unless mask_token_id is set:
    # speculators' and vLLM's DSpark choice, which then need no mask_embedding file)
    mask_input: str = "trained"  # trained | target_row: the mask slots' input (see above)
    block_causal: bool = False  # block slot j attends to slots 0..j only (speculators' default) instead of the whole block
    sliding_window: int = 0  # > 0: a query at q sees the context positions s with q - s < sliding_window only; 0: all
    # training signal
    anchors_per_row: int = 64  # blocks drawn per row per step
    # supervise_prompt: training anchors anywhere in the row (prompt and user turns too, as EAGLE-3's), a slot there
    # supervised only while the tokens between anchor and slot are the target's own greedy choices (its labels are
    # then the target's greedy continuation); held-out figures stay on target-written anchors
    supervise_prompt: bool = False  # anchors in the prompt and user turns too, a slot there on the target's greedy path
    # labels: target_probs (soft CE against the target's distribution over the draft vocabulary; slots whose data token
    # is outside it are dropped) | target_argmax (CE on the target's argmax over the draft vocabulary, speculators':
    # every supervised slot is kept, an out-of-vocabulary token's slot learns the best in-vocabulary one) | data (CE on
    # the data token; out-of-vocabulary slots dropped)
    labels: str = "target_probs"  # target_probs | target_argmax | data: what each slot learns (see above)
    # slot_weights: decay (slot j weighs exp(-(j - 1) / loss_decay), the loss divided by the weights' sum) | dpace
    # (speculators' D-PACE: slot j weighs sum_{i >= j} prod_{k <= i} s_k, s_k = (1 - dpace_alpha) exp(-CE_k) +
    # dpace_alpha, detached: slots the draft already gets right pass weight to later ones; divided by the slot count)
    slot_weights: str = "decay"  # decay | dpace: how the block's slots are weighted (see above)
    loss_decay: float = 4.0  # slot_weights decay: slot j's weight is exp(-(j - 1) / loss_decay)
    dpace_alpha: float = 0.5  # slot_weights dpace: the confidence floor alpha (speculators' default)
    optimizer: str = "adamw"  # adamw | muon: Muon on fc and the layers' weight matrices, AdamW on the rest (train/muon.py)
    lr_schedule: str = "cosine"  # cosine | linear (warmup, then linear to 0: speculators')
    eval_anchors: int = 64  # held-out anchors per row, evenly spaced over the valid ones


def check_config(cfg: DFlashTrainConfig) -> DFlashTrainConfig:
    check_run_config(cfg, ("dflash",))
    if cfg.num_layers < 1 or cfg.block_size < 2:
        raise ConfigError(f"num_layers must be >= 1 and block_size >= 2, got {cfg.num_layers}, {cfg.block_size}")
    if cfg.anchors_per_row < 1 or cfg.eval_anchors < 1:
        raise ConfigError("anchors_per_row and eval_anchors must be >= 1")
    check_number(cfg, "loss_decay", 0, above=True)
    check_number(cfg, "init_std", 0)
    check_number(cfg, "sliding_window", 0)
    if 0 < cfg.sliding_window < cfg.block_size:
        raise ConfigError(f"sliding_window {cfg.sliding_window} must be 0 (the whole context) or >= block_size "
                          f"{cfg.block_size}, so the block stays in view")
    for name, allowed in (("mask_input", ("trained", "target_row")), ("labels", LABELS),
                          ("slot_weights", ("decay", "dpace")), ("optimizer", ("adamw", "muon")),
                          ("lr_schedule", ("cosine", "linear"))):
        if getattr(cfg, name) not in allowed:
            raise ConfigError(f"{name} must be {' or '.join(allowed)}, got {getattr(cfg, name)!r}")
    if cfg.supervise_prompt and cfg.labels == "data":
        raise ConfigError("supervise_prompt needs the target's labels there: set labels to target_argmax or target_probs")
    if not 0 <= cfg.dpace_alpha <= 1:
        raise ConfigError(f"dpace_alpha must be in [0, 1], got {cfg.dpace_alpha}")
    check_number(cfg, "draft_vocab_size", 0)
    check_number(cfg, "mask_token_id", 0, unset=-1, unset_means="the lowest token id no training row contains")
    return cfg


# ----------------------------------------------------------------------------------------------------
# blocks


def valid_anchors(loss_mask: torch.Tensor, length: int, anywhere: bool = False) -> torch.Tensor:
    """Anchor positions p of one row (loss_mask [T]): the target wrote x_p and x_{p+1} (anywhere: every p with
    x_{p+1} in the row). -> [n] increasing."""
    mask = torch.ones(length, dtype=torch.bool) if anywhere else loss_mask[: length].bool()
    ok = mask[:-1] & mask[1:]
    return torch.nonzero(ok).squeeze(-1)


def pick_anchors(valid: torch.Tensor, count: int, seed: int, step: int | None, row: int) -> torch.Tensor:
    """`count` anchors of `valid` (fewer if there are fewer): drawn per (seed, step, row) in training, evenly spaced
    for evaluation (step None). -> [k] increasing."""
    n = valid.numel()
    if n <= count:
        return valid
    if step is None:
        return valid[torch.linspace(0, n - 1, count).round().long()]
    return valid[torch.randperm(n, generator=row_generator(seed, step, row))[:count].sort().values]


def block_inputs(batch: dict, cfg: DFlashTrainConfig, mask_token_id: int, step: int | None, anchors: int) -> dict:
    """The blocks of a collated batch (with `rows`). Up to `anchors` blocks per row; K = the most any row of the batch
    gets (a row with fewer valid anchors is padded with blocks that have no supervised slot; a block attends only to
    its own block and the context, so K beyond that would be padding compute and change nothing), Bk = block_size,
    Q = K * Bk:

    tokens [B, Q] (anchor then mask tokens per block), positions [B, Q], mask bool [B, 1, Q, T + Q] (a block sees the
    positions < its anchor of its own row in the query's sliding window and its whole block, with block_causal its
    slots up to the query's), labels [B, K, Bk - 1] (x_{p+j}, 0 past the row),
    supervised [B, K, Bk - 1] (the target wrote x_{p+j}), in_row [B, K, Bk - 1] (x_{p+j} is in the row, the block
    real), label_pos [B, K, Bk - 1] (p + j, clamped into the row). Training with supervise_prompt draws the anchors
    anywhere in the row.
    """
    ids, loss_mask, lengths = batch["input_ids"], batch["loss_mask"], batch["attention_mask"].sum(1).tolist()
    B, T = ids.shape
    device = ids.device
    anywhere = cfg.supervise_prompt and step is not None
    chosen = [pick_anchors(valid_anchors(loss_mask[b].cpu(), lengths[b], anywhere), anchors, cfg.seed, step, r)
              for b, r in enumerate(batch["rows"].tolist())]
    Bk, K = cfg.block_size, max(1, max(c.numel() for c in chosen))
    anchor_pos = torch.zeros(B, K, dtype=torch.long)
    real = torch.zeros(B, K, dtype=torch.bool)
    for b, row_anchors in enumerate(chosen):
        anchor_pos[b, : row_anchors.numel()] = row_anchors
        real[b, : row_anchors.numel()] = True
    anchor_pos, real = anchor_pos.to(device), real.to(device)
    offsets = torch.arange(Bk, device=device)
    positions = anchor_pos[:, :, None] + offsets  # [B, K, Bk]
    tokens = torch.full((B, K, Bk), mask_token_id, dtype=torch.long, device=device)
    tokens[:, :, 0] = ids.gather(1, anchor_pos)
    label_pos = positions[:, :, 1:].clamp(max=T - 1)  # [B, K, Bk-1]
    inside = positions[:, :, 1:] < torch.tensor(lengths, device=device)[:, None, None]
    labels = torch.where(inside, ids.gather(1, label_pos.reshape(B, -1)).view(B, K, Bk - 1), 0)
    in_row = inside & real[:, :, None]
    supervised = in_row & loss_mask.bool().gather(1, label_pos.reshape(B, -1)).view(B, K, Bk - 1)
    # attention: context s < p (and inside the row) in the query's sliding window, the own block
    key_pos = torch.arange(T, device=device)
    ctx_ok = (key_pos[None, None, :] < anchor_pos[:, :, None]).repeat_interleave(Bk, dim=1)  # [B, Q, T]
    ctx_ok = ctx_ok & in_window(positions.view(B, K * Bk), key_pos, cfg.sliding_window)
    block_id = torch.arange(K * Bk, device=device) // Bk
    own = block_id[:, None] == block_id[None, :]  # [Q, Q]
    if cfg.block_causal:  # slot j sees slots 0..j of its block
        own = own & torch.ones_like(own).tril()
    mask = torch.cat([ctx_ok, own[None].expand(B, -1, -1)], dim=-1)  # [B, Q, T + Q]
    return {"tokens": tokens.view(B, K * Bk), "positions": positions.view(B, K * Bk), "mask": mask[:, None],
            "labels": labels, "supervised": supervised, "in_row": in_row, "label_pos": label_pos}


class BlockDraft(nn.Module):
    """The draft over many blocks per row in one forward (what accelerate wraps for training).

    With a sliding window W (and `block_local`, the default) each block attends over its own keys only: the W - 1
    context positions before its anchor and its own block, gathered per block, instead of every row position and
    every block of the row under the dense mask. The mask decides exactly as before (the dense mask's entries are
    gathered; a dense mask that lets a block see anything else is refused), so the outputs are the dense path's up
    to float rounding, at a fraction of its attention cost (a row's 64 blocks of 8 see 71 keys each, not T + 512).
    """

    def __init__(self, draft: DFlashDraft, block_local: bool = True):
        super().__init__()
        self.draft = draft
        self.block_local = block_local

    def forward(self, taps: torch.Tensor, tokens: torch.Tensor, target_embeds: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """taps [B, T, n*h], tokens [B, Q] (Q = K blocks of block_size) and their target embeddings [B, Q, h],
        positions [B, Q], mask [B, 1, Q, T + Q] -> [B, Q, h]."""
        B, T, _ = taps.shape
        ctx = self.draft.fuse(taps)
        ctx_positions = torch.arange(T, device=taps.device).expand(B, T)
        context_kv = self.draft.context_kv(ctx, ctx_positions)
        embeds = self.draft.embed_block(tokens, target_embeds)
        window, Bk, Q = self.draft.config.sliding_window, self.draft.config.block_size, tokens.shape[1]
        if not (self.block_local and window and Q % Bk == 0):
            return self.draft(embeds, positions, context_kv, mask)
        K, h = Q // Bk, embeds.shape[-1]
        # each block's context positions: the W-1 before its anchor [B, K, W-1] (those before 0 masked, clamped)
        context_pos = positions[:, ::Bk, None] - (window - 1) + torch.arange(window - 1, device=taps.device)
        in_row = context_pos >= 0
        context_pos = context_pos.clamp(min=0)
        local_mask = block_local_mask(mask, context_pos, in_row, Bk)  # [B*K, 1, Bk, W-1+Bk]
        rows = torch.arange(B, device=taps.device)[:, None, None]

        def gather(x: torch.Tensor) -> torch.Tensor:  # [B, kvh, T, d] -> [B*K, kvh, W-1, d]: each block's context
            picked = x.transpose(1, 2)[rows, context_pos]  # [B, K, W-1, kvh, d]
            return picked.permute(0, 1, 3, 2, 4).reshape(B * K, x.shape[1], window - 1, x.shape[-1])

        local_kv = [(gather(k), gather(v)) for k, v in context_kv]
        out = self.draft(embeds.reshape(B * K, Bk, h), positions.reshape(B * K, Bk), local_kv, local_mask)
        return out.view(B, Q, h)


def block_local_mask(mask: torch.Tensor, context_pos: torch.Tensor, in_row: torch.Tensor, Bk: int) -> torch.Tensor:
    """The dense mask [B, 1, Q, T + Q] cut to each block's own keys: the context positions `context_pos` [B, K, W-1]
    (valid where in_row) and its own block -> [B*K, 1, Bk, W-1+Bk]. Raises if the dense mask lets a block see any
    other key (the block-local forward would then differ from the dense one)."""
    B, _, Q, TQ = mask.shape
    K, T = Q // Bk, TQ - Q
    dense = mask[:, 0].view(B, K, Bk, TQ)
    context = dense[..., :T].gather(-1, context_pos[:, :, None, :].expand(B, K, Bk, context_pos.shape[-1]))
    context = context & in_row[:, :, None, :]  # [B, K, Bk, W-1]
    own = torch.diagonal(dense[..., T:].view(B, K, Bk, K, Bk), dim1=1, dim2=3).permute(0, 3, 1, 2)  # [B, K, Bk, Bk]
    if int(context.sum()) + int(own.sum()) != int(mask.sum()):
        raise ValueError("the attention mask lets a block see keys outside its window and its own block")
    return torch.cat([context, own], dim=-1).reshape(B * K, 1, Bk, -1)


# ----------------------------------------------------------------------------------------------------
# targets and loss


@torch.no_grad()
def prepare_batch(batch: dict, source: FeatureSource, target, draft: DFlashDraft, scored: torch.Tensor,
                  cfg: DFlashTrainConfig, step: int | None, anchors: int) -> dict:
    """Target-side tensors of one micro-batch (no gradient): the blocks; `draft_labels` [B, K, Bk-1] (the data
    tokens as indices into the draft vocabulary) and `in_vocab`; `selected` [B, K, Bk-1], the slots the loss sees
    (supervised; in the draft vocabulary unless labels target_argmax); their base weights `weights` [B, K, Bk-1]
    (slot_weights decay: the decay, dpace: 1, times selected); at the N selected slots the labels `target_labels` [N]
    (draft-vocabulary indices: the data token's, or with target_argmax the target's argmax) and, with labels
    target_probs, the target's probs [N, Vd] (its softmax over the draft vocabulary, `scored` = those rows of its
    lm_head [Vd, h]); `written` [B, K, Bk-1] (the target wrote the slot's token) and, training with supervise_prompt,
    `greedy_labels` [N] (the target's argmax over the draft vocabulary at each selected slot; else None)."""
    taps, final = source.batch(batch)
    blocks = block_inputs(batch, cfg, draft.config.mask_token_id, step, anchors)
    written = blocks["supervised"]
    greedy = None
    if cfg.supervise_prompt and step is not None:
        greedy = target_greedy(final, scored)
        on_greedy_path = greedy_prefix(batch["input_ids"], greedy, draft, blocks["label_pos"])
        blocks["supervised"] = written | (blocks["in_row"] & on_greedy_path)
    draft_labels, in_vocab = draft.to_draft_labels(blocks["labels"])
    sel = blocks["supervised"] & in_vocab if cfg.labels != "target_argmax" else blocks["supervised"]
    Bk = cfg.block_size
    if cfg.slot_weights == "decay":
        base = torch.exp(-torch.arange(Bk - 1, device=taps.device, dtype=torch.float32) / cfg.loss_decay)
    else:  # dpace: the weights need the draft's CE (block_loss); the loss is divided by the selected slots' count
        base = torch.ones(Bk - 1, device=taps.device)
    B = taps.shape[0]
    rows = torch.arange(B, device=taps.device)[:, None, None].expand_as(sel)[sel]
    before = (blocks["label_pos"] - 1)[sel]  # the target's distribution for x_{p+j} comes from its logits at p+j-1
    probs, target_labels = None, draft_labels[sel]
    greedy_labels = None if greedy is None else greedy[rows, before]  # [N]
    if cfg.labels == "target_argmax" and greedy_labels is not None:
        target_labels = greedy_labels
    elif cfg.labels != "data":
        states = final[rows, before]  # [N, h]
        parts = [(part @ scored.t()).float() for part in states.split(2048)]  # [n, Vd] each
        if cfg.labels == "target_probs":
            probs = torch.cat([torch.softmax(p, -1) for p in parts]) if parts else states.new_zeros(0, scored.shape[0]).float()
        elif parts:
            target_labels = torch.cat([p.argmax(-1) for p in parts])
    return {"taps": taps, "embeds": target.get_input_embeddings()(blocks["tokens"]), **blocks,
            "draft_labels": draft_labels, "in_vocab": in_vocab, "selected": sel, "weights": sel.float() * base,
            "target_labels": target_labels, "probs": probs, "written": written, "greedy_labels": greedy_labels}


def target_greedy(final: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """final [B, T, h] (the target's final hidden states) -> [B, T]: its argmax over the draft vocabulary at each
    position (a draft-vocabulary index: its greedy guess for the next token)."""
    B, T, h = final.shape
    parts = [(part @ scored.t()).argmax(-1) for part in final.reshape(B * T, h).split(2048)]
    return torch.cat(parts).view(B, T)


def greedy_prefix(ids: torch.Tensor, greedy: torch.Tensor, draft: DFlashDraft, label_pos: torch.Tensor) -> torch.Tensor:
    """ids [B, T], greedy [B, T] (target_greedy), label_pos [B, K, S] (p + j) -> [B, K, S] bool: the tokens between
    the anchor and slot j, x_{p+1} .. x_{p+j-1}, are each the target's greedy choice, so the target's greedy
    continuation of x_{<=p} reaches slot j through the data (always for slot 1; on greedy self-distilled answers
    everywhere)."""
    B, T = ids.shape
    data, in_vocab = draft.to_draft_labels(ids)
    chosen = torch.zeros(B, T, dtype=torch.bool, device=ids.device)  # x_t is the target's greedy choice after x_{<t}
    chosen[:, 1:] = in_vocab[:, 1:] & (greedy[:, :-1] == data[:, 1:])
    at_slot = chosen.gather(1, label_pos.reshape(B, -1)).view(label_pos.shape)  # [B, K, S]
    prefix = torch.ones_like(at_slot)
    prefix[..., 1:] = at_slot[..., :-1].long().cumprod(-1).bool()
    return prefix


def slot_outputs(model, prep: dict) -> torch.Tensor:
    """The draft's outputs [B, K, Bk-1, h] at the drafted slots (slot 0, the anchor, predicts nothing)."""
    out = model(prep["taps"], prep["tokens"], prep["embeds"], prep["positions"], prep["mask"])  # [B, Q, h]
    B, K, S = prep["supervised"].shape
    return out.view(B, K, S + 1, -1)[:, :, 1:]


def dpace_weights(ce: torch.Tensor, selected: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE slot weights (speculators' losses/utils.py), per block: ce [N] at the selected slots of selected
    [B, K, S] -> [B, K, S] (0 off the selected slots), detached. With q_k = exp(-CE_k) (the draft's probability of a
    hard label), s_k = (1 - alpha) q_k + alpha (1 off the selected slots) and P_k = prod_{i <= k} s_i:
    w_k = sum_{i >= k, i selected} P_i at a selected slot k: a slot weighs its own survival and every later one's."""
    full = torch.zeros(selected.shape, dtype=torch.float32, device=ce.device)
    full[selected] = ce.detach().float()
    s = torch.where(selected, (1 - alpha) * torch.exp(-full) + alpha, torch.ones_like(full))
    survival = s.cumprod(-1) * selected
    return survival.flip(-1).cumsum(-1).flip(-1) * selected


def block_loss(logits: torch.Tensor, prep: dict, denom: torch.Tensor, cfg: DFlashTrainConfig) -> tuple[torch.Tensor, dict]:
    """logits [N, Vd] at the selected slots -> sum of weight * CE / denom (the global sum of the base weights: the
    decay's, or the selected slots' count for dpace). -> (loss, sums: ce, hits and slots per block slot [Bk-1])."""
    w = prep["weights"][prep["selected"]]  # [N]
    logp = F.log_softmax(logits.float(), -1)
    if cfg.labels == "target_probs":
        ce = -(prep["probs"] * logp).sum(-1)
    else:
        ce = -logp.gather(-1, prep["target_labels"][:, None]).squeeze(-1)
    if cfg.slot_weights == "dpace":
        w = w * dpace_weights(ce, prep["selected"], cfg.dpace_alpha)[prep["selected"]]
    loss = (w * ce).sum() / denom.clamp(min=1e-9)
    with torch.no_grad():
        slot = torch.nonzero(prep["selected"])[:, 2]  # [N] slot index j - 1
        S = prep["supervised"].shape[-1]
        hits = torch.bincount(slot, weights=(logits.argmax(-1) == prep["target_labels"]).float(), minlength=S)
        counts = torch.bincount(slot, minlength=S).float()
    return loss, {"ce": (w * ce).sum().detach(), "hits": hits, "slots": counts}


# ----------------------------------------------------------------------------------------------------
# evaluation


def evaluate(model: BlockDraft, target, source: FeatureSource, ids: list[int], cfg: DFlashTrainConfig,
             accelerator: Accelerator, pad_id: int, scored: torch.Tensor) -> dict:
    """Per-slot ranks of the data token on the held-out rows source.rows[ids] (train/evaluate.py), one row at a time
    ([K * (Bk-1), Vd] logits), and the greedy chain's accepted tokens per block."""
    draft = model.draft

    def score(batch: dict) -> SlotScores:
        prep = prepare_batch(batch, source, target, draft, scored, dataclasses.replace(cfg, labels="data"), None,
                             cfg.eval_anchors)
        logits = draft.logits(slot_outputs(model, prep)[0], scored).float()  # [K, S, Vd]
        sup = prep["supervised"][0]  # [K, S]
        real = sup[:, 0]  # blocks of real anchors (slot 1 is always supervised there)
        return SlotScores(logits.transpose(0, 1), prep["draft_labels"][0].t(), prep["in_vocab"][0].t(), sup.t(),
                          chain=lambda hits: hits[:, real])

    return evaluate_slots(score, source.rows, ids, 1, accelerator, pad_id, cfg.block_size - 1, chained=True)


# ----------------------------------------------------------------------------------------------------
# the draft and its output


def choose_mask_token(rows: list[dict], vocab_size: int) -> int:
    """The lowest target id that no training row contains (a token the draft never sees as text)."""
    seen = torch.zeros(vocab_size, dtype=torch.bool)
    for row in rows:
        seen[torch.as_tensor(row["input_ids"])] = True
    unseen = torch.nonzero(~seen).squeeze(-1)
    if unseen.numel() == 0:
        raise ConfigError("every target token id occurs in the training rows: set mask_token_id to a special token")
    return int(unseen[0])


@torch.no_grad()
def init_from_target(draft: DFlashDraft, target, layers: bool, mask_input: str = "trained", init_std: float = 0.0) -> list[str]:
    """With init_std > 0, fc and every draft-layer Linear <- N(0, init_std) (speculators' initialisation).
    mask_embedding <- mask_input trained: a random vector at the scale of the target's embeddings (not zero, where
    the layer norm's gradient is 1/sqrt(eps)); target_row: the target's own embedding row of the mask token, frozen
    (requires_grad False: the optimizer never sees it). With `layers`, draft layer i <- the target's layer
    L - num_layers + i wherever names and shapes match (train/from_target.py). Returns the names set. The draft's `norm` stays at ones:
    started from the target's final norm, its random outputs give logits several times the target's scale and it
    learns far slower (docs/measured.md)."""
    done = []
    if init_std > 0:
        for name, module in draft.named_modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, init_std)
                done.append(f"{name}.weight")
    embeddings = target.get_input_embeddings().weight
    if mask_input == "target_row":
        draft.mask_embedding.copy_(embeddings[draft.config.mask_token_id].float())
        draft.mask_embedding.requires_grad_(False)
    else:
        draft.mask_embedding.copy_(torch.randn(draft.config.hidden_size) * embeddings.float().std())
    done.append("mask_embedding")
    if layers:
        done += copy_last_layers(draft.layers, target, draft.config.hidden_size)
    return done


def build_draft(run: Run, cfg: DFlashTrainConfig) -> DFlashDraft:
    target, info = run.target, run.info
    if cfg.mask_token_id >= 0:
        mask_token_id = cfg.mask_token_id
    elif cfg.mask_input == "target_row":  # a real token's row, as speculators: the pad token (else 0)
        mask_token_id = run.pad_id
    else:
        mask_token_id = choose_mask_token(run.train_rows, info.vocab_size)
    vocab = min(cfg.draft_vocab_size, info.vocab_size)
    try:
        config = dflash_config_for(target, cfg.num_layers, cfg.block_size, mask_token_id, cfg.feature_layers, vocab, info,
                                   block_causal=cfg.block_causal, sliding_window=cfg.sliding_window)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    L = info.num_hidden_layers
    if not all(0 <= i <= L for i in config.feature_layers):
        raise ConfigError(f"feature_layers {config.feature_layers} must be hidden_states indices in 0..{L}")
    draft = DFlashDraft(config)
    if vocab:
        draft.set_draft_vocab(most_frequent_tokens(supervised_token_counts(run.train_rows, info.vocab_size), vocab))
    initialised = init_from_target(draft, target, cfg.init_layers_from_target, cfg.mask_input, cfg.init_std)
    run.accelerator.print(f"DFlash draft: {cfg.num_layers} layers, block {cfg.block_size}"
                          f"{' (causal)' if cfg.block_causal else ''}, mask token {mask_token_id} ({cfg.mask_input}), "
                          f"target layers {config.feature_layers}; initialised from the target: {len(initialised)} tensors")
    return draft.to(run.accelerator.device)


def model_card(cfg: DFlashTrainConfig, info, stats: dict, metrics: dict) -> str:
    return heads_card(cfg, info, stats, metrics, CardText(
        title="DFlash draft", slot="slot",
        method=f"DFlash: {cfg.num_layers} decoder layers read the target's layers {metrics['feature_layers']} (fused) and "
               f"draft a block of {cfg.block_size - 1} tokens in one forward (mask token {metrics['mask_token_id']})",
        table_caption="at block slot j: the token j positions after the anchor",
        lines=[f"Mean drafted tokens a greedy chain of {cfg.block_size - 1} gets accepted: "
               f"{metrics['chain_accepted_tokens']:.3f}"]))


def scaled_lr_groups(draft: nn.Module, groups: list[dict], lr_scales: dict[str, float], lr: float) -> list[dict]:
    """Each prefix of lr_scales takes the trainable parameters whose names start with it out of `groups` into an
    AdamW group of its own at lr x its scale (a scale of 1 leaves the groups as they are)."""
    for prefix, scale in lr_scales.items():
        if scale == 1.0:
            continue
        chosen = {id(p): p for name, p in draft.named_parameters() if name.startswith(prefix) and p.requires_grad}
        if not chosen:
            raise ConfigError(f"no trainable parameters named {prefix}* to scale the learning rate of")
        groups = [dict(g, params=[p for p in g["params"] if id(p) not in chosen]) for g in groups]
        groups.append({"params": list(chosen.values()), "lr": lr * scale})
    return [g for g in groups if g["params"]]


def train_block_drafter(cfg: DFlashTrainConfig, build: Callable, micro_loss: Callable, step_log: Callable,
                        evaluate_fn: Callable, card: Callable, module_class: type, extra_metrics: dict,
                        lr_scales: dict[str, float] | None = None) -> dict:
    """The run a block drafter's trainer shares (DFlash here, DSpark in train/dspark.py): the draft from
    build(run, cfg), the features, the optimizer steps with micro_loss(draft, model, prep, scored, denom) -> (loss,
    sums) logged by step_log(sums, denom), then evaluate_fn's held-out metrics (plus extra_metrics), the heads
    directory and the card. lr_scales: parameter-name prefix -> learning-rate multiplier (scaled_lr_groups)."""
    run = start_run(cfg)
    accelerator, target = run.accelerator, run.target
    draft = build(run, cfg)
    all_rows = run.train_rows + run.eval_rows
    source = open_feature_source(cfg, target, run.info, all_rows, draft.config.feature_layers, accelerator)
    if cfg.build_cache_only:
        end_run(accelerator, run.claim)
        return {"feature_cache_dir": cfg.feature_cache_dir, **source.identity}
    # the target's frozen lm_head rows the draft scores, sliced once: [Vd, h]
    scored = draft.draft_lm_head_weight(target.get_output_embeddings().weight).detach()

    def step_fn(model, micro: list[dict], step: int) -> dict:
        unwrapped = accelerator.unwrap_model(model).draft
        preps = [prepare_batch(b, source, target, unwrapped, scored, cfg, step, cfg.anchors_per_row) for b in micro]
        denom = accelerator.reduce(torch.stack([p["weights"].sum() for p in preps]).sum(), "sum")
        sums = accumulate(accelerator, model, preps, lambda prep: micro_loss(unwrapped, model, prep, scored, denom))
        return step_log({k: accelerator.reduce(v, "sum") for k, v in sums.items()}, denom)

    groups = [dict(g, params=[p for p in g["params"] if p.requires_grad]) for g in param_groups(draft, cfg.optimizer)]
    groups = scaled_lr_groups(draft, groups, lr_scales or {}, cfg.learning_rate)
    trained = train(run, BlockDraft(draft), groups, step_fn, schedule=cfg.lr_schedule)
    if not trained.finished:
        return {"step": trained.step}
    # under FSDP or DeepSpeed: an unsharded copy of its own for the trained tensors
    model = plain_model(accelerator, trained.model, lambda: BlockDraft(module_class(draft.config)).to(accelerator.device))
    model.eval()
    n_train = len(run.train_rows)
    metrics = evaluate_fn(model, target, source, list(range(n_train, len(all_rows))), cfg, accelerator, run.pad_id,
                          scored)
    metrics.update({"feature_layers": draft.config.feature_layers, "mask_token_id": draft.config.mask_token_id,
                    "block_size": cfg.block_size, **extra_metrics, "feature_source": source.mode})
    return finish_run(run, trained, metrics, model.draft.save_pretrained, card, "slot")


def main(argv: list[str] | None = None) -> dict:
    cfg = check_config(parse_config(DFlashTrainConfig, argv))

    def loss(draft: DFlashDraft, model, prep: dict, scored: torch.Tensor, denom: torch.Tensor) -> tuple:
        logits = draft.logits(slot_outputs(model, prep)[prep["selected"]], scored)  # [N, Vd]
        return block_loss(logits, prep, denom, cfg)

    def log(sums: dict, denom: torch.Tensor) -> dict:
        acc = sums["hits"] / sums["slots"].clamp(min=1)
        return {"loss": float(sums["ce"] / denom.clamp(min=1e-9)), "acc": [round(float(a), 4) for a in acc]}

    return train_block_drafter(cfg, build_draft, loss, log, evaluate, model_card, DFlashDraft, {})

if __name__ == "__main__":
    run_main(main)
