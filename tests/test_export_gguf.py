"""heads/export_gguf.py (`--format llamacpp`): the draft GGUF read back with gguf's reader holds the architecture,
metadata keys, tensor names and shapes llama.cpp's loaders read (src/models/eagle3.cpp, src/models/dflash.cpp of
build b11434); an EAGLE-3 draft recomputed from the GGUF as llama.cpp's graph does it (NORM rope on the permuted q/k
rows, d2t scatter) gives headstart's logits; what llama.cpp would drop or cannot run is one line. Tiny random
models and a tiny target GGUF, no llama.cpp."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from test_export import LAYERS, dflash_dir, eagle_dir, make_target, medusa_dir
from headstart.heads.export import ExportError, export_heads, main
from headstart.heads.served_speed import choose_draft_length, served_record
from headstart.heads.target import target_info

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 128, 64, 4, 2, 16, 128  # conftest's tiny target

# what llama.cpp's eagle3 loader creates, GGUF dims (ne: torch's dims reversed), for the tiny target and 64 draft ids
EAGLE3_TENSORS = {
    "fc.weight": [3 * HIDDEN, HIDDEN], "output_norm.weight": [HIDDEN], "output.weight": [HIDDEN, 64], "d2t": [64],
    "blk.0.attn_norm.weight": [HIDDEN], "blk.0.attn_norm_2.weight": [HIDDEN],
    "blk.0.attn_q.weight": [2 * HIDDEN, HEADS * HEAD_DIM], "blk.0.attn_k.weight": [2 * HIDDEN, KV_HEADS * HEAD_DIM],
    "blk.0.attn_v.weight": [2 * HIDDEN, KV_HEADS * HEAD_DIM], "blk.0.attn_output.weight": [HEADS * HEAD_DIM, HIDDEN],
    "blk.0.ffn_norm.weight": [HIDDEN], "blk.0.ffn_gate.weight": [HIDDEN, FFN], "blk.0.ffn_up.weight": [HIDDEN, FFN],
    "blk.0.ffn_down.weight": [FFN, HIDDEN]}
# llama.cpp's dflash loader, two draft layers, 3 taps, 32 draft ids
DFLASH_TENSORS = {"fc.weight": [3 * HIDDEN, HIDDEN], "enc.output_norm.weight": [HIDDEN],
                  "output_norm.weight": [HIDDEN], "output.weight": [HIDDEN, 32], "d2t": [32],
                  "token_embd.weight": [HIDDEN, VOCAB]} | {
    f"blk.{i}.{name}": shape for i in range(2) for name, shape in {
        "attn_norm.weight": [HIDDEN], "attn_q.weight": [HIDDEN, HEADS * HEAD_DIM],
        "attn_k.weight": [HIDDEN, KV_HEADS * HEAD_DIM], "attn_v.weight": [HIDDEN, KV_HEADS * HEAD_DIM],
        "attn_output.weight": [HEADS * HEAD_DIM, HIDDEN], "attn_q_norm.weight": [HEAD_DIM],
        "attn_k_norm.weight": [HEAD_DIM], "ffn_norm.weight": [HIDDEN], "ffn_gate.weight": [HIDDEN, FFN],
        "ffn_up.weight": [HIDDEN, FFN], "ffn_down.weight": [FFN, HIDDEN]}.items()}
SIZES = {"block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
         "attention.head_count_kv", "attention.key_length", "attention.value_length", "rope.dimension_count",
         "rope.freq_base", "attention.layer_norm_rms_epsilon"}


def target_gguf(path: Path, arch: str = "llama", layers: int = LAYERS, vocab: int = VOCAB,
                file_type: int | None = None) -> Path:
    """A tiny target GGUF: the graph, sizes and tokenizer keys a draft export reads (and general.file_type if given:
    0 f32, 3 Q4_1)."""
    T = gguf.GGUFValueType
    writer = gguf.GGUFWriter(str(path), arch)
    if file_type is not None:
        writer.add_uint32("general.file_type", file_type)
    writer.add_uint32(f"{arch}.block_count", layers)
    writer.add_uint32(f"{arch}.embedding_length", HIDDEN)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "smollm")
    writer.add_key_value("tokenizer.ggml.tokens", [f"tok{i}" for i in range(vocab)], T.ARRAY, sub_type=T.STRING)
    writer.add_key_value("tokenizer.ggml.token_type", [1] * vocab, T.ARRAY, sub_type=T.INT32)
    writer.add_key_value("tokenizer.ggml.merges", ["t o", "o k"], T.ARRAY, sub_type=T.STRING)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.add_uint32("tokenizer.ggml.mask_token_id", 5)  # the draft's own mask token must replace it
    writer.add_tensor("token_embd.weight", np.zeros((vocab, HIDDEN), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def read_gguf(path: Path) -> tuple[dict, dict, dict]:
    """(metadata, {name: GGUF dims}, {name: array in torch layout}) as gguf's reader returns them."""
    reader = gguf.GGUFReader(path)
    meta = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    dims = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
    data = {t.name: np.array(t.data) for t in reader.tensors}
    return meta, dims, data


def rms(x: torch.Tensor, weight, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * torch.as_tensor(weight)


def rope_adjacent_pairs(x: torch.Tensor, theta: float) -> torch.Tensor:
    """llama.cpp's NORM rope: dims (2i, 2i + 1) rotate by position * theta^(-2i/d). x [T, heads, d]."""
    T, _, d = x.shape
    angle = torch.arange(T, dtype=torch.float64)[:, None] * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = angle.cos()[:, None, :].float(), angle.sin()[:, None, :].float()
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).reshape(x.shape)


def llamacpp_eagle3_logits(meta: dict, w: dict, embeds: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """llama.cpp's eagle3 encoder + decoder (src/models/eagle3.cpp) over one causal sequence, from the GGUF alone:
    embeds [T, h] (target embedding of the tokens), taps [T, 3h] -> logits [T, V] (-inf off the draft vocabulary)."""
    t = {name: torch.as_tensor(a) for name, a in w.items()}
    eps, theta = meta["eagle3.attention.layer_norm_rms_epsilon"], meta["eagle3.rope.freq_base"]
    heads, kv_heads = meta["eagle3.attention.head_count"], meta["eagle3.attention.head_count_kv"]
    d = meta["eagle3.attention.key_length"]
    T = embeds.shape[0]
    g = taps @ t["fc.weight"].T
    embd_norm, g_norm = rms(embeds, t["blk.0.attn_norm.weight"], eps), rms(g, t["blk.0.attn_norm_2.weight"], eps)
    residual = g_norm if meta["eagle3.norm_before_residual"] else g
    cur = torch.cat([embd_norm, g_norm], dim=-1)
    q = rope_adjacent_pairs((cur @ t["blk.0.attn_q.weight"].T).view(T, heads, d), theta)
    k = rope_adjacent_pairs((cur @ t["blk.0.attn_k.weight"].T).view(T, kv_heads, d), theta)
    v = (cur @ t["blk.0.attn_v.weight"].T).view(T, kv_heads, d)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    ffn_inp = att.transpose(0, 1).reshape(T, heads * d) @ t["blk.0.attn_output.weight"].T + residual
    x = rms(ffn_inp, t["blk.0.ffn_norm.weight"], eps)
    out = (F.silu(x @ t["blk.0.ffn_gate.weight"].T) * (x @ t["blk.0.ffn_up.weight"].T)) @ t["blk.0.ffn_down.weight"].T
    draft_logits = rms(out + ffn_inp, t["output_norm.weight"], eps) @ t["output.weight"].T
    logits = torch.full((T, meta["eagle3.vocab_size"]), float("-inf"))
    logits[:, t["d2t"].long()] = draft_logits
    return logits


def test_eagle3_gguf_names_shapes_keys(tmp_path):
    model, info = make_target("llama")
    src, draft = eagle_dir(tmp_path, model, info, "eagle3")
    tgt = target_gguf(tmp_path / "target.gguf")
    out = export_heads(src, tmp_path / "out", "llamacpp", target_gguf=tgt)
    assert sorted(p.name for p in out.iterdir()) == [".headstart-run.json", "README.md", "draft.gguf", "export.json"]
    meta, dims, data = read_gguf(out / "draft.gguf")
    assert dims == EAGLE3_TENSORS  # no token_embd: llama.cpp takes the target's
    assert data["d2t"].dtype == np.int64 and data["fc.weight"].dtype == np.float32
    assert meta["general.architecture"] == "eagle3"
    assert {k[len("eagle3."):] for k in meta if k.startswith("eagle3.")} == SIZES | {
        "vocab_size", "target_layers", "target_hidden_size", "norm_before_residual", "norm_before_fc"}
    assert meta["eagle3.target_layers"] == [2, 3, 3]  # = HF hidden_states (layer inputs), top level
    assert meta["eagle3.target_hidden_size"] == HIDDEN and meta["eagle3.block_count"] == 1
    assert meta["eagle3.norm_before_residual"] is False and meta["eagle3.norm_before_fc"] is False
    assert meta["eagle3.attention.head_count_kv"] == KV_HEADS and meta["eagle3.vocab_size"] == VOCAB
    assert meta["tokenizer.ggml.tokens"] == [f"tok{i}" for i in range(VOCAB)]  # copied from the target GGUF
    assert meta["tokenizer.ggml.merges"] == ["t o", "o k"] and meta["tokenizer.ggml.eos_token_id"] == 2
    assert np.array_equal(data["d2t"], np.arange(0, 128, 2))  # absolute target ids
    state = draft.state_dict()
    assert np.array_equal(data["fc.weight"], state["fc.weight"].numpy())
    assert np.array_equal(data["blk.0.attn_norm_2.weight"], state["layers.0.hidden_norm.weight"].numpy())
    assert not np.array_equal(data["blk.0.attn_q.weight"], state["layers.0.self_attn.q_proj.weight"].numpy())
    info_json = json.loads((out / "export.json").read_text())
    assert info_json["format"] == "llamacpp" and info_json["num_speculative_tokens"] == 3
    card = (out / "README.md").read_text()
    assert (f"llama-server -m {tgt} --spec-draft-model {out / 'draft.gguf'} --spec-type draft-eagle3 "
            "--spec-draft-n-max 3") in card


@pytest.mark.parametrize("norms", [{}, {"norm_before_fc": True, "norm_before_residual": True}])
def test_eagle3_gguf_computes_headstart_logits(tmp_path, norms):
    """The GGUF run as llama.cpp's graph runs it (rope on adjacent pairs, d2t scatter) gives headstart's logits: the
    q/k permutation, the tensor orientation, the norm flags and d2t are right."""
    model, info = make_target("llama")
    src, draft = eagle_dir(tmp_path, model, info, "eagle3", **norms)
    out = export_heads(src, tmp_path / "out", "llamacpp", target_gguf=target_gguf(tmp_path / "t.gguf"))
    meta, dims, data = read_gguf(out / "draft.gguf")
    assert ("enc.output_norm.weight" in dims) is bool(norms)
    torch.manual_seed(4)
    tokens, taps = torch.randint(0, VOCAB, (7,)), torch.randn(7, 3 * HIDDEN)
    embeds = model.model.embed_tokens.weight[tokens].detach()
    with torch.no_grad():
        fused = draft.fuse(taps[None])
        ours = draft.logits(draft(embeds[None], fused, torch.arange(7)[None]))[0]  # [T, draft vocab]
        if norms:  # llama.cpp's encoder: fc(enc.output_norm(taps))
            taps = rms(taps, data["enc.output_norm.weight"], meta["eagle3.attention.layer_norm_rms_epsilon"])
        theirs = llamacpp_eagle3_logits(meta, data, embeds, taps)
    torch.testing.assert_close(theirs[:, draft.to_target_ids(torch.arange(64))], ours, rtol=1e-4, atol=1e-4)
    assert torch.isinf(theirs[:, 1::2]).all()  # target ids outside the draft vocabulary


def test_dflash_gguf_names_shapes_keys(tmp_path):
    model, info = make_target("llama")
    src, draft = dflash_dir(tmp_path, model, info, [4, 2, 5])
    out = export_heads(src, tmp_path / "out", "llamacpp", target=model,
                       target_gguf=target_gguf(tmp_path / "target.gguf"))
    meta, dims, data = read_gguf(out / "draft.gguf")
    assert dims == DFLASH_TENSORS and meta["general.architecture"] == "dflash"
    assert {k[len("dflash."):] for k in meta if k.startswith("dflash.")} == SIZES | {"block_size", "target_layers"}
    assert meta["dflash.target_layers"] == [4, 2, 5]  # layer inputs, in fc's column order (no shift, no sort)
    assert meta["dflash.block_size"] == 4 and meta["dflash.block_count"] == 2
    assert meta["tokenizer.ggml.mask_token_id"] == 7  # the draft's, not the target GGUF's 5
    assert len([k for k in meta if k == "tokenizer.ggml.mask_token_id"]) == 1
    embed = model.model.embed_tokens.weight.detach()
    table = data["token_embd.weight"]
    assert np.array_equal(table[7], draft.mask_embedding.detach().numpy())  # the trained mask embedding
    assert np.array_equal(np.delete(table, 7, 0), np.delete(embed.numpy(), 7, 0))
    assert np.array_equal(data["d2t"], np.arange(32) * 2)  # absolute target ids
    assert np.array_equal(data["output.weight"], model.lm_head.weight.detach()[::2][:32].numpy())
    assert np.array_equal(data["fc.weight"], draft.fc.weight.detach().numpy())
    assert np.array_equal(data["blk.1.attn_q.weight"], draft.layers[1].self_attn.q_proj.weight.detach().numpy())
    card = (out / "README.md").read_text()
    assert "--spec-type draft-dflash --spec-draft-n-max 3" in card and "mask_embedding" in card
    windowed, _ = dflash_dir(tmp_path, model, info, [4, 2, 5], name="windowed", sliding_window=64)
    meta, _, _ = read_gguf(export_heads(windowed, tmp_path / "windowed-out", "llamacpp", target=model,
                                        target_gguf=tmp_path / "target.gguf") / "draft.gguf")
    assert meta["dflash.attention.sliding_window"] == 64  # llama.cpp's standard window, every layer
    assert meta["dflash.attention.sliding_window_pattern"] == [True, True]
    causal, _ = dflash_dir(tmp_path, model, info, [4, 2, 5], name="causal", block_causal=True)
    with pytest.raises(ExportError, match="block_causal"):  # llama.cpp's dflash draft attends both ways
        export_heads(causal, tmp_path / "causal-out", "llamacpp", target=model, target_gguf=tmp_path / "target.gguf")
    full, _ = dflash_dir(tmp_path, model, info, [2, 3], name="full", draft_vocab=0)
    meta, dims, data = read_gguf(export_heads(full, tmp_path / "full-out", "llamacpp", target=model,
                                              target_gguf=tmp_path / "target.gguf") / "draft.gguf")
    assert "d2t" not in dims and dims["output.weight"] == [HIDDEN, VOCAB]  # the target's own lm_head, not the table
    assert np.array_equal(data["output.weight"], model.lm_head.weight.detach().numpy())


def refusal(tmp_path, src, name: str, **kwargs) -> str:
    with pytest.raises(ExportError) as err:
        export_heads(src, tmp_path / name, "llamacpp", **kwargs)
    assert "\n" not in str(err.value) and not (tmp_path / name).exists()
    return str(err.value)


def test_refusals_are_one_line(tmp_path):
    model, info = make_target("llama")
    tgt = target_gguf(tmp_path / "target.gguf")
    normed, _ = eagle_dir(tmp_path, model, info, "eagle3", name="normed", norm_output=True)
    assert "norm_output: false" in refusal(tmp_path, normed, "a", target_gguf=tgt)
    biased = tiny_model("llama", num_hidden_layers=LAYERS, attention_bias=True)
    src, _ = eagle_dir(tmp_path, biased, target_info("tiny-biased", biased), "eagle3", name="biased")
    assert "q/k/v biases" in refusal(tmp_path, src, "b", target_gguf=tgt)
    qmodel, qinfo = make_target("qwen2")
    q3, _ = eagle_dir(tmp_path, qmodel, qinfo, "eagle3", name="qwen2")
    assert "'qwen2' model" in refusal(tmp_path, q3, "c", target_gguf=tgt)
    qd, _ = dflash_dir(tmp_path, qmodel, qinfo, [2, 3], name="qwen2-dflash")
    assert "'qwen2' model" in refusal(tmp_path, qd, "d", target=qmodel, target_gguf=tgt)
    med, _ = medusa_dir(tmp_path, info)
    assert "no Medusa drafter" in refusal(tmp_path, med, "e", target_gguf=tgt)
    e1, _ = eagle_dir(tmp_path, model, info, "eagle", name="e1")
    assert "not EAGLE-1" in refusal(tmp_path, e1, "f", target_gguf=tgt)
    good, _ = eagle_dir(tmp_path, model, info, "eagle3", name="good")
    assert "--target_gguf" in refusal(tmp_path, good, "g")  # a tiny target has no GGUF of its own
    shallow = target_gguf(tmp_path / "shallow.gguf", layers=4)
    assert "block_count 4" in refusal(tmp_path, good, "h", target_gguf=shallow)
    assert "cannot read" in refusal(tmp_path, good, "i", target_gguf=tmp_path / "missing.gguf")
    top, _ = dflash_dir(tmp_path, model, info, [2, LAYERS], name="top")
    assert "final-norm" in refusal(tmp_path, top, "j", target=model, target_gguf=tgt)


def test_cli_exit_codes(tmp_path, capsys):
    model, info = make_target("llama")
    tgt = target_gguf(tmp_path / "target.gguf")
    src, _ = eagle_dir(tmp_path, model, info, "eagle3")
    assert main([str(src), str(tmp_path / "ok"), "--format", "llamacpp", "--target_gguf", str(tgt)]) == 0
    assert "--spec-type draft-eagle3" in capsys.readouterr().out
    normed, _ = eagle_dir(tmp_path, model, info, "eagle3", name="normed", norm_output=True)
    run = subprocess.run([sys.executable, "-m", "headstart.heads.export", str(normed), str(tmp_path / "no"), "--format",
                          "llamacpp", "--target_gguf", str(tgt)], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "norm_output" in run.stderr
    assert not (tmp_path / "no").exists()


def test_weak_heads_llamacpp_card_and_command_serve_the_target_alone(tmp_path, capsys):
    """The llama.cpp export chooses its length on llama.cpp's step-cost prior: a weak draft's card and printed command
    serve the target GGUF alone (the draft file is written all the same); a strong one gets a length and a figure."""
    model, info = make_target("llama")
    tgt = target_gguf(tmp_path / "target.gguf", file_type=3)  # a Q4_1 target: llama.cpp's quantised step costs
    src, _ = eagle_dir(tmp_path, model, info, "eagle3")
    (src / "metrics.json").write_text(json.dumps({"top1": [0.1, 0.05, 0.02]}))
    assert main([str(src), str(tmp_path / "weak"), "--format", "llamacpp", "--target_gguf", str(tgt)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert "no draft length is predicted to pay in llama.cpp" in printed[0]
    assert printed[1].strip() == f"llama-server -m {tgt}"
    card = (tmp_path / "weak" / "README.md").read_text()
    assert "--spec-draft-model" not in card and f"llama-server -m {tgt}\n" in card
    assert (tmp_path / "weak" / "draft.gguf").is_file()
    (src / "metrics.json").write_text(json.dumps({"top1": [0.95] * 3}))
    out = export_heads(src, tmp_path / "strong", "llamacpp", target_gguf=tgt)
    served = json.loads((out / "export.json").read_text())["served_speed"]
    assert served["engine"] == "llamacpp" and not served["serve_without_draft"] and served["predicted_speedup"] >= 1.05
    assert f"--spec-draft-n-max {served['k']}" in (out / "README.md").read_text()


@pytest.mark.parametrize("file_type, engine", [(None, "llamacpp-f32"), (0, "llamacpp-f32"), (1, "llamacpp-f32"),
                                               (3, "llamacpp")])
def test_the_target_ggufs_file_type_chooses_the_step_costs(tmp_path, file_type, engine):
    """A float target GGUF (f32, f16; no file type: llama.cpp's f32 default) is served at llama.cpp's f32 step costs,
    a quantised one at its quantised costs: the export's engine, and so its chain length, follow the target GGUF."""
    model, info = make_target("llama")
    tgt = target_gguf(tmp_path / "target.gguf", file_type=file_type)
    src, _ = eagle_dir(tmp_path, model, info, "eagle3")
    (src / "metrics.json").write_text(json.dumps({"top1": [0.95] * 3}))
    out = export_heads(src, tmp_path / "out", "llamacpp", target_gguf=tgt)
    served = json.loads((out / "export.json").read_text())["served_speed"]
    assert served["engine"] == engine
    expected = served_record(choose_draft_length({"top1": [0.95] * 3}, "eagle3", engine, src, [1, 2, 3]), "export",
                             fallback_k=3)
    assert {key: served[key] for key in expected} == expected


def test_llamacpp_check_serves_the_draft_with_its_chain_and_p_min(tmp_path):
    """The check's draft server gets the draft, its --spec-type and chain, and --spec-draft-p-min only when asked
    (0: the whole chain, which is what it compares with headstart's); --p_min with --write_engines is refused, since
    the engines record is the whole chain's."""
    from headstart.inference import llamacpp_check

    tgt = target_gguf(tmp_path / "target.gguf", file_type=0)
    draft = (tmp_path / "draft.gguf", "draft-dspark", 7)
    whole = llamacpp_check.LlamaServer(Path("llama-server"), tgt, tmp_path / "a.log", 1, 4096, draft)
    cut = llamacpp_check.LlamaServer(Path("llama-server"), tgt, tmp_path / "b.log", 1, 4096, draft, p_min=0.3)
    assert whole.cmd[whole.cmd.index("--spec-type"):] == [
        "--spec-type", "draft-dspark", "--spec-draft-model", str(tmp_path / "draft.gguf"), "--spec-draft-threads", "1",
        "--spec-draft-n-max", "7"]
    assert cut.cmd[-2:] == ["--spec-draft-p-min", "0.3"] and "--no-repack" not in cut.cmd  # an f32 target
    with pytest.raises(SystemExit) as err:
        llamacpp_check.main(["--heads", "h", "--target_gguf", str(tgt), "--p_min", "0.3", "--write_engines"])
    assert err.value.code == 2
