"""One command from prompts to heads: train/medusa.py self-distils first when its data_dir is empty."""

import json

from headstart.heads.load import load_heads
from headstart.train.medusa import main as medusa_main
from headstart.train.selfdistill import load_selfdistilled


def test_medusa_self_distils_first_when_data_is_missing(tiny_target_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"p{i}", "turns": [f"hello there {i}", "tell me a story"]})
                                 for i in range(10)))
    recipe = tmp_path / "selfdistill.yaml"
    recipe.write_text(f"prompts: {prompts}\nmax_turns: 2\nmax_new_tokens: 10\nmax_length: 256\nbatch_size: 4\n"
                      "device: cpu\n")
    data_dir, out = tmp_path / "sd", tmp_path / "medusa"
    medusa_main(["--target", str(tiny_target_dir), "--data_dir", str(data_dir), "--selfdistill_recipe", str(recipe),
                 "--num_prompts", "8", "--output_dir", str(out), "--num_heads", "2", "--per_device_batch_size", "2",
                 "--eval_rows", "2", "--max_steps", "2"])
    dataset, meta = load_selfdistilled(data_dir)
    assert len(dataset) == 8 and meta["generation"]["num_prompts"] == 8 and meta["generation"]["max_new_tokens"] == 10
    assert meta["target"]["name"] == str(tiny_target_dir)
    heads = load_heads(out / "heads")
    assert heads.config.num_heads == 2 and heads.config.target["fingerprint"] == meta["target"]["fingerprint"]
    metrics = json.loads((out / "heads" / "metrics.json").read_text())
    assert metrics["steps"] == 2 and len(metrics["top1"]) == 2
