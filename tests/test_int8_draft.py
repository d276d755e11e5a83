"""inference/int8_draft.py: the draft's linear layers from int8 copies (weight-only, a scale per output row, bfloat16
activations): what they compute, which layers they replace, that the heads' Parameters and state_dict stay, and that
a Speculator drafting in int8 still decodes exactly the target's greedy output."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_model
from torch import nn

from headstart.heads.dflash import DFlashDraft, dflash_config_for
from headstart.heads.medusa import MedusaConfig, MedusaHeads
from headstart.heads.target import fingerprint
from headstart.inference.cpu_linear import CpuLinear, use_cpu_linears
from headstart.inference.int8_draft import ALIGN, Int8Linear, Int8Swap, int8_applies
from headstart.inference.speculator import Speculator

pytestmark = [pytest.mark.usefixtures("one_thread"),  # tests/conftest.py
              pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int8pack_mm"),
                                 reason="this torch build has no int8 weight kernel")]


@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_is_bfloat16_input_times_the_dequantised_weight(bias):
    torch.manual_seed(0)
    layer = nn.Linear(64, 40, bias=bias)
    q = Int8Linear(layer)
    assert q.qweight.dtype == torch.int8 and q.qweight.shape == (40, 64) and q.qweight.abs().max() == 127
    assert q.weight is layer.weight and q.bias is layer.bias and q.original is layer
    dequantised = q.qweight.float() * q.scales.float()[:, None]  # [40, 64]
    assert (dequantised - layer.weight).abs().max() <= q.scales.float().max() * 0.51  # half a step, bf16 scale
    x = torch.randn(3, 5, 64)
    want = x.to(torch.bfloat16).float() @ dequantised.t() + (layer.bias if bias else 0)  # [3, 5, 40]
    got = q(x)
    assert got.shape == (3, 5, 40) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)  # the kernel rounds its output to bfloat16
    with torch.no_grad():
        exact = layer(x)
    assert ((got - exact).norm() / exact.norm()) < 0.02


def test_only_float32_cpu_layers_of_a_width_the_kernel_takes_apply():
    assert int8_applies(nn.Linear(ALIGN * 4, 8))
    assert not int8_applies(nn.Linear(24, 8))  # the kernel would crash the process on this width
    assert not int8_applies(nn.Linear(64, 8).to(torch.bfloat16))
    assert not int8_applies(nn.Linear(64, 8, device="meta"))
    assert not int8_applies(nn.LayerNorm(64))


def test_swap_puts_copies_in_place_and_back_keeping_the_state_dict():
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(hidden_size=64, vocab_size=128, num_heads=2))
    heads.odd = nn.Linear(24, 8)  # a width the kernel does not take: left as it is
    before = {k: (v.data_ptr(), v.clone()) for k, v in heads.state_dict().items()}
    linears = [m for m in heads.modules() if type(m) is nn.Linear and m is not heads.odd]
    swap = Int8Swap(heads)
    assert len(swap.slots) == len(linears) and not swap.int8
    swap.use(True)
    assert swap.int8 and sum(isinstance(m, Int8Linear) for m in heads.modules()) == len(linears)
    assert type(heads.odd) is nn.Linear
    after = heads.state_dict()
    assert list(after) == list(before)  # the same names: saving and fingerprints see no change
    for name, (pointer, value) in before.items():
        assert after[name].data_ptr() == pointer and torch.equal(after[name], value), name
    again = Int8Swap(heads)  # a second Speculator over the same heads finds the copies and their originals
    assert again.int8 and [s[2] for s in again.slots] == [s[2] for s in swap.slots]
    again.use(False)
    assert not any(isinstance(m, Int8Linear) for m in heads.modules())
    assert [m for m in heads.modules() if type(m) is nn.Linear and m is not heads.odd] == linears


def test_cpu_linears_are_swapped_too():
    heads = MedusaHeads(MedusaConfig(hidden_size=64, vocab_size=128, num_heads=2))
    use_cpu_linears(heads)
    swap = Int8Swap(heads)
    assert swap.slots and all(isinstance(original, CpuLinear) for _, _, original, _ in swap.slots)


def dflash_draft(model) -> DFlashDraft:
    torch.manual_seed(0)
    vocab = model.config.vocab_size
    config = dflash_config_for(model, num_layers=2, block_size=4, mask_token_id=vocab - 1, feature_layers=[1, 3],
                               target_info={"name": "tiny", "fingerprint": fingerprint(model)})
    draft = DFlashDraft(config)
    with torch.no_grad():
        draft.norm.weight.copy_(model.model.norm.weight)
        draft.mask_embedding.copy_(model.get_input_embeddings().weight[3])
    return draft.eval()


def test_int8_draft_decodes_the_greedy_output_and_float32_comes_back():
    model = tiny_model("llama", num_hidden_layers=4, vocab_size=16, seed=3)
    model.generation_config.eos_token_id = None
    draft = dflash_draft(model)
    spec = Speculator(model, draft, tree=[[0], [1], [0, 0], [0, 0, 0]])
    assert spec.draft_weights == "int8" and spec.draft_project is spec.int8_project
    assert isinstance(draft.layers[0].mlp.down_proj, Int8Linear) and isinstance(draft.fc, Int8Linear)
    gen = torch.Generator().manual_seed(0)
    drafted = {"int8": 0, "float32": 0}
    for i in range(8):
        prompt = torch.randint(0, 15, (1, 5 + i), generator=gen)
        ref = model.generate(prompt, max_new_tokens=40, do_sample=False)[0, prompt.shape[1]:].tolist()
        for int8 in (True, False):
            spec.use_draft_int8(int8)
            out = spec.generate(prompt, 40, stop_token_ids=[], adaptive=False, lookup=False)
            assert out.tokens == ref
            drafted[spec.draft_weights] += sum(a * c for a, c in enumerate(out.stats.accept_hist))
    assert drafted["int8"] >= 5 and drafted["float32"] >= 5  # drafts were accepted in both precisions
    assert spec.draft_weights == "float32" and spec.draft_project is spec.float_project
    assert not any(isinstance(m, Int8Linear) for m in draft.modules())
    plain = Speculator(model, dflash_draft(model), tree="default", draft_int8=False)
    assert plain.draft_weights == "float32" and not any(isinstance(m, Int8Linear) for m in plain.heads.modules())
    assert plain.int8_swap is None and plain.int8_project is None  # no int8 copies made for a float32 draft


def test_the_tree_calibration_records_the_drafts_precision(tmp_path, monkeypatch):
    import headstart.inference.calibrate as calibrate_module

    model = tiny_model("llama", num_hidden_layers=4, vocab_size=16, seed=3)
    spec = Speculator(model, dflash_draft(model), tree="default", heads_dir=tmp_path)
    spec.calibrate(sizes=(1, 2, 4), prefix_len=32, repeats=1,
                   timer=lambda kind, size, run: 1.0 if kind == "draft" else 10.0 + size)
    record = json.loads((tmp_path / "tree.json").read_text())
    assert record["draft_weights"] == "int8" and not record["noisy"]
    monkeypatch.setattr(calibrate_module, "time_ms", None)  # reused as it is: not timed again
    assert Speculator(model, dflash_draft(model), heads_dir=tmp_path).tree.size == len(record["choices"]) + 1
    float32 = Speculator(model, dflash_draft(model), tree="default", heads_dir=tmp_path, draft_int8=False)
    assert float32._stale_reason(record) == "it timed the draft in int8, not float32"  # measured again
