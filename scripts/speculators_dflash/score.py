"""One evaluator for two DFlash trainers: headstart's held-out DFlash metric (train/dflash.py's evaluation: rows,
anchors, slots, rank histogram, greedy chain) computed on speculators 0.9.0's own DFlash forward (`_backbone_forward`),
for docs/measured.md "DFlash against the reference trainer".

Held-out rows, anchors and labels come from headstart's functions (prepare_rows, collate, block_inputs with step None:
up to `eval_anchors` evenly spaced valid anchors); the target's taps from headstart's target_features at the
speculators model's `aux_hidden_state_layer_ids`. Only the draft's logits come from speculators: its random anchor
choice is replaced by headstart's anchors for the scoring forward, nothing else.

The speculators module comes from
  --spec_ckpt DIR        a checkpoint speculators' trainer wrote (DIR/config.json + model.safetensors), or
  --headstart_heads DIR  a headstart DFlash heads directory loaded INTO speculators' DFlashDraftModel (the check that
                         both forwards agree: same tensor names; taps = feature_layers; in-block attention as trained;
                         draft vocabulary = token_map as t2d/d2t; the mask token's embedding row = the trained
                         mask_embedding). It must reproduce the heads' metrics.json exactly.

    SPEC_PYTHON scripts/speculators_dflash/score.py --data_dir runs/sd --train_rows 89 --eval_rows 16 \
        --spec_ckpt ref/run/7 --out ref/score.json
"""

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import Qwen3Config

import speculators.models.dflash.core as core
from speculators.models.dflash import DFlashDraftModel

from headstart.heads.target import load_target, target_source
from headstart.train.data import collate
from headstart.train.dflash import DFlashTrainConfig, block_inputs
from headstart.train.features import target_features
from headstart.train.evaluate import rank_summary, truth_rank
from headstart.train.loop import ensure_data, prepare_rows

def load_spec_ckpt(path: str, verifier: str) -> DFlashDraftModel:
    cfg = DFlashDraftModel.config_class.from_pretrained(path)
    cfg.transformer_layer_config._attn_implementation = "sdpa"
    cfg.speculators_config.verifier.name_or_path = verifier
    model = DFlashDraftModel.from_pretrained(path, config=cfg)
    # speculators' checkpointer stores every float tensor in bf16 (save_checkpoint float_dtype default), even after an
    # fp32 run: compute in fp32 on those stored weights, and reload the frozen verifier parts (embedding, lm_head,
    # verifier norm) in the verifier's own fp32
    model.float()
    model.load_verifier_weights()
    return model


def load_headstart_heads(path: str, verifier: str) -> DFlashDraftModel:
    hcfg = json.loads((Path(path) / "config.json").read_text())
    weights = load_file(str(Path(path) / "model.safetensors"))
    layer_config = Qwen3Config(**hcfg["layer_config"], tie_word_embeddings=False)
    causal = hcfg.get("block_causal", False)
    if causal:  # speculators masks a block causally only in sliding-window layers: one wider than any row
        layer_config.layer_types = ["sliding_attention"] * layer_config.num_hidden_layers
        layer_config.sliding_window = layer_config.max_position_embeddings
    V, Vd = hcfg["vocab_size"], hcfg["draft_vocab_size"]
    t2d = d2t = None
    if Vd:
        token_map = weights["token_map"].long()
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[token_map] = True
        assert torch.equal(torch.nonzero(t2d).squeeze(-1), token_map), "token_map must be increasing"
        d2t = token_map - torch.arange(Vd)
    model = DFlashDraftModel.from_training_args(
        verifier_config=layer_config, t2d=t2d, d2t=d2t, verifier_name_or_path=verifier,
        draft_vocab_size=Vd or V, block_size=hcfg["block_size"], target_layer_ids=hcfg["feature_layers"],
        mask_token_id=hcfg["mask_token_id"], sliding_window_non_causal=not causal,
        draft_attn_impl="sdpa")
    body = {k: v for k, v in weights.items() if k not in ("token_map", "mask_embedding")}
    missing, unexpected = model.load_state_dict(body, strict=False)
    assert not unexpected, unexpected
    trained_missing = [k for k in missing if not k.startswith(("embed_tokens", "lm_head", "verifier_", "t2d", "d2t"))]
    assert not trained_missing, trained_missing
    emb = model.embed_tokens.weight.detach().clone()
    emb[hcfg["mask_token_id"]] = weights["mask_embedding"]
    model.embed_tokens.weight = torch.nn.Parameter(emb, requires_grad=False)
    return model


@torch.no_grad()
def spec_logits(model: DFlashDraftModel, taps, ids, loss_mask, anchors) -> torch.Tensor:
    """speculators' forward at the given anchors [K] of one row -> logits [K, block_size, V_draft]."""
    # block_size padding positions past the row (document -1, loss_mask 0: never visible to any block) so that the
    # targets speculators computes for blocks reaching past the row end (unused here) stay in range
    T, B = ids.shape[1], model.block_size
    K = anchors.numel()
    taps = torch.cat([taps, taps.new_zeros(1, B, taps.shape[-1])], 1)
    ids = torch.cat([ids, ids.new_zeros(1, B)], 1)
    loss_mask = torch.cat([loss_mask, loss_mask.new_zeros(1, B)], 1)
    doc = torch.cat([torch.zeros(1, T, dtype=torch.long), torch.full((1, B), -1)], 1)
    orig = core.select_anchors
    core.select_anchors = lambda lm, n, bs: (anchors.clone(), torch.ones(K, dtype=torch.bool))
    try:
        _, logits, _, _, _ = model._backbone_forward(
            taps, ids, loss_mask, torch.zeros(1, T + B, model.hidden_size), doc, torch.arange(T + B)[None],
            max_anchors=K)
    finally:
        core.select_anchors = orig
    return logits[0].view(K, model.block_size, -1).float()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--train_rows", type=int, default=-1)
    ap.add_argument("--eval_rows", type=int, default=16)
    ap.add_argument("--max_length", type=int, default=512)
    ap.add_argument("--eval_anchors", type=int, default=64)
    ap.add_argument("--spec_ckpt")
    ap.add_argument("--headstart_heads")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.out and Path(a.out).exists():
        raise SystemExit(f"error: {a.out} exists: give a new file for the scores (nothing is overwritten)")

    verifier = str(target_source(a.target))
    model = load_spec_ckpt(a.spec_ckpt, verifier) if a.spec_ckpt else load_headstart_heads(a.headstart_heads, verifier)
    model.eval()
    cfg = DFlashTrainConfig(data_dir=a.data_dir, train_rows=a.train_rows, eval_rows=a.eval_rows,
                            max_length=a.max_length, eval_anchors=a.eval_anchors, block_size=model.block_size,
                            output_dir=a.out or ".")
    dataset, meta = ensure_data(cfg)
    target, tok, info = load_target(a.target, "float32", "cpu")
    target.requires_grad_(False)
    emb_same = torch.equal(target.get_input_embeddings().weight, model.embed_tokens.weight) if a.spec_ckpt else None
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    train_rows, eval_rows, stats = prepare_rows(dataset, meta, info, cfg)
    layers = list(model.target_layer_ids)
    S, R = model.block_size - 1, 10
    rank_counts = torch.zeros(S, R + 1)
    chain = torch.zeros(2)
    t2d = model.t2d if model.use_draft_vocab else None
    draft_index = (torch.cumsum(t2d.long(), 0) - 1) if t2d is not None else None
    for i, row in enumerate(eval_rows):
        batch = collate([row], pad_id)
        batch["rows"] = torch.tensor([len(train_rows) + i])
        blocks = block_inputs(batch, cfg, model.mask_token_id, None, cfg.eval_anchors)
        sup = blocks["supervised"][0]  # [K, S]
        real = sup[:, 0]
        K_real = int(real.sum())
        anchors = blocks["positions"][0].view(-1, model.block_size)[:K_real, 0]
        taps, _ = target_features(target, batch["input_ids"], batch["attention_mask"], layers)
        logits = spec_logits(model, taps, batch["input_ids"], batch["loss_mask"], anchors)[:, 1:]  # [K_real, S, Vd]
        labels = blocks["labels"][0][:K_real]  # [K_real, S] target ids
        if t2d is not None:
            in_vocab = t2d[labels]
            dl = torch.where(in_vocab, draft_index[labels], 0)
        else:
            in_vocab = torch.ones_like(labels, dtype=torch.bool)
            dl = labels
        truth = logits.gather(-1, dl[..., None])
        rank = torch.where(in_vocab, truth_rank(logits, truth, R), R)
        sup = sup[:K_real]
        for j in range(S):
            rank_counts[j] += torch.bincount(rank[:, j][sup[:, j]], minlength=R + 1).float()
        accepted = ((rank == 0) & sup).long().cumprod(1).sum(1)
        chain[0] += accepted.sum()
        chain[1] += K_real
    metrics = {**rank_summary(rank_counts), "chain_accepted_tokens": round(float(chain[0] / chain[1].clamp(min=1)), 4),
               "blocks": int(chain[1]), "rows": stats, "target_layer_ids": layers,
               "mask_token_id": model.mask_token_id, "draft_vocab": int(model.draft_vocab_size),
               "embed_tokens_equal_headstart_target": emb_same,
               "source": a.spec_ckpt or a.headstart_heads}
    print(json.dumps({k: metrics[k] for k in ("top1", "top5", "chain_accepted_tokens", "eval_positions", "blocks")}))
    if a.out:
        Path(a.out).write_text(json.dumps(metrics, indent=1))


if __name__ == "__main__":
    main()
