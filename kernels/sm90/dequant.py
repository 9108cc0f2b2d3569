"""K and V blocks in float8 into the 16-bit buffers the wgmma reads (kv_dtype variants of
the forward, kernels/sm90/fwd.py).

TMA lands each e4m3 block in a ring of its own; the consumer warpgroup converts it into
a single 16-bit K (V) buffer laid out as the 16-bit kernels' rings are, and frees the
ring slot at once, so the loads run ahead by the whole ring while the block is used.
The conversion is exact (every e4m3 value is a bf16 and an fp16 value); the descales
stay out of it (the scores' scale and out take them).
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline

RUN = 16  # float8 values per thread access: 16 bytes, one swizzle granule


@cute.jit
def convert_block(src: cute.Tensor, dst: cute.Tensor, contiguous: cutlass.Constexpr,
                  tidx, threads: cutlass.Constexpr):
    """dst = src in dst's element type; both are (rows, cols) views of shared memory
    whose mode `contiguous` is contiguous in runs of RUN values. Each of `threads`
    threads converts whole runs: a 16-byte load, 32 bytes stored."""
    run = (1, RUN) if cutlass.const_expr(contiguous == 1) else (RUN, 1)
    src_runs = cute.zipped_divide(src, run)
    dst_runs = cute.zipped_divide(dst, run)
    count = cute.size(src_runs, mode=[1])
    assert count % threads == 0, (src.layout, threads)
    for i in cutlass.range_constexpr(count // threads):
        at = tidx + i * threads
        values = cute.make_rmem_tensor((RUN,), src.element_type)
        cute.autovec_copy(src_runs[None, at], values)
        wide = cute.make_rmem_tensor((RUN,), dst.element_type)
        wide.store(values.load().to(dst.element_type))
        cute.autovec_copy(wide, dst_runs[None, at])


@cute.jit
def dequantize(pairs, barrier_id, tidx, threads: cutlass.Constexpr):
    """Convert each (src, dst, contiguous mode) of `pairs` (convert_block) by one
    warpgroup: first every warp must be past the wgmma that last read dst (a warp's
    wait covers its own part of the MMA only), and after the stores the async proxy
    must see them before any warp's wgmma reads dst."""
    barrier = pipeline.NamedBarrier(barrier_id, threads)
    barrier.arrive_and_wait()
    for src, dst, contiguous in pairs:
        convert_block(src, dst, contiguous, tidx, threads)
    cute.arch.fence_proxy("async.shared", space="cta")
    barrier.arrive_and_wait()
