"""Split-KV combine: the partial results of a split forward merged into out and lse, in
one small kernel launched right after the split kernel (kernels/sm90/fwd.py).

Per row (batch b, packed row r, K/V head h) with S splits, from the fp32 partials
O_s (normalized per split) and LSE_s (natural log; -inf when split s saw no key):
    M = max_s LSE_s,  w_s = exp(LSE_s - M),  W = sum_s w_s
    LSE = M + log W,  O = sum_s (w_s / W) O_s
A row no split sees (M = -inf) gets O = 0 and LSE = -inf, as without splits.

Operands: mOpart (B * S, R, Hkv, Dv) and mLSEpart (B * S, Hkv, R) fp32, batch-major
(index b * S + s); mO and mLSE hold the caller's (B, R / g, Hkv * g, Dv) in dtype and
(B, Hkv * g, R / g) fp32, where g is the pack-GQA group (jax_fa4/_pack_gqa.py): packed
row r = p * g + j of K/V head h is query head h * g + j at position p. The combine
writes there directly, so that no transpose runs after it (g = 1: no packing).

One warp per row, ROWS_PER_CTA rows per CTA, one pass over the splits in chunks: every
lane reads each LSE_s of a chunk (broadcast loads) and its 4-float column groups of O_s
(16-byte loads, whole rows per warp), all of the chunk's loads issued before any merge,
then merges the chunk with one rescale of its running sums: a chunk is one round trip
to memory. Chunks hold 16 splits at Dv <= 128 (FLOATS_IN_FLIGHT): against an online
merge unrolled by 8 (H100, 2026-11-26, alternated twice, 32 / 8 heads, batch 1), d128
at 8k keys (16 splits) 1.05-1.06x, d64 at 1280 keys (10 splits) 1.05x, at 1088 keys (8
splits) 0.985x.

Per-kernel CUPTI time of a decode step's combine (H200, 2026-11-26, 32 / 8 heads, in
one process): at d128, batch 1, 16 splits, 2.8 us at 8k keys and 2.9 at 128k, where
the three XLA kernels it replaced took 3.9 and 4.5 (1.07-1.09x the whole step at 8k);
with 4 splits (d64, 1088 keys) 2.1-2.3 us against XLA's two kernels' 1.8. Measured and
not kept: the row's M first and the weights through shared memory, 3.6-3.9 us; the
loads of 16 splits at a time, each predicated, before any merge, 5.5 us.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from kernels.sm90.softmax import LN2, LOG2_E

WARP = 32
ROWS_PER_CTA = 4
QUAD = 4  # fp32 values per 16-byte access
# fp32 partial values per lane loaded before any is merged: 16 splits at Dv <= 128.
FLOATS_IN_FLIGHT = 64


def unpacked(mO: cute.Tensor, mLSE: cute.Tensor, group: Int32):
    """The caller's out (B, R / g, Hkv * g, Dv) and lse (B, Hkv * g, R / g) over the
    memory of mO (B, R, Hkv, Dv) and mLSE (B, Hkv, R), the shapes the export ABI declares
    for them (the packed problem's), both row-major."""
    batch, rows, heads_kv, dv = mO.shape
    positions, heads = rows // group, heads_kv * group
    out = cute.make_tensor(mO.iterator, cute.make_layout(
        (batch, positions, heads, dv), stride=(rows * heads_kv * dv, heads * dv, dv, 1)))
    lse = cute.make_tensor(mLSE.iterator, cute.make_layout(
        (batch, heads, positions), stride=(heads_kv * rows, positions, 1)))
    return out, lse


class SplitCombine:
    def __init__(self, dtype, head_dim_v: int):
        self.dtype = dtype
        self.head_dim_v = head_dim_v
        assert head_dim_v % QUAD == 0
        self.col_passes = -(-head_dim_v // (QUAD * WARP))
        # Splits whose loads a lane issues together (QUAD floats per column pass each).
        self.splits_in_flight = FLOATS_IN_FLIGHT // (QUAD * self.col_passes)

    def launch(self, mOpart, mLSEpart, mO, mLSE, num_splits: Int32, group: Int32, stream):
        rows = mOpart.shape[1] * mOpart.shape[2]  # packed rows x K/V heads, per batch
        self.kernel(mOpart, mLSEpart, mO, mLSE, num_splits, group).launch(
            grid=(cute.ceil_div(rows, ROWS_PER_CTA), mO.shape[0], 1),
            block=[WARP * ROWS_PER_CTA, 1, 1], stream=stream,
        )

    @cute.kernel
    def kernel(self, mOpart: cute.Tensor, mLSEpart: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor, num_splits: Int32, group: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, batch, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tidx // WARP)
        lane = tidx % WARP
        packed_rows, heads_kv = mOpart.shape[1], mOpart.shape[2]
        index = bx * ROWS_PER_CTA + warp
        if index < packed_rows * heads_kv:
            row = index // heads_kv
            head = index - row * heads_kv
            first = batch * num_splits
            # Lane l sums column groups l, l + 32, ... (4 floats each); lanes past Dv
            # read group 0 again and store nothing, which keeps the loop branch-free.
            groups = cute.make_rmem_tensor((self.col_passes,), Int32)
            for c in cutlass.range_constexpr(self.col_passes):
                g = c * WARP + lane
                groups[c] = cutlass.select_(g < self.head_dim_v // QUAD, g, Int32(0))
            acc = cute.make_rmem_tensor((QUAD, self.col_passes), Float32)
            acc.fill(0.0)
            top, total = -Float32.inf, Float32(0.0)
            in_flight = self.splits_in_flight
            for chunk in cutlass.range(cute.ceil_div(num_splits, in_flight), unroll=1):
                # The chunk's loads first, all of them: past the last split a lane reads
                # the last one again (no branch, no extra round trip) and weighs it 0.
                lses = cute.make_rmem_tensor((in_flight,), Float32)
                parts = cute.make_rmem_tensor((QUAD, self.col_passes, in_flight), Float32)
                for j in cutlass.range_constexpr(in_flight):
                    s = chunk * in_flight + j
                    split = first + cutlass.min(s, num_splits - 1)
                    lse = mLSEpart[split, head, row]
                    lses[j] = cutlass.select_(s < num_splits, lse, -Float32.inf)
                    for c in cutlass.range_constexpr(self.col_passes):
                        src = cute.local_tile(mOpart[split, row, head, None], (QUAD,),
                                              (groups[c],))
                        cute.autovec_copy(src, parts[None, c, j])
                new_top = top
                for j in cutlass.range_constexpr(in_flight):
                    new_top = cute.arch.fmax(new_top, lses[j])
                # Splits that saw no key (-inf) weigh 0, without inf - inf.
                base = cutlass.select_(new_top == -Float32.inf, Float32(0.0), new_top)
                keep = cute.math.exp2((top - base) * LOG2_E, fastmath=True)
                total = total * keep
                acc.store(acc.load() * keep)
                for j in cutlass.range_constexpr(in_flight):
                    weight = cute.math.exp2((lses[j] - base) * LOG2_E, fastmath=True)
                    total = total + weight
                    acc.store(acc.load() + parts[None, None, j].load() * weight)
                top = new_top

            # The caller's place of this row: query head head * g + j at position p.
            position = row // group
            q_head = head * group + (row - position * group)
            scale = cutlass.select_(total > Float32(0.0), Float32(1.0) / total, Float32(0.0))
            out = cute.make_rmem_tensor((QUAD, self.col_passes), self.dtype)
            out.store((acc.load() * scale).to(self.dtype))
            for c in cutlass.range_constexpr(self.col_passes):
                if c * WARP + lane < self.head_dim_v // QUAD:
                    dst = cute.local_tile(mO[batch, position, q_head, None], (QUAD,),
                                          (groups[c],))
                    cute.autovec_copy(out[None, c], dst)
            if lane == 0:
                mLSE[batch, q_head, position] = cutlass.select_(
                    total > Float32(0.0), top + cute.math.log2(total, fastmath=True) * LN2,
                    -Float32.inf)
