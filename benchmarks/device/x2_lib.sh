#!/usr/bin/env bash
# Shared by the two-GPU quality scripts on nvidia-h200-x2 (quality_sweep_x2.sh); sourced, not run.
# Needs `out` set. Provides:
#   GPU_BASE          GPU_PRESET's settings as spear_sweep.py overrides (192 x 1024 self-sampled tokens)
#   gguf_setup        the GGUF / sdist set-up of quality.sh (after the two GGUF-half transfers); exits on failure
#   sweep GPU T ARGS  spear_sweep.py on the development plays on one GPU, two workers, T seconds at most,
#                     into $out/sweepGPU (log: $out/sweepGPU.log)
GPU_BASE='select=all,steps=480,lr_ab=0.001,schedule=cosine,sample_batch=64,cuda_graph=true,seq_len=1024,sampler=static,teacher_cache_bytes=48000000000,n_seqs=192'

gguf_setup() {
  bash benchmarks/device/quality.sh --help > /dev/null 2>&1 || { echo "GGUF / sdist set-up failed"; exit 1; }
}

sweep() {
  local gpu=$1 limit=$2
  CUDA_VISIBLE_DEVICES=$gpu timeout "$limit" bash benchmarks/device/quality.sh benchmarks/spear_sweep.py \
    --out "$out/sweep$gpu" --jobs 2 --deadline-s $((limit - 15)) "${@:3}" > "$out/sweep$gpu.log" 2>&1
}

# pick_best [EXCLUDED ...]: print every variant's recovery from $out/sweep*/, then write the best
# variant's overrides (the EXCLUDED names left out of the choice) to $out/best.json.
pick_best() {
  python3 - "$out" "$@" <<'PY'
import glob, json, sys
out, excluded = sys.argv[1], set(sys.argv[2:])
rows = [r for r in (json.load(open(p)) for p in sorted(glob.glob(f"{out}/sweep*/*.json")))
        if isinstance(r, dict) and "variant" in r and "gap_recovered" in r]
for r in sorted({r["variant"]: r for r in rows}.values(), key=lambda r: r["variant"]):
    print(r["variant"], round(100 * r["gap_recovered"], 2))
best = max((r for r in rows if r["variant"] not in excluded), key=lambda r: r["gap_recovered"])
print("eval with", best["variant"], best["overrides"])
json.dump(best["overrides"], open(f"{out}/best.json", "w"))
PY
}
