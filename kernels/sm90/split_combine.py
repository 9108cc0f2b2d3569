"""Split-KV's combine inside the forward's split variants: the last split of a query
tile to finish merges the tile's partials, so a decode step needs no combine kernel
after the attention kernel.

Each split s of a tile writes O_s (its own softmax over its keys, times V, fp32) and
LSE_s (natural log; 0 and -inf when it sees no key), then counts itself in the tile's
counter (one int32 per tile, zeroed by the handler before the launch). The split that
counts last reads every split's partials of the tile and writes, per row,
    LSE = m + log(sum_s exp(LSE_s - m)),  m = max_s LSE_s,
    O = sum_s exp(LSE_s - m) O_s / sum_s exp(LSE_s - m),
in the output dtype; a row no split sees gets O = 0 and LSE = -inf. The splits are
summed in their index order, whichever finishes last, so the result is the same bits
every run.

Memory order: every consumer thread fences (acq_rel, GPU scope) after its partial
stores and the consumers meet at a named barrier before one thread counts, with an
acq_rel atomic; the last tile's threads fence again before reading the partials (the
pattern of CUDA's threadFenceReduction sample).
"""

import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32

LOG2_E = math.log2(math.e)
LN2 = math.log(2.0)
QUAD = 4  # output columns per thread and pass: 16 bytes of fp32 partials


class Partials:
    """The split variants' global tensors: the fp32 partials o_part (Sq, Dv, H, B *
    splits) and lse_part (Sq, H, B * splits), seq-major like the kernel's other views,
    split s of batch b at b * splits + s; the outputs o (Sq, Dv, H, B) in dtype and lse
    (Sq, H, B); count (B, H, tiles) int32, row-major; num_splits."""

    def __init__(self, o_part, lse_part, o, lse, count, num_splits):
        self.o_part, self.lse_part, self.o, self.lse = o_part, lse_part, o, lse
        self.count, self.num_splits = count, num_splits


@cute.jit
def combine_if_last(parts: Partials, flag: cute.Tensor, m_block: Int32, head: Int32,
                    batch: Int32, seqlen_q: Int32, t: Int32, barrier_id: cutlass.Constexpr,
                    threads: cutlass.Constexpr, tile_m: cutlass.Constexpr,
                    head_dim_v: cutlass.Constexpr):
    """Called by all `threads` consumer threads (t = their index) of the CTA that
    computed one split of tile (m_block, head, batch) once its partials are stored;
    flag: one int32 of shared memory."""
    # The DSL carries no plain object through a runtime `if`: unpack the holder first.
    o_part, lse_part, o, lse = parts.o_part, parts.lse_part, parts.o, parts.lse
    splits = parts.num_splits
    counter = parts.count[batch, head, None].iterator + m_block
    cute.arch.fence_acq_rel_gpu()
    pipeline.NamedBarrier(barrier_id, threads).arrive_and_wait()
    if t == 0:
        flag[0] = cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu")
    pipeline.NamedBarrier(barrier_id, threads).arrive_and_wait()
    if flag[0] == splits - 1:
        cute.arch.fence_acq_rel_gpu()
        _merge_tile(o_part, lse_part, o, lse, splits, m_block, head, batch, seqlen_q, t,
                    threads, tile_m, head_dim_v)


@cute.jit
def _merge_tile(o_part: cute.Tensor, lse_part: cute.Tensor, o: cute.Tensor,
                lse: cute.Tensor, splits: Int32, m_block: Int32, head: Int32, batch: Int32,
                seqlen_q: Int32, t: Int32, threads: cutlass.Constexpr,
                tile_m: cutlass.Constexpr, head_dim_v: cutlass.Constexpr):
    """The tile's rows (Partials' tensors), rows_per_pass at a time: thread t takes row
    t // quads and columns 4 (t % quads) .. + 3 of each pass."""
    quads = head_dim_v // QUAD
    rows_per_pass = threads // quads
    first_split = batch * splits
    row0 = m_block * tile_m
    rows = cutlass.min(tile_m, seqlen_q - row0)
    col = (t % quads) * QUAD
    acc = cute.make_rmem_tensor((QUAD,), Float32)
    out = cute.make_rmem_tensor((QUAD,), o.element_type)
    if t < rows_per_pass * quads:
        for r in cutlass.range(t // quads, rows, rows_per_pass, unroll=1):
            row = row0 + r
            top = -Float32.inf
            for s in cutlass.range(splits, unroll=1):
                top = cute.arch.fmax(top, lse_part[row, head, first_split + s])
            total = Float32(0.0)
            acc.fill(0.0)
            if top != -Float32.inf:
                for s in cutlass.range(splits, unroll=1):
                    weight = cute.math.exp2(
                        (lse_part[row, head, first_split + s] - top) * LOG2_E,
                        fastmath=True)
                    total += weight
                    for j in cutlass.range_constexpr(QUAD):
                        acc[j] += weight * o_part[row, col + j, head, first_split + s]
            seen = total > Float32(0.0)
            safe = cutlass.select_(seen, total, Float32(1.0))
            inv = cutlass.select_(seen, cute.arch.rcp_approx(safe), Float32(0.0))
            out.store((acc.load() * inv).to(o.element_type))
            for j in cutlass.range_constexpr(QUAD):
                o[row, col + j, head, batch] = out[j]
            if col == 0:
                log_total = cute.math.log2(safe, fastmath=True) * LN2
                lse[row, head, batch] = cutlass.select_(seen, top + log_total,
                                                              -Float32.inf)
