"""Acceptance rules: which drafted path of a tree the target keeps, and the token it adds.

Every rule reads the target's output at all tree nodes (one forward pass) and returns
`(path, bonus)`: `path` = accepted node indices from the root (node 0, always kept) down, and
`bonus` = the token the target itself chooses after the last accepted node. A step therefore emits
`len(path) - 1` drafted tokens plus the bonus.

- `greedy_accept`: lossless for temperature 0 (the output equals the target's greedy decoding).
- `sample_accept`: lossless for sampling with a deterministic draft (the tree is a function of
  the context, i.e. q = 1 on each drafted child): at a node, try the children in order, accept
  child x with probability p(x) under the current p; on rejection set p(x) = 0 and renormalise; when
  every child is rejected sample the bonus from what remains. Each emitted token then has exactly
  the target's (temperature / top-p processed) distribution.
- `typical_accept`: Medusa's typical acceptance. LOSSY (the output distribution is not the target's);
  opt-in only, never the default.
"""

from __future__ import annotations

import math

import torch


def target_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """logits [..., V] -> sampling distribution [..., V] after temperature and nucleus (top-p) filtering.

    Top-p follows transformers' TopPLogitsWarper: drop the lowest tokens whose cumulative probability
    stays within 1 - top_p, always keeping the most likely token.
    """
    if temperature <= 0:
        raise ValueError("target_probs needs temperature > 0 (temperature 0 is greedy decoding)")
    scores = logits.float() / temperature
    if top_p < 1.0:
        sorted_scores, sorted_idx = scores.sort(dim=-1, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - top_p)
        remove_sorted[..., -1] = False
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, -math.inf)
    return scores.softmax(dim=-1)


def greedy_accept(children: list[list[int]], tokens: list[int], logits: torch.Tensor) -> tuple[list[int], int]:
    """Longest path whose every token equals the target's argmax at its parent, plus the bonus token.

    children: per node, its children; tokens [N]: node tokens; logits [N, V]: target logits per node.
    """
    best = logits.argmax(dim=-1).tolist()  # [N] the target's greedy next token after each node
    path = [0]
    node = 0
    while True:
        nxt = next((c for c in children[node] if tokens[c] == best[node]), None)
        if nxt is None:
            return path, best[node]
        path.append(nxt)
        node = nxt


def sample_accept(children: list[list[int]], tokens: list[int], probs: torch.Tensor,
                  generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Lossless acceptance for a deterministic tree (q = 1 on each drafted child).

    probs [N, V]: the target's processed distribution (see `target_probs`) after each node, on any device; the rows
    on the path come to the host once each (`generator` is a CPU generator), where the residual is kept in float64.
    """
    path = [0]
    node = 0
    while True:
        row = probs[node].to("cpu", torch.float64)  # [V]
        p = row.clone()  # unnormalised residual
        mass = float(p.sum())
        accepted = None
        for child in children[node]:
            x = tokens[child]
            px = float(p[x]) / mass if mass > 0 else 0.0
            if px > 0 and float(torch.rand((), generator=generator, dtype=torch.float64)) < px:
                accepted = child
                break
            mass -= float(p[x])
            p[x] = 0.0
        if accepted is None:
            if float(p.sum()) <= 0:  # numerically exhausted: cannot happen with exact arithmetic
                p = row
            bonus = int(torch.multinomial(p, 1, generator=generator))
            return path, bonus
        path.append(accepted)
        node = accepted


def typical_accept(children: list[list[int]], tokens: list[int], logits: torch.Tensor, temperature: float,
                   posterior_threshold: float = 0.09, posterior_alpha: float = 0.3,
                   generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Medusa typical acceptance (LOSSY, opt-in): accept child x of node u when
    p_u(x) > min(posterior_threshold, posterior_alpha * exp(-H(p_u))); keep the deepest path of
    accepted nodes (the first found, children tried in rank order), then sample the bonus from p.
    """
    probs = target_probs(logits, temperature)  # [N, V]
    entropy = -(probs * probs.clamp_min(1e-12).log()).sum(dim=-1)  # [N]
    threshold = torch.minimum(torch.full_like(entropy, posterior_threshold), posterior_alpha * torch.exp(-entropy))
    probs, threshold = probs.cpu(), threshold.cpu()  # the search reads single entries; `generator` is a CPU one
    best_path = [0]
    stack = [[0]]
    while stack:
        path = stack.pop()
        node = path[-1]
        if len(path) > len(best_path):
            best_path = path
        for child in reversed(children[node]):  # reversed so rank 0 is explored first
            if float(probs[node, tokens[child]]) > float(threshold[node]):
                stack.append(path + [child])
    last = best_path[-1]
    bonus = int(torch.multinomial(probs[last], 1, generator=generator))
    return best_path, bonus
