"""headstart's self-distilled rows -> speculators 0.9.0's offline training format, the same rows headstart trains on
and holds out (train/loop.py prepare_rows: the last `eval_rows` rows held out, the first `train_rows` of the rest,
each cut to max_length, rows with no target-written token dropped).

OUT (a new or empty directory):
  the root        a HF datasets dir (input_ids, loss_mask, seq_len): training rows, then held-out rows (speculators'
                  val split, never trained on: pass --train-data-ratio from OUT/info.json)
  hidden_states/hs_{i}.safetensors  {"hidden_states": [T, taps + 1, h]: HF hidden_states[i] of each tap, then the
                  last decoder layer's output before the final norm (speculators applies the verifier's norm),
                  "token_ids": [T]}
  token_freq.pt   token counts of the training rows' target-written tokens; info.json

    SPEC_PYTHON scripts/speculators_dflash/prepare.py --data_dir runs/sd --train_rows 89 --eval_rows 16 --out ref/data
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from datasets import Dataset
from safetensors.torch import save_file

from headstart.heads.target import load_target
from headstart.train.dflash import DFlashTrainConfig
from headstart.train.loop import ensure_data, prepare_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--data_dir", required=True, help="a headstart self-distillation (train/selfdistill.py)")
    parser.add_argument("--train_rows", type=int, default=-1)
    parser.add_argument("--eval_rows", type=int, default=16)
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument("--layers", type=int, nargs="+", default=None,
                        help="HF hidden_states indices (default speculators': 2, L // 2, L - 3)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        sys.exit(f"error: {out} is not empty: give a new or empty directory for the converted rows")

    config = DFlashTrainConfig(data_dir=args.data_dir, train_rows=args.train_rows, eval_rows=args.eval_rows,
                               max_length=args.max_length, output_dir=str(out))
    dataset, meta = ensure_data(config)
    target, _, info = load_target(args.target, "float32", "cpu")
    target.requires_grad_(False)
    num_layers = target.config.num_hidden_layers
    layers = args.layers or [2, num_layers // 2, num_layers - 3]
    train_rows, eval_rows, stats = prepare_rows(dataset, meta, info, config)

    (out / "hidden_states").mkdir(parents=True, exist_ok=True)
    pre_norm = {}
    decoder = target.get_decoder()
    hook = decoder.norm.register_forward_hook(lambda module, inputs, output: pre_norm.__setitem__("x", inputs[0]))
    rows = train_rows + eval_rows
    for i, row in enumerate(rows):
        ids = torch.tensor(row["input_ids"])[None]  # [1, T]
        with torch.no_grad():
            states = decoder(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True,
                             use_cache=False).hidden_states
        stack = torch.stack([states[k][0] for k in layers] + [pre_norm["x"][0]], dim=1).contiguous()  # [T, taps+1, h]
        save_file({"hidden_states": stack, "token_ids": ids[0].clone()},
                  str(out / "hidden_states" / f"hs_{i}.safetensors"))
    hook.remove()
    Dataset.from_dict({"input_ids": [r["input_ids"] for r in rows], "loss_mask": [r["loss_mask"] for r in rows],
                       "seq_len": [len(r["input_ids"]) for r in rows]}).with_format("torch").save_to_disk(str(out))

    counts = torch.zeros(info.vocab_size, dtype=torch.long)
    for row in train_rows:
        ids = torch.tensor(row["input_ids"])[torch.tensor(row["loss_mask"]).bool()]
        counts += torch.bincount(ids, minlength=info.vocab_size)
    torch.save(counts, out / "token_freq.pt")
    n, m = len(train_rows), len(eval_rows)
    ratio = (n + 0.5) / (n + m)  # int((n + m) * ratio) == n: speculators' train split is exactly the training rows
    summary = {"train_rows": n, "eval_rows": m, "train_data_ratio": ratio, "layers": layers, "stats": stats,
               "train_tokens": sum(len(r["input_ids"]) for r in train_rows),
               "lengths": [len(r["input_ids"]) for r in train_rows]}
    (out / "info.json").write_text(json.dumps(summary))
    print({k: v for k, v in summary.items() if k != "lengths"})


if __name__ == "__main__":
    main()
