"""The hf engine's packed decoding (inference/packed_decode.py): the same answers as transformers `generate`, and a row's
tokens independent of the rows decoded beside it."""

import pytest
import torch

from conftest import tiny_model
from headstart.heads.chat import render_chat, stop_token_ids
from headstart.inference.cpu_linear import linear_kernel
from test_selfdistill import read_rows, tiny_cfg, write_prompts
from headstart.train.bench_selfdistill import generate_padded
from headstart.inference.packed_decode import PackedDecoder, prefix_reusable, shared_prefix
from headstart.train.selfdistill import run_selfdistill

STOP = {3}


def tiny_prompts(n: int, vocab: int = 128) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(4, vocab, (int(torch.randint(2, 30, (1,), generator=generator)),),
                          generator=generator).tolist() for _ in range(n)]


def peaked_tiny_model():
    """A tiny random Llama whose logits have clear margins (lm_head scaled), so rounding never decides a token and
    `generate` is a fair reference for a different but exact computation."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.lm_head.weight.mul_(200.0)
    return model


def test_answers_do_not_depend_on_rows_beside_them(one_thread):
    # an unscaled random model: near-ties everywhere, so any rounding that depended on the batch would show
    model = tiny_model("llama")
    prompts = tiny_prompts(10)
    decoder = PackedDecoder(model, max_new_tokens=20, stop_ids=STOP, max_rows=1)
    alone = decoder.generate(prompts, seeds=list(range(10)))
    for max_rows in (2, 3, 10):
        decoder.max_rows = max_rows
        assert decoder.generate(prompts, seeds=list(range(10))) == alone
    assert decoder.generate(prompts[3:5], seeds=[3, 4]) == alone[3:5]


def test_shared_prefix_and_where_its_states_are_reusable():
    assert shared_prefix([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == [1, 2]
    assert shared_prefix([[1, 2], [3]]) == [] and shared_prefix([[1, 2, 3]]) == []
    assert shared_prefix([[1, 2, 3], [1, 2, 3, 4]]) == [1, 2, 3]
    # query blocks of 32 rows under 192 tokens, 64 under 768, 256 beyond; the prefix's blocks end inside the prompt
    assert prefix_reusable(24, 32) and not prefix_reusable(24, 31)
    assert prefix_reusable(40, 64) and not prefix_reusable(40, 63)
    assert prefix_reusable(130, 191) and not prefix_reusable(170, 191) and prefix_reusable(170, 192)
    assert prefix_reusable(300, 768) and not prefix_reusable(513, 800)  # its blocks end 512 / 768 keys in
    assert prefix_reusable(512, 767) and not prefix_reusable(513, 767)
    assert not prefix_reusable(0, 100) and not prefix_reusable(64, 64)  # nothing shared; nothing after it


@pytest.mark.parametrize("shared", [20, 40, 130])
def test_a_shared_prefix_run_once_gives_the_same_logits_bit_for_bit(shared, one_thread):
    # an unscaled random model (near-ties everywhere); prompts on both sides of the 32 / 192 / 768-token query blocks,
    # some too short for the prefix to be reused (computed in full), all admitted over several steps
    model = tiny_model("llama")
    generator = torch.Generator().manual_seed(shared)
    prefix = torch.randint(4, 128, (shared,), generator=generator).tolist()
    lengths = [shared + 1, 33, 63, 65, 150, 191, 192, 300, 700, 767, 768, 800]
    prompts = [prefix + torch.randint(4, 128, (max(1, n - shared),), generator=generator).tolist() for n in lengths]
    runs = {}
    for share in (False, True):
        decoder = PackedDecoder(model, max_new_tokens=6, stop_ids=STOP, max_rows=5, share_prefix=share)
        fed, logits = [], []
        forward, pick = decoder._forward, decoder._pick
        decoder._forward = lambda step, ids, positions, last: (fed.append(len(ids)), forward(step, ids, positions, last))[1]
        decoder._pick = lambda step_logits, rows: (logits.append(step_logits), pick(step_logits, rows))[1]
        runs[share] = decoder.generate(prompts, seeds=[0] * len(prompts)), fed, logits
    (plain, plain_fed, plain_logits), (shared_run, shared_fed, shared_logits) = runs[False], runs[True]
    assert shared_run == plain and len(shared_logits) == len(plain_logits)
    assert all(torch.equal(a, b) for a, b in zip(shared_logits, plain_logits))
    reused = sum(prefix_reusable(shared, len(p)) for p in prompts) - 1  # the first reusable one computes it
    assert reused >= 6 and sum(plain_fed) - sum(shared_fed) == reused * shared


def test_rows_decoded_together_are_capped_by_the_cache_size(one_thread):
    model = tiny_model("llama")  # 2 layers, keys and values of the kv heads, fp32
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_row = 2 * 2 * config.num_key_value_heads * head_dim * 4  # bytes a position: layers x (k, v) x kv heads x d x fp32
    decoder = PackedDecoder(model, max_new_tokens=20, stop_ids=STOP, max_rows=10, cache_gib=5 * 50 * per_row / 2**30)
    assert decoder.rows_for(50) == 5  # the cache holds 5 rows of 50 positions
    assert decoder.rows_for(25) == 10  # 10 fit: max_rows
    assert decoder.rows_for(10**6) == 1  # never fewer than one
    prompts = tiny_prompts(10)
    capped = decoder.generate(prompts, seeds=list(range(10)))
    decoder.cache_gib = 1.0
    assert decoder.generate(prompts, seeds=list(range(10))) == capped  # the cap changes no row


def test_sampled_answers_follow_each_prompts_own_seed(one_thread):
    model = tiny_model("llama")
    prompts = tiny_prompts(6)
    decoder = PackedDecoder(model, max_new_tokens=16, stop_ids=STOP, max_rows=6, temperature=0.9, top_p=0.9)
    together = decoder.generate(prompts, seeds=[10, 11, 12, 13, 14, 15])
    decoder.max_rows = 2
    assert decoder.generate(prompts, seeds=[10, 11, 12, 13, 14, 15]) == together
    assert decoder.generate(prompts[4:], seeds=[14, 15]) == together[4:]
    assert decoder.generate(prompts, seeds=[20, 11, 12, 13, 14, 15])[0] != together[0]


@pytest.mark.parametrize("batch_size", [1, 4])
def test_answers_equal_transformers_generate_on_a_tiny_model(batch_size, one_thread):
    model = peaked_tiny_model()
    prompts = tiny_prompts(8)
    unstopped = generate_padded(model, prompts, pad_id=0, stop_ids=set(), max_new_tokens=24, batch_size=1)
    stop = {unstopped[0][6]}  # a token the model writes: some answers end on it
    expected = generate_padded(model, prompts, pad_id=0, stop_ids=stop, max_new_tokens=24, batch_size=batch_size)
    assert any(len(a) < 24 for a in expected) and any(len(a) == 24 for a in expected)  # both ways of ending
    decoder = PackedDecoder(model, max_new_tokens=24, stop_ids=stop, max_rows=3)
    assert decoder.generate(prompts, seeds=[0] * 8) == expected
    # the model is as it was: its own linear layers and attention back in place
    assert linear_kernel(model) == "default" and model.config._attn_implementation == "sdpa"


def test_answers_equal_transformers_generate_on_embedded_target(embedded_target, one_thread):
    model, tokenizer, _ = embedded_target
    stop = set(stop_token_ids(tokenizer, model.generation_config))
    turns = ["Hi! How are you?", "Write a haiku about the sea.", "def fib(n):", "What is the capital of France?",
             "List three colours."]
    prompts = [render_chat(tokenizer, [{"role": "user", "content": t}], True) for t in turns]
    expected = generate_padded(model, prompts, tokenizer.pad_token_id, stop, max_new_tokens=32, batch_size=5)
    decoder = PackedDecoder(model, max_new_tokens=32, stop_ids=stop, max_rows=2)
    assert decoder.batch_invariant
    assert decoder.generate(prompts, seeds=[0] * 5) == expected


def test_rows_do_not_depend_on_prompts_per_call_or_hf_rows(tiny_target_dir, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 7)
    run_selfdistill(tiny_cfg(tiny_target_dir, prompts, tmp_path / "a"))  # every batch in one engine call
    run_selfdistill(tiny_cfg(tiny_target_dir, prompts, tmp_path / "b", prompts_per_call=1, hf_rows=2))
    a, meta = read_rows(tmp_path / "a")
    b, _ = read_rows(tmp_path / "b")
    assert a == b and len(a) == 7
    assert meta["engine"]["decoding"] == "packed" and meta["engine"]["batch_invariant"]
