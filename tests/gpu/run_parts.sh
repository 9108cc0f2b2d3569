#!/usr/bin/env bash
# The GPU tier in parts that each fit one 10-minute device call on an H100,
# together every file of tests/gpu:
#
#   bash tests/gpu/run_parts.sh quick      # iteration: every path once (not the matrix)
#   bash tests/gpu/run_parts.sh core       # numerics, backward, runtime values, determinism,
#                                          # graphs, back-to-back calls, split-KV, paged
#   bash tests/gpu/run_parts.sh features   # windows and softcap, segments, varlen, jax.nn
#   bash tests/gpu/run_parts.sh heads      # GQA, sinks, transforms, fallback, float8,
#                                          # the long-band tile
#   bash tests/gpu/run_parts.sh large      # 2^31-element tensors and softcap accuracy, alone
#   bash tests/gpu/run_parts.sh multi      # 2 or more GPUs
#   bash tests/gpu/run_parts.sh single     # core, large, features and heads: with 3 or
#                                          # more GPUs each on its own (large after core),
#                                          # in parallel; else one after the other
#
# Extra arguments go to pytest. On an H100 (80 GB) on 2026-11-25, the kernels of 050e892:
# core 5.4 minutes (1796 passed), features 7.4 (505), heads 4.3 (319), large 0.5 (10);
# the kernels of 68c86d7, on another H100 that day: core 3.1 (1804), features 5.5 (505),
# heads 3.0 (319), large 0.3 (10); a9f7285: core 3.8, features 5.9, heads 3.6, large 0.4;
# 2026-11-26, 0e5cdf9: core 3.6 (1813), features 5.5 (505), heads 3.3 (319), large 0.3 (10);
# with q read in place: core 3.7, features 5.5, heads 3.6, large 0.3; eab18ca's build:
# core 4.9, features 5.5, heads 3.3, large 0.4; ba4b771's: core 5.1, features 7.3,
# heads 4.6, large 0.4; 2026-11-27, HEAD's kernels built anew (11c3ece8): core 4.6
# (1827), features 7.2 (505), heads 4.6 (319), large 0.4 (10); with the e4m3 forwards
# (f52174d4): core 4.4, large 0.4, heads 4.3 (334); with the float8-KV forwards
# (d2c48104): core 5.3 (1827), large 0.4 (10), features 7.4 (505), heads 4.6 (353);
# with Q in registers in the d128 split tiles (e25ff426): core 4.6, large 0.4,
# features 6.2, heads 4.6; with the keys-as-M decode tiles (854fdc7f): core 5.0 (1831),
# large 0.4, features 7.0, heads 4.5 (355).
# multi on 4 x H100 (2026-11-26): 1.5 minutes (14 passed). On 4 x H100, 2026-11-27,
# the parts in parallel one per GPU with K in registers in the float8 keys-as-M tiles
# (d87efd7c): core 5.7 then large 0.4, features 7.0, heads 5.0; again with `single`:
# core 4.4 then large 0.4, features 5.4, heads 3.9: 5.5 minutes in all. With the
# long-band tiles (715ff729): core 4.9 (1833) then large 0.4, features 6.1, heads 4.6
# (388): 6.2 minutes. On 2 x H200 (2026-11-28, c486b662, backward references shared
# between a problem's two dq modes): core 3.6 (1836), features 6.6 (505), heads 4.9
# (388), large 0.3 (10); again (b569fa9e, fifth session): core 5.7, features 7.1,
# heads 4.1, large 0.5. On 4 x H200 with `single` (69c37c94, sixth session; an A/B
# beside it on the fourth GPU): core 5.2 (1877) then large 0.4, features 6.0, heads 4.6;
# seventh session, the same way (3ddb0e00, the backward beside cuDNN on the fourth):
# core 5.9 then large 0.4, features 6.8, heads 5.3.
# One H200, one part a call (617bcdd0, eighth session): core 4.8, large 0.4,
# features 6.7, heads 4.5; again (b598d388, ninth session): core 4.3, large 0.3,
# features 6.0, heads 4.5. One H200, 2026-12-02 (a407f648): core and features side by
# side in one call (two pytest processes of 8 workers on its 16 cores) 8.6 minutes each,
# where one after the other takes about 10.3; heads 3.8, large 0.3. With the forward's
# decoded tile hand-off (c8b158ac), the same way: core 8.6, features 9.3, heads 5.1,
# large 0.4. With f815c455 on a freshly started H200, core beside features had reached
# 97% and 92% when its 10-minute call ended: give core (with large), features and heads
# a call each. The next session, f815c455 one part a call: core 5.3, large 0.4,
# features 7.1; 5b6c11c0: features 7.2, core 4.4 at 12 workers (`core -n 12`).
# With the references' band traced (87231f66): on one H100 at 8 workers features 4.9,
# heads 5.3; on one H200 at 12 core 4.1, large 0.3.
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
  quick) files="$g/test_gpu_runtime_values.py $g/test_gpu_determinism.py $g/test_gpu_transforms.py $g/test_gpu_fallback.py $g/test_gpu_long_band.py" ;;
  core) files="$g/test_gpu_back_to_back.py $g/test_gpu_numerics.py $g/test_gpu_backward.py $g/test_gpu_runtime_values.py $g/test_gpu_determinism.py $g/test_gpu_command_buffer.py $g/test_gpu_split_kv.py $g/test_gpu_paged.py" ;;
  features) files="$g/test_gpu_window.py $g/test_gpu_segments.py $g/test_gpu_varlen.py $g/test_gpu_jax_nn.py" ;;
  heads) files="$g/test_gpu_gqa.py $g/test_gpu_sinks.py $g/test_gpu_transforms.py $g/test_gpu_fallback.py $g/test_gpu_float8.py $g/test_gpu_kv_float8.py $g/test_gpu_long_band.py" ;;
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
# The slowest tests are listed above the summary: where the part's minutes go.
# shellcheck disable=SC2086  # the file list splits on purpose
XLA_PYTHON_CLIENT_PREALLOCATE=false exec python3 -m pytest -q -m gpu -p no:cacheprovider \
  --durations=25 "${workers[@]}" $files "$@"
