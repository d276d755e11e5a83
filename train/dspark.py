"""Train a DSpark draft (heads/dspark.py: a DFlash block drafter + a Markov head + a confidence head) on the target's
own generations (the target stays frozen).

CPU (2 cores, the embedded SmolLM2-135M; self-distils the recipe's prompts first if data_dir is empty):
    python train/dspark.py --config recipes/smollm2-135m/dspark.yaml --output_dir runs/dspark-smollm2
The run (data, schedule, resume, logging, checkpoints, heads directory) is train/loop.py's; blocks, anchors, targets,
the token loss and its options (labels, slot_weights, optimizer, mask_input...) are train/dflash.py's, unchanged.

What DSpark adds to one block of DFlash's training: slot j's logits are the Markov-corrected ones, DFlash's plus
markov_bias(x_{p+j-1}), the previous token teacher-forced with the data (slot 1's is the anchor): on the accepted
prefix, what the draft conditions on at inference (with `supervise_prompt`, a prompt slot is trained only on the
target's greedy path, where the data before it is what the target would have drafted). The token loss is DFlash's on
those logits (with the default labels, soft cross-entropy against the target's distribution: KL up to a constant,
speculators' DSpark loss). The confidence head learns, by binary cross-entropy with the slots' token-loss weights
(`confidence_weight` x), whether the slot's Markov-corrected argmax is the data token: the event that verifies a
deterministic draft token. On greedy self-distilled data (headstart's default) the data token is the target's greedy
choice, so this is exactly greedy acceptance (a prompt slot's target is the target's greedy token there), and the
running product along the block is the accepted-prefix indicator of a greedy chain; on sampled data it is an unbiased
draw of the target's probability of the drafted token, its acceptance under sampling. (DeepSpec and speculators use
1 - TV(q, p), the acceptance of a token *sampled* from the draft, which headstart never drafts.)

metrics.json: DFlash's (per block slot top1, top5, rank_accuracy, eval_positions; chain_accepted_tokens) on the
Markov-corrected logits, plus the confidence head's calibration on the held-out blocks:
`confidence_by_slot` (mean c_j where slots < j were accepted) beside `accepted_by_slot` (how often slot j then was),
`expected_chain_tokens` (mean of sum_j S_j, S_j = c_1 .. c_j) beside chain_accepted_tokens, and `survival_ece`
(expected calibration error of S_j against "slots 1..j all accepted", 10 equal-width bins); and `without_markov`, the
same draft's top1 by slot and chain_accepted_tokens with the Markov bias left out, so a head that learned nothing
shows (the two chains equal).

The head learns on the training rows, where the draft is right far more often than on rows it never saw, so it comes
out overconfident. With `calibrate_confidence` (the default) the end of training fits Platt scaling to the held-out
rows, c = sigmoid(scale * z + shift) over the head's logits z at the slots whose prefix was accepted (the c_j the
adaptive cut multiplies), and folds it into `confidence_head.proj` (weight x scale, bias x scale + shift): the same
tensors, so an engine's export reads the calibrated head. The held-out figures above are then the calibrated head's
(on the rows it was fitted to: two parameters over thousands of slots), and `confidence_calibration` keeps the fit
and the figures before it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from accelerate import Accelerator

from headstart.heads.dspark import ECE_BINS, DSparkConfig, DSparkDraft, calibration
from headstart.train import dflash
from headstart.train.card import CardText, heads_card
from headstart.train.cli import run_main
from headstart.train.config import check_number, check_run_config, parse_config
from headstart.train.dflash import (BlockDraft, DFlashTrainConfig, block_loss, prepare_batch, slot_outputs,
                                    train_block_drafter)
from headstart.train.evaluate import RANKS, SlotScores, evaluate_slots, truth_rank
from headstart.train.features import FeatureSource
from headstart.train.loop import Run

# Platt scaling's data: the head's logits z on held-out slots, counted in bins of LOGIT_STEP over
# [-LOGIT_MAX, LOGIT_MAX]
LOGIT_MAX, LOGIT_STEP = 12.0, 0.05
LOGIT_BINS = round(2 * LOGIT_MAX / LOGIT_STEP)


@dataclass
class DSparkTrainConfig(DFlashTrainConfig):
    output_dir: str = "runs/dspark"  # where the heads directory, checkpoints and train_log.jsonl go
    method: str = "dspark"  # dspark (the only method of this script)
    markov_rank: int = 64  # rank of the Markov head's factors
    confidence_with_markov: bool = True  # the confidence head reads markov_w1[prev] beside the slot's output
    confidence_weight: float = 1.0  # weight of the confidence head's binary cross-entropy in the loss
    markov_context: bool = False  # the Markov factor also reads its slot's output (headstart's decode loop only)
    calibrate_confidence: bool = True  # fit Platt scaling of the confidence head to the held-out rows at the end
    markov_lr_scale: float = 1.0  # the Markov head's learning rate over learning_rate (its own AdamW group)


def check_config(cfg: DSparkTrainConfig) -> DSparkTrainConfig:
    check_run_config(cfg, ("dspark",))
    dflash.check_config(dataclasses.replace(cfg, method="dflash"))  # the backbone's and the token loss's checks
    check_number(cfg, "markov_rank", 1)
    check_number(cfg, "confidence_weight", 0)
    check_number(cfg, "markov_lr_scale", 0, above=True)
    return cfg


def previous_tokens(prep: dict) -> torch.Tensor:
    """The token before each drafted slot, teacher-forced [B, K, Bk-1]: the anchor for slot 1, x_{p+j-1} after."""
    B, K, S = prep["labels"].shape
    anchors = prep["tokens"].view(B, K, S + 1)[..., :1]
    return torch.cat([anchors, prep["labels"][..., :-1]], dim=-1)


def slot_index(prep: dict) -> torch.Tensor:
    """Each drafted slot's index in its block [B, K, Bk-1]: 0 for slot 1."""
    B, K, S = prep["labels"].shape
    return torch.arange(S, device=prep["labels"].device).expand(B, K, S)


def slot_accepted(logits: torch.Tensor, draft_labels: torch.Tensor, in_vocab: torch.Tensor) -> torch.Tensor:
    """logits [..., Vd], the data tokens' draft indices and in-vocabulary mask [...] -> bool [...]: the draft's
    argmax is the data token (the confidence head's target)."""
    return (logits.argmax(-1) == draft_labels) & in_vocab


def dspark_loss(draft: DSparkDraft, out: torch.Tensor, prep: dict, scored: torch.Tensor, denom: torch.Tensor,
                cfg: DSparkTrainConfig) -> tuple[torch.Tensor, dict]:
    """out [N, h] (the draft's outputs at the selected slots) -> (DFlash's token loss on the Markov-corrected logits
    + confidence_weight x the weighted BCE of the confidence head / denom, sums: DFlash's plus bce and conf_hits)."""
    sel = prep["selected"]
    prev = previous_tokens(prep)[sel]  # [N]
    logits = draft.corrected_logits(out, scored, prev, slot_index(prep)[sel])  # [N, Vd]
    loss, sums = block_loss(logits, prep, denom, cfg)
    truth, in_vocab = prep["draft_labels"][sel], prep["in_vocab"][sel]
    if prep["greedy_labels"] is not None:  # supervise_prompt: off the answers, the target's greedy token verifies
        prompt = ~prep["written"][sel]
        truth, in_vocab = torch.where(prompt, prep["greedy_labels"], truth), in_vocab | prompt
    accepted = slot_accepted(logits.detach(), truth, in_vocab).float()  # [N]
    conf = draft.confidence_logit(draft.norm(out), prev).float()  # [N]
    w = prep["weights"][sel]
    bce = (w * F.binary_cross_entropy_with_logits(conf, accepted, reduction="none")).sum()
    sums.update(bce=bce.detach(), accepted=(w * accepted).sum(), predicted=(w * torch.sigmoid(conf.detach())).sum())
    return loss + cfg.confidence_weight * bce / denom.clamp(min=1e-9), sums


def held_out_extras(sums: dict[str, torch.Tensor]) -> dict:
    """From evaluate's summed counts (summed over rows and processes): the confidence head's held-out figures
    (heads/dspark.py calibration), the Platt fit to them (`platt_fit`), and `without_markov`: top1 by slot and
    chain_accepted_tokens of the same draft with its Markov bias left out (what the Markov head adds)."""
    slots, chain = sums["without_markov"], sums["without_markov_chain"]
    without = {"top1": [round(float(a), 4) for a in slots[0] / slots[1].clamp(min=1)],
               "chain_accepted_tokens": round(float(chain[0] / chain[1].clamp(min=1)), 4)}
    return {**calibration(sums), "platt_fit": fit_platt(sums["logits"]), "without_markov": without}


def fit_platt(counts: torch.Tensor) -> dict:
    """counts [2, LOGIT_BINS] (accepted, slots in each logit bin) -> {"scale", "shift", "slots"}: the maximum
    likelihood sigmoid(scale * z + shift) of the accepted slots (Newton's method with step halving on the two
    parameters; the problem is convex). scale stays >= 0: a head whose logits rank the slots backwards gets scale 0
    and the base rate. With no accepted or no rejected slot there is nothing to fit: scale 1, shift 0."""
    z = -LOGIT_MAX + LOGIT_STEP * (torch.arange(LOGIT_BINS, dtype=torch.float64) + 0.5)  # the bins' centres
    accepted, slots = counts[0].double().cpu(), counts[1].double().cpu()
    total, hits = float(slots.sum()), float(accepted.sum())
    if hits == 0 or hits == total:
        return {"scale": 1.0, "shift": 0.0, "slots": int(total)}
    x = torch.stack([z, torch.ones_like(z)], dim=1)  # [bins, 2]

    def nll(theta: torch.Tensor) -> float:  # the negative log-likelihood of the accepted slots
        s = x @ theta
        return float((slots * F.softplus(s) - accepted * s).sum())

    theta = torch.tensor([1.0, 0.0], dtype=torch.float64)
    loss = nll(theta)
    for _ in range(100):
        p = torch.sigmoid(x @ theta)  # [bins]
        grad = x.t() @ (slots * p - accepted)
        hess = x.t() @ (x * (slots * p * (1 - p))[:, None]) + 1e-9 * torch.eye(2, dtype=torch.float64)
        step = torch.linalg.solve(hess, grad)
        rate = 1.0  # halved until the step lowers the loss: a full Newton step overshoots from far away
        while nll(theta - rate * step) > loss and rate > 1e-6:
            rate /= 2
        theta = theta - rate * step
        loss = nll(theta)
        if float((rate * step).abs().max()) < 1e-9:
            break
    scale, shift = float(theta[0]), float(theta[1])
    if scale < 0:
        scale, shift = 0.0, float(torch.logit(torch.tensor(hits / total, dtype=torch.float64)))
    return {"scale": scale, "shift": shift, "slots": int(total)}


def evaluate(model: BlockDraft, target, source: FeatureSource, ids: list[int], cfg: DSparkTrainConfig,
             accelerator: Accelerator, pad_id: int, scored: torch.Tensor) -> dict:
    """DFlash's held-out metrics (train/evaluate.py) on the Markov-corrected logits, one row at a time, and the
    confidence head's calibration (`calibration`) from sums kept beside them."""
    draft, S = model.draft, cfg.block_size - 1

    def score(batch: dict) -> SlotScores:
        prep = prepare_batch(batch, source, target, draft, scored, dataclasses.replace(cfg, labels="data"), None,
                             cfg.eval_anchors)
        out = slot_outputs(model, prep)[0]  # [K, S, h]
        prev = previous_tokens(prep)[0]  # [K, S]
        logits = draft.corrected_logits(out, scored, prev, slot_index(prep)[0]).float()  # [K, S, Vd]
        plain = draft.logits(out, scored).float()  # [K, S, Vd]: the same draft without the Markov bias
        labels, in_vocab, sup = prep["draft_labels"][0], prep["in_vocab"][0], prep["supervised"][0]
        real = sup[:, 0]  # blocks of real anchors (slot 1 is always supervised there)

        def greedy_hits(scores: torch.Tensor) -> torch.Tensor:  # [K, S, Vd] -> [K, S]
            # the draft's argmax is the data token: rank 0, as evaluate_slots counts it
            return (truth_rank(scores, scores.gather(-1, labels[..., None]), RANKS) == 0) & in_vocab & sup

        hit, plain_hit = greedy_hits(logits), greedy_hits(plain)
        conf_logits = draft.confidence_logit(draft.norm(out), prev).float()  # [K, S]
        conf = torch.sigmoid(conf_logits)
        prefix = hit.long().cumprod(1)  # slots 1..j all accepted
        before = torch.cat([torch.ones_like(prefix[:, :1]), prefix[:, :-1]], 1).bool() & sup  # slots < j were
        survival, counted = conf.cumprod(1), sup.long().cumprod(1).bool()  # S_j; slots whose prefix is supervised
        z = conf_logits[before]  # [M] the head's logits where the prefix was accepted
        z_bin = ((z + LOGIT_MAX) / LOGIT_STEP).long().clamp(0, LOGIT_BINS - 1)
        index = (survival * ECE_BINS).long().clamp(max=ECE_BINS - 1)[counted]
        extra = {
            "by_slot": torch.stack([(conf * before).sum(0), (hit & before).float().sum(0), before.float().sum(0)]),
            "bins": torch.stack([torch.bincount(index, weights=w[counted].float(), minlength=ECE_BINS)
                                 for w in (survival, prefix, torch.ones_like(survival))]),
            "chain": torch.stack([(survival * counted).sum(1)[real].sum(), real.sum().float()]),
            "logits": torch.stack([torch.bincount(z_bin, weights=hit[before].float(), minlength=LOGIT_BINS),
                                   torch.bincount(z_bin, minlength=LOGIT_BINS).float()]),
            "without_markov": torch.stack([plain_hit.float().sum(0), sup.float().sum(0)]),
            "without_markov_chain": torch.stack([plain_hit[real].long().cumprod(1).sum().float(),
                                                 real.sum().float()]),
        }
        return SlotScores(logits.transpose(0, 1), labels.t(), in_vocab.t(), sup.t(), chain=lambda hits: hits[:, real],
                          extra=extra)

    # by_slot: where the slots before were accepted, per slot: confidence, accepted, slots; bins: per survival bin:
    # predicted, observed, slots; chain: expected drafted tokens (sum of survivals), blocks; logits: per logit bin
    # where the prefix was accepted: accepted, slots; without_markov: per slot, hits without the Markov bias, slots
    # scored; without_markov_chain: accepted tokens of those chains, blocks
    zeros = {"by_slot": torch.zeros(3, S), "bins": torch.zeros(3, ECE_BINS), "chain": torch.zeros(2),
             "logits": torch.zeros(2, LOGIT_BINS), "without_markov": torch.zeros(2, S),
             "without_markov_chain": torch.zeros(2)}
    return evaluate_slots(score, source.rows, ids, 1, accelerator, pad_id, S, chained=True, extra=zeros,
                          summarise=held_out_extras)


def evaluate_calibrated(model: BlockDraft, target, source: FeatureSource, ids: list[int], cfg: DSparkTrainConfig,
                        accelerator: Accelerator, pad_id: int, scored: torch.Tensor) -> dict:
    """evaluate's held-out metrics; with calibrate_confidence, those of the head after the Platt scaling fitted to
    these rows is folded into it, and `confidence_calibration`: the fit and the head's figures before it."""
    metrics = evaluate(model, target, source, ids, cfg, accelerator, pad_id, scored)
    fit = metrics.pop("platt_fit")
    accelerator.print(f"held-out greedy chain: {metrics['chain_accepted_tokens']:.3f} tokens accepted, "
                      f"{metrics['without_markov']['chain_accepted_tokens']:.3f} without the Markov head")
    if not cfg.calibrate_confidence:
        return metrics
    before = {k: metrics[k] for k in ("expected_chain_tokens", "confidence_by_slot", "survival_ece")}
    model.draft.confidence_head.rescale(fit["scale"], fit["shift"])
    metrics = evaluate(model, target, source, ids, cfg, accelerator, pad_id, scored)
    del metrics["platt_fit"]
    metrics["confidence_calibration"] = {"scale": round(fit["scale"], 6), "shift": round(fit["shift"], 6),
                                         "slots": fit["slots"], "before": before}
    accelerator.print(f"confidence head calibrated on the held-out rows (Platt: scale {fit['scale']:.3f}, shift "
                      f"{fit['shift']:.3f}, {fit['slots']} slots): survival calibration error "
                      f"{before['survival_ece']:.3f} -> {metrics['survival_ece']:.3f}")
    return metrics


def build_draft(run: Run, cfg: DSparkTrainConfig) -> DSparkDraft:
    """DFlash's draft (train/dflash.py build_draft: mask token, draft vocabulary, initialisation) with the Markov and
    confidence heads added, freshly initialised."""
    backbone = dflash.build_draft(run, cfg)
    config = DSparkConfig(**dict(dataclasses.asdict(backbone.config), method="dspark", markov_rank=cfg.markov_rank,
                                 confidence_with_markov=cfg.confidence_with_markov, markov_context=cfg.markov_context))
    draft = DSparkDraft(config).to(run.accelerator.device)
    missing, unexpected = draft.load_state_dict(backbone.state_dict(), strict=False)
    assert not unexpected and all(n.startswith(("markov_head.", "confidence_head.")) for n in missing), missing
    draft.mask_embedding.requires_grad_(backbone.mask_embedding.requires_grad)  # mask_input target_row: frozen
    reads = " reading its slot" if cfg.markov_context else ""
    run.accelerator.print(f"DSpark heads: Markov rank {cfg.markov_rank}{reads}, confidence head over "
                          f"{draft.confidence_head.proj.in_features} features")
    return draft


def model_card(cfg: DSparkTrainConfig, info, stats: dict, metrics: dict) -> str:
    return heads_card(cfg, info, stats, metrics, CardText(
        title="DSpark draft", slot="slot",
        method=f"DSpark: a DFlash draft ({cfg.num_layers} decoder layers read the target's layers "
               f"{metrics['feature_layers']} and draft a block of {cfg.block_size - 1} tokens in one forward, mask token "
               f"{metrics['mask_token_id']}), a rank-{cfg.markov_rank} Markov head (a bias from the previous token"
               f"{' and the slot' if cfg.markov_context else ''}) and a "
               f"confidence head (the chance each slot is accepted"
               f"{', Platt-scaled on the held-out rows' if 'confidence_calibration' in metrics else ''})",
        table_caption="at block slot j: the token j positions after the anchor, Markov-corrected",
        lines=[f"Mean drafted tokens a greedy chain of {cfg.block_size - 1} gets accepted: "
               f"{metrics['chain_accepted_tokens']:.3f} (the confidence head expects "
               f"{metrics['expected_chain_tokens']:.3f}; survival calibration error {metrics['survival_ece']:.3f})",
               "Without the Markov head the same chain gets "
               f"{metrics['without_markov']['chain_accepted_tokens']:.3f}"]))


def main(argv: list[str] | None = None) -> dict:
    cfg = check_config(parse_config(DSparkTrainConfig, argv))

    def loss(draft: DSparkDraft, model, prep: dict, scored: torch.Tensor, denom: torch.Tensor) -> tuple:
        out = slot_outputs(model, prep)[prep["selected"]]  # [N, h]
        return dspark_loss(draft, out, prep, scored, denom.clamp(min=1e-9), cfg)

    def log(sums: dict, denom: torch.Tensor) -> dict:
        denom = denom.clamp(min=1e-9)
        acc = sums["hits"] / sums["slots"].clamp(min=1)
        return {"loss": float(sums["ce"] / denom), "bce": float(sums["bce"] / denom),
                "conf": round(float(sums["predicted"] / denom), 4), "accepted": round(float(sums["accepted"] / denom), 4),
                "acc": [round(float(a), 4) for a in acc]}

    return train_block_drafter(cfg, build_draft, loss, log, evaluate_calibrated, model_card, DSparkDraft,
                               {"markov_rank": cfg.markov_rank, "markov_context": cfg.markov_context},
                               lr_scales={"markov_head.": cfg.markov_lr_scale})

if __name__ == "__main__":
    run_main(main)
