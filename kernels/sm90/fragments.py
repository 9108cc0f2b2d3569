"""Register-fragment views for sm90 warpgroup MMA (wgmma) accumulators.

A wgmma m64nNk16 accumulator holds, per thread, the layout ((2, 2, N/8), MMA_M, MMA_N)
(((2, 2), MMA_M, MMA_N) at N = 8):
mode (0,0) steps one column, mode (0,1) steps 8 rows, mode (0,2) steps 8 columns. The
4 threads of a quad (lanes 4k..4k+3) share the same two rows.
"""

import cutlass.cute as cute


def rows_cols(t: cute.Tensor) -> cute.Tensor:
    """View an accumulator-shaped tensor (values or coordinates) as (rows, cols)."""
    (values, mma_m, mma_n), (strides, s_m, s_n) = t.layout.shape, t.layout.stride
    if len(values) == 2:  # N = 8: one 8-column block
        values, strides = (*values, 1), (*strides, 0)
    (v_col, v_row, v_blk), (d_col, d_row, d_blk) = values, strides
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


# float8 P as the register A operand of O += P V. An m64nNk32 e4m3 A slice holds, per
# thread, 16 values (4 columns, 2 row halves, 2 column halves: columns 4t..4t+3 and
# 16+4t..16+4t+3 of lane quad index t), while the accumulator's ((2, 2, N/8)) holds
# columns 2t, 2t+1 of each 8-column block. No shuffle between threads moves one into the
# other: the thread's 8 accumulator columns of a 32-column slice fill its 8 A columns of
# that slice in order, so A column 16 h + 4 t + 2 q + p holds score column 16 h + 8 q +
# 2 t + p, and V's keys come in that order instead (jax_fa4/_float8.py transposed_v),
# which the sum over keys does not see.
def acc_as_fp8_operand_a(acc_layout: cute.Layout) -> cute.Layout:
    """The e4m3 A-operand layout ((4, 2, 2), 1, N/32) over a compact fragment of the
    accumulator's size (N/2 values), filled by convert_to_fp8_operand_a."""
    (v_col, v_row, v_blk), mma_m, mma_n = acc_layout.shape
    assert (v_col, v_row, mma_m, mma_n) == (2, 2, 1, 1) and v_blk % 4 == 0, acc_layout
    return cute.make_layout(((4, 2, 2), 1, v_blk // 4), stride=((1, 4, 8), 0, 16))


def convert_to_fp8_operand_a(src: cute.Tensor, dst: cute.Tensor):
    """dst (acc_as_fp8_operand_a's registers) = the accumulator src in e4m3: the column
    pair (p, row r, block j = 4 s + 2 h + q) of src goes to A slot (2 q + p, r, h) of
    slice s, two values (one cvt) at a time."""
    (v_col, v_row, v_blk), _, _ = src.layout.shape
    (d_col, d_row, d_blk), _, _ = src.layout.stride
    assert d_col == 1, src.layout
    for j in range(v_blk):  # unrolled as the kernel is traced
        s, h, q = j // 4, (j % 4) // 2, j % 2
        for r in range(v_row):
            at_src = r * d_row + j * d_blk
            at_dst = 2 * q + 4 * r + 8 * h + 16 * s
            pair = cute.make_tensor(src.iterator + at_src, cute.make_layout(2))
            out = cute.make_tensor(dst.iterator + at_dst, cute.make_layout(2))
            out.store(pair.load().to(dst.element_type))
