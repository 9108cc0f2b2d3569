"""Decode-step attention with L2 emptied before every call, as inside a model's decode
loop (examples/generate.py), where the other layers' weights and caches pass through
L2 between two calls of one layer. `bench.run`'s decode cells call the kernel back to
back, so part of the cache is still in L2; here a 256 MB pass runs first each time:

    python -m bench.cold_decode                        # the generation example's step
    python -m bench.cold_decode --keys 8192 --batch 1 --head-dim 128 --flush dirty

`--flush clean` reads the 256 MB (as the loop reads its weights: L2 is left clean),
`dirty` writes it (L2 is left full of lines to write back). Each backend runs `--calls`
steps in one jitted loop whose carry holds the cache (the appending call writes it in
place) and prints the median CUPTI time of the attention kernels of a step (and of
each, where a split-KV step runs the split kernel and the combine):

    paged_append  jax_fa4.paged_attention with the step's own key and value (k_new)
    paged         jax_fa4.paged_attention
    lengths       jax_fa4.attention on the same keys as a dense cache, with kv_lengths
    cudnn         jax.nn.dot_product_attention(implementation="cudnn"), kv lengths

The paged cache hands each sequence its pages in a random order. All sequences have
--keys keys; the dense cache holds the same values in (batch, pages * page size).
"""

import argparse
import statistics

import jax
import jax.numpy as jnp

import jax_fa4
from bench.timing import kernel_times

FLUSH_ELEMENTS = 128 << 20  # bf16: 256 MB, five times the H100's L2
BACKENDS = ("paged_append", "paged", "lengths", "cudnn")


# Kernel name parts of the attention kernels: jax_fa4's forward and split-KV combine
# (CuTe-DSL names), cuDNN's forward and its split-KV reduction (seen in --kernels lines
# of bench.run, bench/results/2026-11-25-h100.jsonl; leaving it out had understated a
# batch-1 cuDNN step at 8k keys by 24%). XLA's own small kernels around either call (a
# split's reshapes, jax_fa4's segment rows) are not counted.
ATTENTION_KERNELS = ("FwdSm90", "FwdKeysAsM", "SplitCombine", "sdpa", "lean_reduction")


def _is_attention(kernel: str) -> bool:
    return any(part in kernel for part in ATTENTION_KERNELS)


def step_times(kernels, calls: int) -> list[list[float]]:
    """Each step's attention kernels' times, [[ms of its first kernel, ...], ...], from
    one run's [(kernel name, ms)] in launch order (bench.timing.kernel_times; a
    split-KV step launches the split kernel and the combine)."""
    times = [ms for kernel, ms in kernels if _is_attention(kernel)]
    if not times or len(times) % calls:
        raise RuntimeError(f"{len(times)} attention kernels in {calls} steps")
    per_step = len(times) // calls
    return [times[i:i + per_step] for i in range(0, len(times), per_step)]


def summary(steps: list[list[float]]) -> str:
    """The median step's time in us and, for steps of several kernels, each kernel's
    median."""
    text = f"{statistics.median(sum(step) for step in steps) * 1e3:8.2f} us a step"
    if len(steps[0]) > 1:
        parts = [statistics.median(step[i] for step in steps) * 1e3
                 for i in range(len(steps[0]))]
        text += f" (kernels {' + '.join(f'{t:.2f}' for t in parts)})"
    return text


def flushed_loop(step, q, calls: int, flush_kind: str):
    """run(flush, k, v): `calls` steps step(q, k, v) -> (out, k, v) in one loop, each
    after a pass over `flush` that reads it ("clean") or writes it ("dirty")."""
    def body(i, carry):
        acc, flush, k, v = carry
        if flush_kind == "dirty":
            flush = flush + 1
            after = flush[0]
        else:
            # Tied to the step's index: otherwise XLA hoists the read out of the loop,
            # and it runs once, not before every step.
            flush, _ = jax.lax.optimization_barrier((flush, i))
            after = jnp.max(flush)
        # q waits for the flush, so that XLA runs it first.
        out, k, v = step(q + (after * 0).astype(q.dtype), k, v)
        return acc + out, flush, k, v

    def run(flush, k, v):
        return jax.lax.fori_loop(0, calls, body, (jnp.zeros_like(q), flush, k, v))

    return run


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--heads-kv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--keys", type=int, default=1152, help="keys of every sequence")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--flush", choices=("clean", "dirty"), default="clean")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--backends", default=",".join(BACKENDS))
    args = ap.parse_args(argv)
    sizes = ("batch", "heads", "heads_kv", "head_dim", "keys", "page_size", "calls")
    for name in sizes:
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.heads % args.heads_kv:
        ap.error("--heads-kv must divide --heads")
    args.backends = args.backends.split(",")
    unknown = sorted(set(args.backends) - set(BACKENDS))
    if unknown:
        ap.error(f"unknown backends {', '.join(unknown)}: choose from {', '.join(BACKENDS)}")
    return args


def main(argv=None):
    args = parse(argv)
    if jax.default_backend() != "gpu":
        raise SystemExit("bench.cold_decode times GPU kernels: it needs a GPU")

    b, hq, hkv, d, ps = args.batch, args.heads, args.heads_kv, args.head_dim, args.page_size
    pages_per_seq = -(-args.keys // ps)
    pages = b * pages_per_seq
    keys = jax.random.split(jax.random.key(0), 6)
    q = jax.random.normal(keys[0], (b, 1, hq, d), jnp.bfloat16)
    new = (jax.random.normal(keys[1], (b, 1, hkv, d), jnp.bfloat16),
           jax.random.normal(keys[2], (b, 1, hkv, d), jnp.bfloat16))
    lengths = jnp.full((b,), args.keys, jnp.int32)
    table = jax.random.permutation(keys[3], pages).reshape(b, -1).astype(jnp.int32)

    def cache(key):
        return jax.random.normal(key, (pages, ps, hkv, d), jnp.bfloat16)

    def as_dense(c):
        """The paged cache's keys in sequence order, (B, pages_per_seq * ps, Hkv, D)."""
        return c[table.reshape(-1)].reshape(b, pages_per_seq * ps, hkv, d)

    steps = {
        "paged_append": lambda q, k, v: jax_fa4.paged_attention(
            q, k, v, table, lengths, k_new=new[0], v_new=new[1]),
        "paged": lambda q, k, v: (jax_fa4.paged_attention(q, k, v, table, lengths), k, v),
        "lengths": lambda q, k, v: (jax_fa4.attention(q, k, v, kv_lengths=lengths), k, v),
        "cudnn": lambda q, k, v: (jax.nn.dot_product_attention(
            q, k, v, key_value_seq_lengths=lengths, implementation="cudnn"), k, v),
    }
    print(f"# {jax.devices()[0].device_kind}: batch {b}, {hq}/{hkv} heads of {d}, "
          f"{args.keys} keys, pages of {ps}, {args.flush} flush, median of {args.calls}")
    for name in args.backends:
        k, v = cache(keys[4]), cache(keys[5])
        if not name.startswith("paged"):
            k, v = as_dense(k), as_dense(v)

        run = flushed_loop(steps[name], q, args.calls, args.flush)
        kernels = kernel_times(run, jnp.ones((FLUSH_ELEMENTS,), jnp.bfloat16), k, v,
                               iterations=2)
        print(f"{name:>13}: {summary(step_times(kernels, args.calls))}", flush=True)


if __name__ == "__main__":
    main()
