"""The target's linear layers on a CPU in float32: per call, the kernel this machine runs fastest for that many rows:
PyTorch's default, oneDNN over a weight reordered once, or MKL over a weight packed for a fixed row count.

At batch 1 a decode step multiplies a few rows (1 for plain decoding, the tree's nodes when verifying) by every
weight matrix, so the kernel's speed at 1-16 rows decides what a tree costs over a one-token step. Which kernel wins
depends on the CPU: on an AMD EPYC host PyTorch's default (MKL sgemm) read each weight again for 2-3 rows and
oneDNN was flat; on an Intel Xeon host the default was the fastest for 1-3 rows and jumped at 4, where MKL over a
weight packed for 4, 8 or 16 rows (the rows padded up to the next of those) was the fastest (docs/measured.md). So
`use_cpu_linears(model)` times the kernels over the model's own linear layers for each row count of a decode step
(`KernelChoice.measure`) and swaps every `nn.Linear` for a `CpuLinear`, which keeps the original Parameters (tied
weights, state_dict and fingerprint unchanged), keeps the copies of the weight the chosen kernels read and takes,
per call, the kernel chosen for its row count. Inference only: the copies do not follow later changes of the
weights, and they have no gradient. Plain and speculative decoding then run on the same kernels, so greedy outputs
stay comparable.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT, ONEDNN, MKL = "default", "onednn", "mkl"
PREFERENCE = (DEFAULT, MKL, ONEDNN)  # near a tie the earlier kernel stays (so a repeated measurement gives the same
# choice): PyTorch's default keeps no copy of the weight, MKL's packed copies are the largest
ONEDNN_ROWS = 16  # oneDNN's weight layout is chosen for this many rows (its result does not depend on it)
MKL_ROWS = (4, 8, 16)  # MKL packs a weight for one row count: a call's rows are padded up to the next of these (a
# row's result is the same at any of them); more rows than the last take PyTorch's default
MEASURED_ROWS = (1, 2, 3, 4, 6, 8, 12, 16)  # row counts a decode step's linear calls have (trees up to 16 nodes)
MEASURE_ROUNDS = 3
MARGIN = 0.05  # a kernel later in PREFERENCE is taken only where it is this much faster than every earlier one


def mkl_applies() -> bool:
    """This torch build has MKL's packed linear kernel."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def available_kernels() -> tuple[str, ...]:
    return tuple(k for k in PREFERENCE if k != MKL or mkl_applies())


def mkl_packed_rows(rows: int) -> int | None:
    """The row count of the MKL copy a call of `rows` rows reads (None: more rows than any copy, the default runs)."""
    return next((packed for packed in MKL_ROWS if packed >= rows), None)


class KernelChoice:
    """Which kernel a linear call of n rows takes (DEFAULT, ONEDNN or MKL). One object is shared by every CpuLinear
    of a model (and its heads)."""

    def __init__(self, kernel_by_rows: dict[int, str] | None = None):
        self.kernel_by_rows = dict(sorted((kernel_by_rows or {}).items()))  # {} = oneDNN for every row count
        self._lookup = [self._choose(rows) for rows in range(65)]

    def _choose(self, rows: int) -> str:
        """The choice measured at the largest measured row count <= rows (fewer rows than any measured: the
        smallest's)."""
        if not self.kernel_by_rows:
            return ONEDNN
        below = [r for r in self.kernel_by_rows if r <= rows]
        return self.kernel_by_rows[max(below) if below else min(self.kernel_by_rows)]

    def kernel(self, rows: int) -> str:
        return self._lookup[rows] if rows < len(self._lookup) else self._choose(rows)

    def uses_onednn(self) -> bool:
        return ONEDNN in self._lookup[1:]

    def mkl_rows(self) -> list[int]:
        """The row counts of the MKL copies this choice reads."""
        return sorted({mkl_packed_rows(rows) for rows in range(1, MKL_ROWS[-1] + 1) if self.kernel(rows) == MKL})

    @property
    def label(self) -> str:
        """The kernel's name where one kernel takes every row count, else each kernel's row counts, e.g.
        "default for 1, 2, 3 rows; mkl for 4, 6, 8, 12, 16 rows"."""
        if not self.kernel_by_rows:
            return ONEDNN
        rows_of: dict[str, list[int]] = {}
        for rows, kernel in self.kernel_by_rows.items():
            rows_of.setdefault(kernel, []).append(rows)
        if len(rows_of) == 1:
            return next(iter(rows_of))
        return "; ".join(f"{kernel} for {', '.join(map(str, rows))} rows" for kernel, rows in rows_of.items())

    @classmethod
    @torch.no_grad()
    def measure(cls, layers: list["CpuLinear"], rows: tuple[int, ...] = MEASURED_ROWS, rounds: int = MEASURE_ROUNDS,
                margin: float = MARGIN, kernels: tuple[str, ...] | None = None,
                clock: Callable[[], float] = time.perf_counter) -> "KernelChoice":
        """Time each of `kernels` (default: every one this build has) over all `layers` (one call each, random
        inputs) per row count, in turns, `rounds` times; a row count takes the first kernel in PREFERENCE whose
        median is within `margin` of the fastest. `clock`: seconds now (tests pass a scripted one)."""
        kernels = kernels or available_kernels()
        if not layers:
            return cls()
        inputs = {n: [torch.randn(n, layer.in_features, generator=torch.Generator().manual_seed(n)) for layer in layers]
                  for n in rows}
        times: dict[tuple[int, str], list[float]] = {(n, kernel): [] for n in rows for kernel in kernels}
        for round_ in range(rounds + 1):  # round 0 warms up
            for n in rows:
                for kernel in kernels:
                    start = clock()
                    for layer, x in zip(layers, inputs[n]):
                        layer.compute(x, kernel)
                    if round_:
                        times[(n, kernel)].append(clock() - start)
        choice = {}
        for n in rows:
            median = {kernel: statistics.median(times[(n, kernel)]) for kernel in kernels}
            fastest = min(median.values())
            choice[n] = next(k for k in PREFERENCE if k in median and median[k] <= (1 + margin) * fastest)
        return cls(choice)


ALWAYS_ONEDNN = KernelChoice()


class CpuLinear(nn.Module):
    def __init__(self, linear: nn.Linear, kernels: KernelChoice | None = ALWAYS_ONEDNN):
        """`kernels` None: keep a copy for every kernel this build has, to measure them (then `use` the choice)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter [out, in]
        self.bias = linear.bias
        self.onednn_weight: torch.Tensor | None = None  # oneDNN's blocked layout for ONEDNN_ROWS rows
        self.mkl_weights: dict[int, torch.Tensor] = {}  # packed rows -> MKL's packed copy
        if kernels is None:
            self.kernels = ALWAYS_ONEDNN
            self.keep_every_copy()
        else:
            self.use(kernels)

    def keep_every_copy(self) -> None:
        """Make a copy for every kernel this build has (to measure them; `use` drops the unused ones after)."""
        self._keep_copies(True, list(MKL_ROWS) if mkl_applies() else [])

    @torch.no_grad()
    def _keep_copies(self, onednn: bool, mkl_rows: list[int]) -> None:
        """Make the copies of the weight these kernels read (once) and drop the others. A weight converted with a
        plain to_mkldnn() is reordered again on every call: on an Intel Xeon host that made a one-token step 1.65x
        slower than PyTorch's default."""
        weight = self.weight.detach()
        if onednn and self.onednn_weight is None:
            self.onednn_weight = torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_ROWS)
        if not onednn:
            self.onednn_weight = None
        self.mkl_weights = {rows: self.mkl_weights.get(rows) if rows in self.mkl_weights else
                            torch.ops.mkl._mkl_reorder_linear_weight(weight, rows) for rows in mkl_rows}

    def use(self, kernels: KernelChoice) -> None:
        """Take `kernels`' choices from now on, keeping only the copies of the weight they read."""
        self.kernels = kernels
        self._keep_copies(kernels.uses_onednn(), kernels.mkl_rows())

    def compute(self, x: torch.Tensor, kernel: str) -> torch.Tensor:
        """x [..., in] -> [..., out] through one kernel (MKL with more rows than its largest copy: the default)."""
        rows = x.reshape(-1, self.in_features).contiguous()  # [n, in]
        n = rows.shape[0]
        if kernel == ONEDNN:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.onednn_weight, self.bias, "none", [], "")  # [n, out]
        elif kernel == MKL and (packed := mkl_packed_rows(n)) is not None:
            padded = F.pad(rows, (0, 0, 0, packed - n))  # [packed, in]: zero rows, dropped below
            out = torch.ops.mkl._mkl_linear(padded, self.mkl_weights[packed], self.weight, self.bias, packed)[:n]
        else:
            return F.linear(x, self.weight, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out], float32 on the CPU, through the kernel chosen for its row count."""
        return self.compute(x, self.kernels.kernel(x.numel() // self.in_features))


def onednn_applies(model: nn.Module) -> bool:
    """oneDNN is built in, and the model is float32 on the CPU."""
    first = next(model.parameters())
    return torch.backends.mkldnn.is_available() and first.device.type == "cpu" and first.dtype == torch.float32


def kernels_of(model: nn.Module) -> KernelChoice | None:
    """The KernelChoice of `model`'s CpuLinears (None: it has none)."""
    layer = next((m for m in model.modules() if isinstance(m, CpuLinear)), None)
    return None if layer is None else layer.kernels


def linear_kernel(model: nn.Module) -> str:
    """The kernels of `model`'s linear layers (calibration records it): its CpuLinears' KernelChoice label, else
    "default"."""
    kernels = kernels_of(model)
    return "default" if kernels is None else kernels.label


def projection(weight: torch.Tensor, kernels: KernelChoice | None = ALWAYS_ONEDNN) -> nn.Module:
    """x [..., in] -> x @ weight.T [..., out] as a module over `weight` [out, in] (not copied), a CpuLinear taking
    `kernels`' choices where oneDNN applies (None: a plain nn.Linear): e.g. the rows of a shared lm_head that Medusa
    heads score, a few rows of x at a time. Build it once: the kernels' copies of the weight are made here."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return CpuLinear(linear, kernels) if kernels is not None and onednn_applies(linear) else linear


@torch.no_grad()
def use_cpu_linears(model: nn.Module, kernels: KernelChoice | None = None) -> KernelChoice | None:
    """Swap every nn.Linear of `model` for a CpuLinear, in place, all sharing `kernels` (None: measured here over
    the model's own layers, KernelChoice.measure). -> the KernelChoice in use, or None where nothing was swapped (not
    float32 on the CPU, or no nn.Linear left: already swapped)."""
    if not onednn_applies(model):
        return None
    slots = [(module, name, child) for module in model.modules() for name, child in module.named_children()
             if type(child) is nn.Linear]
    if not slots:
        return None
    layers = [CpuLinear(child, kernels) for _, _, child in slots]  # kernels None: every copy, to measure
    kernels = kernels if kernels is not None else KernelChoice.measure(layers)
    for (module, name, _), layer in zip(slots, layers):
        layer.use(kernels)
        setattr(module, name, layer)
    return kernels
