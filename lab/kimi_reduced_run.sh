#!/usr/bin/env bash
# The Kimi-K2.5 code path with dummy weights (docs/KIMI.md): SGLang at TP $TP as the co-located engine
# of $GPUS DeepSpeed draft trainer ranks; everything the run shows lands under OUT (result.json,
# train.log, plan.txt, ...).
#
#   lab/kimi_reduced_run.sh OUT          # 5 layers on 2 GPUs (after lab/device_run.sh setup-*), ~4 minutes
#   GPUS=1 LAYERS=61 EXPERTS=8 KIMI_ARGS=--int4 AUX=[1,29,57] TOKENS=4096 MEM=0.5 lab/kimi_reduced_run.sh OUT
#                                           # the real depth on one 80-GB GPU
#   lab/kimi_reduced_run.sh OUT --dry    # any machine: writes the config, prints the plans and the commands
#
# Knobs (environment): SITE=/tmp/site DEPS_SITE=/tmp/site2 (lab/device_run.sh's installs) GPUS=2 TP=$GPUS LAYERS=5 EXPERTS=16 KIMI_ARGS= (more lab/kimi_reduced.py
# options: --int4, --language-model) TOKENIZER= (the tokenizer dir to copy; default the embedded target's) AUX=[1,2,3] TOKENS=8192 MEM=0.15 (SGLang's mem_fraction_static)
# LAYOUT=llama (the draft's draft.layout: llama or mla)
# MAX_STEPS=300 TRAIN_S=60 TIMEOUT_S=420 KEEP_EXPORT= (1: keep the exported weights) PEAK_FLOPS= (the GPU's bf16 matmul ceiling for the MFU;
# default: measured here first) PYTHON=python3. The steps: write the target dir
# (lab/kimi_reduced.py, with the embed + lm_head the trainer reads); the memory plans
# (models.memory_plan) of this run and of the full shape at TP 8; the training run under a watcher
# (lab/kimi_reduced_report.py watch: /proc/<pid>/io and nvidia-smi every second); serving.verify
# of the SGLang export with the DeepSeek aux-id rule; the report (result.json).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 OUT [--dry]" >&2; exit 2; }
OUT=$(realpath -m "$1"); DRY=${2:-}
[ -z "$DRY" ] || [ "$DRY" = --dry ] || { echo "$0: unknown option $DRY (only --dry)" >&2; exit 2; }
cd "$(dirname "$0")/.."
SITE=${SITE:-/tmp/site} DEPS_SITE=${DEPS_SITE:-/tmp/site2}  # where lab/device_run.sh installs on a bare GPU host
if [ -d "$SITE" ]; then  # its installs and caches
  export PYTHONPATH="$SITE:$DEPS_SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  export STREAMDRAFT_CACHE=${STREAMDRAFT_CACHE:-/tmp/streamdraft-cache} TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch-ext}
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled
PY=${PYTHON:-python3}
GPUS=${GPUS:-2} TP=${TP:-${GPUS:-2}} LAYERS=${LAYERS:-5} EXPERTS=${EXPERTS:-16} AUX=${AUX:-[1,2,3]} TOKENS=${TOKENS:-8192}
MEM=${MEM:-0.15} MAX_STEPS=${MAX_STEPS:-300} TRAIN_S=${TRAIN_S:-60} TIMEOUT_S=${TIMEOUT_S:-420}
read -r -a KIMI_ARGS <<< "${KIMI_ARGS:-}"
LAYOUT=${LAYOUT:-llama}  # the draft's decoder layer: llama or mla (draft.layout)
[ -z "${TOKENIZER:-}" ] || KIMI_ARGS+=(--tokenizer "$(realpath "$TOKENIZER")")
POOL=$(((TP + 1) * TOKENS))  # SGLang KV pool: one prefill is TP x TOKENS tokens, plus one batch as headroom
T="$OUT/target"
mkdir -p "$OUT"

TRAIN=("$PY" -m deepspeed.launcher.runner --num_gpus "$GPUS" --no_local_rank lab/train_measured.py
  engine=sglang target=local "target.path=$T" "target.aux_layer_ids=$AUX" target.dtype=bfloat16
  "engine.sglang.tp_size=$TP" engine.sglang.load_format=dummy engine.sglang.attention_backend=triton
  "engine.sglang.mem_fraction_static=$MEM" "engine.sglang.max_total_tokens=$POOL"
  "data.max_tokens=$TOKENS" data.max_len=2048 data.packing=true data.epoch_samples=40000 draft.draft_vocab_size=32000
  trainer.epochs=1 "trainer.max_steps=$MAX_STEPS" "trainer.max_time_s=$TRAIN_S" trainer.log_every=5
  trainer.eval_batches=1 trainer.serve_eval=false wandb.mode=disabled "draft.layout=$LAYOUT" "hydra.run.dir=$OUT/run")
VERIFY=("$PY" -m serving.verify "$OUT/run/export/sglang" --engine sglang --target "$T")
# the trainer on this checkout: does load_target read the head by name, or load the whole target?
TRAINER_TARGET=()
grep -q "TargetHead" trainer/target_setup.py || TRAINER_TARGET=(--hf-target-in-trainer)

if [ "$DRY" = --dry ]; then
  "$PY" lab/kimi_reduced.py "$T" --layers "$LAYERS" --experts "$EXPERTS" "${KIMI_ARGS[@]}"
else
  "$PY" lab/kimi_reduced.py "$T" --layers "$LAYERS" --experts "$EXPERTS" "${KIMI_ARGS[@]}" --with-head
fi
"$PY" lab/kimi_reduced.py "$OUT/kimi-full" --full ${TOKENIZER:+--tokenizer "$(realpath "$TOKENIZER")"}
"$PY" -m models.memory_plan --config "$T" --tp "$TP" --tokens "$TOKENS" --ranks "$GPUS" --max-total-tokens "$POOL" \
  --draft-layout "$LAYOUT" "${TRAINER_TARGET[@]}" --json "$OUT/plan.json" | tee "$OUT/plan.txt"
"$PY" -m models.memory_plan --config "$OUT/kimi-full" --tp 8 --tokens 8192 --ranks 8 --json "$OUT/plan_full.json" | tee "$OUT/plan_full.txt"

if [ "$DRY" = --dry ]; then
  echo "dry run: the commands the GPU run executes"
  echo "STREAMDRAFT_MEASURE_DIR=$OUT/measure timeout -k 30 $TIMEOUT_S ${TRAIN[*]}"
  echo "$PY lab/kimi_reduced_report.py watch --pid <the training command's pid> --out $OUT/watch.json"
  echo "${VERIFY[*]}"
  echo "$PY lab/kimi_reduced_report.py report $OUT --peak-flops <PEAK_FLOPS, or measured>"
  exit 0
fi

nvidia-smi > "$OUT/nvidia_smi_before.txt" 2>&1 || true
PEAK_FLOPS=${PEAK_FLOPS:-$("$PY" lab/kimi_reduced_report.py peak)}
echo "bf16 matmul ceiling: $PEAK_FLOPS FLOP/s"
rm -rf "$OUT/measure" "$OUT/run" "$OUT/watch.json"
set +e
STREAMDRAFT_MEASURE_DIR="$OUT/measure" timeout -k 30 "$TIMEOUT_S" "${TRAIN[@]}" > "$OUT/train.log" 2>&1 &
TRAIN_PID=$!
"$PY" lab/kimi_reduced_report.py watch --pid "$TRAIN_PID" --out "$OUT/watch.json" &
WATCH_PID=$!
wait "$TRAIN_PID"; echo $? > "$OUT/train.rc"
wait "$WATCH_PID"
if [ -d "$OUT/run/export/sglang" ]; then
  "${VERIFY[@]}" > "$OUT/verify.txt" 2>&1; echo $? > "$OUT/verify.rc"
fi
set -e
echo "training exit code $(cat "$OUT/train.rc"); the log's tail:"
tr '\r' '\n' < "$OUT/train.log" | grep -v "it/s\]$" | tail -n 25
"$PY" lab/kimi_reduced_report.py report "$OUT" --peak-flops "$PEAK_FLOPS"
rm -f "$T/model.safetensors" "$OUT"/run/checkpoints/*/*.pt  # the 4.7 GB head, optimizer states: not results
[ -n "${KEEP_EXPORT:-}" ] || rm -f "$OUT"/run/export/*/*.safetensors  # the exported weights (KEEP_EXPORT=1: kept to serve them)
