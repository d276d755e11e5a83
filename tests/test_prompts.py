import json

import pytest

from headstart.heads.prompts import PromptSourceError, load_prompts, parse_row, prompt_key


def test_every_schema_parses_and_malformed_rows_are_counted(tmp_path):
    rows = [
        {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"},
                           {"from": "gpt", "value": "hello"}, {"from": "human", "value": "bye"}]},
        {"messages": [{"role": "user", "content": "what is 2+2?"}, {"role": "assistant", "content": "4"}]},
        {"instruction": "Translate", "input": "bonjour"},
        {"prompt": "Write a haiku"},
        {"question_id": 81, "category": "writing", "turns": ["first turn", "second turn"]},
        {"turns": []},  # no user turns
        {"messages": "not a list"},
        {"unrelated": 1},
        {"prompt": 42},  # not text
        [1, 2],  # not an object
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n{broken json\n")
    source = load_prompts(str(path))
    assert [r.turns for r in source.rows] == [
        ["hi", "bye"], ["what is 2+2?"], ["Translate\n\nbonjour"], ["Write a haiku"], ["first turn", "second turn"]]
    assert source.rows[0].system == "be brief"
    assert source.rows[4].id == "81" and source.rows[4].category == "writing"
    assert dict(source.skipped) == {"no_user_turns": 1, "messages_not_a_list": 1, "no_known_fields": 1,
                                    "empty_or_non_text_turn": 1, "not_an_object": 1, "invalid_json_line": 1}


def test_json_list_file_and_limit(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"prompt": f"p{i}"} for i in range(5)]))
    assert [r.turns[0] for r in load_prompts(str(path), limit=3).rows] == ["p0", "p1", "p2"]


def test_embedded_sources_and_fixed_split():
    train, heldout = load_prompts("chitchat:train"), load_prompts("chitchat:heldout")
    train_ids, heldout_ids = {r.id for r in train.rows}, {r.id for r in heldout.rows}
    assert not train_ids & heldout_ids
    texts = {prompt_key(r.turns) for r in train.rows}
    assert len(texts) == len(train.rows) and not texts & {prompt_key(r.turns) for r in heldout.rows}
    # 7,168 conversations, one has no text, 1,125 repeat another's user turns (mostly a lone greeting)
    assert len(train_ids) + len(heldout_ids) == 6042
    assert 0.03 < len(heldout_ids) / 6042 < 0.07
    assert [r.id for r in load_prompts("chitchat:train", limit=5).rows] == [r.id for r in train.rows[:5]]
    code = load_prompts("pycode:train")
    assert len(code.rows) > 500 and code.rows[0].turns[0].startswith("Complete this Python function")
    modules = {r.id.split(".")[0] for r in code.rows[:50]}
    assert len(modules) > 20  # the first rows come from many modules, not the first file alphabetically


def test_mixed_sources_take_rows_in_turn():
    chat, code = load_prompts("chitchat:train", limit=3).rows, load_prompts("pycode:train", limit=3).rows
    mixed = load_prompts("chitchat:train+pycode:train", limit=5)
    assert [r.id for r in mixed.rows] == [chat[0].id, code[0].id, chat[1].id, code[1].id, chat[2].id]
    assert load_prompts("chitchat:train+pycode:train").skipped == load_prompts("chitchat:train").skipped


@pytest.mark.parametrize("spec, fragment", [
    ("nope", "unknown prompt source"),
    ("missing.jsonl", "does not exist"),
    ("chitchat:dev", "unknown split"),
    ("humaneval", "unknown prompt source"),  # no public benchmark set ships with headstart
    ("hf:", "needs a dataset name"),
])
def test_bad_sources_name_the_problem(spec, fragment):
    with pytest.raises(PromptSourceError, match=fragment):
        load_prompts(spec)


def test_unreachable_hf_dataset_says_how_to_work_offline():
    with pytest.raises(PromptSourceError, match="local .jsonl file"):
        load_prompts("hf:someone/not-cached:train")


def test_parse_row_reasons():
    assert parse_row({"messages": [{"role": "user", "content": ""}]}, 0) == (None, "empty_or_non_text_turn")
    row, reason = parse_row({"conversations": [{"from": "user", "value": "x"}]}, 3)
    assert reason == "" and row.id == "3" and row.turns == ["x"]
