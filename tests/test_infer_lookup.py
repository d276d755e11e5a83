"""Drafting from the context (inference/lookup.py): what a lookup finds, and that decoding with it stays exact."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from headstart.inference.decode import speculative_generate
from headstart.inference.speculator import Speculator
import random

from headstart.inference.lookup import ContextIndex, LookupConfig, chain_draft, lookup_continuation

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_lookup_takes_the_longest_ngram_then_the_latest_occurrence():
    cfg = LookupConfig(num_tokens=2, min_ngram=1, max_ngram=3)
    #          0  1  2  3  4  5  6  7  8  9 10 11
    context = [5, 6, 7, 1, 6, 7, 2, 9, 7, 3, 6, 7]
    # "3 6 7" never occurred before; "6 7" did, at 1 and 4: the latest (4) is followed by 2, 9
    assert lookup_continuation(context, cfg) == [2, 9]
    assert lookup_continuation(context + [2], cfg) == [9, 7]  # now "6 7 2" (3-gram) matches at 4
    assert lookup_continuation([1, 2, 3, 4], cfg) == []  # nothing repeats
    assert lookup_continuation([4, 8, 4], cfg) == [8, 4]  # the 1-gram "4" at 0
    assert lookup_continuation([4, 8, 4], LookupConfig(num_tokens=2, min_ngram=2)) == []  # n >= 2 needed
    assert lookup_continuation([3, 4, 3, 4], LookupConfig(num_tokens=5)) == [3, 4]  # cut at the end of the context
    assert lookup_continuation([], cfg) == [] and lookup_continuation([7], cfg) == []


def _scan_branches(context, num_tokens, min_ngram, max_ngram, max_matches):
    """The lookup spelled out: for each n (largest first), every earlier start, latest first."""
    for n in range(max_ngram, max(min_ngram, 1) - 1, -1):
        if len(context) <= n:
            continue
        found = []
        for start in range(len(context) - n - 1, -1, -1):
            follow = context[start + n: start + n + num_tokens]
            if context[start: start + n] == context[-n:] and follow not in found and len(found) < max_matches:
                found.append(follow)
        if found:
            return n, found
    return 0, []


def test_context_index_grown_token_by_token_finds_what_a_full_scan_finds():
    """The decode loop's index, appended to step by step, against the full scan of the context every step."""
    rng = random.Random(0)
    checked = 0
    for _ in range(200):
        vocab = rng.choice([2, 3, 5, 9])
        context: list[int] = []
        index = ContextIndex(context)
        for _ in range(rng.randrange(1, 50)):
            context.extend(rng.randrange(vocab) for _ in range(rng.choice([1, 1, 2, 4])))  # a step emits 1+ tokens
            for args in [(4, 1, 3, 3), (16, 2, 3, 1), (2, 1, 1, 2), (3, 2, 4, 4)]:
                found = index.branches(*args)
                assert found == _scan_branches(context, *args), (context, args)
                checked += bool(found[1])
    assert checked > 1000  # most steps found something: the comparison covered matches, not just misses


def test_chain_draft_is_a_chain():
    tree, tokens = chain_draft(11, [4, 5, 6])
    assert tree.parents == [-1, 0, 1, 2] and tokens.tolist() == [11, 4, 5, 6]
    assert torch.equal(tree.ancestor_mask(), torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_greedy_exact_with_lookup_steps(model_type):
    """Medusa heads + context chains (1-grams: many lookup steps, most of them wrong) == model.generate."""
    from test_infer_generate import _first_diff, random_heads, reference

    model = tiny_model(model_type, vocab_size=128, seed=1)
    spec = Speculator(model, random_heads(seed=2))
    prompts = torch.randint(3, 128, (6, 8), generator=torch.Generator().manual_seed(3))
    refs = reference(model, prompts, 64)
    lookup_steps = kept = 0
    for i in range(6):
        out = speculative_generate(model, spec.make_proposer(), prompts[i], 64, stop_token_ids=[],
                                   lookup=LookupConfig(num_tokens=4, min_ngram=1))
        assert out.tokens == refs[i], f"prompt {i}: first diff at {_first_diff(out.tokens, refs[i])}"
        lookup_steps += out.stats.lookup_steps
        kept += sum(a * c for a, c in enumerate(out.stats.accept_hist))
    assert lookup_steps > 20 and kept > 0  # chains were verified and some of their tokens kept


def test_speculator_uses_lookup_by_default_and_can_turn_it_off():
    from test_infer_generate import random_heads

    model = tiny_model("llama", vocab_size=128, seed=1)
    spec = Speculator(model, random_heads(seed=2))
    prompt = torch.tensor([5, 6, 7, 8, 5, 6, 7, 8, 5, 6])  # repeats: a chain is found at once
    on = spec.generate(prompt, 16, stop_token_ids=[])
    off = spec.generate(prompt, 16, stop_token_ids=[], lookup=False)
    assert on.tokens == off.tokens
    assert on.stats.lookup_steps > 0 and off.stats.lookup_steps == 0
    spec.lookup = False
    assert spec.generate(prompt, 16, stop_token_ids=[]).stats.lookup_steps == 0
