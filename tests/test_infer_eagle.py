"""EAGLE drafting at inference: greedy exactness, the draft's cache and tree inputs, loading, tree sizing."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from headstart.heads.eagle import NORM_FLAGS, EagleDraft, eagle_config_for
from headstart.heads.target import fingerprint
import headstart.inference.calibrate as calibrate_module
from headstart.inference.eagle import EagleProposer, dynamic_config_from_choices
from headstart.inference.decode import speculative_generate
from headstart.inference.forward import target_forward
from headstart.inference.speculator import Speculator, SpeculatorError
from headstart.inference.tree import DraftInput, DynamicTreeConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

VOCAB = 128


def make_draft(model, method: str, seed: int = 0, vocab: int = VOCAB) -> EagleDraft:
    """method "eagle3-norms": EAGLE-3 with all three norm flags (heads/eagle.py) on."""
    torch.manual_seed(seed)
    norms = dict.fromkeys(NORM_FLAGS, True) if method == "eagle3-norms" else {}
    method = method.split("-")[0]
    draft = EagleDraft(eagle_config_for(model, method, draft_vocab_size=vocab // 2 if method == "eagle3" else 0,
                                        target_info={"name": "tiny", "fingerprint": fingerprint(model)}, **norms))
    if method == "eagle3":
        draft.set_draft_vocab(torch.arange(1, vocab, 2))  # odd target ids only
    return draft.eval()


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("method", ["eagle", "eagle3", "eagle3-norms"])
def test_greedy_output_equals_generate(model_type, method):
    model = tiny_model(model_type, num_hidden_layers=4, seed=3)
    draft = make_draft(model, method)
    eos = model.generation_config.eos_token_id
    stops = [] if eos is None else [eos]
    gen = torch.Generator().manual_seed(0)
    for i in range(6):
        prompt = torch.randint(3, VOCAB, (1, 6 + i), generator=gen)
        ref = model.generate(prompt, max_new_tokens=48, do_sample=False)[0, prompt.shape[1]:].tolist()
        proposer = EagleProposer(draft, model, DynamicTreeConfig(topk=3, depth=3, total_tokens=10))
        out = speculative_generate(model, proposer, prompt, 48, stop_token_ids=stops)
        assert out.tokens == ref


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_accepted_drafts_compact_both_caches(method, monkeypatch):
    """Drafted tokens do get accepted (a 16-token vocabulary: the target's token is often among a random draft's
    top 3), on scattered tree paths too: the target cache is compacted from non-contiguous nodes and the draft
    commits several accepted features at once; the output stays model.generate's and the draft cache exact."""
    import headstart.inference.decode

    kept: list[list[int]] = []
    compact = headstart.inference.decode.compact_cache
    monkeypatch.setattr(headstart.inference.decode, "compact_cache", lambda cache, n, keep: (kept.append(list(keep)),
                                                                                  compact(cache, n, keep)))
    model = tiny_model("llama", vocab_size=16, num_hidden_layers=4, seed=3, eos_token_id=None)
    draft = make_draft(model, method, vocab=16)
    gen = torch.Generator().manual_seed(0)
    accepted = 0
    for i in range(4):
        prompt = torch.randint(3, 16, (1, 6 + i), generator=gen)
        ref = model.generate(prompt, max_new_tokens=40, do_sample=False)[0, prompt.shape[1]:].tolist()
        proposer = EagleProposer(draft, model, DynamicTreeConfig(topk=3, depth=3, total_tokens=10))
        out = speculative_generate(model, proposer, prompt, 40, stop_token_ids=[])
        assert out.tokens == ref
        accepted += sum(a * c for a, c in enumerate(out.stats.accept_hist))
        assert_cache_holds_true_pairs(proposer, draft, model, prompt[0].tolist() + out.tokens)
    assert accepted >= 10 and any(len(path) >= 3 for path in kept)
    assert any(path != list(range(len(path))) for path in kept)  # a path through a non-first sibling


def _chain_outputs(draft: EagleDraft, model, context: list[int], taps: torch.Tensor, chain: list[int]) -> torch.Tensor:
    """Brute force: run the draft from scratch over the true pairs, then feed its own outputs along `chain`
    (tokens after the root); returns the outputs [1 + len(chain), h] of the root pair and each chain node."""
    embed = model.get_input_embeddings()
    n = taps.shape[0]
    feats = draft.fuse(taps)  # [n, h]
    tokens = torch.tensor(context[1: n + 1])
    outs = draft(embed(tokens)[None], feats[None], torch.arange(n)[None])[0]  # causal
    result = [outs[-1]]
    seq_feats, seq_tokens = list(feats), tokens.tolist()
    for tok in chain:
        seq_feats.append(result[-1])
        seq_tokens.append(tok)
        length = len(seq_tokens)
        out = draft(embed(torch.tensor(seq_tokens))[None], torch.stack(seq_feats)[None], torch.arange(length)[None])[0]
        result.append(out[-1])
    return torch.stack(result)


@pytest.mark.parametrize("method", ["eagle", "eagle3", "eagle3-norms"])
def test_tree_nodes_see_exactly_their_ancestors(method):
    model = tiny_model("llama", num_hidden_layers=4, seed=1)
    draft = make_draft(model, method, seed=2)
    context = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    _, _, taps = target_forward(model, torch.tensor([context[:-1]]), _cache(), feature_layers=draft.config.feature_layers)
    proposer = EagleProposer(draft, model, DynamicTreeConfig(topk=3, depth=3, total_tokens=16))
    with torch.no_grad():
        proposer(DraftInput(hidden=taps[-1], root=context[-1], context=context, features=taps))
        tokens_by_node, parents = proposer.node_tokens, proposer.node_parents
        checked = 0
        for node, out in proposer.node_outputs.items():
            chain = []
            walk = node
            while walk > 0:
                chain.append(tokens_by_node[walk])
                walk = parents[walk]
            expected = _chain_outputs(draft, model, context, taps, chain[::-1])[-1]
            torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
            checked += 1
        assert checked >= 7  # root, 3 children, and deeper nodes
        assert proposer.cache.get_seq_length() == len(context) - 1  # tree entries dropped again


def test_committed_cache_is_built_from_true_features_only():
    """After several decode steps the draft cache equals a from-scratch run over (f_s, x_{s+1}) pairs."""
    model = tiny_model("qwen2", num_hidden_layers=4, seed=4)
    draft = make_draft(model, "eagle3", seed=1)
    prompt = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    proposer = EagleProposer(draft, model, DynamicTreeConfig(topk=2, depth=3, total_tokens=6))
    out = speculative_generate(model, proposer, prompt, 20, stop_token_ids=[])
    assert_cache_holds_true_pairs(proposer, draft, model, prompt[0].tolist() + out.tokens)


def assert_cache_holds_true_pairs(proposer: EagleProposer, draft: EagleDraft, model, context: list[int]) -> None:
    """The proposer's draft cache == a from-scratch draft run over the pairs (f_s, x_{s+1}) it committed."""
    n = proposer.committed
    _, _, taps = target_forward(model, torch.tensor([context[:n]]), _cache(), feature_layers=draft.config.feature_layers)
    fresh = _cache()
    with torch.no_grad():
        draft(model.get_input_embeddings()(torch.tensor(context[1: n + 1]))[None], draft.fuse(taps)[None],
              torch.arange(n)[None], None if n == 0 else _causal(n), fresh)
    for got, want in zip(proposer.cache.layers, fresh.layers):
        torch.testing.assert_close(got.keys, want.keys, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(got.values, want.values, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_lookup_steps_keep_the_draft_cache_and_the_output_exact(method):
    """Steps drafted from the context skip the EAGLE draft; the target features of what they accept are handed
    over at its next call, so its cache still equals a from-scratch run, and the output model.generate's."""
    from headstart.inference.lookup import LookupConfig

    model = tiny_model("llama", num_hidden_layers=4, seed=3)
    draft = make_draft(model, method, seed=1)
    gen = torch.Generator().manual_seed(5)
    lookup_steps = 0
    for i in range(4):
        prompt = torch.randint(3, VOCAB, (1, 8), generator=gen)
        ref = model.generate(prompt, max_new_tokens=40, do_sample=False)[0, 8:].tolist()
        proposer = EagleProposer(draft, model, DynamicTreeConfig(topk=2, depth=3, total_tokens=5))
        out = speculative_generate(model, proposer, prompt, 40, stop_token_ids=[],
                                   lookup=LookupConfig(num_tokens=4, min_ngram=1))
        assert out.tokens == ref
        lookup_steps += out.stats.lookup_steps
        assert_cache_holds_true_pairs(proposer, draft, model, prompt[0].tolist() + out.tokens)
    assert lookup_steps > 10


def _cache():
    from transformers import DynamicCache

    return DynamicCache()


def _causal(n: int) -> torch.Tensor:
    from headstart.heads.eagle import causal_mask

    return causal_mask(n, torch.float32)


def test_speculator_loads_eagle_dirs_and_refuses_another_target(tmp_path):
    model = tiny_model("llama", num_hidden_layers=4, seed=0)
    for method in ("eagle", "eagle3"):
        draft = make_draft(model, method)
        draft.save_pretrained(tmp_path / method)
        spec = Speculator.from_pretrained(str(tmp_path / method), target=model, tree="default")
        assert spec.dynamic_tree and spec.method.names == (method,)
        prompt = torch.randint(3, VOCAB, (10,), generator=torch.Generator().manual_seed(0))
        ref = model.generate(prompt[None], max_new_tokens=24, do_sample=False)[0, 10:].tolist()
        assert spec.generate(prompt, 24).tokens == ref
        spec.set_tree(DynamicTreeConfig(topk=2, depth=2, total_tokens=5))
        assert spec.tree_size == 5
    other = tiny_model("llama", num_hidden_layers=4, seed=9)
    with pytest.raises(SpeculatorError, match="fingerprint"):
        Speculator.from_pretrained(str(tmp_path / "eagle3"), target=other)


def test_auto_tree_is_timed_with_the_eagle_draft(tmp_path, monkeypatch):
    """The calibration runs the EAGLE draft of every size it times. The timer runs each step and draft for real but
    returns scripted milliseconds (a CPU-like curve) and the machine reads as quiet, so the choice does not depend on
    what else runs beside the test (a busy machine would fall back, tests/test_calibrate.py)."""
    model = tiny_model("llama", num_hidden_layers=4, seed=0)
    make_draft(model, "eagle3").save_pretrained(tmp_path)
    spec = Speculator.from_pretrained(str(tmp_path), target=model, tree="default")
    drafted: set[int] = set()  # tree sizes whose draft ran

    def timer(kind: str, size: int, run) -> float:
        run()
        if kind == "draft":
            drafted.add(size)
        return 1.0 if kind == "draft" else {1: 40.0, 4: 44.0, 8: 60.0}[size]

    monkeypatch.setattr(calibrate_module, "busy_reading", lambda: (None, 0.0))  # unknown load: not busy
    calib = spec.calibrate(sizes=(1, 4, 8), prefix_len=32, repeats=1, timer=timer)
    assert drafted == {1, 4, 8}  # the draft of every size timed, run
    assert calib.chosen_by == "measurement, the prior curve's tree kept" and calib.choices  # scripted: always this
    assert spec.dynamic == dynamic_config_from_choices(calib.choices)
    assert spec.tree_size == len(calib.choices) + 1 and (tmp_path / "tree.json").is_file()
    again = Speculator.from_pretrained(str(tmp_path), target=model)  # reads tree.json
    assert again.dynamic == spec.dynamic


def test_dynamic_config_from_choices():
    assert dynamic_config_from_choices([]) == DynamicTreeConfig(topk=1, depth=0, total_tokens=1)
    assert dynamic_config_from_choices([[0], [1], [0, 0], [0, 0, 0]]) == DynamicTreeConfig(topk=2, depth=3, total_tokens=5)
