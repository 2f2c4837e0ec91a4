#!/usr/bin/env bash
# The Kimi-K2.5 code path at reduced shape on 2 GPUs (docs/KIMI.md): SGLang at TP 2 with dummy
# weights as the co-located engine of two DeepSpeed draft trainer ranks; everything the run
# shows lands under OUT (result.json, train.log, plan.txt, ...).
#
#   launch/kimi_reduced_run.sh OUT          # on 2 x H200 (after launch/device_run.sh setup-*), ~4 minutes
#   launch/kimi_reduced_run.sh OUT --dry    # any machine: writes the config, prints the plans and the commands
#
# Knobs (environment): LAYERS=5 EXPERTS=16 AUX=[1,2,3] TOKENS=8192 MAX_STEPS=300 TRAIN_S=60
# TIMEOUT_S=420 PYTHON=python3. The steps: write the target dir (launch/kimi_reduced.py, with the
# random embed + lm_head the trainer reads); the memory plans (models.memory_plan) of this run and
# of the full shape at TP 8; the training run under a watcher (launch/kimi_reduced_report.py
# watch: /proc/<pid>/io and nvidia-smi every second); serving.verify of the SGLang export with
# the DeepSeek aux-id rule; the report (result.json).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 OUT [--dry]" >&2; exit 2; }
OUT=$(realpath -m "$1"); DRY=${2:-}
[ -z "$DRY" ] || [ "$DRY" = --dry ] || { echo "$0: unknown option $DRY (only --dry)" >&2; exit 2; }
cd "$(dirname "$0")/.."
if [ -d /tmp/site ]; then  # the installs and caches of launch/device_run.sh on a bare GPU machine
  export PYTHONPATH="/tmp/site:/tmp/site2:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  export STREAMDRAFT_CACHE=${STREAMDRAFT_CACHE:-/tmp/streamdraft-cache} TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch-ext}
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled
PY=${PYTHON:-python3}
LAYERS=${LAYERS:-5} EXPERTS=${EXPERTS:-16} AUX=${AUX:-[1,2,3]} TOKENS=${TOKENS:-8192}
MAX_STEPS=${MAX_STEPS:-300} TRAIN_S=${TRAIN_S:-60} TIMEOUT_S=${TIMEOUT_S:-420}
POOL=$((3 * TOKENS))  # SGLang KV pool: one TP-2 prefill is 2 x TOKENS tokens, plus half of that as headroom
T="$OUT/target"
mkdir -p "$OUT"

TRAIN=("$PY" -m deepspeed.launcher.runner --num_gpus 2 --no_local_rank launch/train_measured.py
  engine=sglang target=local "target.path=$T" "target.aux_layer_ids=$AUX" target.dtype=bfloat16
  engine.sglang.tp_size=2 engine.sglang.load_format=dummy engine.sglang.attention_backend=triton
  engine.sglang.mem_fraction_static=0.15 "engine.sglang.max_total_tokens=$POOL"
  "data.max_tokens=$TOKENS" data.max_len=2048 data.packing=true data.epoch_samples=40000 draft.vocab_size=32000
  trainer.epochs=1 "trainer.max_steps=$MAX_STEPS" "trainer.max_time_s=$TRAIN_S" trainer.log_every=5
  trainer.eval_batches=1 trainer.eval_prompts=2 trainer.eval_max_new_tokens=16 wandb.mode=disabled "hydra.run.dir=$OUT/run")
VERIFY=("$PY" -m serving.verify "$OUT/run/export/sglang" --engine sglang --target "$T")
# the trainer on this checkout: does load_target read the head by name, or load the whole target?
TRAINER_TARGET=()
grep -q "TargetHead" trainer/target_setup.py || TRAINER_TARGET=(--hf-target-in-trainer)

if [ "$DRY" = --dry ]; then
  "$PY" launch/kimi_reduced.py "$T" --layers "$LAYERS" --experts "$EXPERTS"
else
  "$PY" launch/kimi_reduced.py "$T" --layers "$LAYERS" --experts "$EXPERTS" --with-head
fi
"$PY" launch/kimi_reduced.py "$OUT/kimi-full" --full
"$PY" -m models.memory_plan --config "$T" --tp 2 --tokens "$TOKENS" --ranks 2 --max-total-tokens "$POOL" \
  "${TRAINER_TARGET[@]}" --json "$OUT/plan.json" | tee "$OUT/plan.txt"
"$PY" -m models.memory_plan --config "$OUT/kimi-full" --tp 8 --tokens 8192 --ranks 8 --json "$OUT/plan_full.json" | tee "$OUT/plan_full.txt"

if [ "$DRY" = --dry ]; then
  echo "dry run: the commands the GPU run executes"
  echo "STREAMDRAFT_MEASURE_DIR=$OUT/measure timeout -k 30 $TIMEOUT_S ${TRAIN[*]}"
  echo "$PY launch/kimi_reduced_report.py watch --pid <the training command's pid> --out $OUT/watch.json"
  echo "${VERIFY[*]}"
  echo "$PY launch/kimi_reduced_report.py report $OUT"
  exit 0
fi

nvidia-smi > "$OUT/nvidia_smi_before.txt" 2>&1 || true
rm -rf "$OUT/measure" "$OUT/run" "$OUT/watch.json"
set +e
STREAMDRAFT_MEASURE_DIR="$OUT/measure" timeout -k 30 "$TIMEOUT_S" "${TRAIN[@]}" > "$OUT/train.log" 2>&1 &
TRAIN_PID=$!
"$PY" launch/kimi_reduced_report.py watch --pid "$TRAIN_PID" --out "$OUT/watch.json" &
WATCH_PID=$!
wait "$TRAIN_PID"; echo $? > "$OUT/train.rc"
wait "$WATCH_PID"
if [ -d "$OUT/run/export/sglang" ]; then
  "${VERIFY[@]}" > "$OUT/verify.txt" 2>&1; echo $? > "$OUT/verify.rc"
fi
set -e
echo "training exit code $(cat "$OUT/train.rc"); the log's tail:"
tr '\r' '\n' < "$OUT/train.log" | grep -v "it/s\]$" | tail -n 25
"$PY" launch/kimi_reduced_report.py report "$OUT"
rm -f "$T/model.safetensors" "$OUT"/run/checkpoints/*/*.pt "$OUT"/run/export/*/*.safetensors  # the 4.7 GB head, optimizer states, exported weights: not results
