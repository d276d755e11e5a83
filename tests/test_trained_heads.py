"""Trained Medusa heads on the real embedded target: greedy output is exactly the target's.

tests/data/smollm2-135m-medusa holds Medusa-1 heads trained on 256 self-distilled chitchat conversations (an
earlier, smaller version of the recipe: 3 heads sharing the target's lm_head, full vocabulary, 4 MB; its README.md).
"""

from pathlib import Path

import pytest
import torch

from headstart.heads.chat import prompt_ids
from headstart.heads.prompts import load_prompts
from headstart.inference.speculator import Speculator

HEADS = Path(__file__).parent / "data" / "smollm2-135m-medusa"

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py: steady on a shared 2-core machine


def test_trained_heads_are_exact_on_20_heldout_prompts(embedded_target):
    model, tokenizer, info = embedded_target
    spec = Speculator.from_pretrained(str(HEADS), target=model, tokenizer=tokenizer, tree="default")
    stops = [tokenizer.eos_token_id]
    forwards = tokens = 0
    for row in load_prompts("chitchat:heldout", limit=20).rows:
        ids = torch.tensor(prompt_ids(tokenizer, row.turns[0]))
        ref = model.generate(ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=32,
                             do_sample=False, eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)[0, len(ids):]
        out = spec.generate(ids, 32, stop_token_ids=stops)
        assert out.tokens == ref.tolist(), row.id
        forwards += out.stats.decode_forwards
        tokens += out.stats.new_tokens
    assert (tokens - 20) / forwards > 1.3  # trained heads do get tokens accepted (tau on held-out chat)
