"""Context-parallel scaling: one long sequence on 1 GPU and split over all local GPUs.

    python -m bench.context_parallel                       # 128k tokens, causal and not
    python -m bench.context_parallel --seqlen 262144 --causal true

The single-GPU run is `jax_fa4.attention` on the whole sequence; the multi-GPU runs
shard the sequence and run ring attention, in both forms: `shard_map` with
`ring_attention` (zigzag layout when causal, which balances the work) and a jit over
sequence-sharded arrays (the automatic path, contiguous chunks). Each pass is timed on
the wall clock over back-to-back calls (several GPUs and their transfers: no single
kernel timeline), forward and forward + backward.

Scaling efficiency = t(1 GPU) / (n * t(n GPUs)); TFLOP/s per GPU uses bench/flops.py.
Appends one JSON line per measurement to --out.
"""

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fa4
from bench.flops import attention_flops
from bench.timing import _wall_ms

AXIS = "s"
SEQ, ROWS = P(None, AXIS, None, None), P(None, None, AXIS)


def single(causal):
    def attn(q, k, v):
        return jax_fa4.attention(q, k, v, causal=causal, implementation="cute")
    return attn


def ring_shard_map(mesh, causal):
    """Inputs in the ring's layout (zigzag when causal)."""
    layout = "zigzag" if causal else "contiguous"
    return jax.shard_map(
        functools.partial(jax_fa4.ring_attention, axis_name=AXIS, causal=causal,
                          layout=layout, implementation="cute"),
        mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ)


def with_backward(attn):
    """Forward and backward: the gradients of <out, dout> with respect to q, k, v."""
    def run(q, k, v, dout):
        _, pullback = jax.vjp(attn, q, k, v)
        return pullback(dout)
    return run


def timed(name, attn, inputs, iterations):
    """Wall-clock ms of the forward ("fwd") or forward + backward ("fwd_bwd")."""
    fn, args = (attn, inputs[:3]) if name == "fwd" else (with_backward(attn), inputs)
    jitted = jax.jit(fn)
    for _ in range(2):
        jax.block_until_ready(jitted(*args))
    return _wall_ms(jitted, *args, iterations=iterations)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=131072)
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--heads", type=int, help="default: 2048 / hdim (hidden 2048)")
    ap.add_argument("--causal", default="false,true", help="comma-separated false, true")
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                  "context_parallel.jsonl"))
    args = ap.parse_args()
    masks = args.causal.split(",")
    if not set(masks) <= {"false", "true"}:
        ap.error(f"--causal takes false, true; got {args.causal!r}")
    gpus = jax.devices()
    n = len(gpus)
    if n < 2:
        ap.error(f"needs 2 or more devices; found {n}")
    s, d = args.seqlen, args.hdim
    h = args.heads or 2048 // d
    if s % (2 * n):
        ap.error(f"--seqlen must divide into {2 * n} chunks")
    mesh = Mesh(np.array(gpus), (AXIS,))
    keys = jax.random.split(jax.random.key(0), 4)
    host = [jax.random.normal(key, (1, s, h, d), jnp.float32).astype(jnp.bfloat16)
            for key in keys]
    print(f"# {n} x {gpus[0].device_kind}, jax {jax.__version__}, seqlen {s}, "
          f"heads {h}, head_dim {d}, bf16, wall clock, {args.iterations} iterations")
    print("| causal | pass | 1 GPU ms | shard_map ring ms | auto ring ms | "
          "efficiency (shard_map / auto) | TFLOP/s per GPU (1 / shard_map / auto) |")
    print("|---|---|---|---|---|---|---|")
    on_one = [jax.device_put(x, gpus[0]) for x in host]
    sharding = NamedSharding(mesh, SEQ)
    with open(args.out, "a") as out:
        for causal in (m == "true" for m in masks):
            laid = [jax_fa4.zigzag(x, n) if causal else x for x in host]
            in_ring = [jax.device_put(x, sharding) for x in laid]
            contiguous = [jax.device_put(x, sharding) for x in host]
            for name in ("fwd", "fwd_bwd"):
                t1 = timed(name, single(causal), on_one, args.iterations)
                t_ring = timed(name, ring_shard_map(mesh, causal), in_ring, args.iterations)
                t_auto = timed(name, single(causal), contiguous, args.iterations)
                flops = attention_flops(1, h, s, s, d, causal, "fwd")
                flops *= 1.0 if name == "fwd" else 3.5
                eff = [t1 / (n * t) for t in (t_ring, t_auto)]
                per_gpu = [flops / (t * 1e-3) / 1e12 / k
                           for t, k in ((t1, 1), (t_ring, n), (t_auto, n))]
                print(f"| {causal} | {name} | {t1:.1f} | {t_ring:.1f} | {t_auto:.1f} | "
                      f"{eff[0]:.0%} / {eff[1]:.0%} | "
                      f"{per_gpu[0]:.0f} / {per_gpu[1]:.0f} / {per_gpu[2]:.0f} |", flush=True)
                out.write(json.dumps({
                    "devices": n, "device": gpus[0].device_kind, "seqlen": s, "heads": h,
                    "head_dim": d, "causal": causal, "mode": name, "timing": "wall",
                    "ms_1gpu": t1, "ms_shard_map": t_ring, "ms_auto": t_auto,
                    "efficiency_shard_map": eff[0], "efficiency_auto": eff[1]}) + "\n")


if __name__ == "__main__":
    main()
