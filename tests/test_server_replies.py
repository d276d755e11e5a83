"""Self-distillation never builds a row from a bad server reply (issue 45): ids outside the vocabulary, empty
completions and malformed replies are one clear error after the retry policy (nothing recorded as done, so a rerun
against a good server fills them), the request timeout is a total deadline, and the progress bar counts prompts.
The servers are tests/fake_openai.py on 127.0.0.1, switched to each bad reply after the client's probe."""

from __future__ import annotations

import re
import threading

import pytest

from headstart.heads.target import load_target
from test_safety import assert_one_line_error, cli
from test_selfdistill import tiny_cfg, write_prompts
import headstart.train.openai_engine as openai_engine
from headstart.train.engines import EngineError
from headstart.train.openai_engine import OpenAIEngine
from headstart.train.selfdistill import load_selfdistilled, run_selfdistill

# each malformed reply: the words its error names (the problem, then the fix)
MALFORMED = {
    "no_choices": ("a reply without choices", "vLLM >= 0.10.2"),
    "no_token_ids": ("no token_ids", "vLLM >= 0.10.2"),
    "null_token_ids": ("no token_ids", "vLLM >= 0.10.2"),
    "string_token_ids": ("a token id that is not an integer", "vLLM >= 0.10.2"),
    "negative_token_ids": ("token id -1, outside the target's vocabulary", "serve the target's own model directory"),
    "aborted": ("finish_reason 'abort'", "restart it"),
}


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    return load_target(str(tiny_target_dir))[1]


def engine_for(tiny_target_dir, tokenizer, server, clock=None, **kw):
    cfg = tiny_cfg(tiny_target_dir, "", "unused", backend="openai", server_url=[server.url], **kw)
    return OpenAIEngine(cfg, tokenizer, {tokenizer.eos_token_id}, **({} if clock is None else {"clock": clock}))


PROMPT = [5, 6, 7, 8]


# ------------------------------------------------------------------------------------ 6. ids outside the vocabulary


def test_out_of_vocabulary_ids_are_an_error_never_a_row(tiny_target_dir, tokenizer, fake):
    server = fake(reply="oov")  # [60000, 123456] before the real answer
    engine = engine_for(tiny_target_dir, tokenizer, server, max_retries=2)
    with pytest.raises(EngineError) as caught:
        engine.generate([PROMPT], [0])
    message = str(caught.value)
    assert server.url in message and f"token id 60000, outside the target's vocabulary (ids 0..{len(tokenizer) - 1})" \
        in message and "serve the target's own model directory" in message, message
    assert server.completions == 1 + 2  # the probe, then max_retries tries


# ------------------------------------------------------------------------------------------ 7. empty completions


def test_empty_completions_are_an_error_and_a_rerun_fills_them(tiny_target_dir, fake, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 4)
    out = tmp_path / "o"
    empty = fake(reply="empty")
    proc = cli("train/selfdistill.py", "--target", tiny_target_dir, "--prompts", prompts, "--output_dir", out,
               "--max_new_tokens", "6", "--max_length", "256", "--batch_size", "2", "--backend", "openai",
               "--server_url", empty.url, "--max_retries", "2")
    assert_one_line_error(proc, empty.url, "an empty completion", "restart it")
    assert not list((out / "parts").glob("batch_*.json")) and not (out / "dataset").exists()  # nothing marked done

    good = fake()
    run_selfdistill(tiny_cfg(tiny_target_dir, prompts, out, max_new_tokens=6, batch_size=2, backend="openai",
                             server_url=[good.url]))
    dataset, meta = load_selfdistilled(out)
    assert len(dataset) == 4 and meta["rows"] == 4
    assert all(sum(row["loss_mask"]) > 0 for row in dataset)


# ------------------------------------------------------------------------------------------ 14. malformed replies


@pytest.mark.parametrize("mode", sorted(MALFORMED))
def test_malformed_replies_are_one_error_after_retries(tiny_target_dir, tokenizer, fake, mode):
    server = fake(reply=mode)
    engine = engine_for(tiny_target_dir, tokenizer, server, max_retries=2)
    with pytest.raises(EngineError) as caught:
        engine.generate([PROMPT], [0])
    message = str(caught.value)
    assert server.url in message and all(words in message for words in MALFORMED[mode]), message
    assert "\n" not in message
    assert server.completions == 1 + 2  # the probe, then max_retries tries


@pytest.mark.parametrize("mode", sorted(MALFORMED) + ["oov", "empty"])
def test_malformed_probe_reply_is_refused_before_any_prompt(tiny_target_dir, tokenizer, fake, mode):
    server = fake(reply=mode, bad_from=0)
    with pytest.raises(EngineError, match=server.url):
        engine_for(tiny_target_dir, tokenizer, server)


def test_malformed_reply_cli_exits_2_in_one_line(tiny_target_dir, fake, tmp_path):
    server = fake(reply="null_token_ids")
    proc = cli("train/selfdistill.py", "--target", tiny_target_dir, "--prompts",
               write_prompts(tmp_path / "p.jsonl", 2, turns=1), "--output_dir", tmp_path / "o", "--max_new_tokens",
               "4", "--max_length", "256", "--backend", "openai", "--server_url", server.url, "--max_retries", "1")
    assert_one_line_error(proc, server.url, "no token_ids", "vLLM >= 0.10.2")


def test_every_reply_number_is_checked():
    BadReply, completion_token_ids = openai_engine.BadReply, openai_engine.completion_token_ids

    def reply(token_ids, finish_reason="stop"):
        return {"choices": [{"token_ids": token_ids, "finish_reason": finish_reason}]}

    assert completion_token_ids(reply([3, 4, 9]), vocab_size=10, max_tokens=3) == [3, 4, 9]
    assert completion_token_ids(reply([3, 4, 9], "length"), vocab_size=10, max_tokens=3) == [3, 4, 9]
    bad = {
        "a token id that is not an integer (True)": reply([True]),
        "a token id that is not an integer (2.0)": reply([2.0]),
        "token id 10, outside the target's vocabulary (ids 0..9)": reply([10]),
        "4 token ids for max_tokens 3": reply([1, 2, 3, 4]),
        "finish_reason None": reply([1], None),
        'token_ids that are not a list ("1 2")': reply("1 2"),
        "a reply without choices": {"choices": {"token_ids": [1]}},
    }
    for problem, body in bad.items():
        with pytest.raises(BadReply, match=re.escape(problem)):
            completion_token_ids(body, vocab_size=10, max_tokens=3)
    with pytest.raises(BadReply, match="a reply without choices"):
        completion_token_ids([1, 2], vocab_size=10, max_tokens=3)


def test_garbage_model_card_is_one_error(tiny_target_dir, tokenizer, fake):
    server = fake(max_model_len="4096")
    with pytest.raises(EngineError, match=r"max_model_len '4096'.*not a positive integer"):
        engine_for(tiny_target_dir, tokenizer, server)


# ------------------------------------------------------------------------------------------ 15. a dripping server


def test_request_timeout_is_a_total_deadline(tiny_target_dir, tokenizer, fake):
    """The reply arrives one byte every 10 ms, forever. The engine's clock is the count of bytes dripped, so the
    5 "second" deadline passes after 5 bytes however fast this machine is (a per-read timeout never would)."""
    server = fake(reply="drip")
    engine = engine_for(tiny_target_dir, tokenizer, server, request_timeout_s=5, max_retries=1,
                        clock=lambda: float(server.dripped))
    outcome = {}

    def ask():
        try:
            outcome["answer"] = engine.generate([PROMPT], [0])
        except Exception as err:  # noqa: BLE001 (checked below)
            outcome["error"] = err

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    asker.join(timeout=1800)  # a guard against a hang, not the result: the result is the error below
    assert not asker.is_alive(), "the request outlived its deadline"
    error = outcome.get("error")
    assert isinstance(error, EngineError), outcome
    assert f"{server.url}: no complete reply within 5 s" in str(error) and "--request_timeout_s" in str(error)
    assert server.dripped >= 5


# ------------------------------------------------------------------------------------------ 20. progress counts prompts


class RecordingBar:
    """tqdm's stand-in: what a run's progress bar was told."""

    made: list["RecordingBar"] = []

    def __init__(self, total=None, unit="it", **kwargs):
        self.total, self.unit, self.updates = total, unit, []
        RecordingBar.made.append(self)

    def update(self, n=1):
        self.updates.append(n)

    def set_postfix(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_progress_bar_counts_prompts_as_they_are_answered(tiny_target_dir, tmp_path, monkeypatch):
    import headstart.train.selfdistill as selfdistill

    RecordingBar.made = []
    monkeypatch.setattr(selfdistill, "tqdm", RecordingBar)
    prompts = write_prompts(tmp_path / "p.jsonl", 5)  # 5 conversations of 2 user turns, 3 batches, 1 engine call
    run_selfdistill(tiny_cfg(tiny_target_dir, prompts, tmp_path / "o", max_new_tokens=4))
    (bar,) = RecordingBar.made
    assert (bar.total, bar.unit) == (10, "prompt")
    assert bar.updates == [1] * 10  # one per answer as it comes, not one per engine call
