"""The target without its model (heads/target.py, load_target_without_model): the fingerprint read from a sample of
each stored tensor equals the one of the loaded model, bit for bit, and so do the tokenizer and stop tokens."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import no_model_built, tiny_chat_tokenizer, tiny_model
from headstart.heads.chat import stop_token_ids
from headstart.heads.target import load_target, load_target_without_model

SAVES = {  # name -> (model overrides, save_pretrained kwargs, dtype the weights are stored in)
    "fp32": ({}, {}, torch.float32),
    "tied_embeddings": ({"tie_word_embeddings": True}, {}, torch.float32),
    "bf16": ({}, {}, torch.bfloat16),
    "fp16_sharded": ({}, {"max_shard_size": "20KB"}, torch.float16),
}


def save_target(path, overrides: dict, save_kwargs: dict, dtype: torch.dtype):
    tokenizer = tiny_chat_tokenizer()
    model = tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, **overrides)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.to(dtype).save_pretrained(path, **save_kwargs)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("kind", sorted(SAVES))
def test_fingerprint_without_model_equals_loaded(kind, tmp_path):
    target = save_target(tmp_path / kind, *SAVES[kind])
    if kind == "fp16_sharded":
        assert len(list(target.glob("*.safetensors"))) > 1
    with no_model_built():
        tokenizer, generation_config, info = load_target_without_model(str(target))
        with pytest.raises(AssertionError, match="LlamaForCausalLM.from_pretrained: a model was loaded"):
            load_target(str(target))  # what the check catches
    model, loaded_tokenizer, loaded_info = load_target(str(target))
    assert info == loaded_info
    assert stop_token_ids(tokenizer, generation_config) == stop_token_ids(loaded_tokenizer, model.generation_config)
    assert tokenizer("hello there")["input_ids"] == loaded_tokenizer("hello there")["input_ids"]
    assert tokenizer.pad_token_id == loaded_tokenizer.pad_token_id


def test_fingerprint_without_model_tells_weights_apart(tmp_path):
    first = save_target(tmp_path / "a", {}, {}, torch.float32)
    state = load_file(first / "model.safetensors")
    state["model.norm.weight"] = state["model.norm.weight"] + 1  # 64 elements: every one is sampled
    other = save_target(tmp_path / "b", {}, {}, torch.float32)
    save_file(state, other / "model.safetensors", metadata={"format": "pt"})
    with no_model_built():
        assert load_target_without_model(str(first))[2].fingerprint != load_target_without_model(str(other))[2].fingerprint


def test_unreadable_checkpoint_loads_the_model_and_says_so(tmp_path, capsys):
    target = save_target(tmp_path / "f64", {}, {}, torch.float32)
    state = load_file(target / "model.safetensors")
    state["model.norm.weight"] = state["model.norm.weight"].double()  # a dtype the samples would round differently
    save_file(state, target / "model.safetensors", metadata={"format": "pt"})
    _, _, info = load_target_without_model(str(target))
    assert "cannot be read from its files alone (tensor model.norm.weight is stored as F64)" in capsys.readouterr().out
    assert info == load_target(str(target))[2]


def test_embedded_target_fingerprint_without_model(embedded_target):
    model, tokenizer, info = embedded_target
    with no_model_built():
        lazy_tokenizer, generation_config, lazy_info = load_target_without_model("smollm2-135m")
    assert lazy_info == info
    assert stop_token_ids(lazy_tokenizer, generation_config) == stop_token_ids(tokenizer, model.generation_config)
