"""Pure batching helpers for training on self-distilled rows (no model, no I/O).

A self-distilled row has `input_ids` (the whole chat rendered with the target's template) and `loss_mask`
(1 exactly on the tokens the target wrote, its end-of-turn token included). Supervision is decided by the
loss mask of the *label* token, never by comparing with the pad id: pad = eos on many targets, and a real
end-of-turn token must stay supervised.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class DataError(ValueError):
    """A dataset that cannot be trained on (empty, missing columns, nothing supervised)."""


REQUIRED_COLUMNS = ("input_ids", "loss_mask")


def check_columns(column_names: Sequence[str]) -> None:
    missing = [c for c in REQUIRED_COLUMNS if c not in column_names]
    if missing:
        raise DataError(f"self-distilled dataset lacks column(s) {missing}; it has {list(column_names)}")


def truncate_rows(rows: Sequence[dict], max_length: int, min_supervised: int = 1) -> tuple[list[dict], int]:
    """Cut every row to `max_length` tokens; drop rows left with fewer than `min_supervised` target tokens.

    Returns (kept rows with `input_ids`, `loss_mask` as lists, number dropped).
    """
    kept, dropped = [], 0
    for row in rows:
        ids, mask = list(row["input_ids"])[:max_length], list(row["loss_mask"])[:max_length]
        if len(ids) != len(mask):
            raise DataError(f"row {row.get('id', '?')}: input_ids and loss_mask lengths differ ({len(ids)} vs {len(mask)})")
        if sum(mask) < min_supervised:
            dropped += 1
            continue
        kept.append({"input_ids": ids, "loss_mask": mask})
    return kept, dropped


def split_eval(num_rows: int, eval_rows: int) -> tuple[list[int], list[int]]:
    """Deterministic split: the last `eval_rows` rows are held out. Returns (train indices, eval indices)."""
    if num_rows == 0:
        raise DataError("the self-distilled dataset is empty: nothing to train on")
    eval_rows = min(max(eval_rows, 0), num_rows - 1)
    return list(range(num_rows - eval_rows)), list(range(num_rows - eval_rows, num_rows))


def collate(rows: Sequence[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad rows to the longest: input_ids, attention_mask, loss_mask [B, T] (loss_mask 0 on padding)."""
    longest = max(len(r["input_ids"]) for r in rows)
    input_ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), longest), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        input_ids[i, :n] = torch.as_tensor(r["input_ids"])
        attention_mask[i, :n] = 1
        loss_mask[i, :n] = torch.as_tensor(r["loss_mask"])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def shifted_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels `offset` tokens ahead: labels[:, t] = input_ids[:, t + offset], valid where that token is target-written.

    input_ids, loss_mask [B, T] -> labels [B, T] (0 where invalid), valid [B, T] bool.
    The target's lm_head uses offset 1; Medusa head k (1-based) uses offset k + 1.
    """
    labels = torch.zeros_like(input_ids)
    valid = torch.zeros_like(loss_mask, dtype=torch.bool)
    if offset < input_ids.shape[1]:
        labels[:, :-offset] = input_ids[:, offset:]
        valid[:, :-offset] = loss_mask[:, offset:].bool()
    return labels, valid


def pad_features(features: Sequence[torch.Tensor], length: int) -> torch.Tensor:
    """Stack per-row features [T_i, h] into [B, length, h], zero-padded on the right."""
    out = features[0].new_zeros((len(features), length, features[0].shape[-1]))
    for i, f in enumerate(features):
        out[i, : f.shape[0]] = f[:length]
    return out


def shard_epoch(order: Sequence[int], per_device_batch: int, num_processes: int, process_index: int) -> list[int]:
    """This process's rows of one epoch, in batch order.

    Global batch g is `order[g*G : (g+1)*G]` with G = per_device_batch * num_processes; process p takes the p-th
    slice of every global batch. The incomplete last global batch is dropped, so every process runs the same
    number of steps and N processes see exactly the global batches one process with batch G would see.
    """
    global_batch = per_device_batch * num_processes
    mine = []
    for g in range(len(order) // global_batch):
        start = g * global_batch + process_index * per_device_batch
        mine.extend(order[start : start + per_device_batch])
    return mine


def row_generator(seed: int, step: int, row: int) -> torch.Generator:
    """A generator seeded per (seed, step, row): what a training step draws for a row (EAGLE's feature noise, DFlash's
    anchors) is the same in any batch layout, process count or resume point."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_000_003 + row)


def supervised_token_counts(rows: list[dict], vocab_size: int) -> torch.Tensor:
    """How often each target id is a target-written (loss_mask = 1) token of `rows`: [V]."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for row in rows:
        ids = torch.as_tensor(row["input_ids"])[torch.as_tensor(row["loss_mask"]).bool()]
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts
