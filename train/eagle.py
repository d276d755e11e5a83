"""Train an EAGLE-1 or EAGLE-3 draft layer on the target's own generations (the target stays frozen).

CPU (2 cores, the embedded SmolLM2-135M; self-distils the recipe's prompts first if data_dir is empty):
    python train/eagle.py --config recipes/smollm2-135m/eagle3.yaml --output_dir runs/eagle3-smollm2
    python train/eagle.py --config recipes/smollm2-135m/eagle.yaml --output_dir runs/eagle-smollm2
Single GPU:
    accelerate launch --num_processes 1 train/eagle.py --config recipes/llama-3.1-8b-instruct/eagle3.yaml \
        --output_dir runs/eagle3-llama8b
Multi-GPU (DDP):
    accelerate launch --config_file recipes/accelerate/multi-gpu.yaml train/eagle.py \
        --config recipes/llama-3.1-8b-instruct/eagle3.yaml --output_dir runs/eagle3-llama8b
Preempted? Run the same command with --resume: it continues from the newest checkpoint in DIR/checkpoints.
The run itself (data, schedule, resume, logging, checkpoints, heads directory) is train/loop.py's.

Alignment (what inference does): draft position t reads the pair (feature f_t, token x_{t+1}) at position id t and
predicts the target's next feature f_{t+1} and its distribution p_{t+1} = softmax(target logits at t+1), i.e. the
token x_{t+2}. Position t is supervised iff t + 2 < T and loss_mask[t + 2] = 1 (the token is target-written); with
`supervise_prompt` every real position t + 2 < T in training (prompt and user turns too: the pair read and the
target's feature and distribution there are as exact as on an answer), and held-out figures stay on loss_mask.

EAGLE-1 (`method: eagle`): f_t is the target's final-norm hidden state; loss = feature_loss_weight * SmoothL1(f_hat,
f_{t+1}) + prob_loss_weight * soft-CE(p_{t+1}, draft logits through the target's frozen lm_head), with uniform noise
U(-feature_noise, feature_noise) added to the input features.
EAGLE-3 (`method: eagle3`): f_t = fc(cat(hidden_states[i] for i in feature_layers)); training-time test: the draft is
unrolled `ttt_steps` times on its own outputs (step i at query t: token x_{t+1}, position id t, feature = step i-1's
output at t-1; it sees the true prefix up to t-i and its own chain, exactly the keys of a depth-(i+1) tree node at
inference), loss sum_i ttt_decay^i soft-CE(target probs over the draft vocabulary, draft logits), positions whose target
argmax lies outside the draft vocabulary masked. The draft vocabulary is the `draft_vocab_size` most frequent
target-written tokens of the training rows; the draft's lm_head and norm start from the target's.

Target features: online, in memory or from an offline cache on disk (train/features.py).
The loss is a mean over supervised positions of the whole global batch (per unrolled step), so N processes x batch b
give the same loss and gradients as 1 process x batch N*b.

Output: DIR/heads (config.json, model.safetensors, README.md, metrics.json, ngram.safetensors), DIR/checkpoints,
DIR/train_log.jsonl.
Load the draft with `headstart.heads.load.load_heads(DIR/heads, target_info)`.
metrics.json (held-out rows = the last `eval_rows` rows): per draft depth d = 1..eval_depth (the draft unrolled on its
own outputs along the true tokens, as at inference): `top1`, `top5`, `rank_accuracy` [depth][10] (P(the data token is
exactly the rank-r draft guess), for sizing trees), `eval_positions`; `chain_accepted_tokens` (mean drafted tokens a
greedy chain of eval_depth would get accepted); `target_top1` (the target's own next-token accuracy at the same
positions); EAGLE-3: `draft_vocab_coverage` (share of held-out supervised tokens inside the draft vocabulary).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DistributedType

from headstart.heads.draft_vocab import coverage, most_frequent_tokens
from headstart.heads.eagle import NORM_FLAGS, EagleDraft, eagle_config_for
from headstart.train.card import CardText, heads_card
from headstart.train.cli import run_main
from headstart.train.config import ConfigError, TrainRunConfig, check_number, check_run_config, parse_config
from headstart.train.data import row_generator, shifted_labels, supervised_token_counts
from headstart.train.eagle_unroll import UnrolledDraft
from headstart.train.evaluate import SlotScores, evaluate_slots
from headstart.train.features import FeatureSource, open_feature_source
from headstart.train.from_target import copy_last_layers
from headstart.train.loop import Run, accumulate, end_run, finish_run, start_run, train
from headstart.train.sharding import plain_model


@dataclass
class EagleTrainConfig(TrainRunConfig):
    output_dir: str = "runs/eagle"  # where the heads directory, checkpoints and train_log.jsonl go
    learning_rate: float = 1e-4  # peak learning rate (cosine schedule with warmup)
    warmup_ratio: float = 0.05  # share of the optimizer steps the learning rate warms up over, in [0, 1)
    max_grad_norm: float = 0.5  # gradients are clipped to this global norm
    # draft
    method: str = "eagle3"  # eagle (EAGLE-1) | eagle3
    feature_layers: Optional[list[int]] = None  # HF hidden_states indices; None: eagle [L], eagle3 [2, L//2, L-3]
    draft_vocab_size: int = 0  # eagle3: most frequent target tokens kept; 0 = the whole target vocabulary
    ttt_steps: Optional[int] = None  # unrolled training-time-test steps; None: eagle 1, eagle3 7
    ttt_decay: float = 0.8  # step i's loss weight is ttt_decay ** i (i = 0..ttt_steps-1)
    feature_noise: Optional[float] = None  # U(-a, a) added to the input features; None: eagle 0.1, eagle3 0
    feature_loss_weight: float = 1.0  # eagle: SmoothL1(f_hat, f) weight
    prob_loss_weight: float = 0.1  # eagle: soft cross-entropy weight (eagle3 uses soft CE alone, weight 1)
    init_layer_from_target: bool = False  # start the decoder layer from the target's last layer (matching shapes)
    # eagle3's optional RMSNorms (heads/eagle.py); None: eagle3 DEFAULT_NORMS, eagle off (EAGLE-1 has none)
    norm_before_fc: Optional[bool] = None  # one RMSNorm over the concatenated taps before fc
    norm_before_residual: Optional[bool] = None  # the residual around the attention is hidden_norm(feature)
    norm_output: Optional[bool] = None  # feed norm(output) back as the next step's feature
    eval_depth: int = 0  # depths evaluated on held-out rows; 0 = max(3, ttt_steps)
    # supervise_prompt None: eagle3 on (higher held-out acceptance, docs/heads_training.md), eagle off (not measured)
    supervise_prompt: Optional[bool] = None  # train on prompt and user-turn positions too (evaluation: answers only); None: eagle3 on, eagle off
    # optimiser
    # optimizer muon (eagle3): Muon on the draft's fc and decoder-layer matrices, AdamW on the lm_head, norms and
    # biases (train/muon.py). None: eagle3 muon (higher held-out acceptance, docs/heads_training.md), adamw where FSDP
    # or DeepSpeed shard the matrices; eagle adamw
    optimizer: Optional[str] = None  # adamw | muon (eagle3 only); None: muon for eagle3, adamw for eagle and FSDP/DeepSpeed
    adam_beta1: float = 0.9  # AdamW beta1, in [0, 1)
    adam_beta2: float = 0.95  # AdamW beta2, in [0, 1)


# eagle3 with the norm flags unset: all three RMSNorms on (speculators' default draft), since they raise the held-out
# accuracy at every depth (docs/heads_training.md). A heads dir saved without the keys loads as norms off (heads/eagle.py).
DEFAULT_NORMS = {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}


def check_config(cfg: EagleTrainConfig) -> EagleTrainConfig:
    """Validate, and return a copy with the method-dependent defaults (None / 0) filled in."""
    check_run_config(cfg, ("eagle", "eagle3"))
    if cfg.method == "eagle" and cfg.draft_vocab_size:
        raise ConfigError("EAGLE-1 drafts over the target's whole vocabulary (its lm_head): draft_vocab_size needs method eagle3")
    eagle3 = cfg.method == "eagle3"
    ttt = cfg.ttt_steps if cfg.ttt_steps is not None else (7 if eagle3 else 1)
    noise = cfg.feature_noise if cfg.feature_noise is not None else (0.0 if eagle3 else 0.1)
    norms = {n: getattr(cfg, n) if getattr(cfg, n) is not None else eagle3 and DEFAULT_NORMS[n] for n in NORM_FLAGS}
    if not eagle3 and any(norms.values()):
        raise ConfigError(f"{', '.join(n for n in NORM_FLAGS if norms[n])}: EAGLE-3 draft options; set them false or "
                          "use method: eagle3")
    if cfg.optimizer not in (None, "adamw", "muon") or (cfg.optimizer == "muon" and not eagle3):
        raise ConfigError(f"optimizer must be adamw or muon (muon: method eagle3), got {cfg.optimizer!r}")
    if ttt < 1 or not noise >= 0 or cfg.eval_depth < 0:
        raise ConfigError("ttt_steps must be >= 1, feature_noise and eval_depth >= 0")
    check_number(cfg, "draft_vocab_size", 0)
    check_number(cfg, "ttt_decay", 0, above=True)
    check_number(cfg, "feature_noise", 0)
    check_number(cfg, "feature_loss_weight", 0)
    check_number(cfg, "prob_loss_weight", 0)
    check_number(cfg, "adam_beta1", 0, high=1, below=True)
    check_number(cfg, "adam_beta2", 0, high=1, below=True)
    supervise_prompt = cfg.supervise_prompt if cfg.supervise_prompt is not None else eagle3
    return dataclasses.replace(cfg, ttt_steps=ttt, feature_noise=noise, eval_depth=cfg.eval_depth or max(3, ttt),
                               supervise_prompt=supervise_prompt, **norms)


def optimizer_for(cfg: EagleTrainConfig, accelerator: Accelerator) -> str:
    """The run's optimizer: cfg.optimizer when set; else Muon for EAGLE-3, AdamW for EAGLE-1 and wherever FSDP or
    DeepSpeed shard the weight matrices Muon orthogonalises whole (said in the log)."""
    if cfg.optimizer is not None:
        return cfg.optimizer
    if cfg.method != "eagle3":
        return "adamw"
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        accelerator.print(f"optimizer: adamw, as {accelerator.distributed_type.value} shards the weight matrices "
                          "that EAGLE-3's default optimizer muon orthogonalises whole")
        return "adamw"
    return "muon"


def param_groups(draft: EagleDraft, optimizer: str) -> list[dict]:
    """adamw: one group. muon: the fc and decoder-layer weight matrices in a Muon group, the rest (lm_head, norms,
    biases) in an AdamW group."""
    if optimizer != "muon":
        return [{"params": list(draft.parameters())}]
    muon, adamw = [], []
    for name, p in draft.named_parameters():
        matrix = p.ndim == 2 and (name.startswith("fc.") or name.startswith("layers."))
        (muon if matrix else adamw).append(p)
    return [{"params": muon, "muon": True}, {"params": adamw}]


def row_noise(rows: list[int], lengths: list[int], width: int, scale: float, seed: int, step: int) -> torch.Tensor:
    """U(-scale, scale) noise [B, max(lengths), width], drawn per (seed, step, row) (row_generator): the same whatever
    the batch layout, process count or resume point."""
    out = torch.zeros(len(rows), max(lengths), width)
    for b, (r, n) in enumerate(zip(rows, lengths)):
        out[b, :n] = (torch.rand(n, width, generator=row_generator(seed, step, r)) * 2 - 1) * scale
    return out


# ----------------------------------------------------------------------------------------------------
# draft vocabulary and initialisation


@torch.no_grad()
def init_from_target(draft: EagleDraft, target, layer: bool) -> list[str]:
    """EAGLE-3: lm_head <- the target's lm_head rows of the draft vocabulary, norm <- the target's final norm.
    `layer`: the decoder layer <- the target's last layer (train/from_target.py; q/k/v read 2h in EAGLE-3: their
    feature half gets the target's weight). Returns the names initialised."""
    done = []
    if draft.is_eagle3:
        ids = torch.nonzero(draft.t2d).squeeze(-1)
        draft.lm_head.weight.copy_(target.get_output_embeddings().weight[ids])
        draft.norm.weight.copy_(target.get_decoder().norm.weight)
        done += ["lm_head", "norm"]
    if layer:
        done += copy_last_layers(draft.layers, target, draft.config.hidden_size)
    return done


# ----------------------------------------------------------------------------------------------------
# targets and loss


@torch.no_grad()
def prepare_batch(batch: dict, source: FeatureSource, target, draft: EagleDraft, cfg: EagleTrainConfig, pad_id: int,
                  step: int | None) -> dict:
    """Target-side tensors of one micro-batch (no gradient). `step` None: no feature noise (evaluation).

    select [B, T]: supervised draft positions t (t + 2 < T, loss_mask[t + 2] = 1; in training with supervise_prompt
    attention_mask[t + 2] = 1); at its N positions: t_index [N],
    labels [N] (x_{t+2}), target_argmax [N], probs [N, draft_vocab] (target softmax at t+1, restricted to the draft
    vocabulary for EAGLE-3), in_vocab [N] (target argmax inside the draft vocabulary), feature_target [N, h] (f_{t+1}).
    """
    ids, attn = batch["input_ids"], batch["attention_mask"]
    B, T = ids.shape
    taps, final = source.batch(batch)
    supervised = attn if cfg.supervise_prompt and step is not None else batch["loss_mask"]
    labels, select = shifted_labels(ids, supervised, 2)
    next_final = final[:, 1:][select[:, :-1]]  # [N, h]: the target's state at t+1 (select is False at T-2, T-1)
    lm_head_weight = target.get_output_embeddings().weight  # [V, h]
    argmax, chunks = [], []
    draft_ids = draft.to_target_ids(torch.arange(draft.config.draft_vocab_size, device=ids.device)) \
        if draft.is_eagle3 else None  # t2d's ids in increasing order (set_draft_vocab), without nonzero()'s sync
    for part in next_final.split(2048):  # bounded memory: [<=2048, V] logits at a time
        logits = (part @ lm_head_weight.t()).float()
        argmax.append(logits.argmax(-1))
        chunks.append(torch.softmax(logits[:, draft_ids] if draft.is_eagle3 else logits, -1))
    argmax = torch.cat(argmax) if argmax else torch.zeros(0, dtype=torch.long, device=ids.device)
    probs = torch.cat(chunks) if chunks else next_final.new_zeros(0, draft.config.draft_vocab_size).float()
    if cfg.feature_noise and step is not None:
        lengths = attn.sum(1).tolist()
        taps = taps + row_noise(batch["rows"].tolist(), lengths, taps.shape[-1], cfg.feature_noise, cfg.seed,
                                step)[:, :T].to(taps.device, taps.dtype)
    next_ids = F.pad(ids[:, 1:], (0, 1), value=pad_id)  # x_{t+1} at t
    return {
        "embeds": target.get_input_embeddings()(next_ids), "taps": taps, "key_valid": attn.bool(), "select": select,
        "t_index": torch.arange(T, device=ids.device).expand(B, T)[select], "labels": labels[select],
        "target_argmax": argmax, "probs": probs,
        "in_vocab": draft.t2d[argmax] if draft.is_eagle3 else torch.ones_like(argmax, dtype=torch.bool),
        "feature_target": next_final,
    }


def step_valid(prep: dict, steps: int) -> torch.Tensor:
    """[S, N] bool: unrolled step i is supervised at t iff t >= i and the target's argmax is in the draft vocab."""
    i = torch.arange(steps, device=prep["t_index"].device)[:, None]
    return (prep["t_index"][None] >= i) & prep["in_vocab"][None]


def step_weights(cfg: EagleTrainConfig, steps: int, device) -> torch.Tensor:
    """[S]: unrolled step i's loss weight ttt_decay ** i."""
    return torch.tensor([cfg.ttt_decay ** i for i in range(steps)], device=device)


def step_losses(ce: torch.Tensor, feature: torch.Tensor, cfg: EagleTrainConfig, eagle3: bool) -> torch.Tensor:
    """[S] per-step losses from per-step soft-CE and feature-loss [S]: EAGLE-3 the soft CE alone, EAGLE-1
    prob_loss_weight * soft CE + feature_loss_weight * SmoothL1."""
    return ce if eagle3 else cfg.prob_loss_weight * ce + cfg.feature_loss_weight * feature


def draft_loss(outs: torch.Tensor, logits: torch.Tensor, prep: dict, valid: torch.Tensor, denom: torch.Tensor,
               cfg: EagleTrainConfig, draft: EagleDraft) -> tuple[torch.Tensor, dict]:
    """sum_i decay^i (w_p * sum soft-CE_i + w_f * sum SmoothL1_i) / denom_i.  outs [S, N, h], logits [S, N, dv].

    Returns (loss, per-step sums [S] of: ce, feature loss, top-1 agreement with the target)."""
    S, eagle3 = logits.shape[0], draft.is_eagle3
    ce = -(prep["probs"][None] * F.log_softmax(logits.float(), -1)).sum(-1)  # [S, N]
    ce_sums = (ce * valid).sum(-1)
    if eagle3:
        fl_sums = torch.zeros_like(ce_sums)
    else:
        fl = F.smooth_l1_loss(outs.float(), prep["feature_target"][None].float().expand_as(outs), reduction="none").mean(-1)
        fl_sums = (fl * valid).sum(-1)
    loss = (step_weights(cfg, S, ce.device) * step_losses(ce_sums, fl_sums, cfg, eagle3) / denom.clamp(min=1)).sum()
    with torch.no_grad():
        guess = draft.to_target_ids(logits.argmax(-1))
        hits = ((guess == prep["target_argmax"][None]) & valid).sum(-1).float()
    return loss, {"ce": ce_sums.detach(), "feature": fl_sums.detach(), "hits": hits}


# ----------------------------------------------------------------------------------------------------
# evaluation


def evaluate(model: UnrolledDraft, target, source: FeatureSource, ids: list[int], cfg: EagleTrainConfig,
             accelerator: Accelerator, pad_id: int) -> dict:
    """Per-depth ranks of the data token on the held-out rows source.rows[ids] (train/evaluate.py), the greedy
    chain's accepted tokens, the target's own next-token accuracy and (EAGLE-3) the draft vocabulary's coverage."""
    draft, D = model.draft, cfg.eval_depth
    lm_head_weight = None if draft.is_eagle3 else target.get_output_embeddings().weight

    def score(batch: dict) -> SlotScores:
        prep = prepare_batch(batch, source, target, draft, cfg, pad_id, step=None)
        with accelerator.autocast():
            _, logits = model(prep["embeds"], prep["taps"], prep["key_valid"], prep["select"], D, lm_head_weight)
        labels, select = prep["labels"], prep["select"]  # [N], [B, T]
        label_d, in_vocab = draft.to_draft_labels(labels)
        depth_ok = prep["t_index"][None] >= torch.arange(D, device=labels.device)[:, None]  # [D, N]

        def chain(hits: torch.Tensor) -> torch.Tensor:
            """[D, N] -> [D, N]: the greedy chain from each root n, whose depth d+1 output sits at position n+d of
            step d."""
            B, T = select.shape
            grid = torch.zeros(D, B, T + D, dtype=torch.bool, device=hits.device)
            grid[:, :, :T][:, select] = hits
            return torch.stack([grid[d, :, d : d + T] for d in range(D)])[:, select]

        ratios = {"target_top1": ((prep["target_argmax"] == labels).sum(), labels.numel()),
                  "draft_vocab_coverage": (in_vocab.sum(), labels.numel())}
        return SlotScores(logits.float(), label_d[None].expand(D, -1), in_vocab[None], depth_ok, chain, ratios)

    names = ("target_top1", "draft_vocab_coverage") if draft.is_eagle3 else ("target_top1",)
    return evaluate_slots(score, source.rows, ids, cfg.per_device_batch_size, accelerator, pad_id, D, chained=True,
                          ratios=names)


# ----------------------------------------------------------------------------------------------------
# output


def model_card(cfg: EagleTrainConfig, info, stats: dict, metrics: dict) -> str:
    if cfg.method == "eagle3":
        method = (f"EAGLE-3: features from target layers {metrics['feature_layers']} fused, one decoder layer, own lm_head "
                  f"over a {metrics['draft_vocab_size']}-token draft vocabulary, training-time test over {cfg.ttt_steps} steps, "
                  f"optimizer {cfg.optimizer}")
    else:
        method = "EAGLE-1: the target's final hidden state + next token -> one decoder layer -> the target's lm_head"
    lines = [f"Mean drafted tokens a greedy chain of {len(metrics['top1'])} would get accepted: "
             f"{metrics['chain_accepted_tokens']:.3f}",
             f"Target's own next-token top-1 on the same positions: {metrics['target_top1']:.3f}"]
    if "draft_vocab_coverage" in metrics:
        lines.append(f"Share of held-out target-written tokens inside the draft vocabulary: {metrics['draft_vocab_coverage']:.3f}")
    return heads_card(cfg, info, stats, metrics, CardText(
        title=f"{'EAGLE-3' if cfg.method == 'eagle3' else 'EAGLE-1'} draft", method=method, slot="depth", lines=lines,
        table_caption="at draft depth d: the draft run on its own outputs along the true tokens, as in a tree"))


# ----------------------------------------------------------------------------------------------------


def build_draft(run: Run, cfg: EagleTrainConfig) -> EagleDraft:
    """The draft for the target: its config (feature taps checked), draft vocabulary, initialisation."""
    target, info = run.target, run.info
    try:
        draft_config = eagle_config_for(target, cfg.method, cfg.draft_vocab_size, cfg.feature_layers, info,
                                        **{n: getattr(cfg, n) for n in NORM_FLAGS})
    except ValueError as err:
        raise ConfigError(str(err)) from err
    L = info.num_hidden_layers
    if not all(0 <= i <= L for i in draft_config.feature_layers):
        raise ConfigError(f"feature_layers {draft_config.feature_layers} must be hidden_states indices in 0..{L}")
    if cfg.method == "eagle" and draft_config.feature_layers != [L]:
        raise ConfigError(f"EAGLE-1 reads the final-norm hidden state (feature_layers [{L}]), "
                          f"got {draft_config.feature_layers}")
    draft = EagleDraft(draft_config)
    if draft.is_eagle3:
        counts = supervised_token_counts(run.train_rows, info.vocab_size)
        draft.set_draft_vocab(most_frequent_tokens(counts, draft_config.draft_vocab_size))
        covered = coverage(counts, draft.to_target_ids(torch.arange(draft_config.draft_vocab_size)))
        run.accelerator.print(f"draft vocabulary: {draft_config.draft_vocab_size} of {info.vocab_size} target tokens cover "
                f"{covered:.4f} of the target-written training tokens")
    initialised = init_from_target(draft, target, cfg.init_layer_from_target)
    if initialised:
        run.accelerator.print(f"initialised from the target: {', '.join(initialised)}")
    return draft.to(run.accelerator.device)


def main(argv: list[str] | None = None) -> dict:
    cfg = check_config(parse_config(EagleTrainConfig, argv))
    eagle3 = cfg.method == "eagle3"
    run = start_run(cfg)
    accelerator, target = run.accelerator, run.target
    run.cfg = cfg = dataclasses.replace(cfg, optimizer=optimizer_for(cfg, accelerator))  # recorded in metrics.json
    draft = build_draft(run, cfg)
    layers = draft.config.feature_layers

    all_rows = run.train_rows + run.eval_rows
    source = open_feature_source(cfg, target, run.info, all_rows, layers, accelerator)
    if cfg.build_cache_only:
        end_run(accelerator, run.claim)
        return {"feature_cache_dir": cfg.feature_cache_dir, **source.identity}

    S = cfg.ttt_steps
    lm_head_weight = None if eagle3 else target.get_output_embeddings().weight  # EAGLE-1 drafts through it, frozen

    def step_fn(model, micro: list[dict], step: int) -> dict:
        unwrapped = accelerator.unwrap_model(model).draft
        # target side first: the per-step denominators are counts over the whole global batch
        preps = [prepare_batch(b, source, target, unwrapped, cfg, run.pad_id, step) for b in micro]
        valids = [step_valid(p, S) for p in preps]
        denom = accelerator.reduce(torch.stack([v.sum(-1) for v in valids]).sum(0).float(), "sum")  # [S]

        def micro_loss(item: tuple[dict, torch.Tensor]) -> tuple[torch.Tensor, dict]:
            prep, valid = item
            outs, logits = model(prep["embeds"], prep["taps"], prep["key_valid"], prep["select"], S, lm_head_weight)
            return draft_loss(outs, logits, prep, valid, denom, cfg, unwrapped)

        sums = accumulate(accelerator, model, list(zip(preps, valids)), micro_loss)
        # the exact global per-step means
        means = {k: accelerator.reduce(v, "sum") / denom.clamp(min=1) for k, v in sums.items()}
        loss = (step_weights(cfg, S, denom.device) * step_losses(means["ce"], means["feature"], cfg, eagle3)).sum()
        fields = {"loss": float(loss), "ce": [round(float(c), 6) for c in means["ce"]],
                  "acc": [round(float(a), 4) for a in means["hits"]]}
        if not eagle3:
            fields["feature_loss"] = [round(float(c), 6) for c in means["feature"]]
        return fields

    trained = train(run, UnrolledDraft(draft), param_groups(draft, cfg.optimizer), step_fn,
                    betas=(cfg.adam_beta1, cfg.adam_beta2))
    if not trained.finished:
        return {"step": trained.step}
    # under FSDP or DeepSpeed: an unsharded copy of its own for the trained tensors
    model = plain_model(accelerator, trained.model, lambda: UnrolledDraft(EagleDraft(draft.config)).to(accelerator.device))
    model.eval()
    n_train = len(run.train_rows)
    metrics = evaluate(model, target, source, list(range(n_train, len(all_rows))), cfg, accelerator, run.pad_id)
    metrics.update({"feature_layers": layers, "draft_vocab_size": draft.config.draft_vocab_size, "ttt_steps": S,
                    "feature_source": source.mode})
    return finish_run(run, trained, metrics, model.draft.save_pretrained, model_card, "depth")


if __name__ == "__main__":
    run_main(main)
