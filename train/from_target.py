"""Starting a draft's decoder layers from its target's (EAGLE's init_layer_from_target, DFlash's
init_layers_from_target); what else a method takes from the target is its trainer's."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def copy_last_layers(layers: nn.ModuleList, target, hidden_size: int) -> list[str]:
    """Draft layer i <- the target's decoder layer L - len(layers) + i, tensor by tensor where the names match: equal
    shapes are copied; a draft weight reading 2h inputs where the target's reads h (EAGLE-3's q/k/v over
    cat(embed, feature)) gets the target's weight in its feature half; other tensors keep their values.
    Returns the names set ("layers.{i}.{name}")."""
    source_layers = target.get_decoder().layers
    first = len(source_layers) - len(layers)
    done = []
    for i, layer in enumerate(layers):
        source = dict(source_layers[first + i].named_parameters())
        for name, param in layer.named_parameters():
            if name not in source:
                continue
            if source[name].shape == param.shape:
                param.copy_(source[name])
            elif param.shape[1:] == (2 * hidden_size,) and source[name].shape == (param.shape[0], hidden_size):
                param[:, hidden_size:].copy_(source[name])
            else:
                continue
            done.append(f"layers.{i}.{name}")
    return done
