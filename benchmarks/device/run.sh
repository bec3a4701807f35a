#!/usr/bin/env bash
# The one runner for GPU measurements: records the machine and the code, then runs one topic's
# benchmark or tests, every output under OUT_DIR (JSON from the benchmark scripts, a log beside it).
#
# Usage on the GPU machine, from the repository root:
#   bash benchmarks/device/run.sh TOPIC OUT_DIR [extra args passed to the topic's script]
#
# Topics (the defaults are what the README and docs/gpu.md report; extra args replace or add flags):
#   kernels        benchmarks/kernels.py: every provider side by side, checked against its PyTorch
#                  reference first, the tuned tables copied to OUT_DIR/table (default --ms 1; e.g. --ms 256 1024,
#                  --ms 1 16 256 1024 4096 --shapes ..., --lab gemv --tma --ec-pdl 64)
#   e2e            benchmarks/e2e_decode.py: Llama-2-7B-shaped decode step, one CUDA graph per step
#                  (default --batch 1 16, every variant)
#   ec-ranks       benchmarks/decode_ec_ranks.py: the decode EC per rank, every route
#                  (add --write-table to write the per-rank choice into the tuned table; copied to OUT_DIR/table)
#   gpu-tests      pytest of the kernels, the dispatch, the backend and the GPU calibration / sampling
#                  paths (extra args replace the default paths; SHARDS=N deals them to N parallel pytest
#                  processes, each with its log and junit XML)
#   lab-gemm       benchmarks/lab_gemm.py: large-M GEMM configs against dequantize + cuBLAS
#   ec-prefill     benchmarks/ec_prefill_profile.py: the prefill EC structures part by part
#   ec-tma-parts   benchmarks/ec_tma_parts.py: the decode EC on the TMA GEMV part by part
#   determinism    benchmarks/determinism.py, then benchmarks/determinism_e2e.py
#   e2e-profile    benchmarks/e2e_profile.py: torch.profiler over graph replays of the decode step
#   read-floor     benchmarks/read_floor.py: a kernel that only reads the weight bytes
#   serving        benchmarks/serving.py: the engine under Poisson arrivals, dynamic against static chunks
#                  (default --device cuda --model llama2-7b; e.g. --densities 0 25 --chunks 512 2048 --slo-ms 16 22)
#   engine-profile benchmarks/engine_profile.py: an engine step part by part and the GPU's top kernels
#                  (default --device cuda --model llama2-7b --batch 1 16; --padding transformers|exact)
#   untuned        benchmarks/untuned_shapes.py: shapes outside the shipped table, the route's nearest-geometry
#                  default against the same shapes tuned, and the whole-model spear tune time
#                  (default --models qwen2.5-7b llama3-8b --ms 1 16 64 256)
#   concat-gemm    benchmarks/concat_gemm.py: linears sharing an input at M = 2..256, one GEMM over their concatenation
#                  against one GEMM each (default: Llama-2-7B's and Qwen2.5-7B's q/k/v and gate/up)
#   small-m        benchmarks/small_m_gemm.py: the register-operand GEMM's small tiles at M = 2..128 against the route's
#                  shipped choice and cuBLAS, W4 + EC after (default: the benchmark and Qwen2.5-7B shapes)
#   l2-tables      benchmarks/latency_tables_l2.py: a compiled W4 linear timed as the serving latency tables
#                  time it, on one weight set against weight copies past L2 (default --ms 1 16 64 256)
#   between-buckets benchmarks/latency_between_buckets.py: the serving model's compiled linears timed at M
#                  between the latency model's buckets (default --density 25 --ms 64 128 192 256 320 384)
#   e2e-hf         benchmarks/e2e_decode.py --hf: HF models through the public path with byte floors
#                  (default --hf llama2-7b qwen2.5-7b --batch 1 8 16 64)
#   decode-attn    benchmarks/decode_attention.py: the engine's varlen attention with and without the split-KV
#                  decode kernel, checked and timed on decode and mixed steps
#   ncu-gemv1 | ncu-gemm   benchmarks/ncu_gemv1.py / ncu_gemm.py under Nsight Compute (ncu must exist)
#   quality        benchmarks/quality.py through quality.sh (needs the SmolLM2 GGUF carried in two
#                  halves, see quality.sh); sweep: benchmarks/spear_sweep.py the same way
#
# OUT_DIR/meta.json: GPU name, torch / triton versions, date (UTC), commit, topic and the command.
# With PACK=1 in the environment the folder ends packed as OUT_DIR.tgz (pack.sh), for a transfer
# that returns a limited number of files (8 from the lent GPU machines: a call running two serving topics
# already writes 10; the files past the limit are lost). TIMEOUT_S (default 540) bounds the topic's main command.
set -uo pipefail
if [ $# -lt 2 ]; then sed -n '2,51p' "$0"; exit 2; fi
topic=$1; out=$2; shift 2
topics=" kernels e2e ec-ranks gpu-tests lab-gemm ec-prefill ec-tma-parts determinism e2e-profile read-floor serving engine-profile untuned small-m l2-tables between-buckets e2e-hf decode-attn concat-gemm ncu-gemv1 ncu-gemm quality sweep "
if [[ "$topics" != *" $topic "* ]]; then echo "unknown topic '$topic'; one of:$topics"; exit 2; fi
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
limit=${TIMEOUT_S:-540}
here=$(dirname "$0")

commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)
dirty=$(git status --porcelain 2>/dev/null | grep -qv '^??' && echo true || echo false)
python - "$out/meta.json" "$topic" "$commit" "$dirty" "$*" <<'PY'
import datetime, json, platform, sys
path, topic, commit, dirty, args = sys.argv[1:]
meta = {"topic": topic, "args": args, "commit": commit, "uncommitted_changes": dirty == "true",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host": platform.node(), "python": platform.python_version()}
try:
    import torch
    meta["torch"] = torch.__version__
    meta["cuda"] = torch.version.cuda
    meta["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    meta["gpu_count"] = torch.cuda.device_count()
except Exception as e:  # the record says why rather than inventing a value
    meta["torch"] = f"unknown ({type(e).__name__})"
try:
    import triton
    meta["triton"] = triton.__version__
except Exception:
    meta["triton"] = "unknown"
json.dump(meta, open(path, "w"), indent=1)
print(json.dumps(meta))
PY

log="$out/$topic.log"
bench() {  # bench SCRIPT ARGS...: run one benchmark script into $out, log beside it
  timeout "$limit" python "$@" > "$log" 2>&1
  local rc=$?
  echo "rc $rc"; grep -v Warning "$log" | tail -n 30
  return $rc
}
table() {  # the tuned tables after the run: the shipped ones and those written to the user cache
  mkdir -p "$out/table/shipped" "$out/table/user"
  cp spear_compile/*/tuned/*.json "$out/table/shipped/" 2>/dev/null
  cp "${SPEAR_CACHE_DIR:-$HOME/.cache/spear_compile}"/*.json "$out/table/user/" 2>/dev/null
  true
}

rc=0
case "$topic" in
  kernels)      bench benchmarks/kernels.py --out "$out" ${@:---ms 1}; rc=$?; table ;;
  e2e)          bench benchmarks/e2e_decode.py --out "$out" ${@:---batch 1 16 --variants bf16 int4_tinygemm \
                  ours_w4 spear_ec10 spear_ec25 spear_ec100 unfused_ec25}; rc=$? ;;
  ec-ranks)     bench benchmarks/decode_ec_ranks.py --out "$out" "$@"; rc=$?; table ;;
  gpu-tests)    paths=("$@")
                if [ ${#paths[@]} -eq 0 ]; then  # the kernel, dispatch and backend tests and the GPU calibration paths
                  for t in tests/lowering tests/kernels tests/dispatch tests/passes/test_backend.py \
                           tests/compensators/test_sampling.py tests/compensators/test_calibrate.py; do
                    [ -e "$t" ] && paths+=("$t")
                  done
                fi
                if [ "${SHARDS:-1}" -gt 1 ]; then  # the collected tests dealt round-robin to SHARDS pytest processes
                  python -m pytest -q -p no:cacheprovider --co "${paths[@]}" > "$out/collect.log" 2>&1
                  grep '::' "$out/collect.log" > "$out/ids.txt"
                  if [ ! -s "$out/ids.txt" ]; then  # never fall through to a shard-less run of the whole suite
                    echo "no tests collected from: ${paths[*]}"; tail -n 20 "$out/collect.log"; exit 2
                  fi
                  pids=()
                  for ((i = 0; i < SHARDS; i++)); do
                    awk -v n="$SHARDS" -v i="$i" 'NR % n == i' "$out/ids.txt" > "$out/ids_$i.txt"
                    mapfile -t ids < "$out/ids_$i.txt"  # one argument per test id (ids may hold spaces)
                    timeout "$limit" python -m pytest -q -p no:cacheprovider -rf --junitxml="$out/junit_$i.xml" \
                      "${ids[@]}" > "$out/${topic}_$i.log" 2>&1 &
                    pids+=($!)
                  done
                  rc=0
                  for p in "${pids[@]}"; do wait "$p" || rc=1; done
                  for ((i = 0; i < SHARDS; i++)); do
                    grep -hE '^(FAILED|ERROR)' "$out/${topic}_$i.log"; tail -n 1 "$out/${topic}_$i.log"
                  done
                  echo "rc $rc ($(wc -l < "$out/ids.txt") tests in $SHARDS shards)"
                else
                  timeout "$limit" python -m pytest -q -p no:cacheprovider -rf "${paths[@]}" > "$log" 2>&1; rc=$?
                  echo "rc $rc"; grep -v Warning "$log" | tail -n 20
                fi ;;
  lab-gemm)     bench benchmarks/lab_gemm.py --out "$out" "$@"; rc=$? ;;
  ec-prefill)   bench benchmarks/ec_prefill_profile.py --out "$out" "$@"; rc=$? ;;
  ec-tma-parts) bench benchmarks/ec_tma_parts.py --out "$out" "$@"; rc=$? ;;
  determinism)  bench benchmarks/determinism.py --out "$out" "$@"; rc=$?
                log="$out/determinism_e2e.log"; bench benchmarks/determinism_e2e.py --out "$out" || rc=$? ;;
  e2e-profile)  bench benchmarks/e2e_profile.py --out "$out" "$@"; rc=$? ;;
  read-floor)   bench benchmarks/read_floor.py --out "$out" "$@"; rc=$? ;;
  untuned)      bench benchmarks/untuned_shapes.py --out "$out" "$@"; rc=$? ;;
  small-m)      bench benchmarks/small_m_gemm.py --out "$out" "$@"; rc=$? ;;
  concat-gemm)  bench benchmarks/concat_gemm.py --out "$out" "$@"; rc=$? ;;
  decode-attn)  bench benchmarks/decode_attention.py --out "$out" "$@"; rc=$? ;;
  l2-tables)    bench benchmarks/latency_tables_l2.py --out "$out" "$@"; rc=$? ;;
  between-buckets) bench benchmarks/latency_between_buckets.py --out "$out" "$@"; rc=$? ;;
  serving)      bench benchmarks/serving.py --out "$out" ${@:---device cuda --model llama2-7b}; rc=$? ;;
  engine-profile) bench benchmarks/engine_profile.py --out "$out" ${@:---device cuda --model llama2-7b --batch 1 16}
                rc=$? ;;
  e2e-hf)       bench benchmarks/e2e_decode.py --out "$out" ${@:---hf llama2-7b qwen2.5-7b --batch 1 8 16 64}; rc=$? ;;
  ncu-gemv1|ncu-gemm)
                script=benchmarks/${topic/-/_}.py
                timeout "$limit" ncu --clock-control none -o "$out/rep" python "$script" "$@" > "$log" 2>&1; rc=$?
                ncu -i "$out/rep.ncu-rep" --page details > "$out/details.txt" 2>&1
                echo "rc $rc"; tail -n 20 "$out/details.txt" ;;
  quality)      timeout "$limit" bash "$here/quality.sh" --out "$out" "$@" > "$log" 2>&1; rc=$?
                echo "rc $rc"; tail -n 20 "$log" ;;
  sweep)        timeout "$limit" bash "$here/quality.sh" benchmarks/spear_sweep.py --out "$out" "$@" > "$log" 2>&1; rc=$?
                echo "rc $rc"; tail -n 20 "$log" ;;
esac
if [ "${PACK:-0}" = 1 ]; then bash "$here/pack.sh" "$out"; fi
exit $rc
