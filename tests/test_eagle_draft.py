"""heads/eagle.py's EAGLE-3 norm flags: each one's forward written out by hand (the equations of
vllm-project/speculators' Eagle3 and vLLM 0.32's llama_eagle3.py), and heads saved before the flags existed
loading as the architecture they were trained with."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_model
from headstart.heads.eagle import NORM_FLAGS, EagleConfig, EagleDraft, eagle_config_for
from headstart.heads.load import load_heads
from headstart.heads.target import target_info
from headstart.train.config import ConfigError, parse_config
from headstart.train.eagle import DEFAULT_NORMS, EagleTrainConfig, check_config


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def by_hand(draft: EagleDraft, taps: torch.Tensor, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One causal draft step from the taps, spelled out: -> (fed-back feature [B, T, h], logits [B, T, dv])."""
    cfg, layer, eps = draft.config, draft.layers[0], draft.layers[0].input_layernorm.variance_epsilon
    x = rms(taps, draft.input_norm.weight, eps) if cfg.norm_before_fc else taps
    feature = x @ draft.fc.weight.t()
    normed = rms(feature, layer.hidden_norm.weight, eps)
    residual = normed if cfg.norm_before_residual else feature
    B, T, _ = embeds.shape
    attn_in = torch.cat([rms(embeds, layer.input_layernorm.weight, eps), normed], -1)
    pos = torch.arange(T)[None].expand(B, T)
    attn, _ = layer.self_attn(hidden_states=attn_in, position_embeddings=draft.rotary_emb(residual, position_ids=pos),
                              attention_mask=torch.zeros(1, 1, T, T).masked_fill(torch.ones(T, T).triu(1).bool(),
                                                                                  torch.finfo(torch.float32).min))
    h = residual + attn
    out = h + layer.mlp(rms(h, layer.post_attention_layernorm.weight, eps))
    post = rms(out, draft.norm.weight, eps)
    return (post if cfg.norm_output else out), post @ draft.lm_head.weight.t()


@pytest.mark.parametrize("flags", [(), ("norm_before_fc",), ("norm_before_residual",), ("norm_output",), NORM_FLAGS])
def test_each_norm_flag_is_its_equation(flags, one_thread):
    model = tiny_model("llama", num_hidden_layers=4)
    draft = EagleDraft(eagle_config_for(model, "eagle3", 32, [1, 2, 3], **{n: True for n in flags})).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in draft.parameters():  # norms away from 1, so a norm applied in the wrong place shows
            p.add_(0.3 * torch.randn_like(p))
        taps, embeds = 3 * torch.randn(2, 7, 3 * 64), torch.randn(2, 7, 64)
        out = draft(embeds, draft.fuse(taps), torch.arange(7)[None].expand(2, 7))
        want_out, want_logits = by_hand(draft, taps, embeds)
        torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(draft.logits(out), want_logits, rtol=1e-5, atol=1e-5)
    assert ("input_norm.weight" in draft.state_dict()) == ("norm_before_fc" in flags)


def test_heads_saved_without_the_flags_load_as_before(tmp_path, one_thread):
    """A config.json written before the flags existed (no such keys) is the original draft: same weights, outputs."""
    model = tiny_model("llama", num_hidden_layers=4)
    info = target_info("tiny", model)
    torch.manual_seed(0)
    draft = EagleDraft(eagle_config_for(model, "eagle3", 32, [1, 2, 3], target_info=info)).eval()
    draft.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for name in NORM_FLAGS:
        assert config.pop(name) is False
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_heads(tmp_path, info).eval()
    assert not any(getattr(loaded.config, n) for n in NORM_FLAGS)
    taps, embeds = torch.randn(1, 5, 3 * 64), torch.randn(1, 5, 64)
    with torch.no_grad():
        pos = torch.arange(5)[None]
        old = draft.logits(draft(embeds, draft.fuse(taps), pos))
        torch.testing.assert_close(loaded.logits(loaded(embeds, loaded.fuse(taps), pos)), old, rtol=0, atol=0)
        ref, _ = by_hand(loaded, taps, embeds)
        torch.testing.assert_close(loaded(embeds, loaded.fuse(taps), pos), ref, rtol=1e-5, atol=1e-5)


def test_norm_flags_defaults_and_refusals():
    eagle3 = check_config(parse_config(EagleTrainConfig, ["--method", "eagle3"]))
    assert {n: getattr(eagle3, n) for n in NORM_FLAGS} == DEFAULT_NORMS
    off = check_config(parse_config(EagleTrainConfig, ["--method", "eagle3", "--norm_output", "false"]))
    assert off.norm_output is False
    eagle1 = check_config(parse_config(EagleTrainConfig, ["--method", "eagle"]))
    assert not any(getattr(eagle1, n) for n in NORM_FLAGS)  # EAGLE-1 has none
    with pytest.raises(ConfigError, match="norm_before_fc"):
        check_config(parse_config(EagleTrainConfig, ["--method", "eagle", "--norm_before_fc", "true"]))
    with pytest.raises(ValueError, match="norm_output"):
        EagleConfig(hidden_size=64, vocab_size=128, method="eagle", norm_output=True)
