"""One strict loading path for every heads directory (heads/load.py): Medusa heads and EAGLE drafts alike.

A weights file with a missing or an extra tensor, or a config.json that disagrees with the weights' shapes, is
refused with a message naming the tensor; the loaded module equals the saved one exactly.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict

import pytest
import torch
from safetensors.torch import load_file, save_file

from headstart.heads.directory import HeadsLoadError
from headstart.heads.eagle import EagleDraft, eagle_config_for
from headstart.heads.load import load_heads
from headstart.heads.medusa import MedusaConfig, MedusaHeads
from headstart.heads.target import target_info

from conftest import tiny_model


def medusa(info) -> MedusaHeads:
    heads = MedusaHeads(MedusaConfig(hidden_size=64, vocab_size=128, num_heads=3, target=info.to_dict(),
                                     draft_vocab_size=32))
    heads.set_draft_vocab(torch.arange(0, 128, 4))
    return heads


def eagle3(info, model) -> EagleDraft:
    draft = EagleDraft(eagle_config_for(model, "eagle3", draft_vocab_size=32, target_info=info))
    draft.set_draft_vocab(torch.arange(1, 128, 4))
    return draft


def eagle1(info, model) -> EagleDraft:
    return EagleDraft(eagle_config_for(model, "eagle", target_info=info))


KINDS = {"medusa": lambda info, model: medusa(info), "eagle3": eagle3, "eagle": eagle1}


@pytest.fixture(params=sorted(KINDS))
def saved(request, tmp_path):
    model = tiny_model("llama", num_hidden_layers=4)
    info = target_info("tiny", model)
    torch.manual_seed(1)
    module = KINDS[request.param](info, model)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.02)
    module.save_pretrained(tmp_path / "ok")
    return module, info, tmp_path


def copy_with(tmp_path, name: str, edit) -> object:
    """A copy of the saved heads dir with its weights edited by `edit(state) -> state`."""
    out = tmp_path / name
    shutil.copytree(tmp_path / "ok", out)
    save_file(edit(load_file(out / "model.safetensors")), out / "model.safetensors")
    return out


def test_round_trip_is_exact(saved):
    module, info, tmp_path = saved
    loaded = load_heads(tmp_path / "ok", info)
    assert type(loaded) is type(module) and not loaded.training
    assert asdict(loaded.config) == json.loads(json.dumps(asdict(module.config)))  # as config.json holds it
    want, got = module.state_dict(), loaded.state_dict()
    assert sorted(want) == sorted(got)
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_missing_tensor_is_named(saved):
    _, info, tmp_path = saved
    name = sorted(load_file(tmp_path / "ok" / "model.safetensors"))[-1]
    bad = copy_with(tmp_path, "missing", lambda s: {k: v for k, v in s.items() if k != name})
    with pytest.raises(HeadsLoadError, match=rf"missing tensor\(s\): {name}"):
        load_heads(bad, info)


def test_extra_tensor_is_named(saved):
    _, info, tmp_path = saved
    bad = copy_with(tmp_path, "extra", lambda s: {**s, "blocks.9.layers.0.weight": torch.zeros(2, 2)})
    with pytest.raises(HeadsLoadError, match=r"unexpected tensor\(s\): blocks\.9\.layers\.0\.weight"):
        load_heads(bad, info)


def test_config_that_disagrees_with_the_weights_is_refused(saved):
    module, info, tmp_path = saved
    bad = tmp_path / "reshaped"
    shutil.copytree(tmp_path / "ok", bad)
    config = json.loads((bad / "config.json").read_text())
    config["draft_vocab_size"] = 64 if module.config.method != "eagle" else 0
    if module.config.method == "eagle":  # EAGLE-1 has no draft vocabulary: change the hidden layer's width instead
        config["layer_config"]["intermediate_size"] = 96
    (bad / "config.json").write_text(json.dumps(config))
    tensor = {"medusa": "token_map", "eagle3": "d2t", "eagle": "layers.0.mlp.down_proj.weight"}[module.config.method]
    with pytest.raises(HeadsLoadError, match=rf"shape mismatch: .*{tensor} "):
        load_heads(bad, info)


def test_unknown_method_is_refused(saved):
    _, info, tmp_path = saved
    config = json.loads((tmp_path / "ok" / "config.json").read_text())
    (tmp_path / "ok" / "config.json").write_text(json.dumps({**config, "method": "hydra"}))
    with pytest.raises(HeadsLoadError, match="method 'hydra'"):
        load_heads(tmp_path / "ok", info)
