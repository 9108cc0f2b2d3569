#!/usr/bin/env bash
# Build a variant of this checkout for bench/ab.sh: copy the tree, apply a Python
# snippet to kernels/config.py (the source text is `s`), build the wheel, and keep its
# native module, gzipped (a carry to a GPU machine holds several), under
# build/ab/NAME/_ffi.abi3.so.gz, which ab.sh unzips, next to its jax_fa4/*.py.
#
#   bash bench/variant.sh base ''
#   bash bench/variant.sh pdl 's = s.replace("n=128, q_stages=2)", "n=128, q_stages=2, pdl=True)")'
#
# About 4 minutes on 2 idle cores (every kernel is compiled: config.py is part of the
# kernel cache key). Needs a Python >= 3.12 with pip (PYTHON, default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:?usage: variant.sh NAME 'python edit of s, the text of kernels/config.py'}
edit=${2-}
root=$(pwd)
python=${PYTHON:-.venv/bin/python}
# The build runs in a copy of the tree: a relative interpreter path is this tree's.
case $python in */*) [ "${python#/}" != "$python" ] || python=$root/$python ;; esac
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git ls-files -co --exclude-standard | tar cf - -T - | tar xf - -C "$work"
"$python" - "$work/kernels/config.py" "$edit" <<'P'
import pathlib, sys
path, edit = pathlib.Path(sys.argv[1]), sys.argv[2]
s = path.read_text()
before = s
exec(edit)
if edit and s == before:
    sys.exit(f"variant.sh: the edit changed nothing in {path}")
path.write_text(s)
P
echo "building $name"
(cd "$work" && "$python" -m pip wheel --no-deps -w dist . > build.log 2>&1) ||
  { tail -n 40 "$work/build.log"; exit 1; }
mkdir -p "build/ab/$name"
unzip -p "$work"/dist/jax_fa4-*.whl jax_fa4/_ffi.abi3.so | gzip -9 > "build/ab/$name/_ffi.abi3.so.gz"
# Its Python side too, for ab.sh: a variant of another branch may call the kernels
# differently.
rm -rf "build/ab/$name/jax_fa4" && mkdir -p "build/ab/$name/jax_fa4"
cp "$work"/jax_fa4/*.py "build/ab/$name/jax_fa4/"
echo "build/ab/$name/_ffi.abi3.so.gz"
