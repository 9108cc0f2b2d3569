"""jax_fa4 demo: attention on whatever backend this machine has.

    bash run.sh demo                       # sets up .venv, builds, runs this
    python examples/demo.py --seqlen 8192 --causal

On a Hopper GPU the call runs jax_fa4's CuTe-DSL kernel; on another GPU cuDNN (through
jax.nn) where it takes the call, else the pure-JAX reference, as on a CPU. The demo says
which path ran, how fast, and how far the result is from the fp32 reference.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_fa4


def wall_ms(fn, *args, reps):
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, help="default: 8192 on a GPU, 512 on a CPU")
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    if args.seqlen is not None and args.seqlen < 1:
        ap.error(f"--seqlen must be >= 1; got {args.seqlen}")

    device = jax.devices()[0]
    on_gpu = jax.default_backend() == "gpu"
    seqlen = args.seqlen or (8192 if on_gpu else 512)
    b, h, d = (2, 16, 128) if on_gpu else (1, 4, 64)
    dtype = jnp.bfloat16
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (b, seqlen, h, d), dtype) for key in (kq, kk, kv))

    support = jax_fa4.supports(q, k, v, causal=args.causal)
    path = {"kernel": "jax_fa4 CuTe-DSL kernel", "cudnn": f"cuDNN ({support[1]})",
            "reference": f"pure-JAX reference ({support[1]})"}[support.path]
    attention = jax.jit(lambda q, k, v: jax_fa4.attention(q, k, v, causal=args.causal))
    reference = jax.jit(lambda q, k, v: jax_fa4.attention(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
        causal=args.causal, implementation="reference"))

    out = attention(q, k, v)
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - reference(q, k, v))))
    ms = wall_ms(attention, q, k, v, reps=20 if on_gpu else 3)
    flops = 4 * b * h * seqlen * seqlen * d / (2 if args.causal else 1)

    print(f"device:  {device.device_kind} ({jax.default_backend()})")
    print(f"path:    {path}")
    print(f"shape:   q, k, v ({b}, {seqlen}, {h}, {d}) {jnp.dtype(dtype).name}, causal={args.causal}")
    print(f"time:    {ms:.3f} ms per call (wall clock), {flops / ms / 1e9:.3g} TFLOP/s")
    print(f"error:   max |out - fp32 reference| = {err:.2e}")
    if not np.isfinite(err):
        raise SystemExit("non-finite output")


if __name__ == "__main__":
    main()
