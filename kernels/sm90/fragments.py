"""Register-fragment views for sm90 warpgroup MMA (wgmma) accumulators.

A wgmma m64nNk16 accumulator holds, per thread, the layout ((2, 2, N/8), MMA_M, MMA_N):
mode (0,0) steps one column, mode (0,1) steps 8 rows, mode (0,2) steps 8 columns. The
4 threads of a quad (lanes 4k..4k+3) share the same two rows.
"""

import cutlass.cute as cute


def rows_cols(t: cute.Tensor) -> cute.Tensor:
    """View an accumulator-shaped tensor (values or coordinates) as (rows, cols)."""
    (v_col, v_row, v_blk), mma_m, mma_n = t.layout.shape
    (d_col, d_row, d_blk), s_m, s_n = t.layout.stride
    layout = cute.make_layout(
        ((v_row, mma_m), (v_col, v_blk, mma_n)),
        stride=((d_row, s_m), (d_col, d_blk, s_n)),
    )
    return cute.make_tensor(t.iterator, layout)


def acc_as_operand_a(acc_layout: cute.Layout) -> cute.Layout:
    """The wgmma register A-operand layout ((2, 2, 2), 1, N/16) over the registers of a
    16-bit copy of a ((2, 2, N/8), 1, 1) accumulator: a k16 slice of A owns exactly the
    values of two adjacent 8-column blocks of the accumulator, so no data moves."""
    (v_col, v_row, v_blk), mma_m, mma_n = acc_layout.shape
    (d_col, d_row, d_blk), _, _ = acc_layout.stride
    assert (v_col, v_row, mma_m, mma_n) == (2, 2, 1, 1) and v_blk % 2 == 0, acc_layout
    return cute.make_layout(
        ((2, 2, 2), 1, v_blk // 2),
        stride=((d_col, d_row, d_blk), 0, 2 * d_blk),
    )


def convert(src: cute.Tensor, dst: cute.Tensor, piece: int = 8):
    """dst = src in dst's element type, `piece` values at a time; src and dst share one
    compact register layout. Converted whole, a 40-value fragment (d256's 80-key
    tiles) came out of the compiler one cvt per value, packed into pairs just before
    each wgmma, where ptxas then fenced the PV GEMM at every k-step (C7519); pieces of
    8 convert in pairs (cvt.rn.bf16x2.f32) and leave the wgmma unfenced: the d256
    forward ran 1.03-1.04x at 512 and 2k tokens without a mask and 1.01-1.03x causal
    from 2k (H100, 2026-11-25, alternated twice in one call; 16k 0.95-1.04, noise).
    The other head dims' tiles convert in pairs either way (d128's PTX is unchanged)."""
    n = cute.size(src)
    assert n % piece == 0 and cute.size(dst) == n, (n, piece)
    pieces = cute.make_layout((piece, n // piece))
    src_flat = cute.make_tensor(src.iterator, pieces)
    dst_flat = cute.make_tensor(dst.iterator, pieces)
    for j in range(n // piece):  # unrolled as the kernel is traced
        dst_flat[None, j].store(src_flat[None, j].load().to(dst.element_type))
