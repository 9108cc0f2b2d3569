"""Device-side timing: CUPTI kernel durations through JAX's Mosaic GPU profiler.

The time of a call is the sum of the GPU kernels it launches, so host dispatch does
not count (it matters below ~0.3 ms). Where CUPTI cannot be used (another profiler
attached, a plugin without Mosaic GPU), `make_timer` falls back to the wall clock over
back-to-back calls and says so: the method is recorded with every measurement.
"""

import collections
import statistics
import time

import jax
import jax.numpy as jnp

from bench.clocks import ClockSampler


def _cupti_ms(fn, *args, iterations):
    from jax.experimental.mosaic.gpu import profiler

    _, times = profiler.measure(fn, iterations=iterations)(*args)
    if not times:
        raise RuntimeError("no GPU kernels were launched")
    # One iteration gives one float, not a list of them.
    return statistics.median(times) if iterations > 1 else times


def kernel_times(fn, *args, iterations=10):
    """[(short kernel name, median ms)] of the GPU kernels one call of fn launches, in
    launch order (CUPTI; fn is jitted and warmed up by the profiler)."""
    from jax.experimental.mosaic.gpu import profiler

    _, per_call = profiler.measure(jax.jit(fn), aggregate=False, iterations=iterations)(*args)
    if not per_call:
        raise RuntimeError("no GPU kernels were launched")
    if iterations == 1:
        per_call = [per_call]
    return [(short_name(name), statistics.median(call[i][1] for call in per_call))
            for i, (name, _) in enumerate(per_call[0])]


def short_name(kernel: str, width: int = 48) -> str:
    """A kernel's name cut to what tells kernels apart: CuTe-DSL device names end in a
    long mangled signature after "_object_at_"; others are cut to `width`."""
    return kernel.split("_object_at_")[0].removeprefix("kernel_cutlass_")[:width]


FLUSH_BYTES = 256 << 20  # five times an H100's or H200's 50 MB L2


def cold_cupti_ms(fn, *args, iterations):
    """Median CUPTI time of fn's kernels when a 256 MB read empties L2 before every call
    (as in a model, where other layers' tensors pass through L2 between two calls of
    one attention); back-to-back calls of the same inputs find part of them in L2."""
    flush = jnp.ones((FLUSH_BYTES // 2,), jnp.bfloat16)
    own = collections.Counter(name for name, _ in kernel_times(fn, *args, iterations=2))

    def flushed(flush, *args):
        # The call's inputs wait for the read, so that fn's kernels on them run after it.
        args, _ = jax.lax.optimization_barrier((args, jnp.max(flush)))
        return fn(*args)

    # fn's kernels, by name, from the end (after the read; XLA names the read's
    # kernels as it likes, and one may share a name with one of fn's).
    total, left = 0.0, own.copy()
    for name, ms in reversed(kernel_times(flushed, flush, *args, iterations=iterations)):
        if left[name] > 0:
            left[name] -= 1
            total += ms
    if +left:
        raise RuntimeError(f"kernels of the call not found after the L2 read: {dict(+left)}")
    return total


def _wall_ms(fn, *args, iterations):
    t0 = time.perf_counter()
    for _ in range(iterations):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iterations * 1e3


def make_timer(cold: bool = False):
    """-> (method name, timer(fn, *args, iterations) -> (median ms, clocks)); fn is
    jitted and warmed up by the timer; clocks is bench.clocks' summary of the GPU's SM
    clock and power over the timed calls (None without NVML or a busy sample). cold: L2
    emptied before every call (CUPTI only)."""
    probe = jax.jit(lambda x: x * 2)
    x = jnp.ones((1024,), jnp.float32)
    try:
        _cupti_ms(probe, x, iterations=2)
        method, measure = ("cupti-cold", cold_cupti_ms) if cold else ("cupti", _cupti_ms)
    except Exception as e:  # report the reason, keep going with the fallback
        if cold:
            raise SystemExit(f"timing with L2 emptied needs CUPTI ({type(e).__name__}: {e})")
        print(f"# CUPTI timing unavailable ({type(e).__name__}: {e}); using wall clock")
        method, measure = "wall", _wall_ms

    def timer(fn, *args, iterations=20, warmup=3):
        jitted = jax.jit(fn)
        for _ in range(warmup):
            jax.block_until_ready(jitted(*args))
        with ClockSampler() as clocks:
            ms = measure(jitted, *args, iterations=iterations)
        return ms, clocks.summary

    return method, timer
