"""What each serving engine loads for a headstart draft, and how a heads directory becomes it: per method and
format, the engine's config, tensors and conversion notes (heads/export.py writes them).

Engine conventions (the layouts vLLM's and SGLang's EAGLE / Medusa loaders and SpecForge's export read):

- EAGLE-3, vLLM (`method: eagle3`): the target family's one-layer config, `architectures: [LlamaForCausalLMEagle3]`,
  `draft_vocab_size`, `target_hidden_size`, `eagle_config.eagle_aux_hidden_state_layer_ids` = headstart's
  feature_layers (vLLM's id k is HF hidden_states[k], as headstart's); tensors fc, layers.0.*, norm, lm_head, d2t.
  The draft's norm flags go at the top level, each written out: vLLM's llama_eagle3.py reads
  `norm_before_fc` (RMSNorm `input_norm` over the concatenated taps, in combine_hidden_states),
  `norm_before_residual` (the decoder layer's residual is hidden_norm(feature)) and `norm_output` (the post-norm
  state is fed back), with the meanings of heads/eagle.py; `input_norm.weight` ships when norm_before_fc is on.
- EAGLE-3, SGLang (SpecForge's layout): the decoder layer as `midlayer.*`, `d2t` and `t2d`, layer ids shifted by one
  (SGLang's id L is HF hidden_states[L + 1]), legacy top-level `rope_theta`. Drafts with a norm flag on are refused
  (not checked against an SGLang loader).
- EAGLE-3, speculators (vllm-project/speculators `Eagle3Speculator`): `speculators_model_type: eagle3`,
  `transformer_layer_config`, `speculators_config` (algorithm, greedy proposal, verifier), and the three norm flags
  written out (vLLM's reader assumes `norm_before_residual: true` when it is absent), `fc_norm: false`.
- EAGLE-1, vLLM (`method: eagle`, `EagleLlamaForCausalLM`): vLLM's `fc` has no bias. headstart's fc bias b is
  folded into a draft-owned embedding: fc(cat(e, f)) + b = W_e (e + d) + W_f f with W_e d = b (least squares), so
  the export ships `embed_tokens` = target embedding + d (vLLM keeps a draft embedding that differs from the
  target's). The fold's residual |W_e d - b| is recorded in export.json; it is exact up to rounding in fp32.
- EAGLE-1, SGLang (`LlamaForCausalLMEagle`): fc keeps its bias; tensors fc.*, layers.0.*.
- Medusa, vLLM (`method: medusa`, `MedusaModel`): `medusa_fc_bias: true` (else the block biases are dropped),
  `truncated_vocab_size` + `token_map` for a draft vocabulary, and the lm_head shipped (vLLM's Medusa cannot reach
  the target's): shared-lm_head heads ship the target's draft-vocabulary rows once (`original_lm_head: true`).
  vLLM loads token_map but its weight tracker does not count it as loaded and refuses the checkpoint, so the launch
  command turns the tracker off (`--model-loader-extra-config '{"enable_weights_track": false}'`);
  medusa_full_vocab=True ships the whole lm_head and no token_map instead (loads without the flag, but the heads then
  guess over the whole vocabulary, as headstart's do not). vLLM runs Medusa as a chain (each head's argmax).
- DFlash, vLLM (`method: dflash`, `DFlashDraftModel`, vLLM's qwen3_dflash.py): a Qwen3 config (`model_type: qwen3`,
  `rope_parameters` written out: vLLM's default theta is 1e6) with `dflash_config` {`target_layer_ids`,
  `mask_token_id`}; vLLM's target_layer_ids k is HF hidden_states[k + 1] (a layer's output), so headstart's
  feature_layers are shifted by one, and vLLM concatenates them in ascending order (fc's column blocks are sorted to
  match). No embed_tokens: vLLM then uses the target's, as the draft was trained. A draft with a draft vocabulary
  ships the target lm_head's rows of it as `lm_head.weight` [Vd, h] with `d2t` (draft id i is target id i + d2t[i])
  and `draft_vocab_size`, which vLLM scores as headstart does; a full-vocabulary draft ships no lm_head (vLLM then
  uses the target's). The draft's trained mask embedding goes to `mask_embedding.pt` ({mask_token_id, embedding}),
  the file vLLM substitutes for the mask token's embedding row. `token_map` itself is not shipped (an unknown tensor is an error there). The block is set by num_speculative_tokens alone, so
  the launch command gives block_size - 1 (the block attends both ways: another length changes every slot).
  `dflash_config.causal` says whether block slot j attends to slots 0..j only (`block_causal`; vLLM reads it for
  every layer) or to the whole block. A draft with a sliding window over the context (`sliding_window` W) gets
  `dflash_config.use_swa: true` and `swa_window_size: W`, which windows every layer (vLLM's
  `_resolve_layer_attention`).
  vLLM 0.32's CPU kernel normalises every layer's context keys with layer 0's k_norm (docs/serving.md); a draft of
  several layers with distinct k_norm weights is exported as trained and the note says so.
- Qwen2-family drafts (q/k/v biases, no o_proj bias) are written as Llama layers with `attention_bias: true` and a
  zero `o_proj.bias` (exact). SGLang's EAGLE-3 layer has no q/k/v bias: refused there.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MASK_EMBEDDING_FILE = "mask_embedding.pt"  # vLLM's DFlash reads the mask token's own embedding from this file
LLAMA_LIKE = ("llama", "qwen2", "mistral")  # decoder layers an engine's Llama EAGLE layer reproduces exactly
# the Llama config keys a one-layer draft config carries (everything else of the target's config is dropped)
LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "hidden_act", "rms_norm_eps", "max_position_embeddings", "vocab_size", "rope_parameters", "rope_theta",
              "rope_scaling", "initializer_range", "attention_dropout", "mlp_bias", "bos_token_id", "eos_token_id",
              "pad_token_id")


class ExportError(ValueError):
    """The heads cannot be written in that format: the message says why and what to do instead."""


@dataclass
class ExportRequest:
    """What an engine writer (a DraftMethod's engine_export, heads/draft_method.py) is asked for, beside the heads."""

    fmt: str  # vllm | sglang | speculators: one of the method's formats
    target: Any  # the target (loaded, or a name / path) where the layout needs its weights: see _target_weights
    k: int  # the speculative tokens of the launch command
    verifier: str | None = None  # the target a speculators config names (its Hub id, or a local model directory)
    full_vocab: bool = False  # Medusa: ship the whole lm_head, no token_map


# ----------------------------------------------------------------------------------------------------------- target


def target_hub_id(target: dict) -> str | None:
    """The Hugging Face Hub id of the heads' target, when it can be known: the embedded alias's id, a name that is a
    Hub id, or a local model directory whose config.json names one in `_name_or_path`; else None."""
    from headstart.heads.target import EMBEDDED_ALIAS, EMBEDDED_HUB_ID

    name = str(target.get("name") or "")
    if name == EMBEDDED_ALIAS:
        return EMBEDDED_HUB_ID
    path = Path(name).expanduser()
    if path.is_dir():
        try:
            named = json.loads((path / "config.json").read_text()).get("_name_or_path", "")
        except (OSError, json.JSONDecodeError):
            named = ""
        return named if looks_like_hub_id(named) else None
    return name if looks_like_hub_id(name) and not path.exists() else None


HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")


def looks_like_hub_id(name: object) -> bool:
    """owner/name as the Hub spells repo ids (letters, digits, '-', '_', '.'; no '..' or '--'), not a .gguf file: the
    only target name an export writes into a launch command."""
    return (isinstance(name, str) and HUB_ID.fullmatch(name) is not None and ".." not in name and "--" not in name
            and not name.endswith(".gguf"))


def _target_weights(heads, target) -> tuple[torch.Tensor, torch.Tensor]:
    """(input embedding [V, h], lm_head [V, h]) of the heads' target: `target` (a loaded model, or a name / path for
    headstart.heads.target.load_target), else the target the heads name; checked against the recorded fingerprint."""
    from headstart.heads.directory import check_target
    from headstart.heads.load import resolve_target

    if target is None:
        target = heads.config.target.get("name")
        if not target:
            raise ExportError("these heads name no target, and this export needs the target's embedding / lm_head: "
                              "pass target=")
    model, _, info = resolve_target(target)
    check_target(heads.config, info, where="the heads being exported")
    return (model.get_input_embeddings().weight.detach().float().cpu(),
            model.get_output_embeddings().weight.detach().float().cpu())


# ------------------------------------------------------------------------------------------------------ draft layer


def _layer_config(config, engine: str) -> dict:
    """The EAGLE draft's one decoder layer as the Llama config the engines' EAGLE models build (model_type llama)."""
    layer = dict(config.layer_config)
    family = layer.get("model_type")
    if family not in LLAMA_LIKE:
        raise ExportError(f"the draft's decoder layer is a {family!r} layer; {engine}'s Llama EAGLE models reproduce "
                          f"only {', '.join(LLAMA_LIKE)} layers exactly, so this export is refused")
    if family in ("qwen2", "mistral") and layer.get("use_sliding_window", family == "mistral") and layer.get("sliding_window"):
        raise ExportError(f"the draft's {family} layer uses sliding-window attention (window {layer['sliding_window']}), "
                          "which the engines' Llama EAGLE layers do not")
    out = {k: layer[k] for k in LAYER_KEYS if layer.get(k) is not None}
    rope = layer.get("rope_parameters") or {}
    if "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]  # legacy readers (SGLang, older vLLM) read it at the top level
        if rope.get("rope_type", "default") not in ("default", None):
            out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    qkv_bias = bool(layer.get("attention_bias")) or family == "qwen2"
    out.update(model_type="llama", num_hidden_layers=1, tie_word_embeddings=False, attention_bias=qkv_bias,
               torch_dtype="float32")  # the export's tensors are fp32; an engine casts to its --dtype
    out.setdefault("head_dim", layer["hidden_size"] // layer["num_attention_heads"])
    return out


def _layer_tensors(state: dict, prefix: str, qkv_bias: bool) -> dict:
    """layers.0.* tensors under `prefix`; a zero o_proj bias where the Llama layer's attention_bias adds one."""
    out = {prefix + k[len("layers.0."):]: v for k, v in state.items() if k.startswith("layers.0.")}
    o_bias = prefix + "self_attn.o_proj.bias"
    if qkv_bias and o_bias not in out:
        weight = out[prefix + "self_attn.o_proj.weight"]
        out[o_bias] = torch.zeros(weight.shape[0], dtype=weight.dtype)
    return out


def _check_layer_ids(layers: list[int], num_target_layers: int, engine: str) -> None:
    if any(i == num_target_layers for i in layers):
        raise ExportError(f"feature layer {num_target_layers} is the target's final-norm output (HF hidden_states[L]); "
                          f"{engine} taps layer outputs before the final norm, so this EAGLE-3 draft would read other "
                          "features than it was trained on")
    if engine == "SGLang" and any(i < 1 for i in layers):
        raise ExportError("feature layer 0 (the embedding output) has no SGLang layer id (SGLang's id L is HF "
                          "hidden_states[L + 1])")


def fold_fc_bias(fc_weight: torch.Tensor, fc_bias: torch.Tensor, embed: torch.Tensor) -> tuple[torch.Tensor, float]:
    """EAGLE-1's fc(cat(e, f)) + b as a bias-free fc over a shifted embedding: returns (embed + d, |W_e d - b|_max),
    d the least-squares solution of W_e d = b (W_e = fc_weight[:, :h], the columns that read the embedding)."""
    h = embed.shape[1]
    w_e = fc_weight[:, :h].double()
    d = torch.linalg.lstsq(w_e, fc_bias.double()[:, None], driver="gelsd").solution[:, 0]
    residual = float((w_e @ d - fc_bias.double()).abs().max())
    return (embed.double() + d).to(embed.dtype), residual


# ----------------------------------------------------------------------------------------------------- the formats


def eagle3_export(heads, request: ExportRequest) -> tuple[dict, dict, dict]:
    """EAGLE-3 heads in request.fmt -> (engine config, tensors, conversion notes); request.k: speculative tokens,
    request.verifier: the target named in the speculators config."""
    from headstart.heads.eagle import NORM_FLAGS

    fmt, k, verifier = request.fmt, request.k, request.verifier
    cfg = heads.config
    state = {n: t.detach().cpu() for n, t in heads.state_dict().items()}
    engine = {"vllm": "vLLM", "sglang": "SGLang", "speculators": "vLLM (speculators)"}[fmt]
    layer = _layer_config(cfg, engine)
    _check_layer_ids(cfg.feature_layers, cfg.target.get("num_hidden_layers", -1), "SGLang" if fmt == "sglang" else engine)
    qkv_bias = layer["attention_bias"]
    full_vocab = cfg.draft_vocab_size == cfg.vocab_size
    tensors = {"fc.weight": state["fc.weight"], "norm.weight": state["norm.weight"],
               "lm_head.weight": state["lm_head.weight"]}
    norms = {n: bool(getattr(cfg, n)) for n in NORM_FLAGS}  # the draft's architecture flags (heads/eagle.py)
    if norms["norm_before_fc"]:
        tensors["input_norm.weight"] = state["input_norm.weight"]
    notes = {}
    if fmt == "sglang":
        if any(norms.values()):
            raise ExportError(f"this draft uses {', '.join(n for n in NORM_FLAGS if norms[n])}, which headstart's SGLang "
                              "export has not been checked to reproduce: use --format vllm or speculators")
        if qkv_bias:
            raise ExportError("SGLang's EAGLE-3 layer (LlamaForCausalLMEagle3) builds q/k/v without biases; this "
                              "draft's layer has them (a Qwen2-family target), so SGLang would drop them silently. "
                              "Use --format vllm")
        tensors.update(_layer_tensors(state, "midlayer.", False))
        tensors.update(d2t=state["d2t"], t2d=state["t2d"])
        ids = [i - 1 for i in cfg.feature_layers]
        config = dict(layer, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=cfg.draft_vocab_size,
                      target_hidden_size=cfg.hidden_size, eagle_config={"eagle_aux_hidden_state_layer_ids": ids})
        notes["layer_ids"] = f"SGLang ids {ids} = HF hidden_states {cfg.feature_layers} (SGLang's L = hidden_states[L + 1])"
        return config, tensors, notes
    tensors.update(_layer_tensors(state, "layers.0.", qkv_bias))
    if not full_vocab:
        tensors["d2t"] = state["d2t"]  # vLLM maps it to draft_id_to_target_id; with a full vocabulary it has none
    if fmt == "vllm":
        config = dict(layer, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=cfg.draft_vocab_size,
                      target_hidden_size=cfg.hidden_size, **norms,
                      eagle_config={"eagle_aux_hidden_state_layer_ids": list(cfg.feature_layers)})
        return config, tensors, notes
    if not full_vocab:
        tensors["t2d"] = state["t2d"]
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": dict(layer, architectures=["LlamaForCausalLM"]),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        **norms,
        "fc_norm": False,
        "eagle_aux_hidden_state_layer_ids": list(cfg.feature_layers),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": [_target_architecture(cfg)]},
        },
        "torch_dtype": "float32",
    }
    return config, tensors, notes


def _target_architecture(cfg) -> str:
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
    return arch.get(cfg.target.get("model_type") or cfg.layer_config.get("model_type"), "LlamaForCausalLM")


def eagle1_export(heads, request: ExportRequest) -> tuple[dict, dict, dict]:
    """EAGLE-1 heads for vLLM or SGLang (request.fmt) -> (engine config, tensors, conversion notes); request.target:
    see _target_weights (vLLM's fold needs its embedding)."""
    fmt, target = request.fmt, request.target
    cfg = heads.config
    state = {n: t.detach().cpu() for n, t in heads.state_dict().items()}
    layer = _layer_config(cfg, "vLLM" if fmt == "vllm" else "SGLang")
    qkv_bias = layer["attention_bias"]
    tensors = _layer_tensors(state, "layers.0.", qkv_bias)
    notes = {}
    if fmt == "sglang":
        tensors.update({"fc.weight": state["fc.weight"], "fc.bias": state["fc.bias"]})
        return dict(layer, architectures=["LlamaForCausalLMEagle"]), tensors, notes
    embed, _ = _target_weights(heads, target)
    folded, residual = fold_fc_bias(state["fc.weight"], state["fc.bias"], embed.to(state["fc.weight"].dtype))
    tensors.update({"fc.weight": state["fc.weight"], "embed_tokens.weight": folded})
    notes["fc_bias_fold"] = {
        "how": "vLLM's EagleLlamaForCausalLM fc has no bias: embed_tokens = target embedding + d, W_e d = fc.bias "
               "(least squares), so fc(cat(embed_tokens[x], f)) = headstart's fc(cat(embed[x], f)) + bias",
        "max_abs_residual": residual, "bias_max_abs": float(state["fc.bias"].abs().max()),
    }
    return dict(layer, architectures=["EagleLlamaForCausalLM"]), tensors, notes


def medusa_export(heads, request: ExportRequest) -> tuple[dict, dict, dict]:
    """Medusa-1 heads for vLLM -> (engine config, tensors, conversion notes); request.target: see _target_weights
    (shared lm_head heads ship its rows); request.full_vocab: the whole lm_head, no token_map."""
    target, full_vocab = request.target, request.full_vocab
    cfg = heads.config
    if cfg.adapter:  # Medusa-2
        raise ExportError("Medusa-2 heads read the target with their LoRA adapter merged (adapter/), but vLLM serves "
                          "the target as is and loads no adapter into a Medusa draft: the heads would see other "
                          "features. Serve them with headstart, or merge the adapter into the target, save it, "
                          "and retrain Medusa-1 heads on that merged target")
    state = {n: t.detach().cpu() for n, t in heads.state_dict().items()}
    tensors = {n: t for n, t in state.items() if n.startswith("blocks.")}
    vd = cfg.draft_vocab_size or cfg.vocab_size
    config = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": cfg.hidden_size,
              "vocab_size": cfg.vocab_size, "num_heads": cfg.num_heads, "num_hidden_layers": cfg.num_layers,
              "medusa_fc_bias": True, "truncated_vocab_size": vd, "torch_dtype": "float32"}
    notes = {}
    if cfg.share_lm_head:
        _, lm_head = _target_weights(heads, target)
        rows = lm_head.to(tensors["blocks.0.layers.0.weight"].dtype)
        if full_vocab:
            config["truncated_vocab_size"] = cfg.vocab_size
            notes["vocab"] = "the whole target lm_head, no token_map: drafts range over the whole vocabulary"
        elif cfg.draft_vocab_size:
            rows = rows[state["token_map"]]
        config["original_lm_head"] = True  # one lm_head shared by the heads, read from lm_heads.0.weight
        tensors["lm_heads.0.weight"] = rows.contiguous()
    else:
        if full_vocab and cfg.draft_vocab_size:
            raise ExportError("medusa_full_vocab needs shared-lm_head heads; these heads have their own "
                              f"{cfg.draft_vocab_size}-row lm_heads")
        if cfg.draft_vocab_size:
            raise ExportError("vLLM 0.32's Medusa sizes per-head lm_heads by the full vocabulary and asserts the "
                              "checkpoint's rows match it, so heads with their own draft-vocabulary lm_heads cannot "
                              "load; train with share_lm_head: true, or draft_vocab_size: 0")
        tensors.update({n: t for n, t in state.items() if n.startswith("lm_heads.")})
    if cfg.draft_vocab_size and not full_vocab:
        tensors["token_map"] = state["token_map"]
        notes["token_map"] = ("vLLM 0.32 loads token_map but its weight tracker then reports it as not initialised: "
                              "serve with --model-loader-extra-config '{\"enable_weights_track\": false}'")
    return config, tensors, notes


def dflash_export(heads, request: ExportRequest) -> tuple[dict, dict, dict]:
    """A DFlash draft for vLLM -> (engine config, tensors, conversion notes); request.target: see _target_weights (a
    draft vocabulary ships its lm_head rows); request.k: the speculative tokens of the launch command
    (block_size - 1), which the note names too."""
    target, k = request.target, request.k
    cfg = heads.config
    L = cfg.target.get("num_hidden_layers", -1)
    if any(i < 1 or i >= L for i in cfg.feature_layers):
        raise ExportError(f"feature_layers {cfg.feature_layers}: vLLM's DFlash reads decoder-layer outputs before the "
                          f"final norm, HF hidden_states 1..{L - 1}; this draft reads others, so vLLM would feed it "
                          "other features than it was trained on")
    state = {n: t.detach().cpu() for n, t in heads.state_dict().items() if n not in ("token_map", "mask_embedding")}
    # a file of its own ({"mask_token_id", "embedding"}, read with torch.load(weights_only=True)), not a tensor
    state[MASK_EMBEDDING_FILE] = {"mask_token_id": cfg.mask_token_id,
                                  "embedding": heads.mask_embedding.detach().cpu().float().clone()}
    order = sorted(range(len(cfg.feature_layers)), key=lambda i: cfg.feature_layers[i])
    h = cfg.hidden_size
    state["fc.weight"] = torch.cat([state["fc.weight"][:, i * h:(i + 1) * h] for i in order], dim=1)
    layer = dict(cfg.layer_config)
    config = dict(layer, architectures=["DFlashDraftModel"], model_type="qwen3", tie_word_embeddings=False,
                  target_hidden_size=h, torch_dtype="float32",
                  rope_theta=layer["rope_parameters"].get("rope_theta"),
                  dflash_config={"target_layer_ids": sorted(i - 1 for i in cfg.feature_layers),
                                 "mask_token_id": cfg.mask_token_id, "block_size": cfg.block_size,
                                 "causal": cfg.block_causal})  # vLLM's per-layer causality inside the block
    if cfg.sliding_window:  # every layer windowed over the context (vLLM's _resolve_layer_attention)
        config["dflash_config"].update(use_swa=True, swa_window_size=cfg.sliding_window)
    notes = {"layer_ids": f"vLLM target_layer_ids {config['dflash_config']['target_layer_ids']} = HF hidden_states "
                          f"{sorted(cfg.feature_layers)} (vLLM's k is hidden_states[k + 1])",
             "block": f"serve with num_speculative_tokens {k} (the trained block, anchor included, "
                      f"is {cfg.block_size})"}
    if cfg.draft_vocab_size:
        _, lm_head = _target_weights(heads, target)
        token_map = heads.token_map.detach().cpu()
        state["lm_head.weight"] = lm_head[token_map].to(state["fc.weight"].dtype).contiguous()
        state["d2t"] = token_map - torch.arange(token_map.numel())
        config["draft_vocab_size"] = cfg.draft_vocab_size
        notes["vocabulary"] = (f"the {cfg.draft_vocab_size} draft-vocabulary rows of the target's lm_head with d2t "
                               "offsets (vLLM's EAGLE-3 convention), as headstart scores them")
    k_norms = [state[f"layers.{i}.self_attn.k_norm.weight"] for i in range(cfg.num_layers)]
    if any(not torch.equal(k, k_norms[0]) for k in k_norms[1:]):
        notes["vllm_cpu_k_norm"] = ("vLLM 0.32's CPU build normalises every layer's context keys with layer 0's "
                                    "k_norm; this draft's layers differ, so on a CPU patch DFlashQwen3Model."
                                    "_normalize_context_k as docs/serving.md shows (GPU builds are unaffected)")
    return config, state, notes
