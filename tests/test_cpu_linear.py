"""inference/cpu_linear.py: the oneDNN linear layers compute what nn.Linear does, over the same Parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import tiny_model
from inference.cpu_linear import OneDNNLinear, linear_kernel, projection, use_onednn_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")


def test_swapped_model_keeps_its_weights_and_computes_the_same_logits():
    torch.manual_seed(0)
    model = tiny_model("llama").eval()
    linears = sum(type(m) is nn.Linear for m in model.modules())
    before = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        want = model(ids).logits
    assert linear_kernel(model) == "default"
    assert use_onednn_linears(model) == linears > 0
    assert linear_kernel(model) == "onednn" and not any(type(m) is nn.Linear for m in model.modules())
    after = model.state_dict()
    assert list(after) == list(before)  # the same names: saving, fingerprints and loading see no change
    for name, (pointer, value) in before.items():
        assert after[name].data_ptr() == pointer and torch.equal(after[name], value), name
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert use_onednn_linears(model) == 0  # already swapped


def test_only_float32_on_the_cpu_is_swapped():
    model = tiny_model("llama").to(torch.bfloat16)
    assert use_onednn_linears(model) == 0 and linear_kernel(model) == "default"


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
def test_projection_is_a_matmul_by_the_transposed_weight(rows):
    torch.manual_seed(rows)
    weight = torch.randn(50, 16)
    x = torch.randn(rows, 16)
    project = projection(weight)
    assert isinstance(project, OneDNNLinear)
    torch.testing.assert_close(project(x), x @ weight.t(), rtol=1e-5, atol=1e-5)
    assert project.weight.data_ptr() == weight.data_ptr()  # not a copy


def test_rows_invariant_checks_the_swapped_layers():
    """inference.forward.rows_invariant (what --exact relies on) must test the oneDNN layers the Speculator swapped in:
    one whose output depends on the number of rows makes it False (it checked only nn.Linear and said True)."""
    from inference.forward import rows_invariant

    model = tiny_model("llama").eval()
    use_onednn_linears(model)
    layer = next(m for m in model.modules() if isinstance(m, OneDNNLinear))
    layer.forward = lambda x: torch.nn.functional.linear(x, layer.weight) + x.shape[0]  # row-count dependent
    assert not rows_invariant(model)
