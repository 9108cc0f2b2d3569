#!/usr/bin/env bash
# The portable wheel: build it (bash run.sh wheel), then install it into a fresh venv
# that sees no CUDA toolkit and no CuTe-DSL, and check that it imports with its
# kernels, lowers the kernel path for CUDA and runs the CPU path. Run by .ci/run after
# the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash run.sh wheel
wheel=$(ls dist/jax_fa4-*manylinux*.whl)
echo "wheel: $wheel ($(du -h "$wheel" | cut -f1))"

clean=$(mktemp -d)/venv
python=$(.venv/bin/python -c 'import sys; print(sys._base_executable)')
"$python" -m venv "$clean"
# No toolkit on the path and no CUDA variables: what a user's machine may look like.
env -i HOME="$HOME" PATH=/usr/bin:/bin "$clean/bin/python" -m pip install -q "$wheel"
# The native module needs the C library alone (cudart and the kernels are inside it).
module=$(ls "$clean"/lib/python3.*/site-packages/jax_fa4/_ffi*.so)
needed=$(ldd "$module" | grep -vE 'linux-vdso|ld-linux|libc\.so' || true)
if [ -n "$needed" ]; then
  echo "the native module needs more than libc:"$'\n'"$needed" >&2
  exit 1
fi
# From an empty folder, so that the checkout's own jax_fa4 cannot stand in for the wheel's.
cd "$(mktemp -d)"
env -i HOME="$HOME" PATH=/usr/bin:/bin "$clean/bin/python" - "$clean" <<'PY'
import importlib.util
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_fa4
from jax_fa4 import _registry

assert jax_fa4.__file__.startswith(sys.argv[1]), f"not the wheel's: {jax_fa4.__file__}"
assert importlib.util.find_spec("cutlass") is None, "CuTe-DSL is installed"
assert not _registry.native_reason(), _registry.native_reason()
kernels = jax_fa4.kernels()
assert len(kernels) >= 100, len(kernels)
q = jax.ShapeDtypeStruct((2, 256, 4, 128), jnp.bfloat16)
text = jax.jit(lambda q: jax_fa4.attention(q, q, q, causal=True)).trace(q).lower(
    lowering_platforms=("cuda",)).as_text()
assert "custom_call @jax_fa4_fwd" in text
x = jax.random.normal(jax.random.key(0), (2, 64, 4, 128), jnp.float32)
out = jax_fa4.attention(x, x, x, causal=True)
want = jax_fa4.attention(x, x, x, causal=True, implementation="reference")
np.testing.assert_array_equal(out, want)
print(f"clean venv: jax {jax.__version__}, {len(kernels)} kernels, kernel path lowers "
      "for CUDA, the CPU path runs")
PY
