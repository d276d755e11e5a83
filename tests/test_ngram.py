"""The n-gram table of the target's own answers (inference/ngram.py): exact entries, drafts, the file, and the
adaptive policy drafting its chain as a lookup branch (only with lookup on)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from safetensors.torch import save_file
from test_adapt import _lm_heads
from test_infer_generate import _first_diff, reference

from headstart.heads.directory import HeadsLoadError
from headstart.inference.adapt import AdaptConfig, AdaptivePolicy
from headstart.inference.speculator import Speculator
from headstart.inference.ngram import NGRAM_FILE, STOP, NgramConfig, NgramTable

# 1 and 5 are the prompt's (loss_mask 0); the target wrote 6 7 5 6 8
ROWS = [{"input_ids": [1, 5, 6, 7, 5, 6, 8], "loss_mask": [0, 0, 1, 1, 1, 1, 1]}]


def test_keys_are_the_tails_before_each_target_written_token():
    table = NgramTable.build(ROWS, NgramConfig(max_n=2, min_share=0.3))
    assert table.next_token == {
        (5,): 6, (1, 5): 6,  # before the first 6, and (5,) again before the second
        (6,): 7, (5, 6): 7,  # 7 then 8 after (6,) and (5, 6): a tie, the first seen kept (share 0.5 >= 0.3)
        (7,): 5, (6, 7): 5,
        (7, 5): 6,
    }
    assert NgramTable.build(ROWS, NgramConfig(max_n=2, min_share=0.6)).next_token[(6,)] == STOP  # 0.5 < 0.6


def test_only_target_written_tokens_are_counted_up_to_max_tokens():
    table = NgramTable.build(ROWS, NgramConfig(max_n=1, max_tokens=2))
    assert table.next_token == {(5,): 6, (6,): 7}  # the first two target-written tokens only
    assert (1,) not in NgramTable.build(ROWS, NgramConfig(max_n=1)).next_token  # 5 after 1 is the prompt's


def test_draft_takes_the_longest_key_and_ends_at_a_stop_or_an_unknown_tail():
    table = NgramTable({(3,): 4, (2, 3): 9, (9,): 5, (5,): STOP, (4,): 8}, NgramConfig(max_n=2))
    assert table.draft([1, 2, 3], 8) == (2, [9, 5])  # (2, 3) over (3,); then (9,), then (5,) says stop
    assert table.draft([7, 3], 8) == (1, [4, 8])  # (7, 3) unknown: (3,); after 8 no key
    assert table.draft([7, 3], 1) == (1, [4])
    assert table.draft([7, 7], 8) == (0, [])


def test_file_round_trip(tmp_path):
    table = NgramTable.build(ROWS, NgramConfig(max_n=3, min_share=0.4))
    table.save(tmp_path / "ngram.safetensors")
    loaded = NgramTable.load(tmp_path / "ngram.safetensors")
    assert loaded.next_token == table.next_token and loaded.config == table.config
    NgramTable({}, NgramConfig()).save(tmp_path / "empty.safetensors")  # rows whose only answer token is the first
    assert NgramTable.load(tmp_path / "empty.safetensors").next_token == {}


def test_the_policy_drafts_the_tables_chain_as_a_lookup_branch_with_lookup_on_only():
    table = NgramTable({(3,): 9, (9,): 10, (10,): STOP}, NgramConfig())
    context = [1, 2, 3]  # no repeat: the context itself has nothing to draft
    policy = AdaptivePolicy(AdaptConfig(), heads_depth=0, lookup=True, ngram=table)
    plan = policy.plan(context)
    assert [(parent, token, keys) for parent, token, keys, _ in plan.trie] == [
        (-1, 9, [("ngram", 1, 0, 1)]), (0, 10, [("ngram", 1, 0, 2)])]
    assert plan.lookup_depth == 2  # the prior pays for both nodes on the prior step-cost curve
    tree, tokens, keys = policy.build(plan, 3)
    assert tokens.tolist() == [3, 9, 10] and tree.parents == [-1, 0, 1]
    assert AdaptivePolicy(AdaptConfig(), heads_depth=0, lookup=False, ngram=table).plan(context).trie == []


def test_speculator_loads_the_table_and_stays_greedy_exact_with_fewer_forwards(tmp_path):
    model = tiny_model("llama", vocab_size=128, seed=1)
    prompts = torch.randint(3, 128, (3, 6), generator=torch.Generator().manual_seed(5))
    refs = reference(model, prompts, 40)
    # the target's own answers to these prompts: the table knows what it writes next
    rows = [{"input_ids": prompts[i].tolist() + refs[i], "loss_mask": [0] * 6 + [1] * 40} for i in range(3)]
    NgramTable.build(rows).save(tmp_path / NGRAM_FILE)
    with_table = Speculator(model, _lm_heads(model), heads_dir=tmp_path)
    without = Speculator(model, _lm_heads(model))
    assert with_table.ngram is not None and without.ngram is None
    for i in range(3):
        out = with_table.generate(prompts[i], 40, stop_token_ids=[])
        assert out.tokens == refs[i], f"prompt {i}: first diff at {_first_diff(out.tokens, refs[i])}"
        plain = without.generate(prompts[i], 40, stop_token_ids=[])
        assert plain.tokens == refs[i]
        assert out.stats.decode_forwards < plain.stats.decode_forwards
        assert with_table.generate(prompts[i], 40, stop_token_ids=[], lookup=False).stats.decode_forwards == \
            without.generate(prompts[i], 40, stop_token_ids=[], lookup=False).stats.decode_forwards


def test_a_file_that_is_not_a_table_is_refused_by_name(tmp_path):
    (tmp_path / "garbage.safetensors").write_bytes(b"not safetensors")
    save_file({"keys": torch.zeros(3, 2, dtype=torch.int64), "next": torch.zeros(3, dtype=torch.int64)},
              str(tmp_path / "wide.safetensors"), metadata={"config": '{"max_n": 4}'})  # 2 columns, max_n 4
    save_file({"keys": torch.zeros(3, 4, dtype=torch.int64)}, str(tmp_path / "no_next.safetensors"),
              metadata={"config": '{"max_n": 4}'})
    save_file({"keys": torch.zeros(3, 4, dtype=torch.int64), "next": torch.zeros(3, dtype=torch.int64)},
              str(tmp_path / "odd_config.safetensors"), metadata={"config": '{"max_n": 4, "colour": 1}'})
    for name in ("garbage", "wide", "no_next", "odd_config"):
        with pytest.raises(HeadsLoadError, match=f"{name}.safetensors is not an n-gram table"):
            NgramTable.load(tmp_path / f"{name}.safetensors")
