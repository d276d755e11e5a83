"""inference/cpu_linear.py: the CPU linear layers compute what nn.Linear does, over the same Parameters, through the
kernel measured fastest for each row count."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import tiny_model
from headstart.inference.cpu_linear import (ALWAYS_ONEDNN, DEFAULT, MKL, MKL_ROWS, ONEDNN, CpuLinear, KernelChoice, linear_kernel,
                                  mkl_applies, projection, use_cpu_linears)

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")


def test_swapped_model_keeps_its_weights_and_computes_the_same_logits():
    torch.manual_seed(0)
    model = tiny_model("llama").eval()
    linears = sum(type(m) is nn.Linear for m in model.modules())
    before = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        want = model(ids).logits
    assert linear_kernel(model) == "default" and linears > 0
    kernels = use_cpu_linears(model)
    swapped = [m for m in model.modules() if isinstance(m, CpuLinear)]
    assert len(swapped) == linears and all(m.kernels is kernels for m in swapped)
    assert linear_kernel(model) == kernels.label and not any(type(m) is nn.Linear for m in model.modules())
    after = model.state_dict()
    assert list(after) == list(before)  # the same names: saving, fingerprints and loading see no change
    for name, (pointer, value) in before.items():
        assert after[name].data_ptr() == pointer and torch.equal(after[name], value), name
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert use_cpu_linears(model) is None  # already swapped


def test_only_float32_on_the_cpu_is_swapped():
    model = tiny_model("llama").to(torch.bfloat16)
    assert use_cpu_linears(model) is None and linear_kernel(model) == "default"


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
def test_projection_is_a_matmul_by_the_transposed_weight(rows):
    torch.manual_seed(rows)
    weight = torch.randn(50, 16)
    x = torch.randn(rows, 16)
    project = projection(weight)
    assert isinstance(project, CpuLinear) and project.kernels is ALWAYS_ONEDNN
    torch.testing.assert_close(project(x), x @ weight.t(), rtol=1e-5, atol=1e-5)
    assert project.weight.data_ptr() == weight.data_ptr()  # not a copy


def test_rows_invariant_checks_the_swapped_layers():
    """headstart.inference.forward.rows_invariant (what --exact relies on) must test the CPU layers the Speculator swapped in:
    one whose output depends on the number of rows makes it False (it checked only nn.Linear and said True)."""
    from headstart.inference.forward import rows_invariant

    model = tiny_model("llama").eval()
    use_cpu_linears(model)
    layer = next(m for m in model.modules() if isinstance(m, CpuLinear))
    layer.forward = lambda x: torch.nn.functional.linear(x, layer.weight) + x.shape[0]  # row-count dependent
    assert not rows_invariant(model)


@pytest.mark.skipif(not mkl_applies(), reason="this torch build has no MKL packed linear kernel")
def test_each_call_takes_the_kernel_chosen_for_its_row_count():
    torch.manual_seed(0)
    linear = nn.Linear(16, 40)
    choice = KernelChoice({1: DEFAULT, 2: ONEDNN, 6: MKL})
    assert [choice.kernel(n) for n in (1, 2, 3, 5, 6, 7, 100)] == [DEFAULT, ONEDNN, ONEDNN, ONEDNN, MKL, MKL, MKL]
    assert choice.label == "default for 1 rows; onednn for 2 rows; mkl for 6 rows"
    assert KernelChoice().label == ONEDNN and KernelChoice({1: DEFAULT, 4: DEFAULT}).label == DEFAULT
    layer = CpuLinear(linear, choice)
    assert layer.onednn_weight is not None and sorted(layer.mkl_weights) == [8, 16]  # only the copies it reads
    for rows in (1, 2, 6, 7, 16):
        x = torch.randn(rows, 16)
        want = layer.compute(x, choice.kernel(rows))
        assert torch.equal(layer(x), want)
        torch.testing.assert_close(layer.compute(x, DEFAULT), want, rtol=1e-5, atol=1e-5)
    x = torch.randn(1, 16)
    assert torch.equal(layer(x), F.linear(x, linear.weight, linear.bias))  # 1 row: PyTorch's own kernel, exactly
    batched = torch.randn(2, 1, 16)  # rows are every leading dimension: 2 here, oneDNN's
    assert torch.equal(layer(batched), layer.compute(batched, ONEDNN))
    layer.use(KernelChoice({1: DEFAULT}))
    assert layer.onednn_weight is None and layer.mkl_weights == {}  # copies no kernel reads are dropped


@pytest.mark.skipif(not mkl_applies(), reason="this torch build has no MKL packed linear kernel")
def test_mkl_rows_padded_to_a_packed_copy_give_a_row_the_same_bits_at_any_row_count():
    """A call's rows are padded up to the next packed row count (4, 8, 16): a row's result does not depend on the
    rows beside it or on which copy computed it, and more rows than the largest copy take the default kernel."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 96)
    layer = CpuLinear(linear, KernelChoice({1: MKL}))
    assert sorted(layer.mkl_weights) == list(MKL_ROWS)
    row = torch.randn(1, 64)
    alone = layer(row)[0]
    for rows in (2, 4, 5, 8, 9, 16):
        x = torch.randn(rows, 64)
        x[rows // 2] = row[0]
        assert torch.equal(layer(x)[rows // 2], alone), rows
    torch.testing.assert_close(alone, F.linear(row, linear.weight, linear.bias)[0], rtol=1e-5, atol=1e-5)
    x = torch.randn(17, 64)
    assert torch.equal(layer(x), F.linear(x, linear.weight, linear.bias))


class ScriptedClock:
    """A clock that only the scripted layers move: the measurement decides on scripted times, never on how busy the
    machine is."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ScriptedLayer:
    """A layer whose kernels take scripted times on `clock`: the default 5 ms up to 3 rows and 20 ms beyond, MKL 8 ms,
    oneDNN 10 ms."""

    in_features = 4

    def __init__(self, clock: ScriptedClock):
        self.clock = clock

    def seconds(self, rows: int, kernel: str) -> float:
        return {ONEDNN: 0.010, MKL: 0.008, DEFAULT: 0.005 if rows <= 3 else 0.020}[kernel]

    def compute(self, x: torch.Tensor, kernel: str) -> None:
        self.clock.now += self.seconds(x.shape[0], kernel)


def test_measure_gives_each_row_count_its_fastest_kernel():
    clock = ScriptedClock()
    choice = KernelChoice.measure([ScriptedLayer(clock)], rows=(1, 2, 3, 4, 8), rounds=3, kernels=(DEFAULT, MKL, ONEDNN),
                                  clock=clock)
    assert choice.kernel_by_rows == {1: DEFAULT, 2: DEFAULT, 3: DEFAULT, 4: MKL, 8: MKL}
    assert [choice.kernel(n) for n in (1, 3, 4, 16)] == [DEFAULT, DEFAULT, MKL, MKL]
    without_mkl = KernelChoice.measure([ScriptedLayer(clock)], rows=(1, 4), rounds=3, kernels=(DEFAULT, ONEDNN),
                                       clock=clock)
    assert without_mkl.kernel_by_rows == {1: DEFAULT, 4: ONEDNN}


def test_measure_keeps_the_earlier_preferred_kernel_near_a_tie():
    class NearTie(ScriptedLayer):
        def seconds(self, rows, kernel):
            return 0.0100 if kernel == DEFAULT else 0.0098  # 2% slower: inside the 5% margin

    clock = ScriptedClock()
    choice = KernelChoice.measure([NearTie(clock)], rows=(1, 2), rounds=3, kernels=(DEFAULT, MKL, ONEDNN), clock=clock)
    assert choice.kernel_by_rows == {1: DEFAULT, 2: DEFAULT}


def test_measure_takes_each_kernels_median_so_one_slow_call_changes_nothing():
    """A call held up once per kernel and row count (the machine busy for it) does not move the choice: the median
    of three rounds is the scripted time."""

    class OnceSlow(ScriptedLayer):
        def __init__(self, clock):
            super().__init__(clock)
            self.calls = collections.Counter()

        def seconds(self, rows, kernel):
            self.calls[rows, kernel] += 1
            held_up = 0.050 if self.calls[rows, kernel] == 2 else 0.0  # call 1 warms up, call 2 is round 1's
            return super().seconds(rows, kernel) + held_up

    clock = ScriptedClock()
    choice = KernelChoice.measure([OnceSlow(clock)], rows=(1, 2, 3, 4, 8), rounds=3, kernels=(DEFAULT, MKL, ONEDNN),
                                  clock=clock)
    assert choice.kernel_by_rows == {1: DEFAULT, 2: DEFAULT, 3: DEFAULT, 4: MKL, 8: MKL}
