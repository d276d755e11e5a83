"""Decode loop: greedy exactness against model.generate, KV compaction, EOS, tau, bad input, CLI."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import chi_square_pvalue, exact_first_three, tiny_model

from headstart.heads.medusa import MedusaConfig, MedusaHeads
from headstart.heads.target import fingerprint
from headstart.heads.chat import prompt_ids
from headstart.inference.calibrate import CALIBRATION_SIZES, ROUNDS, calibrate_tree, monotone_fit, read_accuracy
from headstart.inference.cpu_linear import projection
from headstart.inference.decode import SamplingConfig, speculative_generate
from headstart.inference.generate import TextStream, main
from headstart.inference.speculator import Speculator, SpeculatorError
from headstart.inference.medusa import MedusaProposer, medusa_logits
from headstart.inference.tree import DraftInput, DynamicTreeConfig, Proposer, Tree, build_dynamic_tree, static_tree_tokens, tree_from_choices

VOCAB = 128
PROMPT_LEN = 8
NEW = 128
ORACLE_CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0],
                  [0, 0, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0, 0]]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def random_heads(num_heads: int = 3, seed: int = 0, target=None) -> MedusaHeads:
    """Untrained heads with random lm_heads (zero-init blocks + random lm_head): random guesses."""
    torch.manual_seed(seed)
    heads = MedusaHeads(MedusaConfig(hidden_size=64, vocab_size=VOCAB, num_heads=num_heads))
    if target is not None:
        heads.config.target = {"name": "tiny", "fingerprint": fingerprint(target)}
    return heads.eval()


class OracleProposer(Proposer):
    """Test-only draft that knows the target's greedy continuation `ref` (prompt + output).

    At each depth it puts the true next token at rank 0 with probability p_top, at rank 1 or 2
    otherwise (or nowhere), and random tokens elsewhere, so accepted paths are long, often go
    through non-first siblings, and the KV cache gets compacted from scattered tree nodes.
    """

    def __init__(self, ref: list[int], tree: Tree, seed: int, p_top: float = 0.75):
        self.ref = ref
        self.tree = tree
        self.rng = random.Random(seed)
        self.p_top = p_top
        self.calls = 0

    def __call__(self, draft: DraftInput):
        self.calls += 1
        assert draft.context[-1] == draft.root
        k = max(self.tree.ranks) + 1
        topk = torch.empty(self.tree.max_depth, k, dtype=torch.long)
        for d in range(self.tree.max_depth):
            pos = len(draft.context) + d
            row = self.rng.sample(range(VOCAB), k)
            if pos < len(self.ref):
                true = self.ref[pos]
                row = [t for t in row if t != true][: k - 1]
                u = self.rng.random()
                where = 0 if u < self.p_top else (1 if u < self.p_top + 0.1 else (2 if u < self.p_top + 0.15 else None))
                row.insert(where if where is not None else k - 1, true if where is not None else self.rng.randrange(VOCAB))
            topk[d] = torch.tensor(row[:k])
        return self.tree, static_tree_tokens(self.tree, draft.root, topk)


def reference(model, prompts: torch.Tensor, new: int, eos: int | None = None) -> list[list[int]]:
    """model.generate greedy, batched (equal-length prompts: no padding), cut after the first eos."""
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new, do_sample=False,
                         eos_token_id=eos, pad_token_id=eos if eos is not None else 0)[:, prompts.shape[1]:]
    refs = []
    for row in out.tolist():
        if eos is not None and eos in row:
            row = row[: row.index(eos) + 1]
        refs.append(row)
    return refs


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma"])
def test_greedy_exact_50_prompts(model_type):
    """fp32 greedy: speculative output == model.generate, 50 prompts x 128 tokens, oracle draft on all
    50 (long accepted paths, scattered compaction) and random untrained heads on 10."""
    model = tiny_model(model_type, vocab_size=VOCAB, seed=1)
    spec = Speculator(model, random_heads(seed=2))
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(3, VOCAB, (50, PROMPT_LEN), generator=gen)
    refs = reference(model, prompts, NEW)
    tree = tree_from_choices(ORACLE_CHOICES)
    forwards = tokens = 0
    hist = [0] * (tree.max_depth + 1)
    for i in range(50):
        full = prompts[i].tolist() + refs[i]
        out = spec.generate(prompts[i], NEW, stop_token_ids=[], proposer=OracleProposer(full, tree, seed=i),
                            lookup=False)  # the oracle's tree every step (the random heads below run with lookup)
        assert out.tokens == refs[i], f"{model_type} prompt {i}: first diff at {_first_diff(out.tokens, refs[i])}"
        forwards += out.stats.decode_forwards
        tokens += out.stats.new_tokens
        for a, n in enumerate(out.stats.accept_hist):
            hist[a] += n
    assert tokens / forwards > 2.0, f"oracle draft should give long accepted paths, tau {tokens / forwards:.2f}"
    assert hist[tree.max_depth] > 0 and sum(hist[1:-1]) > 0 and hist[0] > 0  # full, partial and no acceptance
    for i in range(10):
        out = spec.generate(prompts[i], NEW, stop_token_ids=[])
        assert out.tokens == refs[i], f"{model_type} random heads, prompt {i}: first diff at {_first_diff(out.tokens, refs[i])}"


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("model_type", ["qwen3", "mistral"])
def test_greedy_exact_other_families_and_eager(model_type):
    for attn in ("sdpa", "eager"):
        model = tiny_model(model_type, vocab_size=VOCAB, seed=4, attn_implementation=attn)
        spec = Speculator(model, random_heads(seed=5))
        prompts = torch.randint(3, VOCAB, (6, PROMPT_LEN), generator=torch.Generator().manual_seed(6))
        refs = reference(model, prompts, 64)
        tree = tree_from_choices(ORACLE_CHOICES)
        for i in range(6):
            full = prompts[i].tolist() + refs[i]
            out = spec.generate(prompts[i], 64, stop_token_ids=[], proposer=OracleProposer(full, tree, seed=i))
            assert out.tokens == refs[i], f"{model_type}/{attn} prompt {i}"


def test_eos_inside_accepted_chunk_ends_output():
    model = tiny_model("llama", vocab_size=VOCAB, seed=1)
    spec = Speculator(model, random_heads(seed=2))
    prompts = torch.randint(3, VOCAB, (20, PROMPT_LEN), generator=torch.Generator().manual_seed(7))
    free = reference(model, prompts, 64)
    tree = tree_from_choices(ORACLE_CHOICES)
    checked_mid_chunk = 0
    for i in range(20):
        eos = free[i][20]  # a token the target emits around position 20: it ends the output there (or earlier)
        ref = reference(model, prompts[i: i + 1], 64, eos=eos)[0]
        assert ref[-1] == eos and len(ref) <= 21
        seen_chunks: list[list[int]] = []
        out = spec.generate(prompts[i], 64, stop_token_ids=[eos], on_tokens=seen_chunks.append,
                            proposer=OracleProposer(prompts[i].tolist() + free[i], tree, seed=i, p_top=0.95))
        assert out.tokens == ref and out.stopped
        assert [t for c in seen_chunks for t in c] == out.tokens  # streaming saw exactly the output
        checked_mid_chunk += int(len(seen_chunks[-1]) > 1)
    assert checked_mid_chunk > 0  # the stop token was inside a multi-token accepted chunk at least once


def test_max_new_tokens_is_exact_and_stats_consistent():
    model = tiny_model("llama", vocab_size=VOCAB, seed=1)
    spec = Speculator(model, random_heads(seed=2))
    prompt = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(8))
    ref = reference(model, prompt[None], 40)[0]
    tree = tree_from_choices(ORACLE_CHOICES)
    for n in (1, 2, 7, 40):
        out = spec.generate(prompt, n, stop_token_ids=[], proposer=OracleProposer(prompt.tolist() + ref, tree, seed=n))
        assert out.tokens == ref[:n]
        s = out.stats
        assert s.new_tokens == n and sum(s.accept_hist) == s.decode_forwards
        # every decode step emits its kept drafted tokens plus the bonus (the last step may be cut by max_new_tokens)
        emitted = 1 + sum((a + 1) * c for a, c in enumerate(s.accept_hist))
        assert emitted >= n and (s.decode_forwards == 0 or emitted - n <= tree.max_depth)
        if s.decode_forwards:
            assert s.tau == pytest.approx((n - 1) / s.decode_forwards)  # the prefill's token is not counted


def test_untrained_heads_give_tau_close_to_one():
    model = tiny_model("llama", vocab_size=VOCAB, seed=1)
    spec = Speculator(model, random_heads(seed=9))
    prompt = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(10))
    out = spec.generate(prompt, 128, stop_token_ids=[], lookup=False)
    # 128 tokens: 1 from the prefill + at least one per decode forward; random heads rarely hit
    assert out.stats.decode_forwards >= 110
    assert 1.0 <= out.stats.tau < 1.2
    assert out.stats.draft_s > 0 and out.stats.verify_s > 0


def test_lm_head_initialised_heads_copy_the_target():
    """Zero blocks + the target's lm_head: every head predicts the target's next token (not t+k+1),
    so acceptance is low on random models too; but the output stays exact."""
    model = tiny_model("llama", vocab_size=VOCAB, seed=1)
    heads = random_heads(seed=2)
    heads.init_lm_heads_from(model.lm_head.weight)
    spec = Speculator(model, heads)
    prompt = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(11))
    assert spec.generate(prompt, 48, stop_token_ids=[]).tokens == reference(model, prompt[None], 48)[0]


def test_sampling_is_seeded_and_valid():
    model = tiny_model("qwen2", vocab_size=VOCAB, seed=1)
    spec = Speculator(model, random_heads(seed=2))
    prompt = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(12))
    a = spec.generate(prompt, 30, temperature=0.8, top_p=0.9, seed=1, stop_token_ids=[])
    b = spec.generate(prompt, 30, temperature=0.8, top_p=0.9, seed=1, stop_token_ids=[])
    c = spec.generate(prompt, 30, temperature=0.8, top_p=0.9, seed=2, stop_token_ids=[])
    assert a.tokens == b.tokens and a.tokens != c.tokens and len(a.tokens) == 30
    t = spec.generate(prompt, 30, temperature=0.8, acceptance="typical", seed=1, stop_token_ids=[])
    assert len(t.tokens) == 30 and all(0 <= x < VOCAB for x in t.tokens)
    with pytest.raises(SpeculatorError, match="acceptance"):
        spec.generate(prompt, 1, temperature=0.8, acceptance="nope")
    with pytest.raises(SpeculatorError, match="top_p"):
        spec.generate(prompt, 5, temperature=0.8, top_p=0.0)


# ---------------------------------------------------------------------------------------------
# Loading, tree.json, bad input, CLI


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB)}
    vocab["<unk>"] = 0
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="w2")


@pytest.fixture
def saved(tmp_path):
    """A tiny target saved with a tokenizer, and random heads recording its name and fingerprint."""
    model = tiny_model("llama", vocab_size=VOCAB, seed=1)
    target_dir = tmp_path / "target"
    model.save_pretrained(target_dir)
    _tokenizer().save_pretrained(target_dir)
    heads = random_heads(seed=2)
    heads.config.target = {"name": str(target_dir), "fingerprint": fingerprint(model)}
    heads_dir = tmp_path / "heads"
    heads.save_pretrained(heads_dir)
    return model, target_dir, heads_dir


def test_from_pretrained_loads_named_target_and_is_exact(saved):
    model, target_dir, heads_dir = saved
    spec = Speculator.from_pretrained(str(heads_dir))
    assert fingerprint(spec.model) == fingerprint(model) and spec.tokenizer is not None
    prompt = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(13))
    assert spec.generate(prompt, 32, stop_token_ids=[]).tokens == reference(model, prompt[None], 32)[0]
    spec2 = Speculator.from_pretrained(str(heads_dir), target=model)  # a loaded, matching target
    assert spec2.model is model


def test_fingerprint_mismatch_names_both_and_the_fix(saved):
    _, _, heads_dir = saved
    other = tiny_model("llama", vocab_size=VOCAB, seed=99)
    with pytest.raises(SpeculatorError) as err:
        Speculator.from_pretrained(str(heads_dir), target=other)
    msg = str(err.value)
    want = json.loads((heads_dir / "config.json").read_text())["target"]["fingerprint"]
    assert want in msg and fingerprint(other) in msg and "load the target they were trained on" in msg


def test_unknown_heads_path(tmp_path):
    with pytest.raises(SpeculatorError, match="no such directory, and not a Hub repo id"):
        Speculator.from_pretrained(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpeculatorError, match="has no config.json"):
        Speculator.from_pretrained(str(tmp_path / "empty"))
    with pytest.raises(SpeculatorError, match="Hugging Face Hub"):  # offline in tests: a clear message, not a traceback
        Speculator.from_pretrained("no-such-user/no-such-heads")


def test_prompt_longer_than_context_and_zero_tokens():
    model = tiny_model("llama", vocab_size=VOCAB, seed=1, max_position_embeddings=64)
    spec = Speculator(model, random_heads(seed=2))
    with pytest.raises(SpeculatorError, match="max_position_embeddings.*shorten the prompt"):
        spec.generate(torch.randint(3, VOCAB, (70,)), 4)
    with pytest.raises(SpeculatorError, match="lower max_new_tokens to at most 4"):
        spec.generate(torch.randint(3, VOCAB, (60,)), 10)
    with pytest.raises(SpeculatorError, match="max_new_tokens must be a positive integer"):
        spec.generate(torch.randint(3, VOCAB, (8,)), 0)
    with pytest.raises(ValueError):  # SpeculatorError is a ValueError
        spec.generate(torch.randint(3, VOCAB, (8,)), -1)
    with pytest.raises(SpeculatorError, match="one sequence at a time"):
        spec.generate(torch.randint(3, VOCAB, (2, 8)), 4)
    with pytest.raises(SpeculatorError, match="prompt is empty"):
        spec.generate(torch.zeros(0, dtype=torch.long), 4)


def steady_timer(kind: str, size: int, run) -> float:
    """A scripted calibration timer (inference/calibrate.py): a step costs 10 ms + 1 ms a token, a draft 1 ms."""
    return 1.0 if kind == "draft" else 10.0 + size


def test_tree_auto_writes_tree_json_and_is_reused(saved, monkeypatch):
    import headstart.inference.calibrate as calibrate_module

    model, _, heads_dir = saved
    monkeypatch.setattr(calibrate_module, "time_ms", steady_timer)  # no wall-clock timing: the choice is fixed
    spec = Speculator.from_pretrained(str(heads_dir), target=model, tree="auto")
    record = json.loads((heads_dir / "tree.json").read_text())
    assert record["accuracy_source"] == "default prior" and record["chosen_by"] == "measurement"
    assert not record["noisy"] and record["rounds"] == ROUNDS and record["device"] == "cpu" and record["threads"] == 1
    assert set(record["step_ms"]) == set(record["spread"]) == {str(n) for n in CALIBRATION_SIZES}
    assert record["samples_ms"]["8"] == [18.0] * ROUNDS and record["draft_samples_ms"] == {"0": [1.0] * ROUNDS}
    assert record["draft_ratio"] == {"0": 1.0 / 11}
    for n in CALIBRATION_SIZES:  # the adaptive policy's step cost is the measured curve, in one-token steps
        assert spec.step_cost.ratio(n) == pytest.approx((10.0 + n) / 11)
    assert spec.step_cost.draft_cost(5) == pytest.approx(1.0 / 11)
    best = max(record["expected_tokens_per_s"], key=lambda k: record["expected_tokens_per_s"][k])
    assert len(record["choices"]) + 1 == int(best) == spec.tree.size
    monkeypatch.setattr(calibrate_module, "time_ms", None)  # a reused tree.json is not timed again
    again = Speculator.from_pretrained(str(heads_dir), target=model)  # tree=None: reads tree.json
    assert again.tree.parents == spec.tree.parents and again.step_cost.points == spec.step_cost.points
    assert again.step_cost.draft == spec.step_cost.draft
    default = Speculator.from_pretrained(str(heads_dir), target=model, tree="default")
    assert default.tree.size == 8


def test_calibrate_uses_recorded_accuracy(saved):
    model, _, heads_dir = saved
    heads = random_heads(seed=2)
    # perfect top-1 heads: the chain [[0], [0, 0], [0, 0, 0]] gives 4 tokens per step at a small tree
    calib = calibrate_tree(model, heads, accuracy=[[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]], sizes=(1, 4), repeats=2,
                           prefix_len=32, timer=steady_timer)
    assert calib.choices_by_size == {1: [], 4: [[0], [0, 0], [0, 0, 0]]}
    assert calib.step_ms == {1: 11.0, 4: 14.0} and calib.draft_ms == 1.0
    assert calib.expected_tokens_per_s == {1: 1000.0 / 11, 4: pytest.approx(4000.0 / 15)}
    assert calib.choices == calib.choices_by_size[4] and calib.accuracy_source == "heads"


def test_cli_streams_and_reports(saved, capsys):
    model, _, heads_dir = saved
    rc = main(["--heads", str(heads_dir), "--prompt", "w5 w6 w7 w8", "--max_new_tokens", "12", "--tree", "default"])
    captured = capsys.readouterr()
    assert rc == 0
    assert "tau" in captured.err and "tokens/s" in captured.err
    tok = _tokenizer()  # the CLI's stop token is the tokenizer's and the target's EOS, "w2"
    want = reference(model, torch.tensor([prompt_ids(tok, "w5 w6 w7 w8")]), 12, eos=tok.eos_token_id)[0]
    assert len(want) > 3 and captured.out == tok.decode(want, skip_special_tokens=True)  # stdout: the streamed answer
    assert ", steps " in captured.err  # adaptive by default: the steps per choice
    rc = main(["--heads", str(heads_dir), "--prompt", "w5 w6 w7 w8", "--max_new_tokens", "12", "--fixed_tree"])
    captured = capsys.readouterr()
    assert rc == 0 and ", steps " not in captured.err and captured.out == tok.decode(want, skip_special_tokens=True)
    rc = main(["--heads", str(heads_dir / "missing"), "--prompt", "w5", "--max_new_tokens", "4"])
    assert rc == 2 and "no such directory" in capsys.readouterr().err
    rc = main(["--heads", str(heads_dir), "--prompt", "w5", "--max_new_tokens", "0"])
    assert rc == 2 and "max_new_tokens" in capsys.readouterr().err


def test_text_stream_writes_only_new_text():
    tok = _tokenizer()
    written: list[str] = []
    stream = TextStream(tok, written.append)
    ids = tok("w5 w6 w7")["input_ids"]
    stream(ids[:1])
    stream(ids[1:])
    assert "".join(written) == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("lookup", [False, True])
def test_sampling_end_to_end_matches_target_distribution(lookup):
    """The whole decode loop (tree forward, sampling acceptance, cache compaction) at temperature 1 on a
    vocab-8 model: the first three tokens follow the target's exact joint distribution (chi-square); with
    `lookup`, steps whose context repeats a token verify a chain from the context instead (inference/lookup.py)."""
    from headstart.inference.lookup import LookupConfig

    model = tiny_model("llama", vocab_size=8, seed=3, hidden_size=32, intermediate_size=64)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)  # peaked distributions: a wrong rule shows up quickly
    heads = MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=8, num_heads=3)).eval()
    heads.init_lm_heads_from(model.lm_head.weight)  # drafts the target's likely tokens: paths get accepted
    spec = Speculator(model, heads, tree=[[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]])
    prompt = torch.tensor([1, 5, 3, 6])
    exact = exact_first_three(model, prompt)
    n = 2000
    counts = torch.zeros(8, 8, 8)
    accepted = lookup_steps = 0
    chain = LookupConfig(num_tokens=3, min_ngram=1) if lookup else None
    for s in range(n):
        out = speculative_generate(model, spec.make_proposer(), prompt, 3, SamplingConfig(temperature=1.0),
                                   [], torch.Generator().manual_seed(s), lookup=chain)
        counts[tuple(out.tokens)] += 1
        accepted += sum(a * c for a, c in enumerate(out.stats.accept_hist))
        lookup_steps += out.stats.lookup_steps
    assert accepted > n // 2  # drafted tokens were kept often (the cache got compacted)
    assert (lookup_steps > n // 2) if lookup else lookup_steps == 0
    pvalue = chi_square_pvalue(counts, exact)
    assert pvalue > 1e-3, f"chi-square p = {pvalue:.3g}"


def test_medusa_logits_match_the_heads_module():
    heads = random_heads(num_heads=4, seed=3)
    hidden = torch.randn(64)
    full = heads(hidden[None, None])[:, 0, 0]  # [K, V]
    torch.testing.assert_close(medusa_logits(heads, hidden, 2), full[:2])
    shared = MedusaHeads(MedusaConfig(hidden_size=64, vocab_size=VOCAB, num_heads=3, share_lm_head=True)).eval()
    weight = torch.randn(VOCAB, 64)
    torch.testing.assert_close(medusa_logits(shared, hidden, 3, projection(weight)), shared(hidden[None, None], weight)[:, 0, 0])


def _draft_vocab_twin(heads: MedusaHeads, token_map: torch.Tensor) -> MedusaHeads:
    """The same heads restricted to a draft vocabulary: blocks copied, lm_heads = the rows of token_map."""
    config = MedusaConfig(**{**heads.config.__dict__, "draft_vocab_size": len(token_map)})
    twin = MedusaHeads(config)
    twin.set_draft_vocab(token_map)
    twin.blocks.load_state_dict(heads.blocks.state_dict())
    if heads.lm_heads is not None:
        for mine, theirs in zip(twin.lm_heads, heads.lm_heads):
            mine.weight.data.copy_(theirs.weight[twin.token_map])
    return twin.eval()


@pytest.mark.parametrize("share", [False, True])
def test_draft_vocabulary_heads_rank_their_tokens_as_the_full_heads_do(share):
    """Heads with a draft vocabulary == the full heads' logits at token_map; the proposer's candidates are the
    full heads' best tokens among token_map, as target ids; a save/load round trip keeps the map."""
    torch.manual_seed(5)
    full = MedusaHeads(MedusaConfig(hidden_size=64, vocab_size=VOCAB, num_heads=3, share_lm_head=share))
    for block in full.blocks:
        torch.nn.init.normal_(block.layers[0].weight, std=0.2)
    weight = torch.randn(VOCAB, 64) if share else None
    token_map = torch.randperm(VOCAB)[:20]
    twin = _draft_vocab_twin(full.eval(), token_map)
    assert torch.equal(twin.token_map, token_map.sort().values)
    hidden = torch.randn(64)
    want = full(hidden[None, None], weight)[:, 0, 0][:, twin.token_map]  # [K, 20]
    torch.testing.assert_close(twin(hidden[None, None], weight)[:, 0, 0], want)
    tree = tree_from_choices([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    project = projection(twin.draft_lm_head_weight(weight)) if share else None
    _, tokens = MedusaProposer(twin, tree, project)(DraftInput(hidden=hidden, root=7, context=[7]))
    expected = static_tree_tokens(tree, 7, twin.token_map[want.topk(2, dim=-1).indices])
    assert torch.equal(tokens, expected) and set(tokens[1:].tolist()) <= set(token_map.tolist())
    again = MedusaHeads(twin.config)
    again.load_state_dict(twin.state_dict())
    assert "target_to_draft" not in twin.state_dict()
    assert torch.equal(again.target_to_draft, twin.target_to_draft) and int((again.target_to_draft >= 0).sum()) == 20


def test_draft_vocabulary_heads_are_greedy_exact():
    """Lossless whatever the heads draft: a 16-token draft vocabulary still gives model.generate's tokens."""
    model = tiny_model("llama", vocab_size=VOCAB, seed=1)
    heads = _draft_vocab_twin(random_heads(seed=2), torch.arange(40, 56))
    spec = Speculator(model, heads)
    prompts = torch.randint(3, VOCAB, (5, PROMPT_LEN), generator=torch.Generator().manual_seed(4))
    refs = reference(model, prompts, 48)
    for i in range(5):
        out = spec.generate(prompts[i], 48, stop_token_ids=[])
        assert out.tokens == refs[i], f"prompt {i}: first diff at {_first_diff(out.tokens, refs[i])}"


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_tree_forward_reads_grouped_heads_without_copies(model_type, monkeypatch):
    """On CPU the tree forward runs SDPA on the key/value heads (enable_gqa) instead of copies of them, with the
    same logits as transformers' sdpa path, and leaves the model's attention setting as it was."""
    from transformers import DynamicCache

    import headstart.inference.attention as attention
    from headstart.inference.forward import compact_cache, target_forward

    model = tiny_model(model_type, vocab_size=VOCAB, seed=1)
    assert model.config._attn_implementation == "sdpa"
    prompt = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    tree = tree_from_choices([[0], [1], [0, 0], [1, 0], [0, 0, 0]])
    tokens = torch.randint(3, VOCAB, (1, tree.size), generator=torch.Generator().manual_seed(1))
    mask, positions = tree.attention_mask(20, dtype=torch.float32), tree.position_ids(20)
    cache = DynamicCache()
    with torch.no_grad():
        target_forward(model, prompt, cache)
        seen = []
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def spy(q, k, v, **kw):
            seen.append((q.shape[1], k.shape[1], kw.get("enable_gqa", False)))
            return sdpa(q, k, v, **kw)

        monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
        fast = target_forward(model, tokens, cache, mask, positions)[0]
        compact_cache(cache, 20, [])
        plain = target_forward(model, tokens, cache, mask, positions, gqa=False)[0]
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    layers = model.config.num_hidden_layers
    assert seen == [(heads, kv_heads, True)] * layers + [(heads, heads, False)] * layers  # the plain path copies
    torch.testing.assert_close(fast, plain, atol=1e-6, rtol=1e-6)
    assert model.config._attn_implementation == "sdpa"


def test_real_embedded_target_greedy_exact():
    """SmolLM2-135M-Instruct (the embedded default), fp32: speculative greedy == model.generate."""
    pytest.importorskip("gguf")
    from headstart.heads.target import TargetLoadError, load_target

    try:
        model, tok, info = load_target("smollm2-135m")
    except TargetLoadError as err:
        pytest.skip(f"embedded target unavailable: {err}")
    heads = MedusaHeads(MedusaConfig(hidden_size=info.hidden_size, vocab_size=info.vocab_size, num_heads=3,
                                     share_lm_head=True, target=info.to_dict())).eval()
    spec = Speculator(model, heads, tok)
    ids = torch.tensor(prompt_ids(tok, "Write a Python function that reverses a string."))
    ref = model.generate(ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=24,
                         do_sample=False)[0, len(ids):].tolist()
    tree = tree_from_choices(ORACLE_CHOICES)
    full = ids.tolist() + ref
    out = spec.generate(ids, 24, proposer=_RealOracle(full, tree, seed=0))
    assert out.tokens == ref and out.stats.tau > 1.5
    text = []
    plain = spec.generate(ids, 8, on_tokens=TextStream(tok, text.append))  # shared lm_head heads, streamed
    assert plain.tokens == ref[: len(plain.tokens)] and "".join(text) == tok.decode(plain.tokens, skip_special_tokens=True)


class _RealOracle(OracleProposer):
    """The oracle over a large vocabulary: true token at rank 0 (75%), random tokens elsewhere."""

    def __call__(self, draft: DraftInput):
        k = max(self.tree.ranks) + 1
        topk = torch.randint(0, 49152, (self.tree.max_depth, k), generator=torch.Generator().manual_seed(self.calls))
        self.calls += 1
        for d in range(self.tree.max_depth):
            pos = len(draft.context) + d
            if pos < len(self.ref) and self.rng.random() < self.p_top:
                topk[d, 0] = self.ref[pos]
        return self.tree, static_tree_tokens(self.tree, draft.root, topk)


def test_read_accuracy_from_training_metrics(saved):
    model, _, heads_dir = saved
    assert read_accuracy(heads_dir) is None
    rank_acc = [[0.9, 0.05, 0.0], [0.9, 0.05, 0.0], [0.9, 0.05, 0.0]]
    (heads_dir / "metrics.json").write_text(json.dumps({"top1": [0.9] * 3, "rank_accuracy": rank_acc}))
    assert read_accuracy(heads_dir) == rank_acc
    spec = Speculator.from_pretrained(str(heads_dir), target=model, tree="auto")
    record = json.loads((heads_dir / "tree.json").read_text())
    assert record["accuracy_source"] == "heads" and record["accuracy"] == rank_acc
    assert read_accuracy(heads_dir) == rank_acc  # now from tree.json
    assert spec.tree.size == len(record["choices"]) + 1


def test_medusa2_adapter_is_merged_and_output_is_the_tuned_targets(saved):
    from peft import LoraConfig, get_peft_model

    model, _, heads_dir = saved
    tuned = get_peft_model(tiny_model("llama", vocab_size=VOCAB, seed=1),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in tuned.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)  # a real change (LoRA starts as a no-op)
    tuned.save_pretrained(heads_dir / "adapter")
    merged = tuned.merge_and_unload().eval()
    config = json.loads((heads_dir / "config.json").read_text())
    (heads_dir / "config.json").write_text(json.dumps(dict(config, adapter=True, method="medusa2")))
    before = fingerprint(model)
    spec = Speculator.from_pretrained(str(heads_dir), target=model)
    assert fingerprint(model) == before  # the caller's target is untouched
    prompt = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(14))
    out = spec.generate(prompt, 32, stop_token_ids=[])
    assert out.tokens == reference(merged, prompt[None], 32)[0] != reference(model, prompt[None], 32)[0]
    (heads_dir / "adapter" / "adapter_config.json").unlink()
    with pytest.raises(SpeculatorError, match="adapter"):
        Speculator.from_pretrained(str(heads_dir), target=model)


def _oracle_dynamic_draft(ref: list[int], seed: int):
    """A draft callable for dynamic trees: on the true continuation it favours the true next token (80%)."""
    rng = random.Random(seed)

    def draft(d: DraftInput, tokens: torch.Tensor, parents: list[int], frontier: list[int]) -> torch.Tensor:
        out = torch.randn(len(frontier), VOCAB, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        for f, node in enumerate(frontier):
            path = []
            while node > 0:
                path.append(int(tokens[node]))
                node = parents[node]
            ctx = d.context + path[::-1]
            if len(ctx) < len(ref) and ref[: len(ctx)] == ctx and rng.random() < 0.8:
                out[f, ref[len(ctx)]] += 10.0
        return out.log_softmax(-1)

    return draft


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_greedy_exact_with_dynamic_trees(model_type):
    """A new tree shape every step (EAGLE-2 style builder around an oracle-ish draft): still exact."""
    model = tiny_model(model_type, vocab_size=VOCAB, seed=1)
    spec = Speculator(model, random_heads(seed=2))
    prompts = torch.randint(3, VOCAB, (10, PROMPT_LEN), generator=torch.Generator().manual_seed(15))
    refs = reference(model, prompts, 64)
    forwards = tokens = 0
    shapes = set()
    for i in range(10):
        full = prompts[i].tolist() + refs[i]
        draft = _oracle_dynamic_draft(full, seed=i)

        class Recording(Proposer):  # a new tree from the draft every step, EAGLE-2 style
            def __call__(self, d: DraftInput, draft=draft):
                tree, toks = build_dynamic_tree(d.root, lambda *partial: draft(d, *partial),
                                                DynamicTreeConfig(topk=3, depth=4, total_tokens=12))
                shapes.add(tuple(tree.parents))
                return tree, toks

        out = spec.generate(prompts[i], 64, stop_token_ids=[], proposer=Recording())
        assert out.tokens == refs[i], f"{model_type} prompt {i}: first diff at {_first_diff(out.tokens, refs[i])}"
        forwards += out.stats.decode_forwards
        tokens += out.stats.new_tokens
    assert tokens / forwards > 2.0 and len(shapes) > 5


def test_cli_applies_the_chat_template(tiny_target_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    ids = prompt_ids(tok, "hello there")
    assert tok.decode(ids).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n") and "hello there" in tok.decode(ids)
    heads = MedusaHeads(MedusaConfig(hidden_size=64, vocab_size=model.config.vocab_size, num_heads=2,
                                     target={"name": str(tiny_target_dir), "fingerprint": fingerprint(model)}))
    heads.save_pretrained(tmp_path / "heads")
    assert main(["--heads", str(tmp_path / "heads"), "--prompt", "hello there", "--max_new_tokens", "16"]) == 0
    out = capsys.readouterr()
    ref = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):]
    assert out.out.rstrip().endswith(tok.decode(ref, skip_special_tokens=True).strip())  # (after loading logs)
    assert "tau" in out.err


def test_root_only_tree_is_plain_decoding():
    """`auto` may find drafting never pays (choices = []): the loop then decodes one token per forward."""
    model = tiny_model("llama", vocab_size=VOCAB, seed=1)
    spec = Speculator(model, random_heads(seed=2), tree=[])
    prompt = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(16))
    out = spec.generate(prompt, 20, stop_token_ids=[], adaptive=False)  # the fixed tree every step
    assert out.tokens == reference(model, prompt[None], 20)[0]
    assert spec.tree.size == 1 and out.stats.decode_forwards == 19 and out.stats.accept_hist == [19]


def test_monotone_fit_pools_timing_inversions():
    assert monotone_fit({1: 10.0, 4: 12.0, 8: 20.0}) == {1: 10.0, 4: 12.0, 8: 20.0}
    fitted = monotone_fit({1: 36.0, 4: 24.0, 8: 48.0, 16: 61.0, 32: 67.0, 64: 53.0})
    assert fitted == pytest.approx({1: 30.0, 4: 30.0, 8: 48.0, 16: 181 / 3, 32: 181 / 3, 64: 181 / 3})


def test_stop_token_as_the_first_token():
    model = tiny_model("llama", vocab_size=VOCAB, seed=1)
    spec = Speculator(model, random_heads(seed=2))
    prompt = torch.randint(3, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(17))
    first = reference(model, prompt[None], 1)[0][0]
    out = spec.generate(prompt, 50, stop_token_ids=[first])
    assert out.tokens == [first] and out.stopped and out.stats.decode_forwards == 0
