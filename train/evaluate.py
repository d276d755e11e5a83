"""The held-out evaluation every trainer runs: where in the draft's ranking the data token sits, per slot.

A slot is what a method drafts in one place: Medusa's head k, EAGLE's draft depth d, DFlash's block slot j. A method
gives, per batch of held-out rows, its logits per slot and the truth (`SlotScores`); this module iterates the rows
(sharded over processes, under no_grad), counts per slot how often the truth was the rank-r guess, sums over
processes and summarises:

    metrics = evaluate_slots(score, all_rows, eval_ids, batch_size, accelerator, pad_id, slots, chained, ratios)
    # top1 [K], top5 [K], rank_accuracy [K][R], eval_positions [K]; chain_accepted_tokens (methods that chain
    # their slots); the method's own ratios (target_top1, ...)

A method whose figures are not ratios of two counts (DSpark's calibration) passes `extra`, zero tensors of the sums it
keeps; each batch's SlotScores.extra adds to them, and `summarise` turns the totals (summed over processes) into
figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from accelerate import Accelerator

from headstart.train.data import collate

RANKS = 10  # rank_accuracy's columns; the histogram's last column counts rank >= RANKS and undraftable truths


@dataclass
class SlotScores:
    """One batch's draft scores. K slots, N positions per slot, V = the draft's vocabulary."""

    logits: torch.Tensor  # [K, N, V]
    labels: torch.Tensor  # [K, N]: the truth's index into the logits (any index where it is not draftable)
    draftable: torch.Tensor  # [K, N] or broadcastable: the truth is in the draft's vocabulary
    counted: torch.Tensor  # [K, N]: the positions this slot is scored at
    # (slot hits [K, N]: rank 0 where counted) -> [K, M]: the hits along each of M greedy chains, slot by slot
    chain: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    ratios: dict[str, tuple] = field(default_factory=dict)  # name -> (numerator, denominator) counts of this batch
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> this batch's sums (evaluate_slots' extra)


def truth_rank(logits: torch.Tensor, truth: torch.Tensor, misses: int) -> torch.Tensor:
    """logits [..., V], truth [..., 1] (the true token's logit) -> rank [...]: how many logits beat the truth's,
    capped at `misses` (the "rank >= R" column). A row holding a NaN or infinite logit is a miss (`misses`): NaN
    compares false with everything, and would otherwise rank 0, a hit."""
    rank = (logits > truth).sum(-1).clamp(max=misses)
    return rank.masked_fill(~torch.isfinite(logits).all(-1), misses)


def rank_summary(rank_counts: torch.Tensor) -> dict:
    """rank_counts [K, R + 1] (per head / depth: how often the truth was the rank-r guess; last column: rank >= R or
    not draftable) -> top1, top5, rank_accuracy [K][R] (P(the truth is exactly the rank-r guess)), eval_positions."""
    R = rank_counts.shape[1] - 1
    rank_acc = rank_counts[:, :R] / rank_counts.sum(-1).clamp(min=1)[:, None]
    return {
        "top1": [round(float(a), 4) for a in rank_acc[:, 0]],
        "top5": [round(float(a), 4) for a in rank_acc[:, :5].sum(-1)],
        "rank_accuracy": [[round(float(a), 5) for a in row] for row in rank_acc],
        "eval_positions": [int(t) for t in rank_counts.sum(-1)],
    }


@torch.no_grad()
def evaluate_slots(score: Callable[[dict], SlotScores], all_rows: list[dict], ids: list[int], batch_size: int,
             accelerator: Accelerator, pad_id: int, slots: int, chained: bool = False,
             ratios: tuple[str, ...] = (), extra: Optional[dict[str, torch.Tensor]] = None,
             summarise: Optional[Callable[[dict[str, torch.Tensor]], dict]] = None) -> dict:
    """score(batch) -> SlotScores for each batch of the held-out rows all_rows[ids] (collated, on the device, with
    `rows` their indices), this process's share of them -> the summary: rank_summary; with `chained` (score gives
    `chain`) chain_accepted_tokens, the mean hits before a chain's first miss; then the `ratios` score counts, in
    this order; then summarise(the `extra` sums: the zeros given plus every batch's SlotScores.extra). Every process
    reduces the same tensors, whether it had rows or not."""
    dev = accelerator.device
    sums = {name: zeros.to(dev).float().clone() for name, zeros in (extra or {}).items()}
    rank_counts = torch.zeros(slots, RANKS + 1, device=dev)
    counts = torch.zeros(2 + 2 * len(ratios), device=dev)  # accepted chain tokens, chains, then each ratio's two
    mine = ids[accelerator.process_index :: accelerator.num_processes]
    for start in range(0, len(mine), batch_size):
        part = mine[start : start + batch_size]
        batch = {k: v.to(dev) for k, v in collate([all_rows[i] for i in part], pad_id).items()}
        batch["rows"] = torch.tensor(part)
        scores = score(batch)
        truth = scores.logits.gather(-1, scores.labels[..., None])  # [K, N, 1]
        rank = torch.where(scores.draftable, truth_rank(scores.logits, truth, RANKS), RANKS)  # [K, N]
        for k in range(slots):
            rank_counts[k] += torch.bincount(rank[k][scores.counted[k]], minlength=RANKS + 1).float()
        if chained:
            hits = scores.chain((rank == 0) & scores.counted)  # [K, M]
            counts[0] += hits.long().cumprod(0).sum()
            counts[1] += hits.shape[1]
        for i, name in enumerate(ratios):
            num, den = scores.ratios[name]
            counts[2 + 2 * i] += num
            counts[3 + 2 * i] += den
        for name in sums:
            sums[name] += scores.extra[name]
    rank_counts = accelerator.reduce(rank_counts, "sum")
    counts = accelerator.reduce(counts, "sum")
    out = rank_summary(rank_counts)
    if chained:
        out["chain_accepted_tokens"] = round(float(counts[0] / counts[1].clamp(min=1)), 4)
    for i, name in enumerate(ratios):
        out[name] = round(float(counts[2 + 2 * i] / counts[3 + 2 * i].clamp(min=1)), 4)
    if summarise is not None:
        out.update(summarise({name: accelerator.reduce(total, "sum") for name, total in sums.items()}))
    return out
