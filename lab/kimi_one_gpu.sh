#!/usr/bin/env bash
# The Kimi-K2.5-shaped target on one GPU, trained and served (docs/KIMI.md), results under OUT:
#
#   lab/kimi_one_gpu.sh OUT [LAYERS EXPERTS KIMI_ARGS TOKENS]   # default: 61 8 --int4 4096 (fits an 80-GB GPU)
#   lab/kimi_one_gpu.sh OUT 61 8 "--int4 --lm-head-scale 131072"  # a trainer's lm_head 2^17 x the served one: the same
#                                                  # greedy tokens, target probabilities a draft can learn, so served tau compares
#
# 1. lab/kimi_reduced_run.sh at TP 1: the co-located SGLang engine (dummy weights) and the trainer of
#    the 0.985 B draft, OUT/kimi/result.json; when it fails with the INT4 experts, once more with 30
#    layers of bf16 experts (OUT/kimi30), the INT4 run's log kept;
# 2. lab/kimi_served.py checks: the served width check on the run's export and its two negative controls;
# 3. serving.sglang_eval: served tau in SGLang's own EAGLE-3 decoding on the same target (a 3-token chain), of the
#    trained export, of the same export untrained (lab/kimi_served.py untrained) and of the trained one with aux
#    capture off (lab/kimi_served.py capture-off): OUT/NAME/tau_{trained,untrained,capture_off}.json.
# Knobs (environment): TRAIN_S=120 MAX_STEPS=1000 TIMEOUT_S=560 MEM=0.64 PYTHON=python3 TOKENIZER= LAYOUT=llama (as
# kimi_reduced_run.sh) PROMPTS= (the prompt file decoded in 3; default the run's eval_prompts.jsonl) SERVED="checks untrained capture_off"
# (the parts of 2 and 3 after the trained export's tau, in that order).
set -uo pipefail
[ $# -ge 1 ] || { echo "usage: $0 OUT [LAYERS EXPERTS KIMI_ARGS TOKENS]" >&2; exit 2; }
OUT=$(realpath -m "$1"); cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p "$OUT"
run() {  # run NAME LAYERS EXPERTS KIMI_ARGS AUX
  GPUS=1 TP=1 LAYERS=$2 EXPERTS=$3 KIMI_ARGS=$4 AUX=$5 TOKENS=$TOKENS MEM=${MEM:-0.64} \
    TRAIN_S=${TRAIN_S:-120} MAX_STEPS=${MAX_STEPS:-1000} TIMEOUT_S=${TIMEOUT_S:-560} KEEP_EXPORT=1 LAYOUT=${LAYOUT:-llama} \
    bash lab/kimi_reduced_run.sh "$OUT/$1"
}
LAYERS=${2:-61} EXPERTS=${3:-8} ARGS=${4---int4} TOKENS=${5:-4096}
ids() { "$PY" -c "import sys; sys.path.insert(0, '.'); from models.aux_ids import AuxLayerIds; print(list(AuxLayerIds.default($1).ids))" | tr -d ' '; }
name=kimi
run "$name" "$LAYERS" "$EXPERTS" "$ARGS" "$(ids "$LAYERS")"
if [ "$(cat "$OUT/$name/train.rc" 2>/dev/null)" != 0 ] && [ -n "$ARGS" ]; then
  echo "== the $LAYERS-layer run failed (train.rc $(cat "$OUT/$name/train.rc" 2>/dev/null)); 30 layers of bf16 experts"
  name=kimi30
  run "$name" 30 8 "" "$(ids 30)"
fi
R=$OUT/$name
tau() {  # tau NAME EXPORT [capture-off]: served tau of EXPORT on the run's target -> R/tau_NAME.json
  echo "== served tau, $1: $2"
  local launcher=(-m); [ -z "${3:-}" ] || launcher=(lab/kimi_served.py capture-off)
  "$PY" "${launcher[@]}" serving.sglang_eval "$2" --target "$R/target" --load-format dummy \
    --prompts "${PROMPTS:-$R/run/eval_prompts.jsonl}" --limit 8 --k 3 --max-new-tokens 64 --json "$R/tau_$1.json" > "$R/tau_$1.log" 2>&1
  echo "sglang_eval exit $?"; tail -n 5 "$R/tau_$1.log"
}
if [ -d "$R/run/export/sglang" ]; then
  tau trained "$R/run/export/sglang"
  for part in ${SERVED-checks untrained capture_off}; do
    case $part in
    checks) echo "== served checks on $R"; "$PY" lab/kimi_served.py checks "$R" ;;
    untrained) "$PY" lab/kimi_served.py untrained "$R" "$R/untrained_export" && tau untrained "$R/untrained_export"
      rm -rf "$R/untrained_export" ;;
    capture_off) tau capture_off "$R/run/export/sglang" capture-off ;;
    *) echo "$0: SERVED: unknown part $part (checks, untrained, capture_off)" >&2 ;;
    esac
  done
fi
rm -f "$R"/run/export/*/*.safetensors "$OUT"/kimi*/run/export/*/*.safetensors
