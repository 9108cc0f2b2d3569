"""Online softmax over key blocks, in base 2, for the query rows one thread owns.

For each row the thread keeps the running max m of the raw scores and a partial sum of
exp2((s - m) * scale_log2) over the columns it holds. Each block:
    m' = max(m, max_j s_j)                  (quad-reduced: 4 threads share a row)
    o_scale = exp2((m - m') * scale_log2)   the factor O and the sum must be rescaled by
    p_j = exp2(s_j * scale_log2 - m' * scale_log2)
A row that has seen only -inf keeps m = -inf; it is treated as max 0 so that every p
and o_scale is exactly 0 (no inf - inf). The partial sums are quad-reduced once, at the
end. Requires scale_log2 > 0.

`p_offset` (float8 kernels): p_j = exp2(... + p_offset), the probabilities times
2^p_offset, so that P rounded to e4m3 for P V keeps e4m3's normal range (its subnormals
start at 2^-6; FlashAttention-3's FP8 offset of 8); the sum carries the same factor, so
O / sum is unchanged, and the LSE takes it out.

Conditional rescaling (FlashAttention-4): with a `rescale_threshold` t, a row keeps its
old max unless the new one exceeds it by more than t (in log2 units), and then o_scale
is exactly 1. Exact: O and the sum share the stale max, and p <= 2^t stays finite in
bf16 / fp16. The consumer skips multiplying O when no row of its warp moved
(`needs_rescale`).
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

LN2 = math.log(2.0)
LOG2_E = math.log2(math.e)


def _quad_allreduce(x: Float32, op) -> Float32:
    for offset in (1, 2):
        x = op(x, cute.arch.shuffle_sync_bfly(x, offset=offset))
    return x


class OnlineSoftmax:
    def __init__(self, scale_log2: Float32, row_max: cute.Tensor, row_sum: cute.Tensor,
                 rescale_threshold: float | None = None, p_offset: float = 0.0):
        self.scale_log2 = scale_log2
        self.row_max = row_max
        self.row_sum = row_sum
        self.num_rows = cute.size(row_max)
        self.rescale_threshold = rescale_threshold
        self.p_offset = p_offset

    @classmethod
    def create(cls, scale_log2: Float32, num_rows: int, rescale_threshold: float | None = None,
               p_offset: float = 0.0) -> "OnlineSoftmax":
        row_max = cute.make_rmem_tensor((num_rows,), Float32)
        row_sum = cute.make_rmem_tensor((num_rows,), Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        return cls(scale_log2, row_max, row_sum, rescale_threshold, p_offset)

    # The DSL carries objects through dynamic control flow by their IR values.
    def __extract_mlir_values__(self):
        return cutlass.extract_mlir_values((self.scale_log2, self.row_max, self.row_sum))

    def __new_from_mlir_values__(self, values):
        parts = cutlass.new_from_mlir_values((self.scale_log2, self.row_max, self.row_sum), values)
        return type(self)(*parts, self.rescale_threshold, self.p_offset)

    @cute.jit
    def step(self, s_rc: cute.Tensor, o_scale: cute.Tensor):
        """Turn the scores `s_rc` (rows, cols) into probabilities in place and write the
        per-row factor the output accumulator must be multiplied by."""
        for r in cutlass.range_constexpr(self.num_rows):
            m = self.row_max[r]
            for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
                m = cute.arch.fmax(m, s_rc[r, c])
            self._update(r, _quad_allreduce(m, cute.arch.fmax), s_rc, o_scale)

    @cute.jit
    def _update(self, r: cutlass.Constexpr, m: Float32, s_rc: cute.Tensor,
                o_scale: cute.Tensor):
        """Row r, given m = max(its running max, its scores' max): the new running max,
        o_scale[r], the probabilities in place and the partial sum."""
        m_old = self.row_max[r]
        if cutlass.const_expr(self.rescale_threshold is not None):
            # False from -inf (m_old - m_old is NaN): the first finite max is taken.
            keep = (m - m_old) * self.scale_log2 <= self.rescale_threshold
            m = cutlass.select_(keep, m_old, m)
        m_scaled = cutlass.select_(m == -Float32.inf, Float32(0.0), m * self.scale_log2)
        scale = cute.math.exp2(m_old * self.scale_log2 - m_scaled, fastmath=True)
        if cutlass.const_expr(self.p_offset != 0.0):
            m_scaled = m_scaled - self.p_offset  # o_scale above is a ratio: unchanged
        if cutlass.const_expr(self.rescale_threshold is not None):
            scale = cutlass.select_(keep, Float32(1.0), scale)
        o_scale[r] = scale
        self.row_max[r] = m
        total = Float32(0.0)
        for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
            p = cute.math.exp2(s_rc[r, c] * self.scale_log2 - m_scaled, fastmath=True)
            s_rc[r, c] = p
            total = total + p
        self.row_sum[r] = self.row_sum[r] * scale + total

    @staticmethod
    def needs_rescale(o_scale: cute.Tensor):
        """Whether any row of this warp has an o_scale other than 1 (warp-uniform)."""
        moved = o_scale[0] != Float32(1.0)
        for r in range(1, cute.size(o_scale)):
            moved = moved | (o_scale[r] != Float32(1.0))
        return cute.arch.vote_any_sync(moved)

    @cute.jit
    def finalize(self, inv_sum: cute.Tensor, lse: cute.Tensor):
        """Per row: 1 / sum (0 for a row with no visible key) and the natural-log LSE
        (-inf for such a row)."""
        for r in cutlass.range_constexpr(self.num_rows):
            self._finish(r, _quad_allreduce(self.row_sum[r], lambda a, b: a + b), inv_sum, lse)

    @cute.jit
    def _finish(self, r: cutlass.Constexpr, total: Float32, inv_sum: cute.Tensor,
                lse: cute.Tensor):
        """Row r's 1 / sum and LSE from its whole sum `total`."""
        empty = total == Float32(0.0)
        safe = cutlass.select_(empty, Float32(1.0), total)
        inv_sum[r] = cutlass.select_(empty, Float32(0.0), cute.arch.rcp_approx(safe))
        log_sum = (self.row_max[r] * self.scale_log2 + cute.math.log2(safe, fastmath=True)
                   - self.p_offset) * LN2
        lse[r] = cutlass.select_(empty, -Float32.inf, log_sum)


class ColumnSoftmax(OnlineSoftmax):
    """The online softmax of a transposed block S^T (keys x query rows: the keys-as-M
    decode tile, kernels/sm90/fwd_keys_m.py), called with the thread's scores viewed as
    (its query columns, its keys): "rows" here are query columns. A column's keys are
    spread over 8 lanes of each of the warpgroup's 4 warps, so its max and sum reduce
    through `columns` (fwd_keys_m.ColumnExchange: shuffles, then shared memory), once for
    all of the thread's columns."""

    @cute.jit
    def step(self, s_rc: cute.Tensor, o_scale: cute.Tensor, columns):
        m = cute.make_rmem_tensor((self.num_rows,), Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            m[r] = self.row_max[r]
            for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
                m[r] = cute.arch.fmax(m[r], s_rc[r, c])
        columns.allreduce(m, cute.arch.fmax)
        for r in cutlass.range_constexpr(self.num_rows):
            self._update(r, m[r], s_rc, o_scale)

    @cute.jit
    def finalize(self, inv_sum: cute.Tensor, lse: cute.Tensor, columns):
        total = cute.make_rmem_tensor((self.num_rows,), Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            total[r] = self.row_sum[r]
        columns.allreduce(total, lambda a, b: a + b)
        for r in cutlass.range_constexpr(self.num_rows):
            self._finish(r, total[r], inv_sum, lse)
