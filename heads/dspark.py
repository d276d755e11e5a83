"""DSpark draft (DeepSeek's DeepSpec): a DFlash block drafter (heads/dflash.py, unchanged) plus two small heads.

- Markov head (vLLM's "vanilla" type): a rank-r bias on each slot's logits from the token before the slot,
  bias(prev) = markov_w2 . markov_w1[prev] [Vd], with markov_w1 [V, r] indexed by the previous token's *target* id and
  markov_w2 [Vd, r] over the scored (draft) vocabulary. Slot j's logits are DFlash's plus bias(x_{p+j-1}): the
  backbone still runs once per block, only the bias is sequential (slot 1's prev is the anchor, slot j's the token
  drafted at slot j - 1).
- Confidence head: proj = Linear(h + r, 1) over cat(norm(out_j), markov_w1[prev_j]) (h alone without
  `confidence_with_markov`); sigmoid(proj) estimates P(slot j's drafted token is accepted | slots before it were).
  The running product along the block is the chance the prefix survives; inference/dspark.py cuts the block there.
- With `markov_context` the Markov factor also reads the slot from slot 2 on: bias = markov_w2 . (markov_w1[prev] *
  (1 + context_proj(norm(out_j)))), a bilinear term in the previous token and the slot's own output (DFlash2's
  candidate selector scores candidates with such a product); slot 1, whose previous token is the anchor the block
  already reads, keeps the vanilla bias. context_proj starts at zero, so training starts from the vanilla head.
  headstart's own decode loop runs it; vLLM 0.32's loader has no such head, so the export refuses it.

The layout is DFlash's fill-in one (vLLM `sample_from_anchor: false`): block [x_p, mask x (B - 1)], slot j predicts
x_{p+j}. Tensor names are vLLM 0.32's qwen3_dspark loader's: DFlash's plus `markov_head.markov_w1.weight`,
`markov_head.markov_w2.weight`, `confidence_head.proj.{weight,bias}`. `dspark_export` writes that layout, and
`dspark_gguf` llama.cpp's (the same block, its `markov_w1`, `markov_w2`, `conf_proj` tensors).

    draft = DSparkDraft(dspark_config_for(model, markov_rank=16, num_layers=2, block_size=8, mask_token_id=m))
    logits = draft.corrected_logits(out, scored, prev)   # out [.., h] (draft forward), prev [..] target ids
    conf = draft.confidence_logit(draft.norm(out), prev)  # [..] logits of P(accepted)
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass

import torch
from torch import nn

from headstart.heads.dflash import DFLASH, DFlashConfig, DFlashDraft, dflash_config_for


@dataclass
class DSparkConfig(DFlashConfig):
    method: str = "dspark"
    markov_rank: int = 64  # r of the Markov head's factors (vLLM's markov_rank; the references use 256)
    confidence_with_markov: bool = True  # the confidence head reads markov_w1[prev] beside the slot's output
    # True: from slot 2 on the Markov factor is scaled by (1 + context_proj(norm(out))) of its slot. Absent from a
    # config.json: False (older drafts)
    markov_context: bool = False

    def __post_init__(self):
        if self.method != "dspark":
            raise ValueError(f"a DSpark config has method 'dspark', got {self.method!r}")
        if self.markov_rank < 1:
            raise ValueError(f"markov_rank must be >= 1, got {self.markov_rank}")
        backbone = {f.name: getattr(self, f.name) for f in dataclasses.fields(DFlashConfig)}
        DFlashConfig(**dict(backbone, method="dflash"))  # the backbone's own checks


def dspark_config_for(model, markov_rank: int = 64, confidence_with_markov: bool = True, markov_context: bool = False,
                      **dflash_args) -> DSparkConfig:
    """A DSparkConfig: DFlash's for `model` (heads/dflash.py dflash_config_for's arguments) plus the two heads."""
    backbone = dataclasses.asdict(dflash_config_for(model, **dflash_args))
    return DSparkConfig(**dict(backbone, method="dspark", markov_rank=markov_rank,
                               confidence_with_markov=confidence_with_markov, markov_context=markov_context))


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int, context_size: int = 0):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)  # [V, r], by the previous token's target id
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)  # [Vd, r]
        nn.init.normal_(self.markov_w1.weight, std=0.01)  # speculators' init; markov_w2 keeps nn.Linear's
        if context_size:  # markov_context: [r, h], zero so that training starts from the vanilla head
            self.context_proj = nn.Linear(context_size, rank, bias=False)
            nn.init.zeros_(self.context_proj.weight)


class ConfidenceHead(nn.Module):
    def __init__(self, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, 1)

    @torch.no_grad()
    def rescale(self, scale: float, shift: float) -> None:
        """Fold a Platt scaling into proj: its logit z becomes scale * z + shift (the same tensors, so any loader
        reads the scaled head)."""
        self.proj.weight.mul_(scale)
        self.proj.bias.mul_(scale).add_(shift)


class DSparkDraft(DFlashDraft):
    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        h, r = config.hidden_size, config.markov_rank
        self.markov_head = MarkovHead(config.vocab_size, config.draft_vocab_size or config.vocab_size, r,
                                      h if config.markov_context else 0)
        self.confidence_head = ConfidenceHead(h + r if config.confidence_with_markov else h)

    def markov_bias(self, prev: torch.Tensor, normed: torch.Tensor | None = None) -> torch.Tensor:
        """prev [...] target token ids (and with markov_context the slots' normed outputs [..., h]; None at slot 1)
        -> [..., Vd] logit bias."""
        head = self.markov_head
        factor = head.markov_w1(prev)  # [..., r]
        if normed is not None:
            factor = factor * (1 + head.context_proj(normed.to(head.context_proj.weight.dtype)))
        return head.markov_w2(factor)

    def corrected_logits(self, out: torch.Tensor, scored_weight: torch.Tensor, prev: torch.Tensor,
                         slots: torch.Tensor | None = None) -> torch.Tensor:
        """out [..., h] (the draft's output before `norm`), prev [...] -> DFlash's logits + the Markov bias [..., Vd].
        With markov_context, slots [...] (0 for slot 1) says where the bias reads its slot: from slot 2 on."""
        normed = None
        if self.config.markov_context:
            normed = self.norm(out) * (slots > 0)[..., None]  # zero at slot 1: the vanilla bias there
        return self.logits(out, scored_weight) + self.markov_bias(prev, normed).to(out.dtype)

    def confidence_logit(self, normed: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """normed [..., h] (norm(out): what the lm_head reads), prev [...] -> [...] logit of P(slot accepted)."""
        x = normed
        if self.config.confidence_with_markov:
            x = torch.cat([normed, self.markov_head.markov_w1(prev).to(normed.dtype)], dim=-1)
        return self.confidence_head.proj(x).squeeze(-1)


# ------------------------------------------------------------------------------------------------------ calibration

ECE_BINS = 10  # equal-width bins of the survival S_j for its calibration error


def calibration(sums: dict[str, torch.Tensor]) -> dict:
    """The confidence head's calibration from summed counts (train/dspark.py's held-out blocks, or
    `chain_confidence_sums` of decoded chains): by_slot [3, S] (where the slots before j were accepted: summed c_j,
    slot j accepted, slots), bins [3, ECE_BINS] (per survival bin: summed S_j, slots 1..j all accepted, slots),
    chain [2] (summed expected drafted tokens sum_j S_j, chains) -> `expected_chain_tokens`, `confidence_by_slot`,
    `accepted_by_slot`, `survival_ece`."""
    by_slot, bins, chain = sums["by_slot"], sums["bins"], sums["chain"]
    return {"expected_chain_tokens": round(float(chain[0] / chain[1].clamp(min=1)), 4),
            "confidence_by_slot": [round(float(c), 4) for c in by_slot[0] / by_slot[2].clamp(min=1)],
            "accepted_by_slot": [round(float(a), 4) for a in by_slot[1] / by_slot[2].clamp(min=1)],
            "survival_ece": round(float((bins[0] - bins[1]).abs().sum() / bins[2].sum().clamp(min=1)), 4)}


def chain_confidence_sums(steps: list[tuple[list[float], int]]) -> dict[str, torch.Tensor]:
    """Decoded steps, each (c_1 .. c_S along the drafted chain, how many of its tokens were accepted) -> the sums
    `calibration` reads."""
    S = max(len(conf) for conf, _ in steps)
    conf = torch.zeros(len(steps), S, dtype=torch.float64)  # [n, S], zero past a step's own chain
    drafted = torch.zeros(len(steps), S, dtype=torch.bool)
    accepted = torch.tensor([a for _, a in steps])  # [n]
    for i, (c, _) in enumerate(steps):
        conf[i, : len(c)] = torch.tensor(c, dtype=torch.float64)
        drafted[i, : len(c)] = True
    slot = torch.arange(S)
    before = (accepted[:, None] >= slot) & drafted  # [n, S] slots 1..j-1 accepted
    hit = (accepted[:, None] > slot) & drafted  # slot j accepted (with every slot before it)
    survival = conf.cumprod(1) * drafted
    index = (survival * ECE_BINS).long().clamp(max=ECE_BINS - 1)[drafted]
    return {"by_slot": torch.stack([(conf * before).sum(0), hit.double().sum(0), before.double().sum(0)]),
            "bins": torch.stack([torch.bincount(index, weights=w[drafted].double(), minlength=ECE_BINS)
                                 for w in (survival, hit.double(), torch.ones_like(survival))]),
            "chain": torch.tensor([float(survival.sum()), float(len(steps))], dtype=torch.float64)}


# ----------------------------------------------------------------------------------------------------------- export


def dspark_export(heads: DSparkDraft, request) -> tuple[dict, dict, dict]:
    """vLLM 0.32 `method: dspark` (Qwen3DSparkModel, native layout) -> (engine config, tensors, notes): DFlash's
    export (heads/export_formats.py dflash_export: layers, fc in ascending tap order, draft-vocabulary lm_head and d2t)
    plus the Markov and confidence tensors and keys. vLLM's DSpark reads no mask_embedding (file or tensor): the mask
    slots embed `embed_tokens[mask_token_id]`, so a trained mask vector ships as `embed_tokens.weight` (the target's
    embedding with that row replaced); a draft trained on the target's own row (mask_input target_row) ships none."""
    # found by name when called, as the declarations name their writers: export_formats imports the registry
    formats = importlib.import_module("headstart.heads.export_formats")
    cfg = heads.config
    if cfg.markov_context:
        raise ValueError("this DSpark draft's Markov head reads its slot (markov_context), which vLLM 0.32's dspark "
                         "loader has no head for: decode it in headstart, or train one with --markov_context false "
                         "to export")
    config, tensors, notes = formats.dflash_export(heads, request)
    del tensors[formats.MASK_EMBEDDING_FILE]
    embeddings, _ = formats._target_weights(heads, request.target)
    mask = heads.mask_embedding.detach().cpu().float()
    if not torch.equal(mask, embeddings[cfg.mask_token_id]):
        embed = embeddings.clone()
        embed[cfg.mask_token_id] = mask
        tensors["embed_tokens.weight"] = embed.to(tensors["fc.weight"].dtype)
        notes["embed_tokens"] = (f"the target's embedding with row {cfg.mask_token_id} (the mask token) replaced by the "
                                 "trained mask vector: vLLM's DSpark embeds the mask slots by that row")
    config.update(architectures=["Qwen3DSparkModel"], eagle_aux_hidden_state_layer_ids=sorted(cfg.feature_layers),
                  mask_token_id=cfg.mask_token_id, block_size=cfg.block_size, sample_from_anchor=False,
                  markov_rank=cfg.markov_rank, markov_head_type="vanilla", enable_confidence_head=True,
                  confidence_head_with_markov=cfg.confidence_with_markov)
    notes["block"] = (f"serve with num_speculative_tokens {request.k} = block_size - 1 (fill-in layout, "
                      "sample_from_anchor false; vLLM's default is block_size, another block than was trained)")
    notes["runner"] = ("vLLM 0.32 runs dspark in Model Runner V2 only (GPU, Triton); its CPU build refuses it. "
                       "'enable_adaptive_verification': true lets the confidence head cut the drafts (CUDA graphs)")
    return config, tensors, notes


def dspark_gguf(heads: DSparkDraft, target):
    """llama.cpp's DSpark draft (`--spec-type draft-dspark`; build b11434's src/models/dflash.cpp
    build_dspark_markov_head and common/speculative.cpp) -> heads/export_gguf.py GgufDraft: DFlash's GGUF (arch
    `dflash`, dflash_gguf) plus `markov_w1` [V, r], `markov_w2` [Vd, r] (its bias scattered to the target ids by d2t,
    as the logits are), `conf_proj` [1, h + r] over cat(output_norm(out), markov_w1[prev]) and its bias, and the keys
    `dflash.sample_from_anchor` false (the fill-in block: slot j is block position j, slot 1's prev the anchor) and
    `dflash.has_confidence_head`. llama.cpp chains the bias in its graph on each slot's argmax, as headstart's greedy
    chain does, and cuts the chain at the first slot whose confidence is below `--spec-draft-p-min` (0 by default:
    the whole chain)."""
    import gguf

    # found by name when called, as dspark_export does: export_gguf imports the method registry
    export_gguf = importlib.import_module("headstart.heads.export_gguf")
    formats = importlib.import_module("headstart.heads.export_formats")
    cfg = heads.config
    if cfg.markov_context:
        raise formats.ExportError("this DSpark draft's Markov head reads its slot (markov_context), which llama.cpp's "
                                  "DSpark draft has no head for: decode it in headstart, or train one with "
                                  "--markov_context false to export")
    draft = export_gguf.dflash_gguf(heads, target)  # named after the heads' method: "headstart DSpark draft for ..."
    T = gguf.GGUFValueType
    draft.add("dflash.sample_from_anchor", False, T.BOOL)
    draft.add("dflash.has_confidence_head", True, T.BOOL)
    proj = heads.confidence_head.proj
    weight = proj.weight.detach().cpu().float()  # [1, h + r], or [1, h] without confidence_with_markov
    if not cfg.confidence_with_markov:  # llama.cpp always reads markov_w1[prev] too: zero columns ignore it
        weight = torch.cat([weight, torch.zeros(1, cfg.markov_rank)], dim=1)
    markov = heads.markov_head
    tensors = {"markov_w1.weight": markov.markov_w1.weight, "markov_w2.weight": markov.markov_w2.weight,
               "conf_proj.weight": weight, "conf_proj.bias": proj.bias}
    draft.tensors.update({name: export_gguf._array(t) for name, t in tensors.items()})
    draft.notes["markov"] = (f"markov_w1 [{cfg.vocab_size}, {cfg.markov_rank}] by the previous token's target id, "
                             "markov_w2 over the scored vocabulary: llama.cpp adds the bias in its graph, slot by "
                             "slot on the argmax before it (sample_from_anchor false: slot 1's previous token is the "
                             "anchor)")
    draft.notes["confidence"] = ("conf_proj reads cat(output_norm(out), markov_w1[prev]); llama.cpp stops a chain at "
                                 "the first slot whose confidence is below --spec-draft-p-min (default 0: never)")
    return draft


# The one declaration of DSpark (heads/draft_method.py), registered in heads/methods.py: DFlash's, with its own
# config, module, proposer, trainer and its vLLM and llama.cpp writers.
DSPARK = dataclasses.replace(
    DFLASH, title="a DSpark draft", card_name="DSpark", names=("dspark",), config_class=DSparkConfig,
    module_class=DSparkDraft, proposer="headstart.inference.dspark:dspark_proposer", trainer="headstart.train.dspark",
    train_config="DSparkTrainConfig",
    formats=("vllm", "llamacpp"),
    refusals={fmt: ("headstart exports DSpark drafts for vLLM and llama.cpp only; {fmt} is not checked against a "
                    "loader: use --format vllm or llamacpp") for fmt in ("sglang", "speculators")},
    engine_export="headstart.heads.dspark:dspark_export",
    gguf_export="headstart.heads.dspark:dspark_gguf", llamacpp_spec_type="draft-dspark",
    bench_info=lambda config: {"method": "dspark", "block_size": config.block_size, "markov_rank": config.markov_rank,
                               "markov_context": config.markov_context},
)
