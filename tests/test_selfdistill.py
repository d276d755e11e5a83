import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from headstart.heads.prompts import PromptRow
from headstart.heads.target import TargetLoadError, load_target
from headstart.train.config import ConfigError, parse_config
from headstart.heads.chat import stop_token_ids
from headstart.train.engines import HFEngine
from headstart.train.data import DataError
from headstart.train.selfdistill import (SelfDistillConfig, deal_batches, distill_batches, load_selfdistilled, render_with_mask,
                               row_cost, run_selfdistill)

REPO = Path(__file__).resolve().parents[1]


def masked_spans(input_ids, loss_mask):
    spans, current = [], []
    for token, keep in zip(input_ids, loss_mask):
        if keep:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    return spans + ([current] if current else [])


def check_mask_matches_answers(tokenizer, records, eos_ids, same_tokens=False):
    """Each masked span decodes to exactly one generated answer (plus the target's own end-of-turn token).

    With `same_tokens`, the rendered answers also tokenize back to as many tokens as the target generated
    (true for a real model's fluent text; a random model's byte soup re-tokenizes differently)."""
    assert records
    for record in records:
        answers = [m["content"] for m in record["conversation"] if m["role"] == "assistant"]
        spans = masked_spans(record["input_ids"], record["loss_mask"])
        assert len(spans) == len(answers)
        for span, answer in zip(spans, answers):
            body = span[:-1] if span[-1] in eos_ids else span
            assert tokenizer.decode(body) == answer
        if same_tokens:
            assert sum(record["loss_mask"]) == record["num_generated"]


def write_prompts(path, n, turns=2):
    rows = [{"id": f"r{i}", "turns": [f"hello there number {i}, how are you?", "tell me a story"][:turns]}
            for i in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def tiny_cfg(target_dir, prompts, out, **kw):
    settings = dict(target=str(target_dir), prompts=prompts, output_dir=str(out), num_prompts=None, max_turns=2,
                    max_new_tokens=12, max_length=256, batch_size=3, device="cpu")
    settings.update(kw)
    return SelfDistillConfig(**settings)


def read_rows(out):
    dataset, meta = load_selfdistilled(out)
    return [(r["id"], r["input_ids"], r["loss_mask"]) for r in dataset], meta


def test_loss_mask_llama3_style_template(tiny_target_dir, tmp_path):
    model, tokenizer, _ = load_target(str(tiny_target_dir))
    eos = set(stop_token_ids(tokenizer, model.generation_config))
    rows = [PromptRow(id=str(i), turns=["hello there", "tell me a story"]) for i in range(3)]
    cfg = tiny_cfg(tiny_target_dir, "", tmp_path)
    records, skipped, generated = distill_batches(HFEngine(model, cfg, eos), tokenizer, {0: rows}, cfg, eos)[0]
    check_mask_matches_answers(tokenizer, records, eos)
    assert generated == sum(r["num_generated"] for r in records)
    # user turns and template tokens are never supervised
    record = records[0]
    user_ids = tokenizer("hello there", add_special_tokens=False)["input_ids"]
    first = next(i for i in range(len(record["input_ids"])) if record["input_ids"][i:i + len(user_ids)] == user_ids)
    assert not any(record["loss_mask"][:first + len(user_ids)])


def test_loss_mask_smollm2_template_on_embedded_target(embedded_target, tmp_path):
    model, tokenizer, _ = embedded_target
    eos = set(stop_token_ids(tokenizer, model.generation_config))
    rows = [PromptRow(id="a", turns=["Hi! How are you?", "What is your name?"]), PromptRow(id="b", turns=["Say hello."])]
    cfg = SelfDistillConfig(max_new_tokens=24, batch_size=2)
    records, _, _ = distill_batches(HFEngine(model, cfg, eos), tokenizer, {0: rows}, cfg, eos)[0]
    check_mask_matches_answers(tokenizer, records, eos, same_tokens=True)
    assert any(r["loss_mask"][-2] == 1 and r["input_ids"][-2] in eos for r in records)  # a real EOS kept


def test_render_with_mask_keeps_eos_only_when_target_wrote_it(tiny_target_dir):
    _, tokenizer, _ = load_target(str(tiny_target_dir))
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "fine thanks"}]
    eos = {tokenizer.eos_token_id}
    ids, mask_eos = render_with_mask(tokenizer, messages, [True], eos)
    _, mask_cut = render_with_mask(tokenizer, messages, [False], eos)
    assert ids[-1] == tokenizer.eos_token_id and mask_eos[-1] == 1 and mask_cut[-1] == 0
    assert mask_eos[:-1] == mask_cut[:-1]


# Runs train/selfdistill.py in a process that SIGKILLs itself right after writing its second batch file: a crash at
# a known point, not a timer.
KILLED_AFTER_TWO_BATCHES = """
import os, signal, sys
import headstart.train.selfdistill as sd
write, batches = sd._write_json_atomic, []
def write_then_die(path, payload):
    write(path, payload)
    if path.name.startswith("batch_"):
        batches.append(path.name)
    if len(batches) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
sd._write_json_atomic = write_then_die
sd.main(sys.argv[1:])
"""


def test_run_is_resumable_after_sigkill(tiny_target_dir, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 12)
    run_selfdistill(tiny_cfg(tiny_target_dir, prompts, tmp_path / "full"))
    expected, meta = read_rows(tmp_path / "full")
    assert len(expected) == 12 and meta["rows"] == 12

    out = tmp_path / "killed"
    args = ["--target", str(tiny_target_dir), "--prompts", prompts, "--output_dir", str(out), "--num_prompts", "12",
            "--max_new_tokens", "12", "--max_length", "256", "--batch_size", "3", "--device", "cpu"]  # 4 batches
    env = dict(os.environ, PYTHONPATH=str(REPO))
    killed = subprocess.run([sys.executable, "-c", KILLED_AFTER_TWO_BATCHES, *args], env=env, capture_output=True)
    assert killed.returncode == -signal.SIGKILL
    assert sorted(p.name for p in (out / "parts").glob("batch_*.json")) == ["batch_000000.json", "batch_000001.json"]
    assert not (out / "dataset").exists()
    rerun = subprocess.run([sys.executable, str(REPO / "train/selfdistill.py"), *args], env=env, check=True,
                           capture_output=True, text=True)
    assert "resuming: 2 of 4 batches already done" in rerun.stdout  # the finished batches were not redone
    resumed, _ = read_rows(out)
    assert resumed == expected


def test_two_processes_give_the_same_rows_as_one(tiny_target_dir, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 8)
    run_selfdistill(tiny_cfg(tiny_target_dir, prompts, tmp_path / "one"))
    one, _ = read_rows(tmp_path / "one")
    cmd = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", str(REPO / "train/selfdistill.py"),
           "--target", str(tiny_target_dir), "--prompts", prompts, "--output_dir", str(tmp_path / "two"),
           "--num_prompts", "8", "--max_new_tokens", "12", "--max_length", "256", "--batch_size", "3"]
    result = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert result.returncode == 0, result.stderr[-3000:]
    two, meta = read_rows(tmp_path / "two")
    assert meta["this_run"]["processes"] == 2
    assert two == one


def test_batches_are_dealt_by_cost_so_processes_finish_together():
    # a 512-token prompt (2,048 characters) and 128 answer tokens, each weighted by 1 + its mean context / 2048
    assert row_cost(["abcd" * 512], 128) == 512 * (1 + 256 / 2048) + 128 * (1 + (512 + 64) / 2048)
    # a second turn's prompt and answer sit on the first turn's context
    assert row_cost(["abcd" * 512, "abcd" * 4], 128) == row_cost(["abcd" * 512], 128) + 4 * (1 + (640 + 2) / 2048) \
        + 128 * (1 + (644 + 64) / 2048)
    # one long-context batch and five short ones: dealt k % 2 the loads would be 7 / 3; by cost they are 5 / 5
    assert deal_batches([5.0, 1.0, 1.0, 1.0, 1.0, 1.0], 2) == [0, 1, 1, 1, 1, 1]
    owner = deal_batches([3.0, 9.0, 1.0, 4.0, 4.0, 2.0, 7.0], 3)
    assert owner == [1, 0, 0, 2, 2, 2, 1]  # costliest first, each to the least-loaded process: loads 10 / 10 / 10
    assert deal_batches([2.0, 2.0], 1) == [0, 0]


def test_rerun_with_other_settings_is_refused(tiny_target_dir, tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 2, turns=1)
    run_selfdistill(tiny_cfg(tiny_target_dir, prompts, tmp_path / "o"))
    with pytest.raises(ValueError, match="other settings.*max_new_tokens"):
        run_selfdistill(tiny_cfg(tiny_target_dir, prompts, tmp_path / "o", max_new_tokens=5))


def test_malformed_rows_and_long_prompts_are_skipped_and_counted(tiny_target_dir, tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [json.dumps({"prompt": "hello there"}), "{not json", json.dumps({"prompt": ""}),
             json.dumps({"prompt": "hello " * 300}), json.dumps({"turns": ["hi", "long " * 200]})]
    path.write_text("\n".join(lines))
    run_selfdistill(tiny_cfg(tiny_target_dir, str(path), tmp_path / "o", max_length=200))
    dataset, meta = load_selfdistilled(tmp_path / "o")
    assert meta["skipped"]["invalid_json_line"] == 1
    assert meta["skipped"]["empty_or_non_text_turn"] == 1
    assert meta["skipped"]["prompt_too_long"] == 1
    assert meta["skipped"]["turns_cut_by_max_length"] == 1
    assert len(dataset) == 2 and meta["rows"] == 2


def test_tokenizer_without_chat_template_is_a_clear_error(tiny_target_dir, tmp_path):
    import shutil

    target = tmp_path / "no-template"
    shutil.copytree(tiny_target_dir, target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in target.glob("chat_template.*"):
        extra.unlink()
    prompts = write_prompts(tmp_path / "p.jsonl", 1, turns=1)
    with pytest.raises(ValueError, match="no chat template.*chat_template in the recipe"):
        run_selfdistill(tiny_cfg(target, prompts, tmp_path / "o"))


def test_unknown_target_and_offline_hub_id_are_clear_errors():
    with pytest.raises(TargetLoadError, match="neither an existing model directory"):
        load_target("./no/such/dir")
    with pytest.raises(TargetLoadError, match="no local copy.*smollm2-135m"):
        load_target("someone/not-cached-model")


def test_recipe_unknown_key_and_cli_override(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("num_prompts: 5\nbatch_size: 2\n")
    cfg = parse_config(SelfDistillConfig, ["--config", str(recipe), "--batch_size", "4"])
    assert (cfg.num_prompts, cfg.batch_size, cfg.target) == (5, 4, "smollm2-135m")
    recipe.write_text("num_prompt: 5\n")
    with pytest.raises(ConfigError, match="unknown key.*num_prompt"):
        parse_config(SelfDistillConfig, ["--config", str(recipe)])
    with pytest.raises(ConfigError, match="--bogus"):
        parse_config(SelfDistillConfig, ["--bogus", "1"])


def test_a_run_with_no_conversation_is_an_error_not_an_empty_dataset(tiny_target_dir, tmp_path):
    """Every prompt too long for max_length: no row comes out, which is a DataError naming the skips (exit 2 from the
    script), never 'wrote 0 conversations' with an empty dataset that training then fails on."""
    cfg = tiny_cfg(tiny_target_dir, write_prompts(tmp_path / "p.jsonl", 3), tmp_path / "out", max_length=4)
    with pytest.raises(DataError, match=r"no conversation came out of 3 prompts .*prompt_too_long"):
        run_selfdistill(cfg)
    assert not (tmp_path / "out" / "dataset").exists() and not (tmp_path / "out" / "meta.json").exists()


@pytest.mark.parametrize("flag, value", [("max_new_tokens", 0), ("max_length", 0), ("max_retries", 0),
                                         ("temperature", -0.5), ("temperature", float("nan")), ("top_p", 0.0),
                                         ("top_p", 1.5), ("request_timeout_s", 0.0), ("gpu_memory_utilization", 2.0)])
def test_bad_generation_flags_are_refused_before_anything_runs(tmp_path, flag, value):
    """Self-distillation's numbers are checked like the trainers' (train/config.py check_number): one line naming the
    flag, nothing written."""
    from headstart.train.selfdistill import check_selfdistill_config

    cfg = tiny_cfg("unused", "", tmp_path / "out", **{flag: value})
    with pytest.raises(ConfigError, match=rf"^{flag} must be a number .*pass another --{flag}$"):
        check_selfdistill_config(cfg)
    assert not (tmp_path / "out").exists()
