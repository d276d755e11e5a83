"""The target's linear layers on a CPU in float32: per call, oneDNN over a packed weight or PyTorch's default, whichever
this machine runs faster for that many rows.

At batch 1 a decode step multiplies a few rows (1 for plain decoding, the tree's nodes when verifying) by every
weight matrix, so the kernel's speed at 1-16 rows decides what a tree costs over a one-token step. Which kernel wins
depends on the CPU: on an AMD EPYC host PyTorch's default (MKL sgemm) read each weight again for 2-3 rows and
oneDNN was flat; on an Intel Xeon host the default was the fastest for 1-3 rows and jumped at 4, where oneDNN over a
weight reordered once stayed flat (docs/measured.md has both). So `use_cpu_linears(model)` times
both kernels over the model's own linear layers for each row count of a decode step (`KernelChoice.measure`) and
swaps every `nn.Linear` for a `CpuLinear`, which keeps the original Parameters (tied weights, state_dict and
fingerprint unchanged), adds the packed copy and takes, per call, the kernel chosen for its row count. Inference
only: the packed copy does not follow later changes of the weights, and it has no gradient. Plain and speculative
decoding then run on the same kernels, so greedy outputs stay comparable.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

PACKED_ROWS = 16  # oneDNN's weight layout is chosen for this many rows (flat from 1 to 16 rows on the hosts measured)
MEASURED_ROWS = (1, 2, 3, 4, 6, 8, 12, 16)  # row counts a decode step's linear calls have (trees up to 16 nodes)
MEASURE_ROUNDS = 3
DEFAULT_MARGIN = 0.1  # the default kernel is taken only where it is this much faster: near a tie oneDNN stays, so a
# repeated measurement gives the same choice


class KernelChoice:
    """Which kernel a linear call of n rows takes: True = oneDNN over the packed weight, False = PyTorch's default.
    One object is shared by every CpuLinear of a model (and its heads)."""

    def __init__(self, onednn_by_rows: dict[int, bool] | None = None):
        self.onednn_by_rows = dict(sorted((onednn_by_rows or {}).items()))  # {} = oneDNN for every row count
        self._lookup = [self._choose(rows) for rows in range(65)]

    def _choose(self, rows: int) -> bool:
        """The choice measured at the largest measured row count <= rows (fewer rows than any measured: the
        smallest's)."""
        if not self.onednn_by_rows:
            return True
        below = [r for r in self.onednn_by_rows if r <= rows]
        return self.onednn_by_rows[max(below) if below else min(self.onednn_by_rows)]

    def onednn(self, rows: int) -> bool:
        return self._lookup[rows] if rows < len(self._lookup) else self._choose(rows)

    @property
    def label(self) -> str:
        """"onednn" (always), "default" (always), else the row counts given to the default kernel, e.g.
        "default for 1, 2, 3 rows, else onednn"."""
        default_rows = [r for r, onednn in self.onednn_by_rows.items() if not onednn]
        if not default_rows:
            return "onednn"
        if len(default_rows) == len(self.onednn_by_rows):
            return "default"
        return "default for " + ", ".join(map(str, default_rows)) + " rows, else onednn"

    @classmethod
    @torch.no_grad()
    def measure(cls, layers: list["CpuLinear"], rows: tuple[int, ...] = MEASURED_ROWS, rounds: int = MEASURE_ROUNDS,
                margin: float = DEFAULT_MARGIN) -> "KernelChoice":
        """Time both kernels over all `layers` (one call each, random inputs) per row count, in turns, `rounds`
        times; a row count takes the default kernel where its median is `margin` below oneDNN's."""
        if not layers:
            return cls()
        inputs = {n: [torch.randn(n, layer.in_features, generator=torch.Generator().manual_seed(n)) for layer in layers]
                  for n in rows}
        times: dict[tuple[int, bool], list[float]] = {(n, onednn): [] for n in rows for onednn in (True, False)}
        for round_ in range(rounds + 1):  # round 0 warms up
            for n in rows:
                for onednn in (True, False):
                    start = time.perf_counter()
                    for layer, x in zip(layers, inputs[n]):
                        layer.compute(x, onednn)
                    if round_:
                        times[(n, onednn)].append(time.perf_counter() - start)
        median = {key: statistics.median(t) for key, t in times.items()}
        return cls({n: median[(n, False)] > (1 - margin) * median[(n, True)] for n in rows})


ALWAYS_ONEDNN = KernelChoice()


class CpuLinear(nn.Module):
    def __init__(self, linear: nn.Linear, kernels: KernelChoice = ALWAYS_ONEDNN):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter [out, in]
        self.bias = linear.bias
        self.kernels = kernels
        # oneDNN's copy of the weight in the blocked layout its kernel reads for up to PACKED_ROWS rows (a weight
        # converted with a plain to_mkldnn() is reordered again on every call: on an Intel Xeon host that made a
        # one-token step 1.65x slower than PyTorch's default)
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACKED_ROWS)
        self.register_buffer("packed_weight", packed, persistent=False)

    def compute(self, x: torch.Tensor, onednn: bool) -> torch.Tensor:
        """x [..., in] -> [..., out] through one kernel: oneDNN over the packed weight, or PyTorch's default."""
        if onednn:
            rows = x.reshape(-1, self.in_features).contiguous()  # [n, in]
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")  # [n, out]
            return out.reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out], float32 on the CPU, through the kernel chosen for its row count."""
        return self.compute(x, self.kernels.onednn(x.numel() // self.in_features))


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
    heads score, a few rows of x at a time. Build it once: the oneDNN copy is made here."""
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
    layers = [CpuLinear(child) for _, _, child in slots]
    kernels = kernels if kernels is not None else KernelChoice.measure(layers)
    for (module, name, _), layer in zip(slots, layers):
        layer.kernels = kernels
        setattr(module, name, layer)
    return kernels
