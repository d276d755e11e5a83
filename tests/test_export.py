"""heads/export.py: the layouts vLLM, SGLang and the speculators format load, the EAGLE-1 bias fold, Medusa's logits,
refusals. Tiny random models, no engine; tests/test_vllm.py runs the exports in vLLM itself."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import tiny_model
from headstart.heads.eagle import EagleDraft, eagle_config_for
from headstart.heads.export import ExportError, export_and_push, export_heads, main
from headstart.heads.export_formats import fold_fc_bias, target_hub_id
from headstart.heads.medusa import MedusaConfig, MedusaHeads
from headstart.heads.target import EMBEDDED_HUB_ID, target_info

LAYERS = 6  # feature layers 2, 3, 3 (EAGLE-3 defaults: 2, L//2, L-3): all valid SGLang ids

# EAGLE-3 tensors in vLLM's llama_eagle3 layout (Llama family: no attention biases)
VLLM_EAGLE3 = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "layers.0.input_layernorm.weight",
               "layers.0.hidden_norm.weight", "layers.0.post_attention_layernorm.weight",
               "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
               "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
               "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight"}
QWEN2_BIASES = {"layers.0.self_attn.q_proj.bias", "layers.0.self_attn.k_proj.bias", "layers.0.self_attn.v_proj.bias",
                "layers.0.self_attn.o_proj.bias"}
# SpecForge's exported EAGLE-3 draft (LlamaForCausalLMEagle3 state dict, embeddings dropped; configs/llama3-8B-eagle3.json)
SPECFORGE_TENSORS = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.input_layernorm.weight",
                     "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight",
                     "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
                     "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
                     "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight"}
SPECFORGE_CONFIG_KEYS = {"architectures", "bos_token_id", "eos_token_id", "hidden_act", "hidden_size",
                         "initializer_range", "intermediate_size", "max_position_embeddings", "model_type",
                         "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "pad_token_id",
                         "rms_norm_eps", "tie_word_embeddings", "torch_dtype", "transformers_version", "use_cache",
                         "vocab_size", "draft_vocab_size"}
SPECFORGE_FUNCTIONAL = SPECFORGE_CONFIG_KEYS - {"bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
                                                "transformers_version", "use_cache"}
VLLM_EAGLE1 = {"fc.weight", "embed_tokens.weight", "layers.0.post_attention_layernorm.weight",
               "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
               "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
               "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight"}


def make_target(family: str = "llama", layers: int = LAYERS):
    model = tiny_model(family, num_hidden_layers=layers)
    return model, target_info(f"tiny-{family}", model)


def eagle_dir(tmp_path, model, info, method: str, draft_vocab: int = 64, bias_scale: float = 0.0, name: str = "",
              **norms: bool):
    torch.manual_seed(1)
    draft = EagleDraft(eagle_config_for(model, method, draft_vocab_size=draft_vocab if method == "eagle3" else 0,
                                        target_info=info, **norms))
    with torch.no_grad():
        for p in draft.parameters():  # trained-looking weights: norms away from 1, biases away from 0
            p.add_(0.05 * torch.randn_like(p))
        if method == "eagle" and bias_scale:
            draft.fc.bias.copy_(bias_scale * torch.randn_like(draft.fc.bias))
    if method == "eagle3":
        draft.set_draft_vocab(torch.arange(0, 2 * draft_vocab, 2))
    path = tmp_path / (name or f"{method}-{info.name}")
    draft.save_pretrained(path)
    return path, draft


def medusa_dir(tmp_path, info, share: bool = True, draft_vocab: int = 32, name: str = "", **extra):
    torch.manual_seed(2)
    heads = MedusaHeads(MedusaConfig(64, 128, num_heads=3, num_layers=2, share_lm_head=share,
                                     draft_vocab_size=draft_vocab, target=info.to_dict(), **extra))
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.1 * torch.randn_like(p))
    if draft_vocab:
        heads.set_draft_vocab(torch.arange(draft_vocab) * 3 + 1)
    path = tmp_path / (name or f"medusa-{share}-{draft_vocab}")
    heads.save_pretrained(path)
    return path, heads


def read(out):
    return json.loads((out / "config.json").read_text()), load_file(out / "model.safetensors")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_eagle3_vllm_layout(tmp_path, family):
    model, info = make_target(family)
    src, draft = eagle_dir(tmp_path, model, info, "eagle3")
    config, tensors = read(export_heads(src, tmp_path / "out", "vllm"))
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == 64 and config["target_hidden_size"] == 64
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]  # = HF hidden_states indices
    assert config["norm_before_residual"] is False and config["tie_word_embeddings"] is False
    expected = VLLM_EAGLE3 | (QWEN2_BIASES if family == "qwen2" else set())
    assert set(tensors) == expected
    assert config["attention_bias"] is (family == "qwen2")  # vLLM's Llama layer: q/k/v and o_proj biases together
    state = draft.state_dict()
    for name in expected - {"layers.0.self_attn.o_proj.bias"}:
        assert torch.equal(tensors[name], state[name]), name
    if family == "qwen2":
        assert not tensors["layers.0.self_attn.o_proj.bias"].any()  # Qwen2's o_proj has none: a zero bias is exact


def test_eagle3_sglang_matches_specforge_layout(tmp_path):
    model, info = make_target("llama")
    src, draft = eagle_dir(tmp_path, model, info, "eagle3")
    config, tensors = read(export_heads(src, tmp_path / "out", "sglang"))
    assert set(tensors) == SPECFORGE_TENSORS
    assert SPECFORGE_FUNCTIONAL <= set(config)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 2]  # SGLang's L = hidden_states[L + 1]
    assert config["rope_theta"] == model.config.rope_parameters["rope_theta"]  # legacy top-level key (SpecForge)
    assert torch.equal(tensors["midlayer.hidden_norm.weight"], draft.state_dict()["layers.0.hidden_norm.weight"])
    assert torch.equal(tensors["t2d"], draft.t2d) and torch.equal(tensors["d2t"], draft.d2t)
    card = (tmp_path / "out" / "README.md").read_text()
    assert "--speculative-algorithm EAGLE3" in card and "does not run on CPU" in card


def test_eagle3_speculators_config(tmp_path):
    model, info = make_target("qwen2")
    src, _ = eagle_dir(tmp_path, model, info, "eagle3")
    config, tensors = read(export_heads(src, tmp_path / "out", "speculators", num_speculative_tokens=4,
                                        target_id="org/tiny-qwen2"))
    # what vLLM 0.32's SpeculatorsConfig reads (validate_speculators_config, update_eagle3)
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 4
    assert spec["verifier"] == {"name_or_path": "org/tiny-qwen2", "architectures": ["Qwen2ForCausalLM"]}
    assert config["norm_before_residual"] is False  # vLLM defaults it to True when absent
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["attention_bias"] is True
    assert set(tensors) == VLLM_EAGLE3 | QWEN2_BIASES | {"t2d"}


@pytest.mark.parametrize("norms", [dict(norm_before_fc=True, norm_before_residual=True, norm_output=True),
                                   dict(norm_before_fc=False, norm_before_residual=True, norm_output=False)])
def test_eagle3_norm_flags_written_for_vllm(tmp_path, norms):
    """vLLM 0.32's llama_eagle3.py reads norm_before_fc / norm_before_residual / norm_output from the top level of
    either format's config and loads `input_norm.weight`; SGLang exports of such drafts are refused."""
    model, info = make_target("llama")
    src, draft = eagle_dir(tmp_path, model, info, "eagle3", **norms)
    extra = {"input_norm.weight"} if norms["norm_before_fc"] else set()
    for fmt, expected in (("vllm", VLLM_EAGLE3 | extra), ("speculators", VLLM_EAGLE3 | extra | {"t2d"})):
        config, tensors = read(export_heads(src, tmp_path / fmt, fmt))
        assert {n: config[n] for n in norms} == norms
        assert set(tensors) == expected
        if extra:
            assert torch.equal(tensors["input_norm.weight"], draft.input_norm.weight)
    with pytest.raises(ExportError, match="norm_before_residual"):
        export_heads(src, tmp_path / "sglang", "sglang")


def test_eagle1_fc_bias_fold_is_exact_in_fp32(tmp_path):
    model, info = make_target("llama")
    src, draft = eagle_dir(tmp_path, model, info, "eagle", bias_scale=0.5)
    out = export_heads(src, tmp_path / "out", "vllm", target=model)
    config, tensors = read(out)
    assert config["architectures"] == ["EagleLlamaForCausalLM"] and config["model_type"] == "llama"
    assert set(tensors) == VLLM_EAGLE1  # no fc.bias (vLLM would ignore it), no input_layernorm (vLLM skips it)
    notes = json.loads((out / "export.json").read_text())["notes"]["fc_bias_fold"]
    assert notes["max_abs_residual"] < 1e-10 and notes["bias_max_abs"] > 0.1

    # the draft's outputs with the folded weights in a bias-free fc equal headstart's
    folded = EagleDraft(draft.config)
    folded.load_state_dict(draft.state_dict())
    with torch.no_grad():
        folded.fc.bias.zero_()
    ids = torch.randint(0, 128, (2, 9))
    feats = torch.randn(2, 9, 64)
    pos = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        want = draft(model.get_input_embeddings()(ids), feats, pos)
        got = folded(F.embedding(ids, tensors["embed_tokens.weight"]), feats, pos)
    assert (want - got).abs().max() < 1e-5
    assert not torch.equal(tensors["embed_tokens.weight"], model.get_input_embeddings().weight)  # vLLM keeps it


def test_fold_fc_bias_least_squares():
    torch.manual_seed(0)
    weight, bias, embed = torch.randn(16, 32), torch.randn(16), torch.randn(50, 16)
    new_embed, residual = fold_fc_bias(weight, bias, embed)
    assert residual < 1e-10
    e, f = embed[:5], torch.randn(5, 16)
    want = F.linear(torch.cat([e, f], -1), weight, bias)
    got = F.linear(torch.cat([new_embed[:5], f], -1), weight)
    # exact up to fp32 rounding of embed + d (|d| = |W_e^-1 b| grows with W_e's condition number; outputs up to ~15)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


def test_eagle1_sglang_keeps_the_bias(tmp_path):
    model, info = make_target("llama")
    src, draft = eagle_dir(tmp_path, model, info, "eagle", bias_scale=0.5)
    config, tensors = read(export_heads(src, tmp_path / "out", "sglang"))
    assert config["architectures"] == ["LlamaForCausalLMEagle"]
    assert set(tensors) == (VLLM_EAGLE1 - {"embed_tokens.weight"}) | {"fc.bias"}
    assert torch.equal(tensors["fc.bias"], draft.fc.bias.detach())


def medusa_vllm_logits(config: dict, tensors: dict, hidden: torch.Tensor) -> torch.Tensor:
    """vLLM 0.32's Medusa (model_executor/models/medusa.py) on the exported files: [K, ..., V], -inf off token_map."""
    logits = []
    for k in range(config["num_heads"]):
        x = hidden
        for l in range(config["num_hidden_layers"]):
            x = x + F.silu(F.linear(x, tensors[f"blocks.{k}.layers.{l}.weight"], tensors[f"blocks.{k}.layers.{l}.bias"]))
        head = tensors["lm_heads.0.weight"] if config.get("original_lm_head") else tensors[f"lm_heads.{k}.weight"]
        small = x @ head[: config["truncated_vocab_size"]].t()
        if config["truncated_vocab_size"] < config["vocab_size"]:
            full = torch.full((*small.shape[:-1], config["vocab_size"]), float("-inf"))
            full[..., tensors["token_map"]] = small
            small = full
        logits.append(small)
    return torch.stack(logits)


@pytest.mark.parametrize("share,draft_vocab", [(True, 32), (True, 0), (False, 0)])
def test_medusa_vllm_logits_equal_headstart(tmp_path, share, draft_vocab):
    model, info = make_target("llama", layers=2)
    src, heads = medusa_dir(tmp_path, info, share=share, draft_vocab=draft_vocab)
    out = export_heads(src, tmp_path / "out", "vllm", target=model)
    config, tensors = read(out)
    assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
    assert config["medusa_fc_bias"] is True and config["num_heads"] == 3 and config["num_hidden_layers"] == 2
    assert config["truncated_vocab_size"] == (draft_vocab or 128)
    assert ("token_map" in tensors) == bool(draft_vocab)
    hidden = torch.randn(2, 5, 64)
    lm_head = model.get_output_embeddings().weight.detach()
    with torch.no_grad():
        ours = heads(hidden, lm_head)  # [K, B, T, Vd]
    if draft_vocab:
        full = torch.full((*ours.shape[:-1], 128), float("-inf"))
        full[..., heads.token_map] = ours
        ours = full
    theirs = medusa_vllm_logits(config, tensors, hidden)
    finite = torch.isfinite(ours)
    assert torch.equal(finite, torch.isfinite(theirs))
    assert (ours[finite] - theirs[finite]).abs().max() < 1e-5
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    card = (out / "README.md").read_text()
    assert ("enable_weights_track" in card) == bool(draft_vocab)


def test_medusa_full_vocab_option(tmp_path):
    model, info = make_target("llama", layers=2)
    src, _ = medusa_dir(tmp_path, info, share=True, draft_vocab=32)
    config, tensors = read(export_heads(src, tmp_path / "out", "vllm", target=model, medusa_full_vocab=True))
    assert config["truncated_vocab_size"] == 128 and "token_map" not in tensors
    assert tensors["lm_heads.0.weight"].shape == (128, 64)


def test_qwen2_drafts_name_llama_architectures(tmp_path):
    model, info = make_target("qwen2")
    for method, arch in (("eagle3", "LlamaForCausalLMEagle3"), ("eagle", "EagleLlamaForCausalLM")):
        src, _ = eagle_dir(tmp_path, model, info, method)
        config, tensors = read(export_heads(src, tmp_path / f"out-{method}", "vllm", target=model))
        assert config["architectures"] == [arch] and config["model_type"] == "llama" and config["attention_bias"]
        assert QWEN2_BIASES <= set(tensors)
    assert json.loads((tmp_path / "out-eagle3" / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]


def test_refusals(tmp_path):
    model, info = make_target("llama")
    med, _ = medusa_dir(tmp_path, info)
    for fmt in ("sglang", "speculators"):
        with pytest.raises(ExportError, match="no Medusa drafter"):
            export_heads(med, tmp_path / f"m-{fmt}", fmt, target=model)
    with pytest.raises(ExportError, match="at most 3 speculative tokens"):
        export_heads(med, tmp_path / "m-k", "vllm", target=model, num_speculative_tokens=5)
    med2, _ = medusa_dir(tmp_path, info, name="m2", method="medusa2", adapter=True)
    with pytest.raises(ExportError, match="Medusa-2"):
        export_heads(med2, tmp_path / "m2-out", "vllm", target=model)
    own, _ = medusa_dir(tmp_path, info, share=False, draft_vocab=32, name="own")
    with pytest.raises(ExportError, match="share_lm_head"):
        export_heads(own, tmp_path / "own-out", "vllm", target=model)
    e1, _ = eagle_dir(tmp_path, model, info, "eagle")
    with pytest.raises(ExportError, match="EAGLE-1"):
        export_heads(e1, tmp_path / "e1-spec", "speculators")
    with pytest.raises(ExportError, match="unknown format"):
        export_heads(e1, tmp_path / "e1-x", "tgi")
    qmodel, qinfo = make_target("qwen2")
    q3, _ = eagle_dir(tmp_path, qmodel, qinfo, "eagle3")
    with pytest.raises(ExportError, match="q/k/v"):
        export_heads(q3, tmp_path / "q3-sglang", "sglang")
    shallow, sinfo = make_target("llama", layers=2)  # default taps of a 2-layer target include hidden_states[0]
    s3, _ = eagle_dir(tmp_path, shallow, sinfo, "eagle3", name="shallow")
    with pytest.raises(ExportError, match="layer 0"):
        export_heads(s3, tmp_path / "s3-sglang", "sglang")
    top = EagleDraft(eagle_config_for(model, "eagle3", draft_vocab_size=64, feature_layers=[2, 3, LAYERS],
                                      target_info=info))
    top.save_pretrained(tmp_path / "top")
    with pytest.raises(ExportError, match="final-norm"):
        export_heads(tmp_path / "top", tmp_path / "top-vllm", "vllm")
    q3model, q3info = make_target("qwen3")
    q3d, _ = eagle_dir(tmp_path, q3model, q3info, "eagle3")
    with pytest.raises(ExportError, match="'qwen3' layer"):
        export_heads(q3d, tmp_path / "qwen3-vllm", "vllm")
    ok = export_heads(e1, tmp_path / "e1-vllm", "vllm", target=model)
    with pytest.raises(ExportError, match="not empty"):
        export_heads(e1, ok, "vllm", target=model)
    other, _ = make_target("llama")
    with torch.no_grad():
        other.model.norm.weight.add_(1.0)
    with pytest.raises(Exception, match="fingerprint"):
        export_heads(e1, tmp_path / "e1-other", "vllm", target=other)


def test_target_hub_id(tmp_path):
    assert target_hub_id({"name": "smollm2-135m"}) == EMBEDDED_HUB_ID
    assert target_hub_id({"name": "Qwen/Qwen2.5-0.5B-Instruct"}) == "Qwen/Qwen2.5-0.5B-Instruct"
    local = tmp_path / "local-model"
    local.mkdir()
    (local / "config.json").write_text(json.dumps({"_name_or_path": "meta-llama/Llama-3.1-8B-Instruct"}))
    assert target_hub_id({"name": str(local)}) == "meta-llama/Llama-3.1-8B-Instruct"
    (local / "config.json").write_text(json.dumps({"_name_or_path": "/scratch/ckpt"}))
    assert target_hub_id({"name": str(local)}) is None
    assert target_hub_id({"name": "model.gguf"}) is None


def test_card_names_target_and_acceptance(tmp_path):
    model, info = make_target("llama")
    src, _ = eagle_dir(tmp_path, model, info, "eagle3")
    (src / "metrics.json").write_text(json.dumps({"top1": [0.5, 0.4, 0.3], "chain_accepted_tokens": 0.9}))
    card = (export_heads(src, tmp_path / "out", "vllm", repo_id="me/draft") / "README.md").read_text()
    assert info.fingerprint in card and "pair this draft" in card.lower()
    assert "vllm serve" in card and '"model": "me/draft"' in card and '"method": "eagle3"' in card
    assert "1.90 with a greedy chain of 3" in card


def test_cli_and_push(tmp_path, monkeypatch, capsys):
    model, info = make_target("llama")
    src, _ = eagle_dir(tmp_path, model, info, "eagle3")
    assert main([str(src), str(tmp_path / "cli"), "--format", "speculators"]) == 0
    assert "vllm serve" in capsys.readouterr().out
    assert main([str(src), str(tmp_path / "cli-sg"), "--format", "sglang"]) == 0
    med, _ = medusa_dir(tmp_path, info)
    assert main([str(med), str(tmp_path / "cli-m"), "--format", "sglang"]) == 2
    assert "no Medusa drafter" in capsys.readouterr().err

    import headstart.heads.directory

    monkeypatch.setattr(headstart.heads.directory, "push_heads_dir", lambda path, repo, private=False: False)
    out, pushed = export_and_push(src, "me/draft-vllm", "vllm")
    assert not pushed and out == src.with_name(f"{src.name}-vllm") and (out / "model.safetensors").is_file()
    assert '"model": "me/draft-vllm"' in (out / "README.md").read_text()


# DFlash in vLLM's qwen3_dflash layout: two draft layers, no embed_tokens / lm_head (the target's are used)
VLLM_DFLASH = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
    f"layers.{i}.{name}.weight" for i in range(2) for name in (
        "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
        "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


def dflash_dir(tmp_path, model, info, feature_layers, name: str = "dflash", draft_vocab: int = 32,
               block_causal: bool = False, sliding_window: int = 0):
    from headstart.heads.dflash import DFlashDraft, dflash_config_for

    torch.manual_seed(3)
    draft = DFlashDraft(dflash_config_for(model, num_layers=2, block_size=4, mask_token_id=7,
                                          feature_layers=feature_layers, draft_vocab_size=draft_vocab, target_info=info,
                                          block_causal=block_causal, sliding_window=sliding_window))
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.05 * torch.randn_like(p))
    if draft_vocab:
        draft.set_draft_vocab(torch.arange(draft_vocab) * 2)
    draft.save_pretrained(tmp_path / name)
    return tmp_path / name, draft


def test_dflash_vllm_layout(tmp_path):
    """vLLM's names, layer ids shifted by one, fc's column blocks in ascending layer order (vLLM concatenates the
    taps so), the block length in the launch command, the CPU k_norm note."""
    model, info = make_target("llama")
    path, draft = dflash_dir(tmp_path, model, info, [4, 2, 5])
    out = export_heads(path, tmp_path / "out", "vllm", target=model)
    config, tensors = read(out)
    assert set(tensors) == VLLM_DFLASH | {"lm_head.weight", "d2t"} and config["draft_vocab_size"] == 32
    ids = torch.arange(32) + tensors["d2t"]  # vLLM's draft id -> target id
    assert torch.equal(ids, torch.arange(32) * 2) and torch.equal(tensors["lm_head.weight"], model.lm_head.weight[ids])
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"]["target_layer_ids"] == [1, 3, 4] and config["dflash_config"]["mask_token_id"] == 7
    assert config["dflash_config"]["causal"] is False  # vLLM: the block attends both ways, as trained
    assert config["num_hidden_layers"] == 2 and config["rope_parameters"]["rope_theta"] == config["rope_theta"]
    assert "eagle_aux_hidden_state_layer_ids" not in config and "eagle_config" not in config  # they would win in vLLM
    taps = torch.randn(5, 3 * 64)  # headstart's order: hidden_states 4, 2, 5
    ascending = torch.cat([taps[:, 64:128], taps[:, :64], taps[:, 128:]], dim=1)  # vLLM's: 2, 4, 5
    torch.testing.assert_close(ascending @ tensors["fc.weight"].t(), draft.fc(taps).detach(), rtol=1e-5, atol=1e-5)
    mask = torch.load(out / "mask_embedding.pt", weights_only=True)  # as vLLM reads it
    assert mask["mask_token_id"] == 7 and torch.equal(mask["embedding"], draft.mask_embedding.detach())
    info_json = json.loads((out / "export.json").read_text())
    assert info_json["num_speculative_tokens"] == 3 and "vllm_cpu_k_norm" in info_json["notes"]
    card = (out / "README.md").read_text()
    assert '"method": "dflash"' in card and '"num_speculative_tokens": 3' in card
    with pytest.raises(ExportError, match="vLLM only"):
        export_heads(path, tmp_path / "sg", "sglang")
    causal, _ = dflash_dir(tmp_path, model, info, [4, 2, 5], name="causal", block_causal=True)
    config, _ = read(export_heads(causal, tmp_path / "causal-out", "vllm", target=model))
    assert config["dflash_config"]["causal"] is True and "use_swa" not in config["dflash_config"]
    windowed, _ = dflash_dir(tmp_path, model, info, [4, 2, 5], name="windowed", sliding_window=64)
    config, _ = read(export_heads(windowed, tmp_path / "windowed-out", "vllm", target=model))
    assert config["dflash_config"]["use_swa"] is True and config["dflash_config"]["swa_window_size"] == 64
    assert "layer_types" not in config  # vLLM: use_swa without layer_types windows every layer
    full, full_draft = dflash_dir(tmp_path, model, info, [2, 3], name="full", draft_vocab=0)
    config, tensors = read(export_heads(full, tmp_path / "full-out", "vllm", target=model))
    assert set(tensors) == VLLM_DFLASH and "draft_vocab_size" not in config  # vLLM uses the target's lm_head
    top, _ = dflash_dir(tmp_path, model, info, [2, LAYERS], name="top")
    with pytest.raises(ExportError, match="final norm"):
        export_heads(top, tmp_path / "top-out", "vllm")
