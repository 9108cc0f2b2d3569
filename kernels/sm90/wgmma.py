"""Warpgroup MMA helpers shared by the sm90 kernels: issuing one GEMM, and storing an
accumulator to shared memory with stmatrix.

A GEMM issue sets the atom's accumulate flag, which rebinds the tiled MMA's IR value;
callers pass a freshly built (purely static) tiled MMA per use so that value never
lives across dynamic loops.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum


@cute.jit
def gemm(tiled_mma, acc, t_a, t_b, zero_init: cutlass.Constexpr):
    """Issue one warpgroup GEMM over all k slices and commit it as one group."""
    warpgroup.fence()
    for kk in cutlass.range_constexpr(cute.size(t_a, mode=[2])):
        tiled_mma.set(warpgroup.Field.ACCUMULATE, not (zero_init and kk == 0))
        cute.gemm(tiled_mma, acc, t_a[None, None, kk], t_b[None, None, kk], acc)
    warpgroup.commit_group()


def acc_store_copy(tiled_mma, dtype):
    """stmatrix copy of a tiled MMA's accumulator (as 16-bit values) into shared memory
    whose rows are the accumulator's rows, 8 or more contiguous columns each."""
    store_atom = sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, dtype, Float32)
    stmatrix = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), dtype)
    return cute.make_tiled_copy_S(store_atom, cute.make_tiled_copy_C_atom(stmatrix, tiled_mma))


@cute.jit
def store_acc(tiled_r2s, values, dst, tidx):
    """Write `values` (an accumulator-shaped fragment in the 16-bit dtype) to the
    shared-memory tile `dst` through `tiled_r2s` (acc_store_copy)."""
    thr_r2s = tiled_r2s.get_slice(tidx)
    # retile groups (atom values, repetitions) in mode 0; the smem partition keeps
    # repetitions in mode 2. Both step 16 columns per repetition.
    src = tiled_r2s.retile(values)
    (vals, reps), _, _ = src.layout.shape
    (d_vals, d_reps), _, _ = src.layout.stride
    src = cute.make_tensor(src.iterator, cute.make_layout((vals, 1, reps), stride=(d_vals, 0, d_reps)))
    cute.copy(tiled_r2s, src, thr_r2s.partition_D(dst))


def transposed(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of a (rows, cols[, stages]) shared-memory tensor: the
    same bytes seen as the other operand major mode."""
    modes = [1, 0] + list(range(2, cute.rank(t.layout)))
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))
