"""Shared fixtures: tiny random models (2 layers, hidden 64) built from a config, no download."""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the network (set before huggingface_hub loads)
os.environ.setdefault("WANDB_MODE", "offline")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

TINY_DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024)


def tiny_model(model_type: str = "llama", vocab_size: int = 128, seed: int = 0, **overrides):
    """A tiny random causal LM of a real architecture (llama, qwen2, qwen3, mistral, gemma), fp32, eval mode."""
    torch.manual_seed(seed)
    kwargs = dict(TINY_DIMS, vocab_size=vocab_size, tie_word_embeddings=False)
    if model_type == "gemma":
        kwargs["head_dim"] = 16
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


@contextlib.contextmanager
def no_model_built():
    """Inside: loading a transformers model (from_pretrained), or building one anywhere but on the meta device (no
    memory), fails the test."""
    from unittest import mock

    from transformers import PreTrainedModel

    init = PreTrainedModel.__init__

    def meta_only(self, *args, **kwargs):
        assert torch.get_default_device().type == "meta", f"{type(self).__name__} built off the meta device"
        init(self, *args, **kwargs)

    def refuse(cls, *args, **kwargs):
        raise AssertionError(f"{cls.__name__}.from_pretrained: a model was loaded")

    with mock.patch.object(PreTrainedModel, "__init__", meta_only), \
            mock.patch.object(PreTrainedModel, "from_pretrained", classmethod(refuse)):
        yield


@pytest.fixture
def one_thread():
    """Tiny models run faster, and steadier on a shared 2-core machine, on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


LLAMA3_STYLE_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
TINY_CORPUS = [
    "hello there, how are you doing today?", "I am fine, thanks for asking. What about you?",
    "def add(a, b):\n    return a + b", "The quick brown fox jumps over the lazy dog.",
    "Tell me a story about a dragon and a knight.", "Once upon a time there was a small village.",
] * 20


def tiny_chat_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on a few sentences, with a Llama-3-style chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TINY_CORPUS, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                      pad_token="<|eot_id|>")
    wrapped.chat_template = LLAMA3_STYLE_TEMPLATE
    return wrapped


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    """A saved tiny Llama target with a Llama-3-style chat tokenizer, loadable by headstart.heads.target.load_target."""
    path = tmp_path_factory.mktemp("tiny-target")
    tokenizer = tiny_chat_tokenizer()
    model = tiny_model("llama", vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def embedded_target():
    """The real embedded default (SmolLM2-135M-Instruct), loaded once per session."""
    from headstart.heads.target import load_target

    return load_target("smollm2-135m")


@pytest.fixture
def launch():
    """Start training scripts in subprocesses (e.g. `accelerate launch --num_processes 2`) that cannot hang a test.

        proc = launch.start([sys.executable, "-m", "accelerate.commands.launch", ...], env=env, cwd=tmp_path)
        output = launch.wait(proc, timeout=1800)     # fails the test with the output if rc != 0 or on timeout

    Every launched script gets HEADSTART_WATCHDOG_S (train/loop.py: a process still running then prints all its
    threads' Python stacks and exits), set below the timeout; on timeout the launcher and every process under it
    (torchrun starts workers in sessions of their own) are killed, and the captured output, stacks included,
    is in the failure message. Processes still running at teardown are killed the same way.
    """
    import subprocess
    import types

    import psutil

    started = []

    def kill_tree(proc):
        try:
            family = psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]
        except psutil.NoSuchProcess:
            return
        for p in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()

    def start(cmd, env, cwd, watchdog_s: float = 1500):
        proc = subprocess.Popen([str(c) for c in cmd], env={**env, "HEADSTART_WATCHDOG_S": str(watchdog_s)}, cwd=cwd,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        started.append(proc)
        return proc

    def wait(proc, timeout: float = 1800) -> str:
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            output, _ = proc.communicate()
            pytest.fail(f"{' '.join(proc.args[:6])} ... still running after {timeout} s (killed); output:\n{output[-12000:]}")
        assert proc.returncode == 0, f"rc {proc.returncode}; output:\n{output[-12000:]}"
        return output

    yield types.SimpleNamespace(start=start, wait=wait)
    for proc in started:
        if proc.poll() is None:
            kill_tree(proc)
            proc.communicate()


def exact_first_three(model, prompt: torch.Tensor) -> torch.Tensor:
    """The target's exact joint distribution [V, V, V] of its first three sampled tokens after `prompt` (temperature 1;
    a tiny vocabulary: V**2 continuations are scored)."""
    import itertools

    V, n = model.config.vocab_size, prompt.numel()
    conts = torch.tensor(list(itertools.product(range(V), range(V))))  # [V*V, 2]
    with torch.no_grad():
        logp = model(torch.cat([prompt.expand(V * V, -1), conts], 1)).logits.double().log_softmax(-1)
    exact = torch.zeros(V, V, V, dtype=torch.float64)
    for row, (t1, t2) in enumerate(conts.tolist()):
        exact[t1, t2] = (logp[row, n - 1, t1] + logp[row, n, t2] + logp[row, n + 1]).exp()
    return exact


def chi_square_pvalue(counts: torch.Tensor, exact: torch.Tensor) -> float:
    """Pearson chi-square p-value of observed counts against exact probabilities (same shape); cells expecting fewer
    than 5 draws are pooled into one."""
    from scipy.stats import chi2

    expected = exact.reshape(-1) * float(counts.sum())
    observed = counts.reshape(-1).double()
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    return float(chi2.sf(float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1))


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1.5 MB tmpfs (root only): a real full disk, torch's own error included."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1500k", "tmpfs", str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root; the monkeypatched full-disk tests cover the same write paths")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.fixture
def fake(tiny_target_dir):
    """fake(**settings) -> a started in-thread FakeServer (tests/fake_openai.py) on the tiny target; all stopped at
    teardown."""
    from fake_openai import FakeServer, FakeSettings

    started = []

    def start(**settings):
        started.append(FakeServer(tiny_target_dir, FakeSettings(**settings)).start())
        return started[-1]

    yield start
    for server in started:
        server.stop()
