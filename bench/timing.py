"""Device-side timing: CUPTI kernel durations through JAX's Mosaic GPU profiler.

The time of a call is the sum of the GPU kernels it launches, so host dispatch does
not count (it matters below ~0.3 ms). Where CUPTI cannot be used (another profiler
attached, a plugin without Mosaic GPU), `make_timer` falls back to the wall clock over
back-to-back calls and says so: the method is recorded with every measurement.
"""

import statistics
import time

import jax
import jax.numpy as jnp


def _cupti_ms(fn, *args, iterations):
    from jax.experimental.mosaic.gpu import profiler

    _, times = profiler.measure(fn, iterations=iterations)(*args)
    if not times:
        raise RuntimeError("no GPU kernels were launched")
    return statistics.median(times)


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


def _wall_ms(fn, *args, iterations):
    t0 = time.perf_counter()
    for _ in range(iterations):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iterations * 1e3


def make_timer():
    """-> (method name, timer(fn, *args, iterations) -> median ms); fn is jitted and
    warmed up by the timer."""
    probe = jax.jit(lambda x: x * 2)
    x = jnp.ones((1024,), jnp.float32)
    try:
        _cupti_ms(probe, x, iterations=2)
        method, measure = "cupti", _cupti_ms
    except Exception as e:  # report the reason, keep going with the fallback
        print(f"# CUPTI timing unavailable ({type(e).__name__}: {e}); using wall clock")
        method, measure = "wall", _wall_ms

    def timer(fn, *args, iterations=20, warmup=3):
        jitted = jax.jit(fn)
        for _ in range(warmup):
            jax.block_until_ready(jitted(*args))
        return measure(jitted, *args, iterations=iterations)

    return method, timer
