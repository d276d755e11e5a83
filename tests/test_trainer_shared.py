"""What the three trainers share: the held-out evaluation (train/evaluate.py) and the model card (train/card.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from accelerate import Accelerator
from huggingface_hub import ModelCard

from headstart.heads.target import TargetInfo
from headstart.train.card import CardText, heads_card
from headstart.train.evaluate import SlotScores, evaluate_slots


def test_evaluate_slots_counts_ranks_chains_and_ratios_exactly():
    """Two slots over three positions of one batch; the chain is the positions' slot hits in order."""
    logits = torch.tensor([[[3.0, 1.0, 2.0], [0.0, 5.0, 1.0], [1.0, 2.0, 3.0]],
                           [[3.0, 1.0, 2.0], [float("nan"), 0.0, 0.0], [1.0, 2.0, 3.0]]])  # [K=2, N=3, V=3]
    labels = torch.tensor([[0, 1, 0], [2, 0, 2]])  # ranks: slot 1: 0, 0, 2; slot 2: 1, then misses
    draftable = torch.tensor([[True, True, True], [True, True, False]])  # slot 2: a NaN row, an undraftable truth
    counted = torch.tensor([[True, True, True], [True, True, True]])

    def score(batch: dict) -> SlotScores:
        assert batch["rows"].tolist() == [1, 2] and batch["input_ids"].shape == (2, 3)
        return SlotScores(logits, labels, draftable, counted, chain=lambda hits: hits,
                          ratios={"target_top1": (torch.tensor(3), 4)})

    short, long = {"input_ids": [5, 6], "loss_mask": [0, 1]}, {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}
    rows = [short, short, long, short]
    out = evaluate_slots(score, rows, [1, 2], 8, Accelerator(cpu=True), 0, 2, chained=True, ratios=("target_top1",))
    assert list(out) == ["top1", "top5", "rank_accuracy", "eval_positions", "chain_accepted_tokens", "target_top1"]
    assert out["top1"] == [round(2 / 3, 4), 0.0] and out["top5"] == [1.0, round(1 / 3, 4)]
    assert out["rank_accuracy"][0][:3] == [round(2 / 3, 5), 0.0, round(1 / 3, 5)]
    assert out["rank_accuracy"][1][:2] == [0.0, round(1 / 3, 5)] and out["eval_positions"] == [3, 3]
    assert out["chain_accepted_tokens"] == round(2 / 3, 4)  # chains: hit then miss (1), hit then miss (1), miss (0)
    assert out["target_top1"] == 0.75


def test_evaluate_slots_sums_extra_over_batches_and_hands_them_to_summarise():
    """Each batch's extra sums add to the zeros given; summarise sees the totals, its figures follow the rest."""
    logits, labels = torch.tensor([[[2.0, 1.0]]]), torch.tensor([[0]])  # [K=1, N=1, V=2]: one hit per batch
    ones = torch.ones(1, 1, dtype=torch.bool)
    seen = []

    def score(batch: dict) -> SlotScores:
        row = float(batch["rows"][0])
        return SlotScores(logits, labels, ones, ones, extra={"pair": torch.tensor([row, 1.0]), "n": torch.tensor(1.0)})

    def summarise(sums: dict) -> dict:
        seen.append({k: v.tolist() for k, v in sums.items()})
        return {"mean_row": float(sums["pair"][0] / sums["pair"][1]), "batches": int(sums["n"])}

    rows = [{"input_ids": [5, 6], "loss_mask": [0, 1]}] * 4
    zeros = {"pair": torch.zeros(2), "n": torch.zeros(())}
    out = evaluate_slots(score, rows, [0, 1, 3, 0], 1, Accelerator(cpu=True), 0, 1, extra=zeros, summarise=summarise)
    assert list(out) == ["top1", "top5", "rank_accuracy", "eval_positions", "mean_row", "batches"]
    assert seen == [{"pair": [4.0, 4.0], "n": 4.0}] and out["mean_row"] == 1.0 and out["batches"] == 4
    assert zeros["pair"].tolist() == [0.0, 0.0]  # the zeros given stay zeros
    assert out["top1"] == [1.0] and out["eval_positions"] == [4]


def test_heads_card_metadata_names_target_license_method_and_figures():
    info = TargetInfo("smollm2-135m", "llama", 576, 30, 49152, "abc123")
    cfg = SimpleNamespace(method="eagle3", data_dir="runs/sd", max_length=1024, learning_rate=1e-4, warmup_ratio=0.05)
    metrics = {"top1": [0.5, 0.25], "top5": [0.75, 0.5], "chain_accepted_tokens": 0.7, "target_top1": 0.99,
               "steps": 3, "global_batch": 4, "train_seconds": 12.3}
    text = heads_card(cfg, info, {"train_rows": 20, "eval_rows": 4}, metrics,
                      CardText("EAGLE-3 draft", "EAGLE-3: one layer", "depth", "at draft depth d", ["Mean: 0.700"]))
    data = ModelCard(text).data
    assert data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct" and data.license == "apache-2.0"
    assert data.library_name == "headstart" and data.tags == ["speculative-decoding", "eagle3"]
    figures = {r.metric_type: r.metric_value for r in data.eval_results}
    assert figures == {"top1_depth1": 0.5, "top5_depth1": 0.75, "top1_depth2": 0.25, "top5_depth2": 0.5,
                       "chain_accepted_tokens": 0.7, "target_top1": 0.99}
    assert "| 2 | 0.250 | 0.500 |" in text and "fingerprint `abc123`" in text and "Mean: 0.700" in text
    assert "from headstart.inference.speculator import Speculator" in text and "heads.load" not in text
