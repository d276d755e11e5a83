"""Tree size by measurement (`--tree auto`): time the target's tree forward (and the draft) on this device for a
range of tree sizes and pick the tree with the most expected tokens per second, given the heads' accuracies.

On a CPU a forward over a few more tokens costs much more than one, so trees come out small; on a GPU, large.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from inference.eagle import EagleProposer, dynamic_config_from_choices
from inference.forward import compact_cache, target_forward
from inference.medusa import medusa_logits
from inference.tree import DEFAULT_ACCURACY, DraftInput, best_choices, expected_accept_length, tree_from_choices

TREE_FILE = "tree.json"
CALIBRATION_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)  # tree sizes timed; the small ones are the CPU's choices


@dataclass
class TreeCalibration:
    choices: list[list[int]]
    expected_accept_length: float
    step_ms: dict[int, float]  # tree size (root included) -> fastest forward ms over the repeats, monotone fit
    raw_step_ms: dict[int, float]  # the same before the fit
    draft_ms: float
    expected_tokens_per_s: dict[int, float]
    accuracy_source: str  # "heads" (measured, from the heads directory) or "default prior"
    prefix_len: int
    device: str
    choices_by_size: dict[int, list[list[int]]] = field(default_factory=dict)

    def to_json(self) -> dict:
        """tree.json's record: every field but choices_by_size, with string keys."""
        record = {k: v for k, v in asdict(self).items() if k != "choices_by_size"}
        return {k: {str(size): x for size, x in v.items()} if isinstance(v, dict) else v for k, v in record.items()}


def monotone_fit(times: dict[int, float]) -> dict[int, float]:
    """Least-squares non-decreasing fit of step time vs tree size (pool adjacent violators).

    A bigger tree never costs less; on a busy machine a small size can still time slower than a bigger
    one, which would make big trees look cheap. Pooling such inversions removes that noise.
    """
    sizes = sorted(times)
    blocks: list[list[float]] = []  # [mean, count]
    for size in sizes:
        blocks.append([times[size], 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, c2), (m1, c1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    fitted: dict[int, float] = {}
    i = 0
    for mean, count in blocks:
        for _ in range(int(count)):
            fitted[sizes[i]] = mean
            i += 1
    return fitted


def _time_ms(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


@torch.no_grad()
def calibrate_tree(model: PreTrainedModel, heads: torch.nn.Module, accuracy: Sequence[Sequence[float]] | None = None,
                   sizes: Sequence[int] = CALIBRATION_SIZES, prefix_len: int = 256, repeats: int = 3,
                   lm_head_weight: torch.Tensor | None = None,
                   draft_for: Callable[[list[list[int]]], Callable[[], None]] | None = None) -> TreeCalibration:
    """Pick the tree size maximising expected tokens/s = expected accepted length / (verify + draft time).

    The draft is timed once with all Medusa heads, or, with `draft_for(choices) -> run` (EAGLE: drafting
    a dynamic tree of that size and depth), per size.

    Each size n is timed as one tree forward of n tokens over a cache of `prefix_len` tokens (the best
    tree of n nodes for `accuracy`, so the mask is the real one), `repeats` rounds over all sizes, fastest
    time kept; accuracy[d][r] is the per-(depth, rank) acceptance rate, DEFAULT_ACCURACY (a documented
    prior, see inference/tree.py) when None. About (sizes x repeats) target forwards.
    """
    source = "heads" if accuracy is not None else "default prior"
    accuracy = [list(row) for row in (accuracy if accuracy is not None else DEFAULT_ACCURACY)]
    accuracy = accuracy[: getattr(heads.config, "num_heads", len(accuracy))]
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    vocab = model.get_output_embeddings().weight.shape[0]
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    limit = getattr(config, "max_position_embeddings", 4096) or 4096
    prefix_len = max(1, min(prefix_len, limit - max(sizes) - 1))
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, prefix_len), generator=gen).to(device)
    cache = DynamicCache()
    _, hidden, _ = target_forward(model, prompt, cache, last_only=True)
    steps: dict[int, Callable[[], None]] = {}
    per_size_choices: dict[int, list[list[int]]] = {}
    for n in sizes:
        choices = best_choices(accuracy, n - 1)
        tree = tree_from_choices(choices)
        tokens = torch.randint(0, vocab, (1, tree.size), generator=gen).to(device)
        mask = tree.attention_mask(prefix_len, dtype=dtype, device=device)
        positions = tree.position_ids(prefix_len, device=device)

        def step(tokens=tokens, mask=mask, positions=positions) -> None:
            target_forward(model, tokens, cache, mask, positions)
            compact_cache(cache, prefix_len, [])  # back to the prefix: every timing sees the same cache

        steps[tree.size] = step
        per_size_choices[tree.size] = choices
    # rounds over all sizes, keeping each size's fastest time: robust to other load on the machine
    for step in steps.values():
        step()  # warm-up
    if draft_for is None:
        draft_weight = heads.draft_lm_head_weight(lm_head_weight) if lm_head_weight is not None else None
        drafts = {None: lambda: medusa_logits(heads, hidden[0], len(accuracy), draft_weight)}
    else:
        drafts = {size: draft_for(per_size_choices[size]) for size in steps}
    draft_times = {key: math.inf for key in drafts}
    step_ms = {size: math.inf for size in steps}
    for _ in range(repeats):
        for key, run in drafts.items():
            draft_times[key] = min(draft_times[key], _time_ms(run))
        for size, step in steps.items():
            step_ms[size] = min(step_ms[size], _time_ms(step))
    raw_step_ms = dict(step_ms)
    step_ms = monotone_fit(step_ms)
    expected: dict[int, float] = {}
    for size in steps:
        draft_ms = draft_times[None] if draft_for is None else draft_times[size]
        cost = step_ms[size] + (draft_ms if size > 1 else 0.0)  # a one-node "tree" is plain decoding: no draft
        expected[size] = 1000.0 * expected_accept_length(per_size_choices[size], accuracy) / cost
    best = max(expected, key=lambda s: expected[s])
    choices = per_size_choices[best]
    draft_ms = draft_times[None] if draft_for is None else draft_times[best]
    return TreeCalibration(choices=choices, expected_accept_length=expected_accept_length(choices, accuracy),
                           step_ms=step_ms, raw_step_ms=raw_step_ms, draft_ms=draft_ms, expected_tokens_per_s=expected,
                           accuracy_source=source, prefix_len=prefix_len, device=str(device),
                           choices_by_size=per_size_choices)


def read_accuracy(heads_dir: Path) -> list[list[float]] | None:
    """Per-(depth, rank) acceptance rates recorded in the heads directory, or None.

    Rows = heads (depth 1, 2, ...), columns = ranks. Read from `tree.json` ("accuracy"), else from the
    training metrics in `metrics.json` ("rank_accuracy": P(the true token is head k's rank-r guess), as
    train/medusa.py writes it). Used as the Medusa paper does: a path's acceptance probability is the
    product of its nodes' rates (heads treated as independent).
    """
    for name, key in ((TREE_FILE, "accuracy"), ("metrics.json", "rank_accuracy"), ("metrics.json", "accuracy")):
        file = heads_dir / name
        if not file.is_file():
            continue
        try:
            data = json.loads(file.read_text())
        except json.JSONDecodeError:
            continue
        acc = data.get(key) if isinstance(data, dict) else None
        if isinstance(acc, list) and acc and all(isinstance(row, list) and row for row in acc):
            return [[float(a) for a in row] for row in acc]
    return None


def eagle_draft_timer(draft: torch.nn.Module, model: PreTrainedModel,
                      prefix_len: int) -> Callable[[list[list[int]]], Callable[[], None]]:
    """draft_for(choices) -> a callable drafting one dynamic tree of that shape after a prefix_len context."""
    vocab = model.get_output_embeddings().weight.shape[0]
    device = next(model.parameters()).device
    context = torch.randint(0, vocab, (prefix_len + 1,), generator=torch.Generator().manual_seed(1)).tolist()
    _, hidden, taps = target_forward(model, torch.tensor([context[:-1]], device=device), DynamicCache(),
                                     feature_layers=draft.config.feature_layers)

    def draft_for(choices: list[list[int]]) -> Callable[[], None]:
        proposer = EagleProposer(draft, model, dynamic_config_from_choices(choices))
        proposer(DraftInput(hidden=hidden[-1], root=context[-1], context=context, features=taps))  # commit
        return lambda: proposer(DraftInput(hidden=hidden[-1], root=context[-1], context=context))

    return draft_for
