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
token x_{t+2}. Position t is supervised iff t + 2 < T and loss_mask[t + 2] = 1 (the token is target-written).

EAGLE-1 (`method: eagle`): f_t is the target's final-norm hidden state; loss = feature_loss_weight * SmoothL1(f_hat,
f_{t+1}) + prob_loss_weight * soft-CE(p_{t+1}, draft logits through the target's frozen lm_head), with uniform noise
U(-feature_noise, feature_noise) added to the input features.
EAGLE-3 (`method: eagle3`): f_t = fc(cat(hidden_states[i] for i in feature_layers)); training-time test: the draft is
unrolled `ttt_steps` times on its own outputs (step i at query t: token x_{t+1}, position id t, feature = step i-1's
output at t-1; it sees the true prefix up to t-i and its own chain, exactly the keys of a depth-(i+1) tree node at
inference), loss sum_i ttt_decay^i soft-CE(target probs over the draft vocabulary, draft logits), positions whose target
argmax lies outside the draft vocabulary masked. The draft vocabulary is the `draft_vocab_size` most frequent
target-written tokens of the training rows; the draft's lm_head and norm start from the target's.

Target features: online (target in the loop), in memory after first use (`feature_cache: true`), or from an offline
cache on disk (`feature_cache_dir`: sharded safetensors files in the target's dtype, written once, resumable).
The loss is a mean over supervised positions of the whole global batch (per unrolled step), so N processes x batch b
give the same loss and gradients as 1 process x batch N*b.

Output: DIR/heads (config.json, model.safetensors, README.md, metrics.json), DIR/checkpoints, DIR/train_log.jsonl.
Load the draft with `heads.load.load_heads(DIR/heads, target_info)`.
metrics.json (held-out rows = the last `eval_rows` rows): per draft depth d = 1..eval_depth (the draft unrolled on its
own outputs along the true tokens, as at inference): `top1`, `top5`, `rank_accuracy` [depth][10] (P(the data token is
exactly the rank-r draft guess), for sizing trees), `eval_positions`; `chain_accepted_tokens` (mean drafted tokens a
greedy chain of eval_depth would get accepted); `target_top1` (the target's own next-token accuracy at the same
positions); EAGLE-3: `draft_vocab_coverage` (share of held-out supervised tokens inside the draft vocabulary).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from tqdm.auto import tqdm
from transformers import DynamicCache

from heads.eagle import NORM_FLAGS, EagleDraft, eagle_config_for, most_frequent_tokens
from heads.target import resolve_dtype
from train.config import ConfigError, TrainRunConfig, check_run_config, parse_config
from train.data import DataError, collate, pad_features, shifted_labels, supervised_token_counts
from train.cli import run_main
from train.loop import Run, accumulate, accuracy_table, card_facts, end_run, finish_run, rank_summary, start_run, train


@dataclass
class EagleTrainConfig(TrainRunConfig):
    output_dir: str = "runs/eagle"
    learning_rate: float = 1e-4
    warmup_ratio: float = 0.05
    max_grad_norm: float = 0.5
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
    # features on disk (feature_cache keeps them in memory instead)
    feature_cache_dir: Optional[str] = None  # offline feature cache on disk (written first if missing; resumable)
    feature_cache_dtype: str = "auto"  # auto = the target's dtype (exactly what online training sees)
    feature_cache_shard_rows: int = 64  # rows per cache file
    build_cache_only: bool = False  # write feature_cache_dir, then stop
    # optimiser
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95


# eagle3 with the norm flags unset: all three RMSNorms on (speculators' default draft). On the demo's 384 rows, 180
# steps, they lifted held-out top-1 from .377 / .256 / .225 to .398 / .353 / .346 by depth and held-out-family tau
# from 1.46 to 1.51 (docs/heads_training.md). A heads dir saved without the keys loads as norms off (heads/eagle.py).
DEFAULT_NORMS = {"norm_before_fc": True, "norm_before_residual": True, "norm_output": True}


def check_config(cfg: EagleTrainConfig) -> EagleTrainConfig:
    """Validate, and return a copy with the method-dependent defaults (None / 0) filled in."""
    check_run_config(cfg, ("eagle", "eagle3"))
    if cfg.feature_cache and cfg.feature_cache_dir:
        raise ConfigError("feature_cache (in memory) and feature_cache_dir (on disk) exclude each other: choose one")
    if cfg.build_cache_only and not cfg.feature_cache_dir:
        raise ConfigError("build_cache_only needs feature_cache_dir")
    if cfg.method == "eagle" and cfg.draft_vocab_size:
        raise ConfigError("EAGLE-1 drafts over the target's whole vocabulary (its lm_head): draft_vocab_size needs method eagle3")
    eagle3 = cfg.method == "eagle3"
    ttt = cfg.ttt_steps if cfg.ttt_steps is not None else (7 if eagle3 else 1)
    noise = cfg.feature_noise if cfg.feature_noise is not None else (0.0 if eagle3 else 0.1)
    norms = {n: getattr(cfg, n) if getattr(cfg, n) is not None else eagle3 and DEFAULT_NORMS[n] for n in NORM_FLAGS}
    if not eagle3 and any(norms.values()):
        raise ConfigError(f"{', '.join(n for n in NORM_FLAGS if norms[n])}: EAGLE-3 draft options; set them false or "
                          "use method: eagle3")
    if ttt < 1 or noise < 0 or cfg.eval_depth < 0:
        raise ConfigError("ttt_steps must be >= 1, feature_noise and eval_depth >= 0")
    resolve_dtype(cfg.dtype if cfg.dtype != "auto" else "float32")
    if cfg.feature_cache_dtype != "auto":
        resolve_dtype(cfg.feature_cache_dtype)
    return dataclasses.replace(cfg, ttt_steps=ttt, feature_noise=noise, eval_depth=cfg.eval_depth or max(3, ttt), **norms)


# ----------------------------------------------------------------------------------------------------
# target features


@torch.no_grad()
def target_features(target, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    feature_layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's inputs from the frozen target: taps [B, T, n*h] = cat(hidden_states[i] for i in feature_layers)
    and the final-norm hidden state [B, T, h] (= hidden_states[L]; the target's logits are lm_head of it)."""
    hidden = target.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                                  use_cache=False).hidden_states  # L + 1 tensors [B, T, h]
    return torch.cat([hidden[i] for i in feature_layers], dim=-1), hidden[-1]


class FeatureSource:
    """Per-batch target features, computed online, kept in memory per row, or read from an offline cache on disk.

    Row ids: training rows 0..n_train-1, held-out rows n_train.. (in the order of `rows`).
    """

    def __init__(self, target, rows: list[dict], feature_layers: list[int], mode: str = "online",
                 cache_dir: Path | None = None, cache_dtype: torch.dtype | None = None, shard_rows: int = 64):
        self.target, self.rows, self.layers, self.mode = target, rows, feature_layers, mode
        self.taps_are_final = feature_layers == [target.config.get_text_config().num_hidden_layers]
        self.memory: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.cache_dir, self.cache_dtype, self.shard_rows = cache_dir, cache_dtype, shard_rows
        self._open: dict[int, tuple] = {}

    def row(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(taps [T_r, n*h], final [T_r, h]) of row r, computed alone (no padding: the same values in any batch)."""
        if self.mode == "disk":
            return self._read(r)
        if r not in self.memory:
            out = self.compute(r)
            if self.mode != "memory":
                return out
            self.memory[r] = out
        return self.memory[r]

    def compute(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.as_tensor(self.rows[r]["input_ids"], device=self.target.device)[None]
        taps, final = target_features(self.target, ids, torch.ones_like(ids), self.layers)
        return taps[0], final[0]

    def batch(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """batch (collated, with `rows`) -> taps [B, T, n*h], final [B, T, h] on the target's device and dtype."""
        if self.mode == "online":
            return target_features(self.target, batch["input_ids"], batch["attention_mask"], self.layers)
        per_row = [self.row(r) for r in batch["rows"].tolist()]
        T = batch["input_ids"].shape[1]
        device, dtype = batch["input_ids"].device, self.target.dtype
        return (pad_features([t for t, _ in per_row], T).to(device, dtype),
                pad_features([f for _, f in per_row], T).to(device, dtype))

    # ---- offline cache: shard k holds rows [k*S, (k+1)*S): taps (unless they are the final state), final, offsets
    def shard_path(self, k: int) -> Path:
        return self.cache_dir / f"shard-{k:05d}.safetensors"

    @property
    def num_shards(self) -> int:
        return math.ceil(len(self.rows) / self.shard_rows)

    def _read(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        from safetensors import safe_open

        k, j = divmod(r, self.shard_rows)
        if k not in self._open:
            handle = safe_open(str(self.shard_path(k)), framework="pt", device="cpu")
            self._open[k] = (handle, handle.get_tensor("offsets").tolist())
        handle, offsets = self._open[k]
        a, b = offsets[j], offsets[j + 1]
        final = handle.get_slice("final")[a:b]
        taps = final if self.taps_are_final else handle.get_slice("taps")[a:b]
        return taps, final

    def write_shard(self, k: int) -> None:
        from safetensors.torch import save_file

        rows = range(k * self.shard_rows, min((k + 1) * self.shard_rows, len(self.rows)))
        computed = [self.compute(r) for r in rows]
        lengths = [f.shape[0] for _, f in computed]
        tensors = {"final": torch.cat([f for _, f in computed]).to("cpu", self.cache_dtype).contiguous(),
                   "offsets": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.long)}
        if not self.taps_are_final:
            tensors["taps"] = torch.cat([t for t, _ in computed]).to("cpu", self.cache_dtype).contiguous()
        tmp = self.shard_path(k).with_suffix(".tmp")
        save_file(tensors, str(tmp))
        tmp.replace(self.shard_path(k))  # atomic: a shard file is complete or absent


def cache_identity(rows: list[dict], info, feature_layers: list[int], dtype: torch.dtype, shard_rows: int) -> dict:
    """What an offline cache was written for; a cache that differs in any field is refused."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row["input_ids"]).encode())
    return {"target_fingerprint": info.fingerprint, "feature_layers": feature_layers, "dtype": str(dtype).split(".")[-1],
            "rows": len(rows), "tokens": sum(len(r["input_ids"]) for r in rows), "rows_sha256": digest.hexdigest()[:16],
            "shard_rows": shard_rows}


def build_feature_cache(source: FeatureSource, identity: dict, hidden: int, accelerator: Accelerator) -> None:
    """Write the missing shards (each process writes every N-th shard); reuse the ones already written."""
    cache_dir = source.cache_dir
    meta_file = cache_dir / "cache.json"
    if meta_file.is_file():
        written_for = json.loads(meta_file.read_text())["identity"]
        if written_for != identity:
            diff = sorted(k for k in identity if written_for.get(k) != identity[k])
            raise ConfigError(f"the feature cache in {cache_dir} was written for other rows, target or settings "
                              f"(differs in {diff}); point feature_cache_dir elsewhere or delete it")
    per_token = hidden + (0 if source.taps_are_final else len(source.layers) * hidden)  # the final state, the taps
    size = identity["tokens"] * per_token * torch.finfo(source.cache_dtype).bits // 8
    missing = [k for k in range(source.num_shards) if not source.shard_path(k).is_file()]
    accelerator.print(f"feature cache {cache_dir}: {identity['rows']} rows, {identity['tokens']} tokens, "
                      f"{size / 2**20:.1f} MiB in {identity['dtype']} ({source.num_shards} shards, {len(missing)} to write)")
    if not missing:
        return
    if accelerator.is_main_process:
        cache_dir.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(cache_dir).free
        if size * len(missing) / source.num_shards > free:
            raise DataError(f"the feature cache needs about {size / 2**30:.2f} GiB; {cache_dir} has {free / 2**30:.2f} GiB free")
        meta_file.write_text(json.dumps({"identity": identity, "bytes_estimate": size}, indent=2))
    accelerator.wait_for_everyone()
    mine = missing[accelerator.process_index :: accelerator.num_processes]
    for k in tqdm(mine, desc="feature cache", disable=not accelerator.is_main_process):
        source.write_shard(k)
    accelerator.wait_for_everyone()


def row_noise(rows: list[int], lengths: list[int], width: int, scale: float, seed: int, step: int) -> torch.Tensor:
    """U(-scale, scale) noise [B, max(lengths), width], drawn per (seed, step, row): the same whatever the batch
    layout, process count or resume point."""
    out = torch.zeros(len(rows), max(lengths), width)
    for b, (r, n) in enumerate(zip(rows, lengths)):
        g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_000_003 + r)
        out[b, :n] = (torch.rand(n, width, generator=g) * 2 - 1) * scale
    return out


# ----------------------------------------------------------------------------------------------------
# the unrolled draft (training-time test)


def ttt_mask(key_valid: torch.Tensor, step: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, T, (step+1)*T] for unrolled step `step` over the keys of steps 0..step (concatenated).

    Query t sees step 0's keys at positions s <= t - step (the true prefix of its chain's root) and, for
    1 <= j <= step, step j's key at s = t - step + j (its ancestors in the chain, itself last). key_valid [B, T] bool
    blocks padded keys (a query's own key stays visible, so no row is fully masked).
    """
    B, T = key_valid.shape
    t = torch.arange(T, device=key_valid.device)[:, None]
    s = torch.arange(T, device=key_valid.device)[None, :]
    allowed = torch.cat([s <= t - step] + [s == t - step + j for j in range(1, step + 1)], dim=1)  # [T, (step+1)T]
    allowed = allowed[None] & key_valid.repeat(1, step + 1)[:, None, :]  # [B, T, (step+1)T]
    allowed[:, :, step * T :] |= torch.eye(T, dtype=torch.bool, device=key_valid.device)
    mask = torch.zeros(B, 1, T, (step + 1) * T, dtype=dtype, device=key_valid.device)
    return mask.masked_fill(~allowed[:, None], torch.finfo(dtype).min)


def unroll(draft: EagleDraft, embeds: torch.Tensor, features: torch.Tensor, key_valid: torch.Tensor,
           steps: int) -> list[torch.Tensor]:
    """Run the draft `steps` times, each step on the previous step's outputs shifted by one position.

    embeds [B, T, h] (embedding of x_{t+1} at t), features [B, T, h] (fused f_t), key_valid [B, T] -> `steps` x [B, T, h];
    step i's output at t is the depth-(i+1) draft state of the chain rooted at t - i (valid for t >= i).
    """
    B, T, _ = embeds.shape
    position_ids = torch.arange(T, device=embeds.device).expand(B, T)
    device_type = embeds.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else embeds.dtype
    cache = DynamicCache()
    outs = []
    for i in range(steps):
        out = draft(embeds, features, position_ids, ttt_mask(key_valid, i, dtype), cache)  # [B, T, h]
        outs.append(out)
        features = F.pad(out[:, :-1], (0, 0, 1, 0))  # step i+1 at t reads step i's output at t-1
    return outs


class UnrolledDraft(nn.Module):
    """The draft and its unroll as one module, so DDP sees one forward per backward."""

    def __init__(self, draft: EagleDraft):
        super().__init__()
        self.draft = draft

    def forward(self, embeds: torch.Tensor, taps: torch.Tensor, key_valid: torch.Tensor, select: torch.Tensor,
                steps: int, lm_head_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> outputs [S, N, h] and logits [S, N, draft_vocab] at the N positions of `select` [B, T] (bool)."""
        dtype = self.draft.fc.weight.dtype  # the target's features and embeddings may be bf16
        outs = unroll(self.draft, embeds.to(dtype), self.draft.fuse(taps.to(dtype)), key_valid, steps)
        selected = torch.stack([o[select] for o in outs])  # [S, N, h]
        if lm_head_weight is None:
            return selected, self.draft.logits(selected)
        return selected, self.draft.logits(selected.to(lm_head_weight.dtype), lm_head_weight)  # EAGLE-1: the target's


# ----------------------------------------------------------------------------------------------------
# draft vocabulary and initialisation


@torch.no_grad()
def init_from_target(draft: EagleDraft, target, layer: bool) -> list[str]:
    """EAGLE-3: lm_head <- the target's lm_head rows of the draft vocabulary, norm <- the target's final norm.
    `layer`: decoder-layer tensors <- the target's last layer where shapes match (q/k/v read 2h in EAGLE-3: their
    feature half gets the target's weight). Returns the names initialised."""
    done = []
    if draft.is_eagle3:
        ids = torch.nonzero(draft.t2d).squeeze(-1)
        draft.lm_head.weight.copy_(target.get_output_embeddings().weight[ids])
        draft.norm.weight.copy_(target.get_decoder().norm.weight)
        done += ["lm_head", "norm"]
    if layer:
        source = dict(target.get_decoder().layers[-1].named_parameters())
        h = draft.config.hidden_size
        for name, param in draft.layers[0].named_parameters():
            if name not in source:
                continue
            if source[name].shape == param.shape:
                param.copy_(source[name])
            elif param.shape[1:] == (2 * h,) and source[name].shape == (param.shape[0], h):
                param[:, h:].copy_(source[name])  # EAGLE-3 q/k/v: cat(embed, feature) -> the feature half
            else:
                continue
            done.append(f"layers.0.{name}")
    return done


# ----------------------------------------------------------------------------------------------------
# targets and loss


@torch.no_grad()
def prepare_batch(batch: dict, source: FeatureSource, target, draft: EagleDraft, cfg: EagleTrainConfig, pad_id: int,
                  step: int | None) -> dict:
    """Target-side tensors of one micro-batch (no gradient). `step` None: no feature noise (evaluation).

    select [B, T]: supervised draft positions t (t + 2 < T, loss_mask[t + 2] = 1); at its N positions: t_index [N],
    labels [N] (x_{t+2}), target_argmax [N], probs [N, draft_vocab] (target softmax at t+1, restricted to the draft
    vocabulary for EAGLE-3), in_vocab [N] (target argmax inside the draft vocabulary), feature_target [N, h] (f_{t+1}).
    """
    ids, attn = batch["input_ids"], batch["attention_mask"]
    B, T = ids.shape
    taps, final = source.batch(batch)
    labels, select = shifted_labels(ids, batch["loss_mask"], 2)
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


def draft_loss(outs: torch.Tensor, logits: torch.Tensor, prep: dict, valid: torch.Tensor, denom: torch.Tensor,
               cfg: EagleTrainConfig, draft: EagleDraft) -> tuple[torch.Tensor, dict]:
    """sum_i decay^i (w_p * sum soft-CE_i + w_f * sum SmoothL1_i) / denom_i.  outs [S, N, h], logits [S, N, dv].

    Returns (loss, per-step sums [S] of: ce, feature loss, top-1 agreement with the target)."""
    S, eagle3 = logits.shape[0], draft.is_eagle3
    ce = -(prep["probs"][None] * F.log_softmax(logits.float(), -1)).sum(-1)  # [S, N]
    ce_sums = (ce * valid).sum(-1)
    weights = torch.tensor([cfg.ttt_decay ** i for i in range(S)], device=ce.device)
    if eagle3:
        per_step, fl_sums = ce_sums, torch.zeros_like(ce_sums)
    else:
        fl = F.smooth_l1_loss(outs.float(), prep["feature_target"][None].float().expand_as(outs), reduction="none").mean(-1)
        fl_sums = (fl * valid).sum(-1)
        per_step = cfg.prob_loss_weight * ce_sums + cfg.feature_loss_weight * fl_sums
    loss = (weights * per_step / denom.clamp(min=1)).sum()
    with torch.no_grad():
        guess = draft.to_target_ids(logits.argmax(-1))
        hits = ((guess == prep["target_argmax"][None]) & valid).sum(-1).float()
    return loss, {"ce": ce_sums.detach(), "feature": fl_sums.detach(), "hits": hits}


# ----------------------------------------------------------------------------------------------------
# evaluation


@torch.no_grad()
def evaluate(model: UnrolledDraft, target, source: FeatureSource, rows: list[int], cfg: EagleTrainConfig,
             accelerator: Accelerator, pad_id: int) -> dict:
    """Per-depth rank histogram of the data token on held-out rows (sharded over processes, then summed)."""
    draft, D, R = model.draft, cfg.eval_depth, 10
    dev = accelerator.device
    rank_counts = torch.zeros(D, R + 1, device=dev)  # last column: rank >= 10 or outside the draft vocabulary
    counts = torch.zeros(5, device=dev)  # target top-1 hits, positions, in-vocab labels, chain accepted, chain roots
    lm_head_weight = None if draft.is_eagle3 else target.get_output_embeddings().weight
    t2d_index = torch.cumsum(draft.t2d.long(), 0) - 1 if draft.is_eagle3 else None  # target id -> draft id (where t2d)
    mine = rows[accelerator.process_index :: accelerator.num_processes]
    for start in range(0, len(mine), cfg.per_device_batch_size):
        idx = mine[start : start + cfg.per_device_batch_size]
        batch = {k: v.to(dev) for k, v in collate([source.rows[i] for i in idx], pad_id).items()}
        batch["rows"] = torch.tensor(idx)
        prep = prepare_batch(batch, source, target, draft, cfg, pad_id, step=None)
        with accelerator.autocast():
            _, logits = model(prep["embeds"], prep["taps"], prep["key_valid"], prep["select"], D, lm_head_weight)
        logits = logits.float()  # [D, N, dv]
        labels = prep["labels"]
        in_vocab = draft.t2d[labels] if draft.is_eagle3 else torch.ones_like(labels, dtype=torch.bool)
        label_d = t2d_index[labels].clamp(min=0) if draft.is_eagle3 else labels
        truth = logits.gather(-1, label_d[None, :, None].expand(D, -1, 1))  # [D, N, 1]
        rank = torch.where(in_vocab[None], (logits > truth).sum(-1), R).clamp(max=R)  # [D, N]
        depth_ok = prep["t_index"][None] >= torch.arange(D, device=dev)[:, None]  # [D, N]
        for d in range(D):
            rank_counts[d] += torch.bincount(rank[d][depth_ok[d]], minlength=R + 1).float()
        counts[0] += (prep["target_argmax"] == labels).sum()
        counts[1] += labels.numel()
        counts[2] += in_vocab.sum()
        # greedy chain from each root n: depth d+1's output sits at position n+d of step d
        B, T = prep["select"].shape
        hit = torch.zeros(D, B, T + D, dtype=torch.bool, device=dev)
        hit[:, :, :T][:, prep["select"]] = (rank == 0) & depth_ok
        chain = torch.stack([hit[d, :, d : d + T] for d in range(D)])  # [D, B, T] at the root's position
        accepted = chain.long().cumprod(0).sum(0)  # [B, T]
        counts[3] += accepted[prep["select"]].sum()
        counts[4] += prep["select"].sum()
    rank_counts = accelerator.reduce(rank_counts, "sum")
    counts = accelerator.reduce(counts, "sum")
    out = {**rank_summary(rank_counts), "chain_accepted_tokens": round(float(counts[3] / counts[4].clamp(min=1)), 4),
           "target_top1": round(float(counts[0] / counts[1].clamp(min=1)), 4)}
    if draft.is_eagle3:
        out["draft_vocab_coverage"] = round(float(counts[2] / counts[1].clamp(min=1)), 4)
    return out


# ----------------------------------------------------------------------------------------------------
# output




def model_card(cfg: EagleTrainConfig, info, stats: dict, metrics: dict) -> str:
    if cfg.method == "eagle3":
        method = (f"EAGLE-3: features from target layers {metrics['feature_layers']} fused, one decoder layer, own lm_head "
                  f"over a {metrics['draft_vocab_size']}-token draft vocabulary, training-time test over {cfg.ttt_steps} steps")
    else:
        method = "EAGLE-1: the target's final hidden state + next token -> one decoder layer -> the target's lm_head"
    coverage = (f"\nShare of held-out target-written tokens inside the draft vocabulary: {metrics['draft_vocab_coverage']:.3f}\n"
                if "draft_vocab_coverage" in metrics else "")
    return f"""---
library_name: headstart
tags: [{cfg.method}, speculative-decoding]
---
# {"EAGLE-3" if cfg.method == "eagle3" else "EAGLE-1"} draft for `{info.name}`

- Method: {method}
{card_facts(cfg, info, stats, metrics)}

Held-out accuracy at draft depth d (the draft run on its own outputs along the true tokens, as in a tree):

{accuracy_table("depth", metrics)}

Mean drafted tokens a greedy chain of {len(metrics['top1'])} would get accepted: {metrics['chain_accepted_tokens']:.3f}
Target's own next-token top-1 on the same positions: {metrics['target_top1']:.3f}
{coverage}
```python
from heads.load import load_heads
draft = load_heads("THIS_DIR_OR_REPO", target_info)
```
"""


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
        covered = int(counts[draft.t2d].sum()) / max(int(counts.sum()), 1)
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
    draft = build_draft(run, cfg)
    layers = draft.config.feature_layers

    # features: online, in memory, or an offline cache on disk (written first if missing)
    all_rows = run.train_rows + run.eval_rows
    mode = "disk" if cfg.feature_cache_dir else ("memory" if cfg.feature_cache else "online")
    cache_dtype = target.dtype if cfg.feature_cache_dtype == "auto" else resolve_dtype(cfg.feature_cache_dtype)
    source = FeatureSource(target, all_rows, layers, mode, Path(cfg.feature_cache_dir or "."), cache_dtype,
                           cfg.feature_cache_shard_rows)
    if mode == "disk":
        identity = cache_identity(all_rows, run.info, layers, cache_dtype, cfg.feature_cache_shard_rows)
        build_feature_cache(source, identity, run.info.hidden_size, accelerator)
        if cfg.build_cache_only:
            end_run(accelerator)
            return {"feature_cache_dir": cfg.feature_cache_dir, **identity}

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
        weights = torch.tensor([cfg.ttt_decay ** i for i in range(S)], device=denom.device)
        per_step = means["ce"] if eagle3 else cfg.prob_loss_weight * means["ce"] + cfg.feature_loss_weight * means["feature"]
        fields = {"loss": float((weights * per_step).sum()), "ce": [round(float(c), 6) for c in means["ce"]],
                  "acc": [round(float(a), 4) for a in means["hits"]]}
        if not eagle3:
            fields["feature_loss"] = [round(float(c), 6) for c in means["feature"]]
        return fields

    trained = train(run, UnrolledDraft(draft), [{"params": list(draft.parameters())}], step_fn,
                    betas=(cfg.adam_beta1, cfg.adam_beta2))
    if not trained.finished:
        return {"step": trained.step}
    model = accelerator.unwrap_model(trained.model).eval()
    n_train = len(run.train_rows)
    metrics = evaluate(model, target, source, list(range(n_train, len(all_rows))), cfg, accelerator, run.pad_id)
    metrics.update({"feature_layers": layers, "draft_vocab_size": draft.config.draft_vocab_size, "ttt_steps": S,
                    "feature_source": mode})
    return finish_run(run, trained, metrics, model.draft.save_pretrained, model_card, "depth")


if __name__ == "__main__":
    run_main(main)
