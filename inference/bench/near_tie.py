"""Mismatches against vanilla (inference/bench/run.py): for an output that differs from vanilla's, both runs decoded again
up to the first differing token keeping the logits, and how close the target's two candidates were there. A
near-tie (both runs' margins within NEAR_TIE_ULPS units in the last place of the dtype at the top logit) is
rounding, not a wrong draft accepted."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from headstart.inference.bench.methods import Method

NEAR_TIE_ULPS = 4  # a mismatch is a near-tie when both runs' margins are within this many ulps of the top logit


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first differing token (the shorter length when one output is a prefix of the other)."""
    return next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _ulp(x: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype` numbers at magnitude |x|."""
    return float(torch.finfo(dtype).eps) * 2.0 ** math.floor(math.log2(max(abs(x), float(torch.finfo(dtype).tiny))))


def _side(logits: torch.Tensor, own: int, other: int, dtype: torch.dtype) -> dict:
    """One run's logits row [V] at the first difference: its top-2 gap, its margin for its own token over the other
    run's, the other token's rank here (0 = top), and that margin in ulps of `dtype` at the top logit."""
    top2 = logits.topk(2).values
    margin = float(logits[own] - logits[other])
    return {"gap": float(top2[0] - top2[1]), "margin": margin, "other_rank": int((logits > logits[other]).sum()),
            "margin_ulps": margin / _ulp(float(top2[0]), dtype)}


def near_tie(vanilla: Method, method: Method, ids: list[int], vanilla_tokens: list[int], method_tokens: list[int],
             dtype: torch.dtype) -> dict:
    """Decode both again up to the first differing token (keeping the logits) and compare them there."""
    at = first_difference(vanilla_tokens, method_tokens)
    out = {"at": at, "vanilla_token": None, "method_token": None, "vanilla": None, "method": None,
           "near_tie": None, "reproduced": None}
    if at >= min(len(vanilla_tokens), len(method_tokens)):  # one output stops earlier: no differing token
        return out
    v_tok, m_tok = vanilla_tokens[at], method_tokens[at]
    v_seen, v_logits = vanilla.trace(ids, at + 1)
    m_seen, m_logits = method.trace(ids, at + 1)
    out.update(vanilla_token=v_tok, method_token=m_tok, vanilla=_side(v_logits[at], v_tok, m_tok, dtype),
               method=_side(m_logits[at], m_tok, v_tok, dtype),
               reproduced=v_seen == vanilla_tokens[:at + 1] and m_seen == method_tokens[:at + 1])
    out["near_tie"] = max(out["vanilla"]["margin_ulps"], out["method"]["margin_ulps"]) <= NEAR_TIE_ULPS
    return out
