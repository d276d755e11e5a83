"""Bad files in a heads directory (issue 45, cases 9, 10, 12, 16, 17, 18): every number read from config.json,
model.safetensors, tree.json, metrics.json and ngram.safetensors is checked before use. A tampered file is one line
naming the file, the field and the fix (HeadsLoadError / SpeculatorError / ExportError, exit 2 from the CLIs), a
config that asks for more than its weights hold is refused before anything is allocated, and an export's launch
command names only a Hub id (or TARGET), shell-quoted, with a chain length the heads draft."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

from headstart.heads.dflash import DFlashDraft, dflash_config_for
from headstart.heads.directory import HeadsLoadError
from headstart.heads.eagle import EagleDraft, eagle_config_for
from headstart.heads.export import ExportError, export_heads
from headstart.heads.export import main as export_main
from headstart.heads.load import load_heads
from headstart.heads.medusa import MedusaConfig, MedusaHeads
from headstart.heads.target import TargetLoadError, load_target
from headstart.inference.decode import SpeculatorError
from headstart.inference.ngram import NGRAM_FILE, NgramConfig, NgramTable


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target(str(tiny_target_dir))  # (model, tokenizer, info)


def medusa_heads(path: Path, info, draft_vocab: int = 0) -> Path:
    heads = MedusaHeads(MedusaConfig(hidden_size=info.hidden_size, vocab_size=info.vocab_size, num_heads=2,
                                     share_lm_head=True, draft_vocab_size=draft_vocab, target=info.to_dict()))
    if draft_vocab:
        heads.set_draft_vocab(torch.arange(draft_vocab) * 2)
    heads.save_pretrained(path)
    return path


def eagle3_heads(path: Path, model, info) -> Path:
    draft = EagleDraft(eagle_config_for(model, "eagle3", draft_vocab_size=64, target_info=info))
    draft.set_draft_vocab(torch.arange(64) * 2)
    draft.save_pretrained(path)
    return path


def dflash_heads(path: Path, model, info) -> Path:
    DFlashDraft(dflash_config_for(model, num_layers=1, block_size=4, feature_layers=[1],
                                  target_info=info)).save_pretrained(path)
    return path


def edit_json(file: Path, **changes) -> None:
    data = json.loads(file.read_text())
    for key, value in changes.items():
        *path, last = key.split(".")
        node = data
        for part in path:
            node = node[part]
        node[last] = value
    file.write_text(json.dumps(data))


def edit_tensor(file: Path, name: str, value: torch.Tensor) -> None:
    state = load_file(file)
    state[name] = value
    save_file(state, str(file))


class AllocationBudget(TorchDispatchMode):
    """Fails as soon as the tensors created off the meta device exceed `limit` bytes in all."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit, self.total = limit, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.total += t.numel() * t.element_size()
        assert self.total <= self.limit, f"{self.total} bytes allocated before the bad config was refused"
        return out


def assert_refused_within(heads_dir: Path, *words: str) -> None:
    """load_heads refuses heads_dir with a HeadsLoadError naming `words`, having allocated at most 10x the size of
    its weights file."""
    limit = 10 * (heads_dir / "model.safetensors").stat().st_size
    with AllocationBudget(limit), pytest.raises(HeadsLoadError) as err:
        load_heads(heads_dir)
    assert all(w in str(err.value) for w in words), str(err.value)


def assert_one_line_error(stderr: str, *words: str) -> None:
    """A CLI's stderr ends in one `error: ...` line naming `words` (progress bars may come before it), no traceback."""
    assert "Traceback" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and all(w in last for w in words), last


# ------------------------------------------------------------------------------------------ 10. bounded memory


def test_a_huge_num_heads_is_refused_before_allocating(target, tmp_path):
    heads = medusa_heads(tmp_path / "medusa", target[2])
    edit_json(heads / "config.json", num_heads=100_000)
    assert_refused_within(heads, "config.json", "num_heads", "100000")


def test_an_eagle_layer_wider_than_its_weights_is_refused_before_allocating(target, tmp_path):
    heads = eagle3_heads(tmp_path / "eagle3", *target[:1], target[2])
    edit_json(heads / "config.json", **{"layer_config.intermediate_size": 100_000})
    assert_refused_within(heads, "model.safetensors", "does not match", "mlp.up_proj.weight")
    edit_json(heads / "config.json", **{"layer_config.intermediate_size": 1e8})
    assert_refused_within(heads, "config.json", "layer_config.intermediate_size", "integer")


def test_a_100000_node_tree_is_refused(target, tmp_path):
    from headstart.inference.speculator import Speculator

    heads = medusa_heads(tmp_path / "medusa", target[2])
    vocab = target[2].vocab_size
    choices = [[r] for r in range(vocab)] + [[a, b] for a in range(vocab) for b in range(vocab)]
    (heads / "tree.json").write_text(json.dumps({"choices": choices[:100_000]}))
    with pytest.raises(SpeculatorError, match=r"100000 nodes, more than the 1024 drafted nodes"):
        Speculator.from_pretrained(heads, tree=str(heads / "tree.json"))


# ------------------------------------------------------------------------------------------ 17. types


@pytest.mark.parametrize("field, value, words", [
    ("hidden_size", "64", "hidden_size must be an integer, got '64'"),
    ("num_heads", True, "num_heads must be an integer, got True"),
    ("num_heads", 2.0, "num_heads must be an integer, got 2.0"),
    ("share_lm_head", "yes", "share_lm_head must be true or false"),
    ("draft_vocab_size", -1, "draft_vocab_size is -1, outside 0.."),
])
def test_config_values_are_type_checked_by_name(target, tmp_path, field, value, words):
    heads = medusa_heads(tmp_path / "medusa", target[2])
    edit_json(heads / "config.json", **{field: value})
    for info in (None, target[2]):
        with pytest.raises(HeadsLoadError, match="config.json: " + words.replace("(", r"\(").replace(".", r"\.")):
            load_heads(heads, info)


# ------------------------------------------------------------------------------------------ 12. tampered files


@pytest.mark.parametrize("ids, words", [
    (torch.tensor([0, 2, 4, 1_000_000]), "token ids 0..1000000, outside the vocabulary"),
    (torch.tensor([-1, 2, 4, 6]), "token ids -1..6, outside the vocabulary"),
    (torch.tensor([0, 4, 2, 6]), "distinct token ids in increasing order"),
    (torch.tensor([0.0, 2.0, 4.0, float("nan")]), "integer token ids"),
])
def test_a_token_map_out_of_range_is_refused_at_load(target, tmp_path, ids, words):
    heads = medusa_heads(tmp_path / "medusa", target[2], draft_vocab=4)
    edit_tensor(heads / "model.safetensors", "token_map", ids)
    with pytest.raises(HeadsLoadError, match=r"model\.safetensors: token_map .*" + words):
        load_heads(heads)


def test_an_eagle3_d2t_out_of_range_is_refused_at_load(target, tmp_path):
    heads = eagle3_heads(tmp_path / "eagle3", target[0], target[2])
    edit_tensor(heads / "model.safetensors", "d2t", torch.full((64,), 10_000))
    with pytest.raises(HeadsLoadError, match=r"d2t \(draft id \+ offset\) holds token ids .* outside the vocabulary"):
        load_heads(heads)


def test_dflash_feature_layers_beyond_the_target_are_refused(target, tmp_path):
    heads = dflash_heads(tmp_path / "dflash", target[0], target[2])
    edit_json(heads / "config.json", feature_layers=[99])
    with pytest.raises(HeadsLoadError, match=r"config\.json: feature_layers\[0\] is 99, but the target has 2 layers"):
        load_heads(heads)


def write_ngram(file: Path, keys: torch.Tensor, nxt: torch.Tensor, config: dict | None = None) -> None:
    save_file({"keys": keys, "next": nxt}, str(file), metadata={"config": json.dumps(config or {"max_n": 2})})


@pytest.mark.parametrize("keys, nxt, words", [
    (torch.tensor([[-1, 5]]), torch.tensor([1_000_000]), "next holds token ids 1000000..1000000, outside"),
    (torch.tensor([[-7, 5]]), torch.tensor([3]), "keys holds token ids -7..5, outside"),
    (torch.tensor([[-1.0, 5.0]]), torch.tensor([float("nan")]), "must hold int64 token ids"),
])
def test_ngram_ids_out_of_vocabulary_are_refused_at_load(target, tmp_path, keys, nxt, words):
    from headstart.inference.speculator import Speculator

    heads = medusa_heads(tmp_path / "medusa", target[2])
    write_ngram(heads / NGRAM_FILE, keys, nxt)
    with pytest.raises(SpeculatorError, match=r"ngram\.safetensors.*" + words):
        Speculator.from_pretrained(heads)


def test_ngram_config_fields_are_checked(tmp_path):
    file = tmp_path / NGRAM_FILE
    write_ngram(file, torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                {"max_n": 2, "min_share": "0.3"})
    with pytest.raises(HeadsLoadError, match="min_share must be a finite number"):
        NgramTable.load(file)


def tree_record(spec, **changes) -> dict:
    """A tree.json calibration record this Speculator would reuse (device, threads and kernels match)."""
    from headstart.inference.cpu_linear import linear_kernel

    record = {"choices": [[0], [0, 0]], "step_ms": {"1": 10.0, "3": 12.0}, "draft_ratio": {"0": 0.1}, "rounds": 9,
              "noisy": False, "device": "cpu", "linear": linear_kernel(spec.model), "threads": torch.get_num_threads(),
              "accuracy": [[0.5, 0.2], [0.3, 0.1]]}
    record.update(changes)
    return record


@pytest.mark.parametrize("changes, words", [
    ({"step_ms": {"1": 0.0, "3": 12.0}}, r"step_ms\[1\] is 0.0, outside"),
    ({"step_ms": {"1": float("nan"), "3": 12.0}}, r"step_ms\[1\] must be a finite number, got nan"),
    ({"step_ms": {"one": 10.0}}, r"step_ms key 'one' is not a tree size"),
    ({"draft_ratio": {"0": "fast"}}, r"draft_ratio\[0\] must be a finite number"),
    ({"accuracy": [[0.5, "x"]]}, r"accuracy\[0\]\[1\] must be a finite number"),
])
def test_a_tampered_tree_json_is_refused_at_load(target, tmp_path, changes, words):
    from headstart.inference.speculator import Speculator

    heads = medusa_heads(tmp_path / "medusa", target[2])
    spec = Speculator.from_pretrained(heads)
    (heads / "tree.json").write_text(json.dumps(tree_record(spec)))
    Speculator.from_pretrained(heads)  # the untampered record is reused
    (heads / "tree.json").write_text(json.dumps(tree_record(spec, **changes)))
    with pytest.raises(SpeculatorError, match=r"tree\.json: " + words):
        Speculator.from_pretrained(heads)


@pytest.mark.parametrize("metrics, words", [
    ({"rank_accuracy": [["x", 0.1]]}, r"rank_accuracy\[0\]\[0\] must be a finite number, got 'x'"),
    ({"top1": [0.5, "high"]}, r"top1\[1\] must be a finite number"),
    ({"rank_accuracy": [[7.0]]}, r"rank_accuracy\[0\]\[0\] is 7.0, outside 0.0..1.0"),
])
def test_strings_in_metrics_json_are_refused_at_load(target, tmp_path, metrics, words):
    from headstart.inference.speculator import Speculator

    heads = medusa_heads(tmp_path / "medusa", target[2])
    (heads / "metrics.json").write_text(json.dumps(metrics))
    with pytest.raises(SpeculatorError, match=r"metrics\.json: " + words):
        Speculator.from_pretrained(heads)


def test_strings_in_metrics_json_are_one_line_from_the_export_cli(target, tmp_path, capsys):
    heads = eagle3_heads(tmp_path / "eagle3", target[0], target[2])
    (heads / "metrics.json").write_text(json.dumps({"top1": [0.5, "x"], "chain_accepted_tokens": "lots"}))
    assert export_main([str(heads), str(tmp_path / "out")]) == 2
    assert_one_line_error(capsys.readouterr().err, "metrics.json: top1[1] must be a finite number", "delete metrics.json")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ 16. one line, not a traceback


def test_a_truncated_ngram_table_is_one_line_from_generate(target, tmp_path, capsys):
    from headstart.inference.generate import main

    heads = medusa_heads(tmp_path / "medusa", target[2])
    NgramTable({(1,): 2, (1, 2): 3}, NgramConfig(max_n=2)).save(heads / NGRAM_FILE)
    data = (heads / NGRAM_FILE).read_bytes()
    (heads / NGRAM_FILE).write_bytes(data[: len(data) - 9])
    assert main(["--heads", str(heads), "--prompt", "hi", "--max_new_tokens", "2"]) == 2
    assert_one_line_error(capsys.readouterr().err, "ngram.safetensors is not an n-gram table", "delete it")


def test_an_auto_map_target_is_one_line_and_runs_no_code(target, tmp_path, capsys):
    from headstart.inference.generate import main

    model_dir = tmp_path / "custom"
    model_dir.mkdir()
    marker = tmp_path / "ran"
    (model_dir / "config.json").write_text(json.dumps({
        "model_type": "custom-arch", "architectures": ["CustomForCausalLM"],
        "auto_map": {"AutoConfig": "custom.CustomConfig", "AutoModelForCausalLM": "custom.CustomForCausalLM"}}))
    (model_dir / "custom.py").write_text(f"import os\nos.mkdir({str(marker)!r})\n")
    with pytest.raises(TargetLoadError, match="needs its own Python code to load .*auto_map.*none ran"):
        load_target(str(model_dir))
    heads = medusa_heads(tmp_path / "medusa", target[2])
    assert main(["--heads", str(heads), "--prompt", "hi", "--target", str(model_dir)]) == 2
    assert_one_line_error(capsys.readouterr().err, "auto_map", "none ran")
    assert not marker.exists()


# ------------------------------------------------------------------------------------------ 18. n-gram size cap


def test_an_oversized_ngram_table_is_refused_from_its_header(tmp_path, monkeypatch):
    import headstart.inference.ngram as ngram

    monkeypatch.setattr(ngram, "MAX_NGRAM_ENTRIES", 100, raising=False)
    file = tmp_path / NGRAM_FILE
    write_ngram(file, torch.zeros(101, 2, dtype=torch.int64), torch.zeros(101, dtype=torch.int64))
    with pytest.raises(HeadsLoadError, match=r"ngram\.safetensors holds 101 entries, more than the 100"):
        NgramTable.load(file)
    write_ngram(file, torch.zeros(100, 2, dtype=torch.int64), torch.zeros(100, dtype=torch.int64))
    assert len(NgramTable.load(file).next_token) == 1  # at the cap: loads


# ------------------------------------------------------------------------------------------ 9. export commands


def commands(card: str) -> list[str]:
    """The lines of the card's bash block."""
    block = card.split("```bash\n", 1)[1].split("```", 1)[0]
    return block.strip().splitlines()


def test_an_export_never_prints_a_traversal_path_as_the_target(target, tmp_path, capsys):
    heads = eagle3_heads(tmp_path / "eagle3", target[0], target[2])
    edit_json(heads / "config.json", **{"target.name": "../../etc/passwd"})
    (heads / "metrics.json").write_text(json.dumps({"top1": [0.5] * 3}))
    out = tmp_path / "my export"
    assert export_main([str(heads), str(out)]) == 0
    printed = [line.strip() for line in capsys.readouterr().out.splitlines()[1:]]  # after "wrote ...; serve it with:"
    for line in printed + commands((out / "README.md").read_text()):
        assert "etc/passwd" not in line and line.split()[:3] == ["vllm", "serve", "TARGET"], line
        spec = shlex.split(line)[4]  # the argument after --speculative-config: one shell word
        assert json.loads(spec) == {"method": "eagle3", "model": str(out), "num_speculative_tokens": 3}
    with pytest.raises(ExportError, match="target_id '../../etc/passwd' is not a Hugging Face Hub id"):
        export_heads(heads, tmp_path / "out2", target_id="../../etc/passwd")


def test_an_export_bounds_num_speculative_tokens_by_the_heads(target, tmp_path):
    model, _, info = target
    heads = eagle3_heads(tmp_path / "eagle3", model, info)
    (heads / "metrics.json").write_text(json.dumps({"top1": [0.5] * 60}))  # within MAX_DEPTH, above the chain cap
    with pytest.raises(ExportError, match="num_speculative_tokens 60 is more than the 32"):
        export_heads(heads, tmp_path / "e1")
    for k in (100_000, 0, -3):
        with pytest.raises(ExportError, match="num_speculative_tokens"):
            export_heads(heads, tmp_path / "e2", num_speculative_tokens=k)
    (heads / "metrics.json").write_text(json.dumps({"top1": [0.5] * 100_000}))
    with pytest.raises(HeadsLoadError, match=r"metrics\.json: top1 has 100000 entries, more than 64"):
        export_heads(heads, tmp_path / "e3")
    dflash = dflash_heads(tmp_path / "dflash", model, info)
    with pytest.raises(ExportError, match="num_speculative_tokens 3, not 50"):
        export_heads(dflash, tmp_path / "d1", num_speculative_tokens=50, target=model)
    out = export_heads(dflash, tmp_path / "d2", target=model)
    card = (out / "README.md").read_text()
    note = json.loads((out / "export.json").read_text())["notes"]["block"]
    assert '"num_speculative_tokens": 3' in commands(card)[0] and note.startswith("serve with num_speculative_tokens 3 ")
    assert not any(p.exists() for p in (tmp_path / "e1", tmp_path / "e2", tmp_path / "e3", tmp_path / "d1"))
    shutil.rmtree(out)
