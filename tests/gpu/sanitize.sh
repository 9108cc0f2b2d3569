#!/usr/bin/env bash
# compute-sanitizer memcheck, racecheck and synccheck over small calls of every kernel
# the build has (tests/gpu/sanitize_calls.py), on a Hopper GPU:
#
#   bash tests/gpu/sanitize.sh [LOG_DIR]          # logs in LOG_DIR, default build/sanitize
#   PYTHON=.venv/bin/python ...                   # the interpreter, default python3
#   SANITIZE_TOOLS="memcheck racecheck" ...       # some of the tools only
#   SANITIZE_ONLY=bf16_d128 ...                   # kernels whose name contains this only
#   SANITIZE_TIMEOUT=1800 ...                     # seconds per tool before it counts as hung
#
# Prints one line per tool with the errors it reports; exits non-zero when a tool reports
# any, or the driver fails. `python tests/gpu/sanitize_calls.py` alone times the calls
# without a tool; `tail -f LOG_DIR/TOOL.log` follows a run.
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
log_dir=${1:-$repo/build/sanitize}
mkdir -p "$log_dir" && log_dir=$(cd "$log_dir" && pwd) || exit 2
cd "$repo" || exit 2

tools=${SANITIZE_TOOLS:-memcheck racecheck synccheck}
only=${SANITIZE_ONLY:-}
python=${PYTHON:-python3}

sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [ ! -x "$sanitizer" ]; then
  echo "compute-sanitizer is neither on PATH nor in /usr/local/cuda/bin" >&2
  exit 2
fi
# What the tools check changes between versions (memcheck covers TMA loads since 2026.2).
echo "compute-sanitizer $("$sanitizer" --version | grep -io "version .*")"
help=$("$sanitizer" --help 2>&1)
supports() { grep -qE -- "^ *$1( |$)" <<<"$help"; }

# The checkout's jax_fa4 with its built module.
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
# Every buffer XLA uses is then a cudaMalloc of its own, which memcheck bounds, rather
# than a slice of one preallocated pool. (XLA's temporaries, the backward's workspaces
# among them, still share one allocation: overruns between them go unseen.)
export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform

# Only the project's kernels are checked, not XLA's (the segment plans, reductions,
# copies): the exported kernels' device names hold the module path of their CuTe-DSL
# source, kernels/sm90 ("kernel_cutlass_kernel_kernelssm90fwdFwdSm90_..."). The option
# is --kernel-name since compute-sanitizer 2023.3, --kernel-regex before; both take
# kns=SUBSTRING. A substring no kernel has would check nothing without a word, so it
# must be in the module the driver loads.
kernels_substring=kernelssm90
module=$("$python" -c "import jax_fa4._ffi as m; print(m.__file__)") || exit 2
if ! grep -q -a "$kernels_substring" "$module"; then
  echo "no kernel name in $module holds '$kernels_substring'; update sanitize.sh" >&2
  exit 2
fi
if supports --kernel-name; then
  filter=(--kernel-name "kns=$kernels_substring")
elif supports --kernel-regex; then
  filter=(--kernel-regex "kns=$kernels_substring")
else
  filter=()
  echo "warning: this compute-sanitizer has no kernel filter: XLA's kernels are checked too"
fi

flags=("${filter[@]}"
  # XLA compiles its kernels with ptxas in child processes, which run no CUDA. Following
  # them too (the default, "all") made compute-sanitizer 2025.3.1 itself crash (SIGSEGV)
  # in most runs of the segment kernels' calls (H100, jax 0.11.2).
  --target-processes application-only
  # Host stacks would show XLA's executor threads, not the call: the error names the
  # kernel, and the driver's progress lines the call.
  --show-backtrace device)
memcheck_flags=(
  # The default, stated: device memory still held at exit is XLA's (live arrays,
  # caches), not the kernels'.
  --leak-check no)
# A gap after each allocation, so an overrun past one is seen even where the next
# allocation would start.
if supports --padding; then memcheck_flags+=(--padding 4096); fi

# Unbuffered, so the driver's lines and the tool's reports interleave in the log as
# they happened.
driver=("$python" -u tests/gpu/sanitize_calls.py ${only:+--only "$only"})
status=0
for tool in $tools; do
  log=$log_dir/$tool.log
  extra=()
  if [ "$tool" = memcheck ]; then extra=("${memcheck_flags[@]}"); fi
  echo "$tool: running, log $log"
  start=$SECONDS
  timeout --kill-after=60 "${SANITIZE_TIMEOUT:-1800}" \
    "$sanitizer" --tool "$tool" "${flags[@]}" "${extra[@]}" "${driver[@]}" >"$log" 2>&1
  rc=$?
  # "ERROR SUMMARY: N errors" (memcheck, synccheck) or "RACECHECK SUMMARY: H hazards
  # displayed (N errors, W warnings)"; one per process the tool followed. Racecheck's
  # warnings (hazards of warp-synchronous code, possibly intended) are shown, and do
  # not fail the run.
  read -r summaries errors warnings < <(awk '
    /ERROR SUMMARY: [0-9]/ { s++; sub(/.*ERROR SUMMARY: /, ""); e += $1 }
    /RACECHECK SUMMARY: [0-9]/ { s++; sub(/.*\(/, ""); e += $1; w += $3 }
    END { print s + 0, e + 0, w + 0 }' "$log")
  ran=$(grep -oE '[0-9]+ kernels, [0-9]+ calls' "$log" | tail -1)
  line="$tool: $errors errors"
  if [ "$tool" = racecheck ]; then line+=", $warnings warnings"; fi
  line+=" (${ran:-driver did not finish}, $((SECONDS - start)) s)"
  if [ "$rc" -ne 0 ]; then
    line+="; exit status $rc"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then line+=" (timed out)"; fi
  fi
  if [ "$summaries" -eq 0 ]; then line+="; no summary from the tool"; fi
  if [ "$rc" -ne 0 ] || [ "$errors" -ne 0 ] || [ "$summaries" -eq 0 ]; then
    status=1
    line+="; see $log"
  fi
  echo "$line"
done
exit "$status"
