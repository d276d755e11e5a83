"""DFlash drafting at inference: greedy exactness (fixed trees, chains, adaptive, lookup), the draft cache holds the
true features of exactly the committed positions, lossless sampling (chi-square), loading and `--tree auto`."""

from __future__ import annotations

import pytest
import torch
from conftest import chi_square_pvalue, exact_first_three, tiny_model
from transformers import DynamicCache

from headstart.heads.dflash import DFLASH, DFlashDraft, dflash_config_for
from headstart.heads.target import fingerprint
from headstart.inference.decode import SamplingConfig, speculative_generate
from headstart.inference.dflash import DFlashProposer
from headstart.inference.forward import target_forward
from headstart.inference.speculator import Speculator, SpeculatorError
from headstart.inference.tree import Proposer, tree_from_choices

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def make_draft(model, block_size: int = 4, seed: int = 0, draft_vocab: int = 0, block_causal: bool = False,
               sliding_window: int = 0) -> DFlashDraft:
    torch.manual_seed(seed)
    vocab = model.config.vocab_size
    draft = DFlashDraft(dflash_config_for(model, num_layers=2, block_size=block_size, mask_token_id=vocab - 1,
                                          feature_layers=[1, 3], draft_vocab_size=draft_vocab,
                                          target_info={"name": "tiny", "fingerprint": fingerprint(model)},
                                          block_causal=block_causal, sliding_window=sliding_window))
    if draft_vocab:
        draft.set_draft_vocab(torch.arange(0, vocab, vocab // draft_vocab))
    with torch.no_grad():  # the target's lm_head reads the draft's output: make it the target's scale
        draft.norm.weight.copy_(model.model.norm.weight)
        draft.mask_embedding.copy_(model.get_input_embeddings().weight[3])  # some token's scale
    return draft.eval()


def spec_for(model, draft, tree) -> Speculator:
    return Speculator(model, draft, tree=tree, cpu_linears=False)


def no_eos(model):
    """A 16-token vocabulary holds the default EOS id: generate to the token budget instead."""
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("model_type,block_causal,window", [("llama", False, 0), ("qwen2", False, 0), ("llama", True, 0),
                                                            ("llama", False, 8)])
@pytest.mark.parametrize("tree", [[[0], [0, 0], [0, 0, 0]], [[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]]])
def test_greedy_output_equals_generate(model_type, block_causal, window, tree):
    """A 16-token vocabulary: random drafts are often right, so accepted paths (scattered too) are exercised. A
    window of 8 is shorter than the prompts, so the windowed decode mask is in use."""
    model = no_eos(tiny_model(model_type, num_hidden_layers=4, vocab_size=16, seed=3))
    spec = spec_for(model, make_draft(model, block_causal=block_causal, sliding_window=window), tree)
    assert greedy_accepted_tokens(model, spec, 6) > 20


def greedy_accepted_tokens(model, spec, prompts: int) -> int:
    """Random prompts decoded 40 tokens with adaptive drafting off, on, and on with lookup, each asserted equal to
    model.generate's greedy tokens; the drafted tokens accepted over all of them."""
    gen = torch.Generator().manual_seed(0)
    accepted = 0
    for i in range(prompts):
        prompt = torch.randint(0, 15, (1, 5 + i), generator=gen)
        ref = model.generate(prompt, max_new_tokens=40, do_sample=False)[0, prompt.shape[1]:].tolist()
        for adaptive, lookup in ((False, False), (True, False), (True, True)):
            out = spec.generate(prompt, 40, stop_token_ids=[], adaptive=adaptive, lookup=lookup)
            assert out.tokens == ref, (adaptive, lookup)
            accepted += sum(a * c for a, c in enumerate(out.stats.accept_hist))
    return accepted


@pytest.mark.parametrize("window", [0, 6])
def test_cache_holds_the_true_features_of_the_committed_positions(window):
    """After a generation the draft cache equals one pass over the target's features of every committed position:
    the prompt and each step's accepted path, nothing drafted. With a sliding window of 6 it holds the last 5 of them
    only, and the next block's logits equal those over the whole context under the window's mask."""
    model = tiny_model("llama", num_hidden_layers=4, vocab_size=16, seed=3)
    draft = make_draft(model, sliding_window=window)
    proposer = DFlashProposer(draft, model, tree_from_choices([[0], [1], [0, 0], [0, 0, 0]]),
                              lambda x: x @ model.lm_head.weight.t())
    prompt = torch.randint(0, 15, (7,), generator=torch.Generator().manual_seed(1))
    out = speculative_generate(model, proposer, prompt, 30, stop_token_ids=[])
    seq = prompt.tolist() + out.tokens
    n = proposer.committed  # the position of the last root drafted from: features of 0..n-1 committed
    assert 7 < n <= len(seq) - 1 and not proposer.pending
    _, _, taps = target_forward(model, torch.tensor([seq[:n]]), DynamicCache(), feature_layers=[1, 3])
    with torch.no_grad():
        full = draft.context_kv(draft.fuse(taps)[None], torch.arange(n)[None])
    first = n - 5 if window else 0
    assert proposer.first == first
    for (k, v), (k_ref, v_ref) in zip(proposer.cache, full):
        torch.testing.assert_close(k, k_ref[:, :, first:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, v_ref[:, :, first:], rtol=1e-5, atol=1e-5)
    if window:
        block = torch.tensor([[seq[n]] + [draft.config.mask_token_id] * 3])
        embeds = draft.embed_block(block, model.get_input_embeddings()(block))
        with torch.no_grad():
            whole = draft(embeds, torch.arange(n, n + 4)[None], full, draft.decode_mask(n))
        torch.testing.assert_close(proposer.block_logits(seq[n], 3), proposer.project(draft.norm(whole[0, 1:])),
                                   rtol=1e-5, atol=1e-5)


def test_draft_vocabulary_scores_only_its_tokens():
    model = no_eos(tiny_model("llama", num_hidden_layers=4, vocab_size=16, seed=3))
    spec = spec_for(model, make_draft(model, draft_vocab=8), [[0], [1], [0, 0]])  # even ids only
    prompt = torch.randint(0, 15, (1, 6), generator=torch.Generator().manual_seed(2))
    proposer = spec.make_proposer()
    drafted = []

    class Recording(Proposer):  # the draft's proposer, its drafts recorded
        feature_layers = proposer.feature_layers  # the decode loop computes these taps for the draft

        def reset(self):
            proposer.reset()

        def __call__(self, inp):
            tree, tokens = proposer(inp)
            drafted.extend(tokens[1:].tolist())
            return tree, tokens

    out = speculative_generate(model, Recording(), prompt, 24, stop_token_ids=[])
    ref = model.generate(prompt, max_new_tokens=24, do_sample=False)[0, 6:].tolist()
    assert out.tokens == ref and drafted and all(t % 2 == 0 for t in drafted)


def test_per_step_trees_are_shaped_by_the_draft_and_decode_greedy_exactly():
    """Resized by the adaptive policy the proposer drafts a tree of the asked size whose shape follows each step's
    probabilities (more than one shape over a generation; the logits sharpened so that some slots are confident),
    and the output stays model.generate's."""
    model = no_eos(tiny_model("llama", num_hidden_layers=4, vocab_size=16, seed=3))
    proposer = DFlashProposer(make_draft(model), model, tree_from_choices([[0]]),
                              lambda x: 8 * (x @ model.lm_head.weight.t()))
    proposer.resize([[0], [1], [0, 0], [0, 0, 0], [2]])
    shapes = set()

    class Recording(Proposer):
        feature_layers = proposer.feature_layers

        def reset(self):
            proposer.reset()

        def __call__(self, inp):
            tree, tokens = proposer(inp)
            assert tree.size == 6 and len(tokens) == 6
            shapes.add(tuple(tree.parents))
            return tree, tokens

    prompt = torch.randint(0, 15, (1, 6), generator=torch.Generator().manual_seed(4))
    out = speculative_generate(model, Recording(), prompt, 40, stop_token_ids=[])
    assert out.tokens == model.generate(prompt, max_new_tokens=40, do_sample=False)[0, 6:].tolist()
    assert len(shapes) > 1 and sum(a * c for a, c in enumerate(out.stats.accept_hist)) > 0


@pytest.mark.parametrize("per_step", [False, True])
def test_sampling_matches_the_target_distribution(per_step):
    """Temperature 1 on a vocab-8 target: the first three tokens follow the target's exact joint distribution, with
    the fixed tree and with per-step shapes of its size."""
    model = tiny_model("llama", num_hidden_layers=4, vocab_size=8, seed=3, hidden_size=32, intermediate_size=64)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    spec = spec_for(model, make_draft(model), [[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]])
    prompt = torch.tensor([1, 5, 3, 6])
    exact = exact_first_three(model, prompt)
    n = 2000
    counts = torch.zeros(8, 8, 8)
    accepted = 0
    for s in range(n):
        proposer = spec.make_proposer()
        if per_step:
            proposer.resize([[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]])
        out = speculative_generate(model, proposer, prompt, 3, SamplingConfig(temperature=1.0), [],
                                   torch.Generator().manual_seed(s))
        counts[tuple(out.tokens)] += 1
        accepted += sum(a * c for a, c in enumerate(out.stats.accept_hist))
    assert accepted > n // 4  # drafted tokens were kept (the caches got compacted)
    pvalue = chi_square_pvalue(counts, exact)
    assert pvalue > 1e-3, f"chi-square p = {pvalue:.3g}"


def test_speculator_loads_dflash_dirs_sizes_trees_and_refuses_another_target(tmp_path):
    model = no_eos(tiny_model("llama", num_hidden_layers=4, vocab_size=16, seed=0))
    make_draft(model, block_size=4).save_pretrained(tmp_path)
    spec = Speculator.from_pretrained(str(tmp_path), target=model, tree="default")
    assert spec.method is DFLASH and spec.max_depth == 3 and spec.tree.max_depth <= 3
    prompt = torch.randint(0, 15, (10,), generator=torch.Generator().manual_seed(0))
    ref = model.generate(prompt[None], max_new_tokens=24, do_sample=False)[0, 10:].tolist()
    assert spec.generate(prompt, 24, stop_token_ids=[]).tokens == ref
    with pytest.raises(SpeculatorError, match="deep"):
        spec.set_tree([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]])
    calib = spec.calibrate(sizes=(1, 2, 4), prefix_len=32, repeats=1)
    assert spec.tree.size == len(calib.choices) + 1 and (tmp_path / "tree.json").is_file()
    assert {2, 4} <= set(calib.draft_ratio)  # the draft timed per tree size
    other = tiny_model("llama", num_hidden_layers=4, vocab_size=16, seed=9)
    with pytest.raises(SpeculatorError, match="fingerprint"):
        Speculator.from_pretrained(str(tmp_path), target=other)


def test_block_causal_slots_ignore_later_slots_and_old_dirs_stay_bidirectional(tmp_path):
    """A causal block's slot j equals slot j of a block cut after it; a bidirectional one's does not. A heads dir whose
    config.json predates block_causal (no such key) loads bidirectional and gives exactly the logits it gave."""
    import json

    from headstart.heads.load import load_heads

    model = tiny_model("llama", num_hidden_layers=4, vocab_size=16, seed=3)
    taps = torch.randn(1, 6, 2 * 64, generator=torch.Generator().manual_seed(0))
    logits = {}
    for causal in (False, True):
        draft = make_draft(model, block_size=4, block_causal=causal)
        proposer = DFlashProposer(draft, model, tree_from_choices([[0], [0, 0], [0, 0, 0]]),
                                  lambda x: x @ model.lm_head.weight.t())
        proposer.pending = [taps[0]]
        proposer._commit()
        full = proposer.block_logits(root=5, depth=3)  # [3, V]
        draft.config.block_size = 3  # the same weights, a block one slot shorter
        short = proposer.block_logits(root=5, depth=2)
        draft.config.block_size = 4
        assert torch.allclose(full[:2], short, atol=1e-6) == causal
        logits[causal] = full
        if not causal:
            draft.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config.pop("block_causal") is False and config.pop("sliding_window") == 0
    (tmp_path / "config.json").write_text(json.dumps(config))  # as the code before block_causal wrote it
    old = load_heads(tmp_path, None)
    assert old.config.block_causal is False and old.config.sliding_window == 0 and old.decode_mask(6) is None
    proposer = DFlashProposer(old, model, tree_from_choices([[0], [0, 0], [0, 0, 0]]),
                              lambda x: x @ model.lm_head.weight.t())
    proposer.pending = [taps[0]]
    proposer._commit()
    assert torch.equal(proposer.block_logits(root=5, depth=3), logits[False])
