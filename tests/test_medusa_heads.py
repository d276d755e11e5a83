"""Medusa heads: label offsets, masks, batching, save/load round trips (local dir, offline Hub cache), refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from headstart.heads.directory import HeadsLoadError
from headstart.heads.load import load_heads, load_heads_and_target
from headstart.heads.medusa import MedusaConfig, MedusaHeads
from headstart.heads.target import load_target, target_info
from headstart.train.data import DataError, collate, shard_epoch, shifted_labels, split_eval, truncate_rows
from headstart.train.features import final_hidden
from headstart.train.medusa import head_targets, target_probs, weighted_head_ce

from conftest import tiny_model

EOS = 2  # also the pad id, as on many chat models


# ---------------------------------------------------------------- labels and masks


def test_head_k_predicts_token_t_plus_k_plus_1():
    ids = torch.arange(100, 112)[None]  # token at position t is 100 + t
    mask = torch.ones_like(ids)
    union, labels, valid, soft_valid = head_targets({"input_ids": ids, "loss_mask": mask, "attention_mask": mask}, 3)
    assert torch.equal(soft_valid, valid)
    for k in range(3):  # 0-based k = head k+1, which learns the token (k+1)+1 positions ahead
        positions = union[0].nonzero()[:, 0][valid[k]]
        assert (labels[k][valid[k]] == 100 + positions + k + 2).all()
        assert int(valid[k].sum()) == 12 - (k + 2)  # the last k+2 positions have no label
    # the loss is ~0 only when head k puts its mass on token t+k+2 (and large for the target's own offset t+1)
    n, V = int(union.sum()), 112
    right = torch.full((3, n, V), -30.0)
    wrong = torch.full((3, n, V), -30.0)
    for k in range(3):
        right[k, torch.arange(n), labels[k]] = 30.0
        wrong[k, torch.arange(n), labels[k] - 1] = 30.0
    denom = valid.sum(-1).float()
    assert weighted_head_ce(right, labels, valid, denom, 0.8)[0] < 1e-6
    assert weighted_head_ce(wrong, labels, valid, denom, 0.8)[0] > 10


def test_soft_labels_are_the_targets_distribution_one_position_before_the_label():
    torch.manual_seed(0)
    B, T, h, V = 2, 9, 8, 11
    hidden, weight = torch.randn(B, T, h), torch.randn(V, h)
    ids = torch.randint(0, V, (B, T))
    # row 0: user 0-2, assistant 3-8; row 1: user 0-1, assistant 2-5, padding 6-8
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 0, 0, 0]])
    attention = torch.tensor([[1] * 9, [1] * 6 + [0] * 3])
    batch = {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": attention}
    union, labels, valid, soft_valid = head_targets(batch, 2, supervise_prompt=True)
    probs = target_probs(hidden, union, weight, 2)  # [K, N, V]
    rows, cols = union.nonzero(as_tuple=True)
    for k in range(2):
        for n in range(len(rows)):
            b, t = int(rows[n]), int(cols[n])
            if t + k + 1 < T:
                torch.testing.assert_close(probs[k, n], torch.softmax(hidden[b, t + k + 1] @ weight.t(), -1))
            # soft labels wherever the label is real text; hard ones only where the target wrote it
            assert bool(soft_valid[k, n]) == (t + k + 2 < T and bool(attention[b, t + k + 2]))
            assert bool(valid[k, n]) == (t + k + 2 < T and bool(loss_mask[b, t + k + 2]))
    assert int(soft_valid.sum()) > int(valid.sum())  # the prompt positions are supervised too


def test_soft_ce_with_one_hot_probs_equals_the_hard_loss():
    torch.manual_seed(0)
    K, N, V = 2, 7, 5
    logits, labels = torch.randn(K, N, V), torch.randint(0, V, (K, N))
    valid = torch.rand(K, N) > 0.3
    denom = valid.sum(-1).float()
    hard = weighted_head_ce(logits, labels, valid, denom, 0.8)[0]
    one_hot = torch.nn.functional.one_hot(labels, V).float()
    for w in (0.0, 0.5, 1.0):
        soft = weighted_head_ce(logits, labels, valid, denom, 0.8, (one_hot, valid, w))[0]
        torch.testing.assert_close(soft, hard)
    uniform = torch.full((K, N, V), 1 / V)  # a different distribution: a different loss, and the logged CE unchanged
    loss, ce, _ = weighted_head_ce(logits, labels, valid, denom, 0.8, (uniform, valid, 1.0))
    assert not torch.allclose(loss, hard)
    torch.testing.assert_close(ce, weighted_head_ce(logits, labels, valid, denom, 0.8)[1])


def test_mask_keeps_real_eos_and_skips_user_and_padding():
    # user: 11 12 13 | assistant: 21 22 EOS | user: 14 15 | assistant: 23 EOS   (pad id == EOS)
    row_a = {"input_ids": [11, 12, 13, 21, 22, EOS, 14, 15, 23, EOS], "loss_mask": [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]}
    row_b = {"input_ids": [16, 24, EOS], "loss_mask": [0, 1, 1]}
    batch = collate([row_a, row_b], pad_id=EOS)
    assert batch["input_ids"][1].tolist() == [16, 24, EOS] + [EOS] * 7
    assert batch["loss_mask"][1].tolist() == [0, 1, 1] + [0] * 7 and batch["attention_mask"][1].sum() == 3
    labels, valid = shifted_labels(batch["input_ids"], batch["loss_mask"], 2)  # head 1
    supervised_a = labels[0][valid[0]].tolist()
    assert supervised_a == [21, 22, EOS, 23, EOS]  # both real EOS tokens are learned
    assert not set(supervised_a) & {11, 12, 13, 14, 15}  # user tokens never are
    assert labels[1][valid[1]].tolist() == [EOS]  # row b: only its real EOS at position 2 (from t=0)...
    assert valid[1][1:].sum() == 0  # ...and none of its padding EOS tokens
    labels0, valid0 = shifted_labels(batch["input_ids"], batch["loss_mask"], 1)  # the target's own offset
    assert labels0[0][valid0[0]].tolist() == [21, 22, EOS, 23, EOS]


def test_truncate_split_and_shard():
    rows = [{"input_ids": list(range(10)), "loss_mask": [0] * 6 + [1] * 4}, {"input_ids": [1, 2], "loss_mask": [1, 1]}]
    kept, dropped = truncate_rows(rows, max_length=6)
    assert dropped == 1 and kept == [{"input_ids": [1, 2], "loss_mask": [1, 1]}]
    with pytest.raises(DataError, match="lengths differ"):
        truncate_rows([{"input_ids": [1, 2], "loss_mask": [1]}], 8)
    assert split_eval(20, 4) == (list(range(16)), [16, 17, 18, 19])
    assert split_eval(3, 10) == ([0], [1, 2])  # always keeps a training row
    with pytest.raises(DataError, match="empty"):
        split_eval(0, 1)
    order = [7, 3, 5, 1, 0, 2, 6, 4, 8]
    two = [shard_epoch(order, 2, 2, p) for p in range(2)]
    assert two == [[7, 3, 0, 2], [5, 1, 6, 4]]  # global batches [7 3 5 1] and [0 2 6 4]; 8 dropped
    assert shard_epoch(order, 4, 1, 0) == [7, 3, 5, 1, 0, 2, 6, 4]


def test_features_are_the_final_norm_hidden_state():
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (2, 9))
    attn = torch.ones_like(ids)
    with torch.no_grad():
        ours = final_hidden(model, ids, attn)
        ref = model(input_ids=ids, attention_mask=attn, output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(ours, ref)


# ---------------------------------------------------------------- save / load


def make_heads(seed: int = 0, share: bool = False):
    model = tiny_model("llama", seed=seed)
    info = target_info("tiny", model)
    torch.manual_seed(seed)
    heads = MedusaHeads(MedusaConfig(hidden_size=64, vocab_size=128, num_heads=3, share_lm_head=share, target=info.to_dict()))
    with torch.no_grad():  # non-trivial weights
        for p in heads.parameters():
            p.normal_(0, 0.02)
    return heads, model, info


def test_round_trip_local_dir(tmp_path):
    heads, model, info = make_heads()
    heads.save_pretrained(tmp_path)
    loaded = load_heads(tmp_path, info)
    x = torch.randn(2, 5, 64)
    torch.testing.assert_close(loaded(x), heads(x), rtol=0, atol=0)
    assert loaded.config == heads.config


def test_round_trip_from_offline_hub_cache(tmp_path, monkeypatch):
    """A Hub id resolves through the local Hub cache (models--owner--name/snapshots/<rev>, refs/main) offline."""
    import huggingface_hub.constants as hub_constants

    heads, model, info = make_heads()
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someone--tiny-medusa"
    heads.save_pretrained(repo / "snapshots" / revision)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    loaded = load_heads("someone/tiny-medusa", info)
    x = torch.randn(1, 4, 64)
    torch.testing.assert_close(loaded(x), heads(x), rtol=0, atol=0)
    with pytest.raises(HeadsLoadError, match="hf download someone/not-cached"):
        load_heads("someone/not-cached")


def test_wrong_target_is_refused(tmp_path):
    heads, _, info = make_heads(seed=0)
    heads.save_pretrained(tmp_path)
    other = target_info("other-tiny", tiny_model("llama", seed=1))  # same shapes, other weights
    with pytest.raises(HeadsLoadError, match="fingerprint"):
        load_heads(tmp_path, other)
    with pytest.raises(HeadsLoadError, match="fingerprint"):
        load_heads(tmp_path, other.to_dict())
    wider = target_info("wide", tiny_model("llama", vocab_size=256))
    with pytest.raises(HeadsLoadError, match="vocab_size=256"):
        load_heads(tmp_path, wider)


def test_load_heads_and_target_checks_the_given_target(tmp_path, tiny_target_dir):
    model, tokenizer, info = load_target(str(tiny_target_dir))
    heads = MedusaHeads(MedusaConfig(hidden_size=info.hidden_size, vocab_size=info.vocab_size, num_heads=2,
                                     target=info.to_dict()))
    heads.save_pretrained(tmp_path / "heads")
    got_heads, got_model, _, got_info = load_heads_and_target(tmp_path / "heads")  # target by its recorded name
    assert got_info.fingerprint == info.fingerprint and got_heads.config.num_heads == 2
    other = tiny_model("llama", vocab_size=info.vocab_size, seed=5)
    with pytest.raises(HeadsLoadError, match="fingerprint"):
        load_heads_and_target(tmp_path / "heads", (other, tokenizer, target_info("other", other)))


def test_missing_or_corrupt_files(tmp_path):
    heads, _, info = make_heads()
    heads.save_pretrained(tmp_path / "ok")
    missing = tmp_path / "missing"
    shutil.copytree(tmp_path / "ok", missing)
    (missing / "model.safetensors").unlink()
    with pytest.raises(HeadsLoadError, match="no model.safetensors"):
        load_heads(missing)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tmp_path / "ok", corrupt)
    data = (corrupt / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated download
    with pytest.raises(HeadsLoadError, match="corrupt or truncated"):
        load_heads(corrupt)
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(HeadsLoadError, match="corrupt or truncated"):
        load_heads(corrupt)
    bad_json = tmp_path / "bad_json"
    shutil.copytree(tmp_path / "ok", bad_json)
    (bad_json / "config.json").write_text("{not json")
    with pytest.raises(HeadsLoadError, match="not valid JSON"):
        load_heads(bad_json)
    with pytest.raises(HeadsLoadError, match="no config.json"):
        load_heads(tmp_path)  # a directory, but not a heads directory
    with pytest.raises(HeadsLoadError, match="no such directory"):
        load_heads(tmp_path / "nope")


def test_medusa2_heads_without_adapter_dir_are_refused(tmp_path, tiny_target_dir):
    _, _, info = load_target(str(tiny_target_dir))
    heads = MedusaHeads(MedusaConfig(hidden_size=info.hidden_size, vocab_size=info.vocab_size, num_heads=2,
                                     target=info.to_dict(), method="medusa2", adapter=True))
    heads.save_pretrained(tmp_path)
    with pytest.raises(HeadsLoadError, match="adapter"):
        load_heads_and_target(tmp_path, str(tiny_target_dir))


def test_shared_lm_head_round_trip(tmp_path):
    heads, model, info = make_heads(share=True)
    heads.save_pretrained(tmp_path)
    loaded = load_heads(tmp_path, info)
    assert loaded.lm_heads is None
    w = model.get_output_embeddings().weight
    x = torch.randn(1, 3, 64)
    torch.testing.assert_close(loaded(x, w), heads(x, w))
    assert "lm_heads.0.weight" not in json.dumps(list(loaded.state_dict()))
