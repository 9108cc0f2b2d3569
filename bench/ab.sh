#!/usr/bin/env bash
# Old vs new build, alternated twice (old, new, then new, old) in one process-per-run
# GPU session (machines are noisy: only ratios within one session count). Each build is
# a folder holding a native module (_ffi.abi3.so, or the _ffi.abi3.so.gz of
# bench/variant.sh) and, where its Python side differs from this checkout's, the .py
# files of its jax_fa4/ (as variant.sh saves them), which replace the checkout's for its
# runs. Then `python -m bench.compare` prints the speedup old / new time per cell.
#
#   bash bench/ab.sh "base=build/ab/base new=build/ab/new" --hdims 64 --passes fwd
#
# Each run is stopped after AB_TIMEOUT seconds (default 300; raise it for long runs).
# Writes $OUT/<label>-<rep>.jsonl (and .txt) for rep 1, 2, and all of them again in one
# file, $OUT.tar, on any exit (a device call brings back 8 files: put its OUT folders one
# level below its $OUT, and the tars come back first). With --generate after the
# builds, each run is the generation example's instead (its arguments follow):
#
#   bash bench/ab.sh "base=build/ab/base new=build/ab/new" --generate --preset gpu --batch 32
set -euo pipefail
cd "$(dirname "$0")/.."
builds=${1:?usage: ab.sh "label=dir ..." [--generate] [bench.run or generate.py args]}
shift
run=(python3 -m bench.run --backends jax_fa4)
record=--out
if [ "${1-}" = --generate ]; then
  shift
  run=(python3 examples/generate.py)
  record=--json  # which appends: each run's file is removed first
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
out=${OUT:-build/ab-out}
mkdir -p "$out"
keep=$(mktemp -d)
cp -r jax_fa4 "$keep/"
# The checkout's own jax_fa4 back, also after a failed run: later commands use it. The
# runs' files go into $out.tar on any exit too: a device call brings back only a few
# files, and a build that hangs in rep 1 would otherwise leave the others' lines behind.
trap 'tar -cf "$out.tar" -C "$out" .; rm -rf jax_fa4 && cp -r "$keep/jax_fa4" . && rm -rf "$keep"' EXIT
# Rep 2 runs the builds in reverse: a drift over the call (clocks, temperature) then
# favours neither side.
reversed=$(printf '%s\n' $builds | tac | tr '\n' ' ')
for rep in 1 2; do
  order=$builds
  if [ "$rep" = 2 ]; then order=$reversed; fi
  for build in $order; do
    label=${build%%=*}
    dir=${build#*=}
    if [ ! -f "$dir/_ffi.abi3.so" ]; then gunzip -k "$dir/_ffi.abi3.so.gz"; fi
    rm -rf jax_fa4 && cp -r "$keep/jax_fa4" .
    if [ -d "$dir/jax_fa4" ]; then cp "$dir"/jax_fa4/*.py jax_fa4/; fi
    cp "$dir/_ffi.abi3.so" jax_fa4/_ffi.abi3.so
    echo "== $label rep $rep"
    rm -f "$out/$label-$rep.jsonl"
    # A build that hangs (a new kernel's pipeline, say) fails after AB_TIMEOUT seconds
    # (default 300), not at the end of the device call.
    timeout "${AB_TIMEOUT:-300}" "${run[@]}" "$@" "$record" "$out/$label-$rep.jsonl" \
      > "$out/$label-$rep.txt" 2>&1 || {
        status=$?
        tail -n 20 "$out/$label-$rep.txt"
        echo "$label rep $rep failed: exit $status (124: timed out)"
        exit 1
      }
  done
done
