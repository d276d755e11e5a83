"""Shared fixtures: tiny random models (2 layers, hidden 64) built from a config, no download."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the network
os.environ.setdefault("WANDB_MODE", "offline")

TINY_DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024)


def tiny_model(model_type: str = "llama", vocab_size: int = 128, seed: int = 0, **overrides):
    """A tiny random causal LM of a real architecture (llama, qwen2, qwen3, mistral, gemma), fp32, eval mode."""
    torch.manual_seed(seed)
    kwargs = dict(TINY_DIMS, vocab_size=vocab_size, tie_word_embeddings=False)
    if model_type == "gemma":
        kwargs["head_dim"] = 16
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


@pytest.fixture
def tiny_llama():
    return tiny_model("llama")
