#!/usr/bin/env bash
# The GPU tier in parts that each fit one 10-minute device call on an H100,
# together every file of tests/gpu:
#
#   bash tests/gpu/run_parts.sh quick      # iteration: every path once (not the matrix)
#   bash tests/gpu/run_parts.sh core       # numerics, backward, runtime values, determinism,
#                                          # graphs, back-to-back calls, split-KV, paged
#   bash tests/gpu/run_parts.sh features   # windows and softcap, segments, varlen, jax.nn
#   bash tests/gpu/run_parts.sh heads      # GQA, sinks, transforms, fallback, float8,
#                                          # the long-row tiles
#   bash tests/gpu/run_parts.sh large      # 2^31-element tensors and softcap accuracy, alone
#   bash tests/gpu/run_parts.sh multi      # 2 or more GPUs
#   bash tests/gpu/run_parts.sh single     # core, large, features and heads: with 3 or
#                                          # more GPUs each on its own (large after core),
#                                          # in parallel; else one after the other
#
# Extra arguments go to pytest. Workers: 12 (at most 3/4 of the cores; WORKERS
# overrides: 8 where GPU memory is short). The latest times, one part a device call
# (bd45a8fc, 2026-12-04, one H200 at 12 workers): core 4.8 minutes, large 0.4, features
# 4.6, heads 5.3. Every earlier time: tests/README.md, Part times.
set -euo pipefail
cd "$(dirname "$0")/../.."
part=${1:?usage: run_parts.sh quick|core|features|heads|large|multi|single [pytest args]}
shift
if [ "$part" = single ]; then
  # Each part's output goes to $LOGS/PART.log (default build/gpu-parts); one line per
  # part as it ends, its summary; non-zero exit when any part fails.
  logs=${LOGS:-build/gpu-parts}
  mkdir -p "$logs"
  if [ -n "${CUDA_VISIBLE_DEVICES-}" ]; then IFS=, read -r -a gpus <<< "$CUDA_VISIBLE_DEVICES"
  else mapfile -t gpus < <(nvidia-smi --query-gpu=index --format=csv,noheader); fi
  run_group() {  # DEVICE PART...: the parts one after the other on DEVICE ("" = as given)
    local dev=$1 p rc=0; shift
    for p in "$@"; do
      if [ -n "$dev" ]; then CUDA_VISIBLE_DEVICES=$dev bash "$0" "$p" "${args[@]}" > "$logs/$p.log" 2>&1 || rc=1
      else bash "$0" "$p" "${args[@]}" > "$logs/$p.log" 2>&1 || rc=1; fi
      echo "$p: $(grep -v '^\s*$' "$logs/$p.log" | tail -n 1)"
    done
    return $rc
  }
  args=("$@")
  if [ "${#gpus[@]}" -ge 3 ]; then
    run_group "${gpus[0]}" core large & a=$!
    run_group "${gpus[1]}" features & b=$!
    run_group "${gpus[2]}" heads & c=$!
    rc=0; for pid in $a $b $c; do wait "$pid" || rc=1; done
    exit $rc
  fi
  run_group "" core large features heads
  exit $?
fi
g=tests/gpu
case "$part" in
  quick) files="$g/test_gpu_runtime_values.py $g/test_gpu_determinism.py $g/test_gpu_transforms.py $g/test_gpu_fallback.py $g/test_gpu_long_rows.py" ;;
  core) files="$g/test_gpu_back_to_back.py $g/test_gpu_numerics.py $g/test_gpu_backward.py $g/test_gpu_runtime_values.py $g/test_gpu_determinism.py $g/test_gpu_command_buffer.py $g/test_gpu_split_kv.py $g/test_gpu_paged.py" ;;
  features) files="$g/test_gpu_window.py $g/test_gpu_segments.py $g/test_gpu_varlen.py $g/test_gpu_jax_nn.py" ;;
  heads) files="$g/test_gpu_gqa.py $g/test_gpu_sinks.py $g/test_gpu_transforms.py $g/test_gpu_fallback.py $g/test_gpu_float8.py $g/test_gpu_kv_float8.py $g/test_gpu_long_rows.py" ;;
  large) files="$g/test_gpu_large.py $g/test_gpu_softcap_accuracy.py" ;;
  multi) files="$g/test_gpu_multi.py" ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
# 12 workers (WORKERS overrides; at most 3/4 of the cores): core took 4.4 minutes at 12
# and 5.3 at 8 (one H200, 2026-12-02; modules 5b6c11c0 and f815c455, which differ only
# in two segment kernels).
n=$(( $(nproc) * 3 / 4 )); n=$(( n > 12 ? 12 : n < 1 ? 1 : n ))
workers=(-n "${WORKERS:-$n}" --dist loadgroup)
case "$part" in large | multi) workers=() ;; esac
# A part that finds no GPU or no built module fails: its tests would all skip and pass.
export JAX_FA4_REQUIRE_NATIVE=1 JAX_FA4_REQUIRE_GPU=1
# The slowest tests are listed above the summary, and every test's time goes to
# JUNIT_DIR/PART.xml (default build/gpu-parts): `python tests/gpu/part_times.py` says
# where the part's minutes go.
junit=${JUNIT_DIR:-build/gpu-parts}
mkdir -p "$junit"
# shellcheck disable=SC2086  # the file list splits on purpose
XLA_PYTHON_CLIENT_PREALLOCATE=false exec python3 -m pytest -q -m gpu -p no:cacheprovider \
  --durations=25 --junitxml "$junit/$part.xml" "${workers[@]}" $files "$@"
