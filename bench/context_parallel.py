"""Context-parallel scaling: one long sequence on 1 GPU and split over several GPUs.

    python -m bench.context_parallel                       # 128k tokens, all local GPUs
    python -m bench.context_parallel --devices 2,4         # 2 and 4 GPUs, one baseline
    python -m bench.context_parallel --documents 8         # 8 packed documents
    python -m bench.context_parallel --seqlen 262144 --causal true

The single-GPU run is `jax_fa4.attention` on the whole sequence; the multi-GPU runs
shard the sequence and run ring attention, in both forms: `shard_map` with
`ring_attention` (zigzag layout when causal, which balances the work) and a jit over
sequence-sharded arrays (the automatic path, contiguous chunks). With --documents N the
sequence packs N equal documents (segment ids; the key ids travel around the ring with
K/V). Each pass is timed on the wall clock over back-to-back calls (several GPUs and
their transfers: no single kernel timeline), forward and forward + backward.

--breakdown (one document) also times the `shard_map` ring with its K/V hops removed:
each device attends its own chunk at every step, the same kernels and merges without
the transfers. t(n GPUs) - that is the communication left exposed; that - t(1 GPU) / n
is the ring's own compute overhead (merges, smaller kernels, uneven work).

--timeline traces one call of each ring and prints where GPU 0's time went
(bench/timeline.py): attention kernels, NCCL kernels (the hops) and how much of them ran
under an attention kernel, other kernels, idle.

Scaling efficiency = t(1 GPU) / (n * t(n GPUs)); TFLOP/s per GPU uses bench/flops.py
(visible pairs only: causal halves them, documents divide them). Appends one JSON line
per measurement to --out.
"""

import argparse
import contextlib
import dataclasses
import json
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_fa4
from bench.flops import attention_flops
from bench.timeline import timeline
from bench.timing import _wall_ms

AXIS = "s"
SEQ, IDS = P(None, AXIS, None, None), P(None, AXIS)


def _segment_args(ids):
    """The attention keyword arguments of packed documents: {} for one document."""
    return {} if ids is None else {"q_segment_ids": ids, "kv_segment_ids": ids}


def single(causal):
    """attention(q, k, v, ids) on whole arrays (one GPU, or the sequence-sharded jit)."""
    def attn(q, k, v, ids):
        return jax_fa4.attention(q, k, v, causal=causal, implementation="cute",
                                 **_segment_args(ids))
    return attn


def ring_shard_map(mesh, causal):
    """Inputs in the ring's layout (zigzag when causal), ids laid out like q."""
    layout = "zigzag" if causal else "contiguous"

    def attn(q, k, v, ids):
        return jax_fa4.ring_attention(q, k, v, axis_name=AXIS, causal=causal, layout=layout,
                                      implementation="cute", **_segment_args(ids))
    return jax.shard_map(attn, mesh=mesh, in_specs=(SEQ, SEQ, SEQ, IDS), out_specs=SEQ)


@contextlib.contextmanager
def hops_removed():
    """The ring traced without its K/V transfers (--breakdown); the chunk ids, and so
    every step's kernels, are those of the real ring. The barrier keeps XLA from
    merging the steps' calls, which would see the same K/V."""
    with mock.patch.object(jax_fa4._context_parallel, "hop",
                           lambda values, *_: jax.lax.optimization_barrier(values)):
        yield


def with_backward(attn):
    """Forward and backward: the gradients of <out, dout> with respect to q, k, v."""
    def run(q, k, v, ids, dout):
        _, pullback = jax.vjp(lambda q, k, v: attn(q, k, v, ids), q, k, v)
        return pullback(dout)
    return run


def compiled(name, attn, inputs):
    """(jitted and warmed up, its arguments) of the forward ("fwd") or forward + backward
    ("fwd_bwd"); inputs = (q, k, v, ids, dout)."""
    fn, args = (attn, inputs[:4]) if name == "fwd" else (with_backward(attn), inputs)
    jitted = jax.jit(fn)
    for _ in range(2):
        jax.block_until_ready(jitted(*args))
    return jitted, args


def wall_ms(call, iterations):
    """Wall-clock ms of a `compiled` call."""
    fn, args = call
    return _wall_ms(fn, *args, iterations=iterations)


def _counts(text, available):
    counts = sorted({int(c) for c in text.split(",")}) if text else [available]
    bad = [c for c in counts if not 2 <= c <= available]
    if bad:
        raise ValueError(f"--devices takes counts from 2 to the {available} local devices; "
                         f"got {bad}")
    return counts


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=131072)
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--heads", type=int, help="default: 2048 / hdim (hidden 2048)")
    ap.add_argument("--causal", default="false,true", help="comma-separated false, true")
    ap.add_argument("--devices", help="comma-separated GPU counts, each >= 2 "
                                      "(default: all local GPUs)")
    ap.add_argument("--documents", type=int, default=1,
                    help="equal documents packed in the sequence (segment ids)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time the shard_map ring without its K/V transfers")
    ap.add_argument("--timeline", action="store_true",
                    help="also print where GPU 0's time goes in each ring (one traced call)")
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                  "context_parallel.jsonl"))
    args = ap.parse_args()
    masks = args.causal.split(",")
    if not set(masks) <= {"false", "true"}:
        ap.error(f"--causal takes false, true; got {args.causal!r}")
    gpus = jax.devices()
    if len(gpus) < 2:
        ap.error(f"needs 2 or more devices; found {len(gpus)}")
    try:
        counts = _counts(args.devices, len(gpus))
    except ValueError as e:
        ap.error(str(e))
    s, d, docs = args.seqlen, args.hdim, args.documents
    h = args.heads or 2048 // d
    for n in counts:
        if s % (2 * n):
            ap.error(f"--seqlen must divide into {2 * n} chunks for {n} devices")
    if docs < 1 or s % docs:
        ap.error(f"--documents must be >= 1 and divide --seqlen; got {docs}")
    if args.breakdown and docs > 1:
        # Without the hops each device would match its own documents at every step.
        ap.error("--breakdown times one document only")
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, dout = (jax.random.normal(key, (1, s, h, d), jnp.float32).astype(jnp.bfloat16)
                     for key in keys)
    ids = None if docs == 1 else (jnp.arange(s, dtype=jnp.int32) * docs // s)[None]
    host = (q, k, v, ids, dout)
    print(f"# {counts} x {gpus[0].device_kind}, jax {jax.__version__}, seqlen {s}, "
          f"{docs} document(s), heads {h}, head_dim {d}, bf16, wall clock, "
          f"{args.iterations} iterations")
    bare_column = " shard_map without transfers ms |" if args.breakdown else ""
    print("| GPUs | causal | pass | 1 GPU ms | shard_map ring ms | auto ring ms | "
          f"efficiency (shard_map / auto) | TFLOP/s per GPU (1 / shard_map / auto) |"
          f"{bare_column}")
    print("|---|---|---|---|---|---|---|---|" + ("---|" if args.breakdown else ""))
    on_one = jax.device_put(host, gpus[0])
    with open(args.out, "a") as out:
        for causal in (m == "true" for m in masks):
            for name in ("fwd", "fwd_bwd"):
                t1 = wall_ms(compiled(name, single(causal), on_one), args.iterations)
                flops = attention_flops(1, h, s, s, d, causal, "fwd", documents=docs)
                flops *= 1.0 if name == "fwd" else 3.5
                for n in counts:
                    mesh = Mesh(np.array(gpus[:n]), (AXIS,))
                    seq, rows = NamedSharding(mesh, SEQ), NamedSharding(mesh, IDS)
                    shardings = (seq, seq, seq, rows, seq)
                    laid = tuple(None if x is None else jax_fa4.zigzag(x, n) if causal else x
                                 for x in host)
                    in_ring = jax.device_put(laid, shardings)
                    contiguous = jax.device_put(host, shardings)
                    ring = compiled(name, ring_shard_map(mesh, causal), in_ring)
                    auto = compiled(name, single(causal), contiguous)
                    t_ring, t_auto = (wall_ms(c, args.iterations) for c in (ring, auto))
                    record, bare = {}, ""
                    if args.breakdown:
                        with hops_removed():
                            no_hops = compiled(name, ring_shard_map(mesh, causal), in_ring)
                            record["ms_shard_map_no_transfers"] = wall_ms(no_hops,
                                                                          args.iterations)
                        bare = f" {record['ms_shard_map_no_transfers']:.1f} |"
                    if args.timeline:
                        line_ring, line_auto = (timeline(fn, *a) for fn, a in (ring, auto))
                        record["timeline_shard_map"] = dataclasses.asdict(line_ring)
                        record["timeline_auto"] = dataclasses.asdict(line_auto)
                    eff = [t1 / (n * t) for t in (t_ring, t_auto)]
                    per_gpu = [flops / (t * 1e-3) / 1e12 / k
                               for t, k in ((t1, 1), (t_ring, n), (t_auto, n))]
                    print(f"| {n} | {causal} | {name} | {t1:.1f} | {t_ring:.1f} | "
                          f"{t_auto:.1f} | {eff[0]:.0%} / {eff[1]:.0%} | "
                          f"{per_gpu[0]:.0f} / {per_gpu[1]:.0f} / {per_gpu[2]:.0f} |{bare}",
                          flush=True)
                    if args.timeline:
                        print(f"|   | GPU 0 timeline | shard_map: {line_ring} | "
                              f"jit: {line_auto} |", flush=True)
                    out.write(json.dumps({
                        "devices": n, "device": gpus[0].device_kind, "seqlen": s,
                        "documents": docs, "heads": h, "head_dim": d, "causal": causal,
                        "mode": name, "timing": "wall", "ms_1gpu": t1,
                        "ms_shard_map": t_ring, "ms_auto": t_auto,
                        "efficiency_shard_map": eff[0], "efficiency_auto": eff[1],
                        "xla_flags": os.environ.get("XLA_FLAGS", ""), **record}) + "\n")


if __name__ == "__main__":
    main()
