"""The draft's linear layers in int8 on a CPU: weight-only, one scale per output row, bfloat16 activations.

At batch 1 a draft forward multiplies a few rows by every weight it has, so on a CPU it mostly waits for its weights
to come from memory; int8 weights are a quarter of float32's bytes (torch's `_weight_int8pack_mm` kernel). Only the
draft changes: its linear layers and the rows of the target's lm_head it scores (Medusa sharing it, DFlash). The
target verifies in float32 as before, so greedy output stays plain decoding's and sampling stays lossless; the
draft's guesses differ from float32's only where two are close (docs/measured.md, "The draft in int8").

    swap = Int8Swap(heads)     # int8 copies of the heads' linear layers, made once
    swap.use(True)             # the copies in place of the originals (False: the originals back)
"""

from __future__ import annotations

import torch
from torch import nn

from headstart.inference.cpu_linear import CpuLinear

ALIGN = 16  # the CPU kernel takes rows of in_features a multiple of this (other widths crash the process)


def int8_applies(layer: nn.Module) -> bool:
    """`layer` (an nn.Linear or inference/cpu_linear.py's CpuLinear) is float32 on a CPU, of a width the kernel
    takes, and this torch build has the kernel."""
    weight = getattr(layer, "weight", None)
    return (hasattr(torch.ops.aten, "_weight_int8pack_mm") and isinstance(weight, torch.Tensor)
            and weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.shape[1] % ALIGN == 0)


class Int8Linear(nn.Module):
    """x [..., in] -> [..., out] in float32: bfloat16(x) times the int8 weight, scaled per output row, plus the
    layer's bias. The int8 copy is made once from the layer's weight (it does not follow later changes). It keeps
    the layer's own Parameters, so a module holding it has the same state_dict, and the layer itself (`original`)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.weight, self.bias = layer.weight, layer.bias  # the same Parameters [out, in], [out] or None
        object.__setattr__(self, "original", layer)  # not a submodule: the state_dict keeps the layer's names
        weight = layer.weight.detach().float()  # [out, in]
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        scales = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127  # [out]
        self.scales = scales.to(torch.bfloat16)  # [out]: the kernel's scale dtype is its input's
        self.qweight = torch.round(weight / self.scales.float()[:, None]).clamp(-127, 127).to(torch.int8)  # [out, in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [n, in]
        out = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales).float()  # [n, out]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


class Int8Swap:
    """Every linear layer of `module` that int8_applies to, with its Int8Linear copy; `use` puts one or the other
    in place (module attributes only: the original layers, their Parameters and the state_dict are untouched). A
    layer another Int8Swap has put in place is found as well (two Speculators over the same heads)."""

    def __init__(self, module: nn.Module):
        self.slots = []  # (parent module, attribute name, the original layer, its Int8Linear)
        for parent in list(module.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, Int8Linear):
                    self.slots.append((parent, name, child.original, child))
                elif isinstance(child, (nn.Linear, CpuLinear)) and int8_applies(child):
                    self.slots.append((parent, name, child, Int8Linear(child)))
        self.int8 = any(getattr(parent, name) is copy for parent, name, _, copy in self.slots)

    def use(self, int8: bool) -> None:
        for parent, name, original, copy in self.slots:
            setattr(parent, name, copy if int8 else original)
        self.int8 = int8
