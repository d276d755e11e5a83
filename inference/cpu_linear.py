"""The target's linear layers through oneDNN with packed weights, for decoding on a CPU in float32.

At batch 1 a decode step multiplies a few rows (1 for plain decoding, the tree's nodes when verifying) by every
weight matrix. PyTorch's default CPU path (MKL sgemm) can read each weight once per row when there are only a few
rows, so verifying a small tree costs a multiple of a one-token step and no tree pays. oneDNN's linear over a weight
converted once reads it once for a few rows alike, so a small tree costs about a one-token step (docs/measured.md has
the timings). `use_onednn_linears(model)` swaps every `nn.Linear` for
`OneDNNLinear`, which keeps the original Parameters (tied weights, state_dict and fingerprint unchanged) and adds
the packed copy. Inference only: the packed copy does not follow later changes of the weights, and it has no
gradient. Plain and speculative decoding then run on the same arithmetic, so greedy outputs stay comparable.
"""

from __future__ import annotations

import torch
from torch import nn


class OneDNNLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter [out, in]
        self.bias = linear.bias
        bias = linear.bias.detach() if linear.bias is not None else torch.zeros(linear.out_features)
        self.register_buffer("packed_weight", linear.weight.detach().to_mkldnn(), persistent=False)
        self.register_buffer("packed_bias", bias.to_mkldnn(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out], float32 on the CPU."""
        return torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), self.packed_weight, self.packed_bias).to_dense()


def onednn_applies(model: nn.Module) -> bool:
    """oneDNN is built in, and the model is float32 on the CPU."""
    first = next(model.parameters())
    return torch.backends.mkldnn.is_available() and first.device.type == "cpu" and first.dtype == torch.float32


def linear_kernel(model: nn.Module) -> str:
    """"onednn" when `model` computes its linear layers through OneDNNLinear, else "default" (calibration records it)."""
    return "onednn" if any(isinstance(m, OneDNNLinear) for m in model.modules()) else "default"


def projection(weight: torch.Tensor, onednn: bool = True) -> nn.Module:
    """x [..., in] -> x @ weight.T [..., out] as a module over `weight` [out, in] (not copied), through oneDNN where
    it applies (and `onednn`): e.g. the rows of a shared lm_head that Medusa heads score, a few rows of x at a time.
    Build it once: the oneDNN copy is made here."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return OneDNNLinear(linear) if onednn and onednn_applies(linear) else linear


@torch.no_grad()
def use_onednn_linears(model: nn.Module) -> int:
    """Swap every nn.Linear of `model` for a OneDNNLinear, in place; -> how many were swapped (0 where it does
    not apply: not float32 on the CPU, or already swapped)."""
    if not onednn_applies(model):
        return 0
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, OneDNNLinear(child))
                swapped += 1
    return swapped
