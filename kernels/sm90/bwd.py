"""FlashAttention backward for Hopper (sm_90a): preprocess, KV-stationary main kernel,
postprocess, launched in order by one entry point.

Math, per (batch b, head h), runtime scale s, scale_log2 = s * log2(e), from the
forward's O and natural-log LSE and the cotangents dO, dLSE:
    P = exp2(S * scale_log2 - LSE2) with S = Q K^T and LSE2 = LSE * log2(e)
    Dsum_i = sum_d dO_id O_id - dLSE_i
    dV = P^T dO,   dS = P * (dO V^T - Dsum),   dK = s * dS^T Q,   dQ = s * dS K
Invisible elements (kernels/sm90/mask.py) have P = 0; a row with LSE = -inf has P = 0.
Softcap variants (banded, runtime cap c; kernels/sm90/softcap.py): P comes from the
capped scores, and dS = P * (dP - Dsum) * (1 - tanh^2(s * S / c)). Segment variants
(banded) take visibility from runtime per-row arrays and walk the query tiles a plan
lists, with the plan's dQ turns (kernels/sm90/segments.py).

Operands (legend in kernels/README.md): mQ, mO, mdO, mdQ (B, Sq, H, D); mK, mV, mdK,
mdV (B, Sk, Hkv, D), Hkv dividing H (GQA/MQA: query head h reads K/V head
h // (H / Hkv)); mLSE, mdLSE (B, H, Sq) fp32. Workspaces, all written here first:
mLSE2 and mDsum (B, H, Sq_pad) fp32, mdQaccum (B, H, Sq_pad * D) fp32, mSem
(B, H, Sq_pad / tile_m * 2) int32, with Sq_pad = Sq rounded up to tile_m.

1. preprocess, one CTA per (query tile, head, batch): LSE2 and Dsum (padding rows get
   LSE2 = +inf, so their P is 0 without masking), zeroes the tile's dQ accumulator
   and semaphores.
2. main, one CTA per (block of tile_n keys, K/V head, batch). It walks the query
   heads of its K/V head one after the other, so dK and dV sum over the group in
   registers, in fp32, with no partials in memory. Warpgroup roles:
   0      warp 0 loads K and V once, then per query tile Q + LSE2 and dO + Dsum into
          two q_stages-deep rings (TMA); warps 1 and 2 add consumer 1's and 2's dQ
          partials to the fp32 accumulator with bulk reduce-adds.
   1, 2   consumers, 64 keys each. Per query tile (tile_m rows: 64, or 128 in the
          d64 kernels without softcap), with S^T = K Q^T and dP^T = V dO^T so that
          P^T and dS^T land in registers as the A operands of dV += P^T dO and
          dK += dS^T Q; dS^T also goes to shared memory, where both consumers read it
          for their part of dQ = dS K: half of the head dims, or in 128-row tiles
          their 64 rows (BwdTile.dq_by_rows). The dK GEMM is issued after the dQ
          GEMM, so that it runs while the dQ partial is staged. Atomic calls hand
          each staged partial to the writer in the next step, once that step's first
          GEMMs are issued (deterministic calls at once).
   Deterministic mode: the dQ writer adds its tile only when the tile's semaphore
   equals the key block's place in the tile's order (mask.dq_turn: ascending, or
   descending in banded kernels, with the grid launched in that order; segment variants:
   the plan's), then increments it: a fixed summation order. Without a band, where a
   K/V head's CTAs fit on the GPU together and its key blocks are no more than its
   query tiles, block n walks the tiles from tile n and the turns follow the walks
   (band.shifted_turn), so that no block waits on another in the same step; else
   short calls launch the K/V heads fastest, so that one head's blocks seldom wait.
   Atomic banded calls launch the K/V heads fastest (every head's longest blocks
   first) up to BwdConfig.banded_heads_fastest_blocks, key blocks fastest past it (one
   head's Q and dO stay in L2).
   bwd_split.py's kernels (but their segment variants) run as 2-CTA pairs
   (bwd_pair.py), whose consumers hand the pair's sum of each dQ half, staged in the
   Q ring slot, to the same writer warps.
   Epilogue: dK * s and dV through shared memory (the K and V buffers) and TMA.
   The roles get what they share in four holders built once in `kernel`: Gmem (TMA
   atoms and tensors, the dQ accumulator and semaphores), Scalars (the launch's
   runtime values), Walk (this CTA's key block, heads and query tiles) and Smem (the
   shared-memory views). The consumers' loop over query heads and tiles
   (_walk_tiles) is shared with bwd_split.py, which supplies its own _consumer_tiles
   and _step.
3. postprocess, one CTA per (query tile, head, batch): dQ = s * accumulator, in dtype.

The accumulator tile holds each consumer's dQ fragment in quads (dq_quads): values
4j .. 4j + 3 of thread t at 512 j + 4 t, so every access is 16 bytes and a warp's
accesses cover 512 contiguous bytes (conflict-free shared-memory writes, one contiguous
bulk reduce per consumer, and red.global.add.v4.f32 in bwd_split.py). The postprocess
maps values back to (row, col) with the same MMA layout.
"""

import enum
import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float16, Float32, Int32, Int64
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.cute.nvgpu.warpgroup import make_smem_layout_atom
from cutlass.tensor_utils import LayoutEnum

from kernels import band
from kernels.config import CONSUMER_REGS, PRODUCER_REGS, BwdConfig
from kernels.sm90 import bwd_pair, mask, segments, softcap, wgmma
from kernels.sm90.fragments import acc_as_operand_a, rows_cols
from kernels.sm90.softmax import LOG2_E

WARPGROUP = 128
WARP = 32
VEC = 8  # 16-bit values per 16-byte access
KEYS_PER_CONSUMER = 64
DTYPES = {"bf16": BFloat16, "fp16": Float16}
QUAD = 4  # fp32 dQ accumulator values per 16-byte access


def dq_quads(base, dq_vals: int, tidx):
    """Thread tidx's (4, dq_vals / 4) view of a consumer's dQ accumulator part at `base`
    (shared or global): quad j at 512 j + 4 tidx. Slicing the thread out of a
    (4, thread, quad) layout keeps the 16-byte alignment visible to vector copies."""
    layout = cute.make_layout((QUAD, WARPGROUP, dq_vals // QUAD),
                              stride=(1, QUAD, QUAD * WARPGROUP))
    return cute.make_tensor(base, layout)[None, tidx, None]


def acc_quads(acc, dq_vals: int):
    """A dQ fragment's registers as (4, dq_vals / 4): value i at (i % 4, i // 4)."""
    return cute.make_tensor(acc.iterator, cute.make_layout((QUAD, dq_vals // QUAD)))


class Barrier(enum.IntEnum):
    """Named barrier ids (0 is __syncthreads); consumer c uses DQ_EMPTY + c, DQ_FULL + c
    (and, in 2-CTA pairs, DQ_FULL_ODD + c: BwdSm90._dq_full)."""

    DS_READY = 1  # both consumers: dS^T of this query tile is in shared memory
    DQ_EMPTY = 2  # dQ writer -> consumer c: its dQ staging buffer may be overwritten
    DQ_FULL = 4  # consumer c -> dQ writer: its dQ partial is staged
    EPILOGUE = 6  # both consumers, around the dK/dV staging
    DQ_FULL_ODD = 7  # pairs: DQ_FULL of the odd steps


def _seq_major(t: cute.Tensor) -> cute.Tensor:
    """(B, S, H, D) -> (S, D, H, B): a TMA box walks (S, D) inside one (head, batch)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))


def _row_major_3(t: cute.Tensor) -> cute.Tensor:
    """(B, H, X) -> (X, H, B)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 1, 0]))


class Gmem:
    """What one CTA reads and writes in global memory: the TMA (atom, tensor) pairs of
    the loads q, do (tile_m rows), k, v (tile_n rows), lse2, dsum (tile_m values) and of
    the stores dk, dv, each tensor (S, D, H, B) or (S, H, B) (_launch_main); and the dQ
    accumulator mdQaccum (B, H, Sq_pad * D) with its semaphores mSem (B, H, n)."""

    def __init__(self, q, do, k, v, lse2, dsum, dk, dv, mdQaccum, mSem):
        self.q, self.do, self.k, self.v, self.lse2, self.dsum = q, do, k, v, lse2, dsum
        self.dk, self.dv = dk, dv
        self.mdQaccum, self.mSem = mdQaccum, mSem


class Scalars:
    """The launch's runtime values, the same for every CTA: the softmax scale in base 2
    (scale_log2) and natural (scale, dK's), deterministic (0: dQ added atomically; 1: in
    a fixed order; 2: the same, where the FFI found room for all of a K/V head's CTAs
    at once, so that walks without a band may be shifted: BwdSm90._shift), the band
    [band_lo, band_hi] of mask.py, softcap_scale (softcap.py) and Sk."""

    def __init__(self, scale_log2, scale, deterministic, band_lo, band_hi, softcap_scale,
                 seqlen_k):
        self.scale_log2, self.scale, self.deterministic = scale_log2, scale, deterministic
        self.band_lo, self.band_hi, self.softcap_scale = band_lo, band_hi, softcap_scale
        self.seqlen_k = seqlen_k


class Walk:
    """Which tiles this CTA computes, for all its roles: key block n_block of K/V head
    kv_head in `batch`; the query heads that share it, heads = (head0, group), visited
    one after the other; its query tiles [m_begin, m_end), of which the first
    masked_front and the last masked_back need element masking (mask.q_block_range), or
    in segment variants the visits 0 .. m_end - 1 of its plan; seg, the segment views
    (segments.Views; None in other variants); pair, this CTA's side of its 2-CTA pair
    (bwd_pair.Pair; None in 1-CTA kernels), whose walk is the pair's common one; shift,
    in kernels without a band, (first, blocks): the walk visits tiles first .. m_end - 1,
    then m_begin .. first - 1, and its dQ turns are band.shifted_turn's among `blocks`
    key blocks (pairs); blocks is 0 where it walks in order, with ascending turns
    (BwdSm90._shift)."""

    def __init__(self, n_block, kv_head, heads, batch, m_begin, m_end, masked_front,
                 masked_back, seg, pair, shift=None):
        self.n_block, self.kv_head, self.heads, self.batch = n_block, kv_head, heads, batch
        self.m_begin, self.m_end = m_begin, m_end
        self.masked_front, self.masked_back = masked_front, masked_back
        self.seg, self.pair, self.shift = seg, pair, shift


class Smem:
    """This CTA's shared memory: the Q and dO rings sQ (tile_m, D, q_stages), sdO
    (tile_m, Dv, q_stages) and their rows' sLSE2, sDsum (tile_m, q_stages); sK (tile_n,
    D, 1), sV (tile_n, Dv, 1); the staged dS^T (and P^T) tiles sdS; kv_full, the barrier
    of the K and V loads; rings, the (Q, dO) ring pipelines. (The dQ staging buffer is
    read from the storage struct where it is used: a struct used inside a role's branch
    is rebuilt there.)"""

    def __init__(self, sQ, sdO, sK, sV, sdS, sLSE2, sDsum, kv_full, rings):
        self.sQ, self.sdO, self.sK, self.sV, self.sdS = sQ, sdO, sK, sV, sdS
        self.sLSE2, self.sDsum, self.kv_full = sLSE2, sDsum, kv_full
        self.rings = rings


class BwdSm90:
    # The consumers stage their dQ partials in an fp32 buffer (sdQ) for the writer
    # warps of the producer warpgroup to add (2-CTA pairs stage them in the Q ring).
    staged_dq = True
    # (tile_m, tile_n) 16-bit tiles staged per ring stage: dS^T.
    staged_s_tiles = 1
    # Column parts of the Q, dO and V tiles that a GEMM takes on its own (the split
    # kernel's consumers each take one): their swizzle atoms must not straddle a part.
    col_parts = 1

    def __init__(self, cfg: BwdConfig):
        self.dtype = DTYPES[cfg.dtype]
        self.head_dim = cfg.head_dim
        self.head_dim_v = cfg.head_dim_v
        self.banded = cfg.banded
        self.softcap = cfg.softcap
        self.segments = cfg.segments
        self.tile_m = cfg.tile.m
        self.tile_n = cfg.tile.n
        self.q_stages = cfg.tile.q_stages
        self.consumers = cfg.tile.consumers
        assert self.tile_n == KEYS_PER_CONSUMER * self.consumers or cfg.tile.split_head_dim
        # Pair configurations run the main kernel as a 2-CTA pair (bwd_pair); others,
        # and their segment variants, 1-CTA.
        self.pair = cfg.pair
        assert not (cfg.pair and self.staged_dq), "pairs stage dQ in the Q ring (bwd_pair)"
        self.threads = WARPGROUP * (1 + self.consumers)
        # each consumer's part of dQ: all tile_m rows x head_dim / consumers columns, or
        # (dq_by_rows) its own 64 rows x every column
        self.dq_by_rows = cfg.tile.dq_by_rows
        self.dq_rows = 64 if self.dq_by_rows else self.tile_m
        self.dq_cols = self.head_dim if self.dq_by_rows else self.head_dim // self.consumers
        self.dq_part = self.dq_rows * self.dq_cols
        # Taller tiles hold more than 32 fp32 values of S^T and of dP^T a thread: issued
        # on P^T alone, beside both, the dV GEMM made ptxas serialize every wgmma of the
        # kernel (C7512; d64 with 128 rows).
        self.late_dv = cfg.tile.late_dv
        self.det_heads_fastest_blocks = cfg.det_heads_fastest_blocks
        self.det_heads_fastest_pairs = cfg.det_heads_fastest_pairs
        self.banded_heads_fastest_blocks = cfg.banded_heads_fastest_blocks
        self.shift_atomic_walks = cfg.shift_atomic_walks
        assert self.late_dv or self.tile_m <= 64, "taller tiles issue the dV GEMM late"
        self.dq_vals = self.dq_part // WARPGROUP  # per thread

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mdLSE: cute.Tensor,
        mdQ: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mLSE2: cute.Tensor,
        mDsum: cute.Tensor,
        mdQaccum: cute.Tensor,
        mSem: cute.Tensor,
        mRows: cute.Tensor | None,
        mKeys: cute.Tensor | None,
        mPlan: cute.Tensor | None,
        scale_log2: Float32,
        scale: Float32,
        deterministic: Int32,
        band_lo: Int32,
        band_hi: Int32,
        softcap_scale: Float32,
        stream: cuda.CUstream,
    ):
        """mRows, mKeys, mPlan: segment variants only (None otherwise: not in the ABI)."""
        batch, seqlen_q, heads, _ = mQ.shape
        n_qtiles = cute.ceil_div(seqlen_q, self.tile_m)
        self.preprocess(mO, mdO, mLSE, mdLSE, mLSE2, mDsum, mdQaccum, mSem).launch(
            grid=(n_qtiles, heads, batch), block=[WARPGROUP, 1, 1], stream=stream
        )
        self._launch_main(mQ, mK, mV, mdO, mdK, mdV, mLSE2, mDsum, mdQaccum, mSem, mRows,
                          mKeys, mPlan, scale_log2, scale, deterministic, band_lo, band_hi,
                          softcap_scale, stream)
        self.postprocess(mdQaccum, mdQ, scale).launch(
            grid=(n_qtiles, heads, batch), block=[WARPGROUP * self.consumers, 1, 1],
            stream=stream,
        )

    # ------------------------------------------------------------------ preprocess
    @cute.kernel
    def preprocess(
        self,
        mO: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mdLSE: cute.Tensor,
        mLSE2: cute.Tensor,
        mDsum: cute.Tensor,
        mdQaccum: cute.Tensor,
        mSem: cute.Tensor,
    ):
        """128 threads. Row sums: Dv / 8 threads per query row (rounded up to a power of
        two for the shuffle reduction; the extra lanes add 0), 8 head dims (16 bytes of O
        and of dO) each, so a warp reads whole rows; then the tile's dQ accumulator is
        zeroed 16 bytes per thread, a warp writing 512 contiguous bytes."""
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        seqlen_q = mO.shape[1]
        per_row = 1 << (self.head_dim_v // VEC - 1).bit_length()
        rows_per_pass = WARPGROUP // per_row
        lane = tidx % per_row
        for p in cutlass.range_constexpr(self.tile_m // rows_per_pass):
            row = m_block * self.tile_m + p * rows_per_pass + tidx // per_row
            total = Float32(0.0)
            if row < seqlen_q and lane < self.head_dim_v // VEC:
                o = cute.local_tile(mO[batch, row, head, None], (VEC,), (lane,))
                do = cute.local_tile(mdO[batch, row, head, None], (VEC,), (lane,))
                prod = o.load().to(Float32) * do.load().to(Float32)
                total = prod.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            for k in cutlass.range_constexpr(int(math.log2(per_row))):
                total = total + cute.arch.shuffle_sync_bfly(total, offset=per_row >> (k + 1))
            if lane == 0:
                lse2 = Float32.inf  # padding rows: P = exp2(-inf) = 0
                dsum = Float32(0.0)
                if row < seqlen_q:
                    lse = mLSE[batch, head, row]
                    # a row with no visible key (lse = -inf) must also give P = 0
                    lse2 = cutlass.select_(lse == -Float32.inf, Float32.inf, lse * LOG2_E)
                    dsum = total - mdLSE[batch, head, row]
                mLSE2[batch, head, row] = lse2
                mDsum[batch, head, row] = dsum
        acc = cute.local_tile(
            mdQaccum[batch, head, None], (self.tile_m * self.head_dim,), (m_block,)
        )
        chunks = self.tile_m * self.head_dim // (4 * WARPGROUP)
        # (4 floats, thread, chunk): slicing the thread keeps 16-byte alignment visible.
        mine = cute.make_tensor(
            acc.iterator,
            cute.make_layout((4, WARPGROUP, chunks), stride=(1, 4, 4 * WARPGROUP)),
        )[None, tidx, None]
        zeros = cute.make_rmem_tensor((4, chunks), Float32)
        zeros.fill(0.0)
        cute.autovec_copy(zeros, mine)
        if tidx < self.consumers:
            mSem[batch, head, m_block * self.consumers + tidx] = Int32(0)

    # ------------------------------------------------------------------ postprocess
    @cute.kernel
    def postprocess(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, scale: Float32):
        """dQ = scale * accumulator in two coalesced passes through shared memory: the
        accumulator is read in quads (one thread per (consumer, thread) of the main
        kernel's dQ fragment) into a (tile_m, D) tile; the tile is written 16 bytes per
        thread, whole rows per warp."""
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        seqlen_q = mdQ.shape[1]
        d = self.head_dim
        # Rows padded by 16 bytes: the fragment's 8 rows per store hit different banks.
        sdQ = utils.SmemAllocator().allocate_tensor(
            self.dtype, cute.make_layout((self.tile_m, d), stride=(d + VEC, 1)), byte_alignment=16
        )
        c = tidx // WARPGROUP
        t = tidx % WARPGROUP
        thr_dq = self._dq_mma().get_slice(t)
        coord = thr_dq.partition_C(cute.make_identity_tensor((self.dq_rows, self.dq_cols)))
        acc = cute.local_tile(
            mdQaccum[batch, head, None], (self.dq_part,), (m_block * self.consumers + c,)
        )
        row0, col0 = (c * self.dq_rows, 0) if self.dq_by_rows else (0, c * self.dq_cols)
        vals = cute.make_rmem_tensor((QUAD, self.dq_vals // QUAD), Float32)
        cute.autovec_copy(dq_quads(acc.iterator, self.dq_vals, t), vals)
        for i in cutlass.range_constexpr(self.dq_vals):
            val = vals[i % QUAD, i // QUAD] * scale
            sdQ[row0 + coord[i][0], col0 + coord[i][1]] = val.to(self.dtype)
        cute.arch.sync_threads()
        per_row = d // VEC
        threads = WARPGROUP * self.consumers
        assert self.tile_m * per_row % threads == 0
        for p in cutlass.range_constexpr(self.tile_m * per_row // threads):
            r = (p * threads + tidx) // per_row
            lane = (p * threads + tidx) % per_row
            row = m_block * self.tile_m + r
            if row < seqlen_q:
                src = cute.local_tile(sdQ[r, None], (VEC,), (lane,))
                dst = cute.local_tile(mdQ[batch, row, head, None], (VEC,), (lane,))
                cute.autovec_copy(src, dst)

    # ------------------------------------------------------------------ main
    @cute.jit
    def _launch_main(
        self, mQ, mK, mV, mdO, mdK, mdV, mLSE2, mDsum, mdQaccum, mSem, mRows, mKeys, mPlan,
        scale_log2, scale, deterministic, band_lo, band_hi, softcap_scale, stream,
    ):
        dt, d, dv = self.dtype, self.head_dim, self.head_dim_v
        q, k, v, do = _seq_major(mQ), _seq_major(mK), _seq_major(mV), _seq_major(mdO)
        dk, dv_t = _seq_major(mdK), _seq_major(mdV)
        lse2, dsum = _row_major_3(mLSE2), _row_major_3(mDsum)

        # Q and dO: B operands of S^T / dP^T (K-major over D, Dv); transposed, of dK / dV.
        sQ_layout = self._k_major_layout(self.tile_m, d, self.q_stages, self.col_parts)
        sdO_layout = self._k_major_layout(self.tile_m, dv, self.q_stages, self.col_parts)
        # V: A operand of dP^T. K: A operand of S^T and, transposed, the B operand of
        # dQ = dS K where each consumer takes its dq_cols columns.
        sV_layout = self._k_major_layout(self.tile_n, dv, 1, self.col_parts)
        sK_layout = self._k_major_layout(self.tile_n, d, 1, d // self.dq_cols)
        # dS as the A operand of dQ = dS K: (tile_m, tile_n), query rows contiguous, so
        # consumers store their S^T-shaped fragments rows-of-keys first. Double
        # buffered: a consumer may write the next tile's dS^T while the other still
        # reads this one.
        sdS_layout = sm90_utils.make_smem_layout_a(
            LayoutEnum.COL_MAJOR, (self.tile_m, self.dq_cols, self.tile_n), dt,
            self.q_stages * self.staged_s_tiles,
        )
        sQ_one = cute.slice_(sQ_layout, (None, None, 0))
        sdO_one = cute.slice_(sdO_layout, (None, None, 0))
        sK_one = cute.slice_(sK_layout, (None, None, 0))
        sV_one = cute.slice_(sV_layout, (None, None, 0))
        row_layout = cute.make_layout(self.tile_m)

        load = cpasync.CopyBulkTensorTileG2SOp()
        store = cpasync.CopyBulkTensorTileS2GOp()
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(load, q, sQ_one, (self.tile_m, d))
        tma_atom_do, tma_do = cpasync.make_tiled_tma_atom(load, do, sdO_one, (self.tile_m, dv))
        tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(load, k, sK_one, (self.tile_n, d))
        tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(load, v, sV_one, (self.tile_n, dv))
        tma_atom_lse2, tma_lse2 = cpasync.make_tiled_tma_atom(load, lse2, row_layout, (self.tile_m,))
        tma_atom_dsum, tma_dsum = cpasync.make_tiled_tma_atom(load, dsum, row_layout, (self.tile_m,))
        tma_atom_dk, tma_dk = cpasync.make_tiled_tma_atom(store, dk, sK_one, (self.tile_n, d))
        tma_atom_dv, tma_dv = cpasync.make_tiled_tma_atom(store, dv_t, sV_one, (self.tile_n, dv))
        row_bytes = self.tile_m * 4
        self.q_bytes = cute.size_in_bytes(dt, sQ_one) + row_bytes
        self.do_bytes = cute.size_in_bytes(dt, sdO_one) + row_bytes
        self.kv_bytes = cute.size_in_bytes(dt, sK_one) + cute.size_in_bytes(dt, sV_one)
        self.storage = self._storage(sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout)
        n_blocks, heads_kv = cute.ceil_div(k.shape[0], self.tile_n), k.shape[2]
        cluster = {}
        if cutlass.const_expr(self.pair):
            # pairs of key blocks along x; an odd count gets a block of no keys (bwd_pair)
            n_blocks = cute.ceil_div(n_blocks, 2) * 2
            cluster = {"cluster": (2, 1, 1)}
        grid = (n_blocks, heads_kv, k.shape[3])
        if cutlass.const_expr(self.banded and not self.pair):
            # Key block 0 has the most query tiles. With atomic adds the K/V heads vary
            # fastest up to a bound (_banded_heads_fastest), so the longest CTAs of every
            # head launch first (with GQA a CTA walks its whole group: few, long CTAs).
            # Deterministic adds keep key blocks fastest (_block_coords): each tile's
            # adders must be in flight together.
            # deterministic is 0 or 1 (the FFI passes 2 only without a band): pick by
            # arithmetic, as launch dimensions must be integers.
            blocks_fastest = 1 - (1 - deterministic) * self._banded_heads_fastest(n_blocks)
            swap = (n_blocks - heads_kv) * blocks_fastest
            grid = (heads_kv + swap, n_blocks - swap, k.shape[3])
        if cutlass.const_expr(not self.banded):
            # pairs stay along x: (2 * K/V head + rank, pair) when heads go fastest
            width = 2 if self.pair else 1
            chain = n_blocks // width
            heads_fastest = self._heads_fastest(
                chain, cute.ceil_div(q.shape[0], self.tile_m), deterministic)
            grid = (n_blocks + (width * heads_kv - n_blocks) * heads_fastest,
                    heads_kv + (chain - heads_kv) * heads_fastest, k.shape[3])
        self.kernel(
            tma_atom_q, tma_q, tma_atom_do, tma_do, tma_atom_k, tma_k, tma_atom_v, tma_v,
            tma_atom_lse2, tma_lse2, tma_atom_dsum, tma_dsum, tma_atom_dk, tma_dk,
            tma_atom_dv, tma_dv, mdQaccum, mSem, mRows, mKeys, mPlan, scale_log2, scale,
            deterministic, band_lo, band_hi, softcap_scale,
            sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout,
        ).launch(grid=grid, block=[self.threads, 1, 1], stream=stream, min_blocks_per_mp=1,
                 **cluster)

    def _k_major_layout(self, rows: int, cols: int, stages: int, parts: int):
        """(rows, cols, stages) 16-bit shared memory, cols contiguous, with the widest
        swizzle atom that fits in cols / parts, so each of the parts starts on an atom."""
        atom = make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, cols // parts),
            self.dtype,
        )
        return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))

    def _storage(self, sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout):
        """Shared memory: the rings, K, V, the staged dS^T (and P^T) tiles and, with
        writer warps, the fp32 staging buffer of both consumers' dQ partials."""
        dt, rows = self.dtype, self.tile_m * self.q_stages

        @cute.struct
        class Storage:
            kv_full: cute.struct.MemRange[Int64, 1]
            q_mbar: cute.struct.MemRange[Int64, 2 * self.q_stages]
            do_mbar: cute.struct.MemRange[Int64, 2 * self.q_stages]
            sLSE2: cute.struct.Align[cute.struct.MemRange[Float32, rows], 128]
            sDsum: cute.struct.Align[cute.struct.MemRange[Float32, rows], 128]
            if self.pair:
                pair_mbar: cute.struct.MemRange[Int64, 2 * self.consumers]  # bwd_pair.Pair
            if self.staged_dq:
                sdQ: cute.struct.Align[cute.struct.MemRange[Float32, self.tile_m * self.head_dim], 128]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sV_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdS_layout)], 1024]

        return Storage

    @cute.kernel
    def kernel(
        self,
        tma_atom_q: cute.CopyAtom,
        tma_q: cute.Tensor,
        tma_atom_do: cute.CopyAtom,
        tma_do: cute.Tensor,
        tma_atom_k: cute.CopyAtom,
        tma_k: cute.Tensor,
        tma_atom_v: cute.CopyAtom,
        tma_v: cute.Tensor,
        tma_atom_lse2: cute.CopyAtom,
        tma_lse2: cute.Tensor,
        tma_atom_dsum: cute.CopyAtom,
        tma_dsum: cute.Tensor,
        tma_atom_dk: cute.CopyAtom,
        tma_dk: cute.Tensor,
        tma_atom_dv: cute.CopyAtom,
        tma_dv: cute.Tensor,
        mdQaccum: cute.Tensor,
        mSem: cute.Tensor,
        mRows: cute.Tensor | None,
        mKeys: cute.Tensor | None,
        mPlan: cute.Tensor | None,
        scale_log2: Float32,
        scale: Float32,
        deterministic: Int32,
        band_lo: Int32,
        band_hi: Int32,
        softcap_scale: Float32,
        sQ_layout: cute.ComposedLayout,
        sdO_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = cute.arch.make_warp_uniform(tidx // WARPGROUP)
        n_block, kv_head, batch = self._block_coords(deterministic, tma_q, tma_k)

        storage = utils.SmemAllocator().allocate(self.storage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        rows = cute.make_layout((self.tile_m, self.q_stages))
        sLSE2 = storage.sLSE2.get_tensor(rows)
        sDsum = storage.sDsum.get_tensor(rows)
        kv_full = storage.kv_full.data_ptr()

        if warp == 0:
            for atom in (tma_atom_q, tma_atom_do, tma_atom_k, tma_atom_v, tma_atom_lse2,
                         tma_atom_dsum, tma_atom_dk, tma_atom_dv):
                cpasync.prefetch_descriptor(atom)
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(kv_full, 1)
                if cutlass.const_expr(self.pair):
                    bwd_pair.init_barriers(storage.pair_mbar.data_ptr(), self.consumers)
        # one release per consumer warp; in a pair the writer warps release Q's slots
        consumer_warps = WARPGROUP // WARP * self.consumers
        q_ring = self._ring(storage.q_mbar.data_ptr(), self.q_bytes,
                            self.consumers if self.pair else consumer_warps)
        do_ring = self._ring(storage.do_mbar.data_ptr(), self.do_bytes, consumer_warps)
        q_producer, q_consumer = q_ring.make_participants()
        do_producer, do_consumer = do_ring.make_participants()
        cute.arch.mbarrier_init_fence()
        if cutlass.const_expr(self.pair):
            # the peer arrives on these barriers: both CTAs' inits come first
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()

        seqlen_q = tma_q.shape[0]
        seqlen_k = tma_k.shape[0]
        m_begin, m_end, masked_front, masked_back = mask.q_block_range(
            n_block, seqlen_q, seqlen_k, band_lo, band_hi, self.tile_m, self.tile_n,
            self.banded,
        )
        pair = None
        if cutlass.const_expr(self.pair):
            peer_range = mask.q_block_range(
                n_block ^ 1, seqlen_q, seqlen_k, band_lo, band_hi, self.tile_m,
                self.tile_n, self.banded,
            )
            m_begin, m_end, masked_front, masked_back = band.pair_q_tiles(
                (m_begin, m_end, masked_front, masked_back), peer_range, cutlass.select_,
                cutlass.min, cutlass.max)
            pair = bwd_pair.Pair(cute.arch.block_idx_in_cluster(),
                                 storage.pair_mbar.data_ptr(), self.consumers)
        seg = None
        if cutlass.const_expr(self.segments):
            # The plan's query tiles replace the band's: visits 0 .. count - 1.
            seg = segments.Views(mRows[batch, None, None], mKeys[batch, 0, None],
                            mPlan[batch, n_block, None], seqlen_q,
                            cute.ceil_div(seqlen_q, self.tile_m))
            m_begin, m_end = Int32(0), seg.count
        # GQA/MQA: this CTA's K/V block serves the query heads [head0, head0 + group),
        # visited one after the other, so dK and dV sum over the group in registers.
        group = tma_q.shape[2] // tma_k.shape[2]
        shift = None
        if cutlass.const_expr(not self.banded):
            shift = self._shift(n_block, seqlen_k, m_end, deterministic)
        walk = Walk(n_block, kv_head, (kv_head * group, group), batch, m_begin, m_end,
                    masked_front, masked_back, seg, pair, shift)
        run = Scalars(scale_log2, scale, deterministic, band_lo, band_hi, softcap_scale,
                      seqlen_k)
        smem = Smem(sQ, sdO, sK, sV, sdS, sLSE2, sDsum, kv_full, (q_ring, do_ring))
        gmem = Gmem(
            (tma_atom_q, tma_q), (tma_atom_do, tma_do), (tma_atom_k, tma_k),
            (tma_atom_v, tma_v), (tma_atom_lse2, tma_lse2), (tma_atom_dsum, tma_dsum),
            (tma_atom_dk, tma_dk), (tma_atom_dv, tma_dv), mdQaccum, mSem,
        )

        if wg == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp == 0:
                self.load(gmem, smem, walk, q_producer, do_producer)
            # Nested: the DSL only resolves a const_expr that stands alone in its `if`.
            if cutlass.const_expr(self.staged_dq or self.pair):  # noqa: SIM102
                if warp >= 1 and warp <= self.consumers:
                    self.dq_writer(self._staged_dq(storage), gmem, run, walk, smem,
                                   warp - 1, tidx % WARP)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS[self.consumers])
            self.mma(gmem, run, walk, smem, storage, q_consumer, do_consumer, wg - 1,
                     tidx % WARPGROUP, warp)

    def _ring(self, barriers, tx_count: int, releases: int):
        """A q_stages-deep TMA ring whose slots are freed by `releases` warps (each
        PipelineTmaAsync release signals from lane 0)."""
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=barriers,
            num_stages=self.q_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, releases),
            tx_count=tx_count,
            defer_sync=True,
        )

    # ------------------------------------------------------------------ producer
    @cute.jit
    def load(self, gmem: Gmem, smem: Smem, walk: Walk, q_producer, do_producer):
        """K and V of this key block once, then per query head and tile of the walk its
        Q, dO, LSE2 and Dsum into the rings."""
        (tma_atom_q, tma_q), (tma_atom_do, tma_do) = gmem.q, gmem.do
        (tma_atom_k, tma_k), (tma_atom_v, tma_v) = gmem.k, gmem.v
        (tma_atom_lse2, tma_lse2), (tma_atom_dsum, tma_dsum) = gmem.lse2, gmem.dsum
        sQ, sdO, sK, sV = smem.sQ, smem.sdO, smem.sK, smem.sV
        sLSE2, sDsum = smem.sLSE2, smem.sDsum
        kv_full = smem.kv_full
        n_block, kv_head, heads, batch = walk.n_block, walk.kv_head, walk.heads, walk.batch
        m_begin, m_end, seg = walk.m_begin, walk.m_end, walk.seg
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(kv_full, self.kv_bytes)
        for atom, src, dst, d in ((tma_atom_k, tma_k, sK, self.head_dim),
                                  (tma_atom_v, tma_v, sV, self.head_dim_v)):
            g = cute.local_tile(src[None, None, kv_head, batch], (self.tile_n, d), (n_block, 0))
            s_part, g_part = cpasync.tma_partition(
                atom, 0, cute.make_layout(1),
                cute.group_modes(dst[None, None, 0], 0, 2), cute.group_modes(g, 0, 2),
            )
            cute.copy(atom, g_part, s_part, tma_bar_ptr=kv_full)

        head0, group = heads
        for head in cutlass.range(head0, head0 + group, unroll=1):
            tQsQ, tQgQ = self._tile_partition(tma_atom_q, tma_q, sQ, head, batch, self.head_dim)
            tOsO, tOgO = self._tile_partition(tma_atom_do, tma_do, sdO, head, batch,
                                              self.head_dim_v)
            tLsL, tLgL = self._row_partition(tma_atom_lse2, tma_lse2, sLSE2, head, batch)
            tDsD, tDgD = self._row_partition(tma_atom_dsum, tma_dsum, sDsum, head, batch)
            for i in cutlass.range(m_begin, m_end, unroll=1):
                m = self._q_tile(i, walk)
                q_producer = self._load_tile(
                    q_producer, tma_atom_q, tQgQ[None, m], tQsQ,
                    tma_atom_lse2, tLgL[None, m], tLsL,
                )
                do_producer = self._load_tile(
                    do_producer, tma_atom_do, tOgO[None, m], tOsO,
                    tma_atom_dsum, tDgD[None, m], tDsD,
                )

    def _tile_partition(self, atom, tma_t, ring, head, batch, width: int):
        g = cute.local_tile(tma_t[None, None, head, batch], (self.tile_m, width), (None, 0))
        return cpasync.tma_partition(
            atom, 0, cute.make_layout(1), cute.group_modes(ring, 0, 2), cute.group_modes(g, 0, 2)
        )

    def _row_partition(self, atom, tma_t, ring, head, batch):
        g = cute.local_tile(tma_t[None, head, batch], (self.tile_m,), (None,))
        return cpasync.tma_partition(
            atom, 0, cute.make_layout(1), cute.group_modes(ring, 0, 1), cute.group_modes(g, 0, 1)
        )

    @staticmethod
    def _load_tile(producer, atom, src, ring, row_atom, row_src, row_ring):
        """One ring slot: a (tile_m, D) tile and its per-row values; returns the
        advanced producer so that loops rebind it."""
        handle = producer.acquire_and_advance()
        cute.copy(atom, src, ring[None, handle.index], tma_bar_ptr=handle.barrier)
        cute.copy(row_atom, row_src, row_ring[None, handle.index], tma_bar_ptr=handle.barrier)
        return producer

    def _staged_dq(self, storage):
        """Where the consumers stage their dQ partials: the sdQ buffer, consumer c's at
        c * dq_part; in a pair, the Q ring as fp32, consumer c's half-part of stage
        `stage` at (stage * consumers + c) * dq_part / 2 (bwd_pair)."""
        if cutlass.const_expr(self.pair):
            return cute.recast_ptr(storage.sQ.data_ptr(), dtype=Float32)
        return storage.sdQ.data_ptr()

    @cute.jit
    def dq_writer(self, staged, gmem: Gmem, run: Scalars, walk: Walk, smem: Smem, c: Int32,
                  lane: Int32):
        """Reduce-adds consumer c's staged dQ partials (`staged`, _staged_dq) into the
        accumulator: the whole part from sdQ, or in a pair the pair's sum of half
        `rank`, after which the writer releases the Q ring slot it was staged in. One
        writer warp per consumer, so a deterministic wait for one half never delays the
        other. Lane 0 issues and waits for every bulk copy (bulk groups are per
        thread)."""
        mdQaccum, mSem, deterministic = gmem.mdQaccum, gmem.mSem, run.deterministic
        heads, batch, seg = walk.heads, walk.batch, walk.seg
        m_begin, m_end = walk.m_begin, walk.m_end
        part = self.dq_part
        added, adders, first = part, 1, 0
        if cutlass.const_expr(self.pair):
            # both CTAs take the pair's turn: it passes on after two increments
            added, adders, first = part // 2, 2, walk.pair.rank * (part // 2)
        q_ring, _ = smem.rings
        step = Int32(0)
        head0, group = heads
        for head in cutlass.range(head0, head0 + group, unroll=1):
            acc_row = mdQaccum[batch, head, None]
            sem_row = mSem[batch, head, None]
            for i in cutlass.range(m_begin, m_end, unroll=1):
                m = self._q_tile(i, walk)
                slot = m * self.consumers + c
                flag = sem_row.iterator + slot
                # The turn first, while the consumers still compute the partial: then
                # the add follows the hand-off at once, not a semaphore read later.
                if lane == 0 and deterministic != 0:
                    self._wait_turn(flag, self._dq_turn(m, i, run, walk), adders)
                self._dq_full(c, step).arrive_and_wait()
                if lane == 0:
                    dst = acc_row.iterator + slot * part + first
                    src = staged + c * part
                    stage = step % self.q_stages
                    if cutlass.const_expr(self.pair):
                        src = staged + (stage * self.consumers + c) * added
                    _bulk_reduce_add_f32(dst, src, added * 4)
                    cute.arch.cp_async_bulk_commit_group()
                    if cutlass.const_expr(self.pair):
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
                        q_ring.consumer_release(
                            pipeline.PipelineState(self.q_stages, Int32(0), stage, Int32(0)))
                    if deterministic != 0:
                        cute.arch.cp_async_bulk_wait_group(0)  # the adds are done, not just read
                        cute.arch.fence_proxy("async.global")
                        cute.arch.atomic_add(flag, Int32(1), sem="release", scope="gpu")
                    else:
                        if cutlass.const_expr(not self.pair):
                            cute.arch.cp_async_bulk_wait_group(0, read=True)
                if cutlass.const_expr(not self.pair):  # noqa: SIM102
                    if (head0 + group - 1 - head) + (m_end - 1 - i) > 0:  # not the last tile
                        self._dq_barrier(Barrier.DQ_EMPTY + c).arrive()
                step += 1
        if lane == 0:
            cute.arch.cp_async_bulk_wait_group(0)

    @cute.jit
    def _wait_turn(self, flag, mine: Int32, adders: cutlass.Constexpr):
        """Spins until the tile's semaphore at `flag` reaches turn `mine` (each turn is
        `adders` increments): the key blocks before this one in the tile's order have
        all added."""
        turn = cute.arch.load(flag, Int32, sem="acquire", scope="gpu")
        while turn // adders != mine:
            turn = cute.arch.load(flag, Int32, sem="acquire", scope="gpu")

    @cute.jit
    def _dq_turn(self, m: Int32, i: Int32, run: Scalars, walk: Walk):
        """The turn of this key block (of its pair, in 2-CTA kernels) at query tile m,
        visit i of its walk."""
        n_blocks, _, _ = cute.arch.grid_dim()  # banded deterministic: key blocks along x
        block, keys = walk.n_block, self.tile_n
        if cutlass.const_expr(self.pair):
            block, n_blocks, keys = block // 2, n_blocks // 2, 2 * keys
        turn = mask.dq_turn(block, m, n_blocks, run.band_hi, self.tile_m, keys, self.banded)
        if cutlass.const_expr(not self.banded):
            _, blocks = walk.shift
            turn = cutlass.select_(
                blocks > 0, band.shifted_turn(block, m, blocks, walk.m_end, cutlass.min,
                                              cutlass.max), turn)
        if cutlass.const_expr(self.segments):
            turn = walk.seg.plan_row[1 + walk.seg.q_tiles + i]
        return turn

    @cute.jit
    def _q_tile(self, i: Int32, walk: Walk):
        """The query tile of visit i: tile i itself, the plan's, or in a shifted walk
        (Walk.shift) tile i + first, wrapped."""
        m = i
        if cutlass.const_expr(self.segments):
            m, _ = segments.visit(walk.seg.plan_row, i)
        if cutlass.const_expr(not self.banded):
            first, _ = walk.shift
            m = i + first
            m = cutlass.select_(m >= walk.m_end, m - walk.m_end, m)
        return m

    def _shift(self, n_block: Int32, seqlen_k: Int32, tiles: Int32, deterministic: Int32):
        """Walk.shift of a kernel without a band. Deterministic calls shift the walks
        (band.shifted_first_tile) where the key blocks (pairs) are no more than the
        query tiles: then at every step the blocks add to different tiles, and the
        turn a block waits for at a tile was taken a visit earlier, not in the same
        one, so it waits only when the block before it ran a whole step behind
        (ascending turns over one common order chain every block to the one before it
        at every tile). A block's turns then wait for blocks launched after it, too: the
        FFI allows it (deterministic 2) only where all of a K/V head's CTAs fit on the
        GPU at once, and they launch together (_heads_fastest). Atomic calls walk in
        order unless BwdConfig.shift_atomic_walks."""
        blocks, block = cute.ceil_div(seqlen_k, self.tile_n), n_block
        if cutlass.const_expr(self.pair):
            blocks, block = (blocks + 1) // 2, n_block // 2
        allowed = deterministic // 2
        if cutlass.const_expr(self.shift_atomic_walks):
            allowed = Int32(1)
        return band.shifted_walk(block, blocks, tiles, allowed, cutlass.min)

    def _heads_fastest(self, n_blocks: Int32, tiles: Int32, deterministic: Int32) -> Int32:
        """1 where a deterministic call without a band, whose `tiles` query tiles see
        `n_blocks` key blocks (pairs, in 2-CTA kernels), launches its K/V heads fastest
        (BwdConfig.det_heads_fastest_blocks and _pairs), else 0: the blocks of one head then
        start far apart and seldom wait for each other's turns. Not with shifted walks
        (_shift), whose turns need a head's blocks launched together."""
        bound = self.det_heads_fastest_pairs if self.pair else self.det_heads_fastest_blocks
        walks = band.shifted(n_blocks, tiles, deterministic // 2, cutlass.min)
        fits = band.at_most(n_blocks, bound, cutlass.min)
        return cutlass.min(deterministic, 1) * (1 - walks) * fits

    def _banded_heads_fastest(self, n_blocks: Int32) -> Int32:
        """1 where an atomic banded call of `n_blocks` key blocks launches its K/V heads
        fastest (BwdConfig.banded_heads_fastest_blocks), else 0: past the bound one
        head's blocks run together, longest first, and share its Q and dO in L2, which
        every head's blocks at once would not fit."""
        return band.at_most(n_blocks, self.banded_heads_fastest_blocks, cutlass.min)

    @cute.jit
    def _block_coords(self, deterministic: Int32, tma_q: cute.Tensor, tma_k: cute.Tensor):
        """(key block, K/V head, batch) of this CTA, from the grid of _launch_main."""
        x, y, z = cute.arch.block_idx()
        n_block, kv_head, batch = x, y, z
        key_blocks = cute.ceil_div(tma_k.shape[0], self.tile_n)
        tiles = cute.ceil_div(tma_q.shape[0], self.tile_m)
        if cutlass.const_expr(not self.banded):
            if cutlass.const_expr(self.pair):
                if self._heads_fastest(cute.ceil_div(key_blocks, 2), tiles,
                                       deterministic) != 0:
                    n_block, kv_head = 2 * y + x % 2, x // 2
            else:
                if self._heads_fastest(key_blocks, tiles, deterministic) != 0:
                    n_block, kv_head = y, x
        if cutlass.const_expr(self.banded):
            if deterministic != 0:
                # Banded adds run from the last key block down (mask.dq_turn): launch
                # in that order, so every block a CTA waits for has started.
                n_blocks, _, _ = cute.arch.grid_dim()
                n_block = n_blocks - 1 - x
            else:
                if cutlass.const_expr(not self.pair):  # pairs keep key blocks along x
                    if self._banded_heads_fastest(key_blocks) != 0:
                        n_block, kv_head = y, x
        return n_block, kv_head, batch

    @cute.jit
    def _mask_kq(self, s_rc, coord_s, key0: Int32, m: Int32, run: Scalars, seg, masked: Int32):
        """Element masking of S^T for query tile m (this consumer's keys from key0): the
        band's, or, in segment variants, the per-row ranges and ids' as the plan's mask
        for the tile says (`masked`)."""
        seqlen_k, band_lo, band_hi = run.seqlen_k, run.band_lo, run.band_hi
        q0 = m * self.tile_m
        if cutlass.const_expr(self.segments):
            # RUNS blocks take the ids' mask: cut ranges gained the backward nothing
            # (six documents per 16k row, H200: 0.985-1.016) and made ptxas spill 12
            # bytes in the d128 kernel (0 this way; 8 with RANGES tested first).
            segments.mask_as_planned(masked, lambda kind, runs: segments.mask_block(
                s_rc, coord_s, q0, key0, seg.rows, seg.keys, seg.seqlen_q, seqlen_k,
                keys_along_rows=True, kind=kind, runs=runs), runs_as_ids=True)
        else:
            mask.mask_block_kq(s_rc, coord_s, key0, q0, seqlen_k, band_lo, band_hi,
                               self.banded)

    def _dq_barrier(self, barrier_id):
        return pipeline.NamedBarrier(barrier_id, WARPGROUP + WARP)

    def _dq_full(self, c: Int32, step: Int32):
        """The barrier on which consumer c hands the dQ partial of walk step `step` to its
        writer warp. Pairs alternate two by the step's parity: the consumers' last
        hand-off (bwd_split._finish_walk) waits for no Q slot, so it and the one before
        may both come before the writer waits for that one (a deterministic writer may
        still be adding step - 2 or waiting for its turn); on one barrier the
        second's arrivals would complete the first's round and the writer then waits
        on a round that never completes."""
        if self.pair:
            return self._dq_barrier(
                Barrier.DQ_FULL + c + (step % 2) * (Barrier.DQ_FULL_ODD - Barrier.DQ_FULL))
        return self._dq_barrier(Barrier.DQ_FULL + c)

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def mma(self, gmem: Gmem, run: Scalars, walk: Walk, smem: Smem, storage, q_consumer,
            do_consumer, c: Int32, tidx: Int32, warp: Int32):
        """Consumer c: its tiles (_consumer_tiles), the walk over the group's query heads
        and their query tiles (_walk_tiles, one _step each), then dK and dV out. `storage`
        is the shared-memory struct as this role's branch sees it (Smem says why)."""
        tiles = self._consumer_tiles(walk, smem, storage, c, tidx)
        cute.arch.mbarrier_wait(smem.kv_full, 0)
        self._walk_tiles(tiles, gmem, run, walk, smem, q_consumer, do_consumer)
        self._finish_walk(tiles, run, smem, walk)
        self.epilogue(tiles.acc_dk, tiles.acc_dv, run.scale, gmem, smem, walk, c, tidx, warp)

    @cute.jit
    def _walk_tiles(self, tiles, gmem: Gmem, run: Scalars, walk: Walk, smem: Smem,
                    q_consumer, do_consumer):
        """One _step per query head of the group and query tile of the walk: visits of
        the plan in segment variants (masked as it says), else the tiles in ascending
        order (from Walk.shift's first tile, without a band): those the band's upper
        edge cuts, the ones seen whole, those its lower edge cuts (mask.q_block_range).
        _step gets the tile m, the head, the visit (the plan's index, else the tile's
        place in the walk) and the plan's masked flag (else 1)."""
        head0, group = walk.heads
        m_begin, m_end = walk.m_begin, walk.m_end
        whole_begin, whole_end = m_begin + walk.masked_front, m_end - walk.masked_back
        for head in cutlass.range(head0, head0 + group, unroll=1):
            if cutlass.const_expr(self.segments):
                for i in cutlass.range(m_end, unroll=1):
                    m, masked = segments.visit(walk.seg.plan_row, i)
                    q_consumer, do_consumer = self._step(
                        True, m, head, i, masked, tiles, gmem, run, walk, smem,
                        q_consumer, do_consumer,
                    )
            else:
                for is_masked, start, stop in ((True, m_begin, whole_begin),
                                               (False, whole_begin, whole_end),
                                               (True, whole_end, m_end)):
                    for i in cutlass.range(start, stop, unroll=1):
                        q_consumer, do_consumer = self._step(
                            is_masked, self._q_tile(i, walk), head, i, 1, tiles, gmem,
                            run, walk, smem, q_consumer, do_consumer,
                        )

    @cute.jit
    def _finish_walk(self, tiles, run: Scalars, smem: Smem, walk: Walk):
        """After the last step: an atomic call hands the last staged dQ partial over
        (_step defers each hand-off by one step)."""
        if walk_steps(walk) > 0 and run.deterministic == 0:
            self._hand_off_dq(tiles.c)

    def _hand_off_dq(self, c: Int32):
        """The staged dQ partial to consumer c's writer warp: this thread's shared
        writes made visible to the bulk copy (async proxy), then DQ_FULL."""
        cute.arch.fence_proxy("async.shared", space="cta")
        self._dq_barrier(Barrier.DQ_FULL + c).arrive()

    def _consumer_tiles(self, walk: Walk, smem: Smem, storage, c: Int32, tidx: Int32):
        """Consumer c's operand fragments, accumulators and staging views (_Tiles)."""
        sQ, sdO, sK, sV, sdS = smem.sQ, smem.sdO, smem.sK, smem.sV, smem.sdS
        d, dv, tm = self.head_dim, self.head_dim_v, self.tile_m
        sdQ_ptr = storage.sdQ.data_ptr()
        thr_sdp = self._sdp_mma().get_slice(tidx)
        thr_dk = self._dkv_mma(d).get_slice(tidx)
        thr_dv = self._dkv_mma(dv).get_slice(tidx)
        thr_dq = self._dq_mma().get_slice(tidx)
        sK_c = cute.local_tile(sK[None, None, 0], (KEYS_PER_CONSUMER, d), (c, 0))
        sV_c = cute.local_tile(sV[None, None, 0], (KEYS_PER_CONSUMER, dv), (c, 0))
        frags = _Tiles(
            k=thr_sdp.make_fragment_A(thr_sdp.partition_A(sK_c)),
            q=thr_sdp.make_fragment_B(thr_sdp.partition_B(sQ)),
            v=thr_sdp.make_fragment_A(thr_sdp.partition_A(sV_c)),
            do=thr_sdp.make_fragment_B(thr_sdp.partition_B(sdO)),
            do_t=thr_dv.make_fragment_B(thr_dv.partition_B(wgmma.transposed(sdO))),
            q_t=thr_dk.make_fragment_B(thr_dk.partition_B(wgmma.transposed(sQ))),
            ds=thr_dq.make_fragment_A(thr_dq.partition_A(self._dq_rows_of(sdS, c))),
            k_t=thr_dq.make_fragment_B(thr_dq.partition_B(cute.local_tile(
                wgmma.transposed(sK[None, None, 0]), (self.dq_cols, self.tile_n),
                (0 if self.dq_by_rows else c, 0)))),
        )
        sdS_t = wgmma.transposed(sdS)  # (tile_n keys, tile_m queries, stages)
        acc_dv = thr_dv.make_fragment_C(thr_dv.partition_shape_C((KEYS_PER_CONSUMER, dv)))
        acc_dk = thr_dk.make_fragment_C(thr_dk.partition_shape_C((KEYS_PER_CONSUMER, d)))
        acc_dv.fill(0.0)
        acc_dk.fill(0.0)
        s_shape = thr_sdp.partition_shape_C((KEYS_PER_CONSUMER, tm))
        coord_s = rows_cols(thr_sdp.partition_C(cute.make_identity_tensor((KEYS_PER_CONSUMER, tm))))
        # P^T and dS^T in the input dtype, viewed as register A operands.
        r_p = cute.make_rmem_tensor(thr_sdp.make_fragment_C(s_shape).layout, self.dtype)
        r_ds = cute.make_rmem_tensor(thr_sdp.make_fragment_C(s_shape).layout, self.dtype)
        p_op = cute.make_tensor(r_p.iterator, acc_as_operand_a(r_p.layout))
        ds_op = cute.make_tensor(r_ds.iterator, acc_as_operand_a(r_ds.layout))
        ds_r2s = wgmma.acc_store_copy(self._sdp_mma(), self.dtype)
        sdQ_c = dq_quads(sdQ_ptr + c * self.dq_part, self.dq_vals, tidx)
        key0 = walk.n_block * self.tile_n + c * KEYS_PER_CONSUMER
        return _Tiles(
            frags=frags, s_shape=s_shape, coord_s=coord_s, r_p=r_p, r_ds=r_ds, p_op=p_op,
            ds_op=ds_op, acc_dv=acc_dv, acc_dk=acc_dk, ds_r2s=ds_r2s, sdS_t=sdS_t,
            sdQ_c=sdQ_c, c=c, tidx=tidx, key0=key0,
        )

    @cute.jit
    def _step(self, is_masked: cutlass.Constexpr, m: Int32, head: Int32, visit: Int32,
              masked: Int32, tiles, gmem: Gmem, run: Scalars, walk: Walk, smem: Smem,
              q_consumer, do_consumer):
        """One query tile: five GEMMs, P and dS in registers, dQ partial staged; returns
        the advanced ring consumers. Segment variants mask when the plan's `masked` flag
        says so."""
        # > 0 when this CTA staged a dQ partial before (the writer must have taken it).
        if cutlass.const_expr(self.segments):
            staged_before = (head - walk.heads[0]) + visit
        else:
            staged_before = (head - walk.heads[0]) + (visit - walk.m_begin)
        frags, s_shape, coord_s = tiles.frags, tiles.s_shape, tiles.coord_s
        r_ds, ds_op = tiles.r_ds, tiles.ds_op
        acc_dk, ds_r2s = tiles.acc_dk, tiles.ds_r2s
        sdS_t, sdQ_c, c, tidx, key0 = tiles.sdS_t, tiles.sdQ_c, tiles.c, tiles.tidx, tiles.key0
        sLSE2, sDsum, scale_log2 = smem.sLSE2, smem.sDsum, run.scale_log2
        softcap_scale = run.softcap_scale
        thr_sdp = self._sdp_mma().get_slice(tidx)
        thr_dq = self._dq_mma().get_slice(tidx)
        q_handle = q_consumer.wait_and_advance()
        stage = q_handle.index
        acc_s = thr_sdp.make_fragment_C(s_shape)
        wgmma.gemm(self._sdp_mma(), acc_s, frags.k, frags.q[None, None, None, stage], True)
        do_handle = do_consumer.wait_and_advance()
        acc_dp = thr_sdp.make_fragment_C(s_shape)
        wgmma.gemm(self._sdp_mma(), acc_dp, frags.v, frags.do[None, None, None, stage], True)
        # Atomic calls hand the previous step's dQ partial over here, behind this step's
        # first GEMMs: the writer then has a whole step to read it before this step's
        # partial needs the buffer (with the hand-off right after staging, ncu put 7.6%
        # of d128's and 10% of d64's warp samples on it, and ptxas spilled 18 words at
        # d64). Against that (H200, 2026-12-03, alternated twice in one call, 2k / 16k):
        # atomic d64 1.00-1.05, causal 1.01-1.04; d96 1.03-1.08, causal 1.00-1.02; d128
        # 1.02-1.04, causal 0.97-1.02. Deterministic calls hand over at once: a partial
        # held back a step holds back every later key block's turn (held back, det d128
        # causal 2k ran 0.96-0.97, d96 causal 0.97-0.98). The fence is unconditional:
        # behind the same guard, ptxas spilled 56 bytes in the d64 kernels.
        cute.arch.fence_proxy("async.shared", space="cta")
        if staged_before > 0 and run.deterministic == 0:
            self._dq_barrier(Barrier.DQ_FULL + c).arrive()

        warpgroup.wait_group(1)  # S^T
        s_rc = rows_cols(acc_s)
        # Softcap: the cap's slope waits in r_ds (free until dS), in the input dtype.
        ds_rc = rows_cols(r_ds)
        if cutlass.const_expr(self.softcap):
            softcap.cap_scores_and_slope(s_rc, ds_rc, softcap_scale)
        if cutlass.const_expr(is_masked):
            self._mask_kq(s_rc, coord_s, key0, m, run, walk.seg, masked)
        for col in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
            lse2 = sLSE2[coord_s[0, col][1], stage]
            for r in cutlass.range_constexpr(cute.size(s_rc, mode=[0])):
                s_rc[r, col] = cute.math.exp2(s_rc[r, col] * scale_log2 - lse2, fastmath=True)
        if cutlass.const_expr(not self.late_dv):
            self._dv_gemm(acc_s, tiles, stage)

        warpgroup.wait_group(0 if self.late_dv else 1)  # dP^T
        dp_rc = rows_cols(acc_dp)
        for col in cutlass.range_constexpr(cute.size(dp_rc, mode=[1])):
            dsum = sDsum[coord_s[0, col][1], stage]
            for r in cutlass.range_constexpr(cute.size(dp_rc, mode=[0])):
                ds = s_rc[r, col] * (dp_rc[r, col] - dsum)
                if cutlass.const_expr(self.softcap):
                    ds = ds * ds_rc[r, col].to(Float32)
                dp_rc[r, col] = ds
        r_ds.store(acc_dp.load().to(self.dtype))
        if cutlass.const_expr(self.late_dv):
            self._dv_gemm(acc_s, tiles, stage)

        my_ds_rows = cute.local_tile(sdS_t[None, None, stage], (KEYS_PER_CONSUMER, self.tile_m), (c, 0))
        wgmma.store_acc(ds_r2s, r_ds, my_ds_rows, tidx)
        cute.arch.fence_proxy("async.shared", space="cta")
        pipeline.NamedBarrier(Barrier.DS_READY, WARPGROUP * self.consumers).arrive_and_wait()
        acc_dq = thr_dq.make_fragment_C(thr_dq.partition_shape_C((self.dq_rows, self.dq_cols)))
        wgmma.gemm(self._dq_mma(), acc_dq, frags.ds[None, None, None, stage], frags.k_t, True)
        # dK last: it runs on while the dQ partial is staged. Against dK before the dS
        # store (4 x H200, 2026-11-28, alternated twice in one call; 2k / 8k): d128
        # 1.02 / 1.07, causal 1.03-1.04 / 0.94-1.06; d96 1.01-1.03 / 0.95-1.04, causal
        # 1.04 / 1.03-1.11; d64: kernels/config.py above _BWD_TALL_TILES.
        wgmma.gemm(self._dkv_mma(self.head_dim), acc_dk, ds_op,
                   frags.q_t[None, None, None, stage], False)
        warpgroup.wait_group(1)  # dV and dQ
        do_handle.release()

        # Stage the dQ partial for the writer warp, in quads (module docstring), once
        # the writer has read the previous one.
        if staged_before > 0:
            self._dq_barrier(Barrier.DQ_EMPTY + c).arrive_and_wait()
        cute.autovec_copy(acc_quads(acc_dq, self.dq_vals), sdQ_c)
        if run.deterministic != 0:
            self._hand_off_dq(c)
        warpgroup.wait_group(0)  # dK
        q_handle.release()
        return q_consumer, do_consumer

    @cute.jit
    def _dv_gemm(self, acc_s, tiles, stage: Int32):
        """dV += P^T dO, P^T (in acc_s) converted to 16 bits in tiles.r_p."""
        tiles.r_p.store(acc_s.load().to(self.dtype))
        wgmma.gemm(self._dkv_mma(self.head_dim_v), tiles.acc_dv, tiles.p_op,
                   tiles.frags.do_t[None, None, None, stage], False)

    @cute.jit
    def epilogue(self, acc_dk, acc_dv, scale: Float32, gmem: Gmem, smem: Smem, walk: Walk,
                 c: Int32, tidx: Int32, warp: Int32):
        """dK * scale and dV -> this consumer's part of the K and V buffers -> TMA."""
        (tma_atom_dk, tma_dk), (tma_atom_dv, tma_dv) = gmem.dk, gmem.dv
        sK, sV = smem.sK, smem.sV
        n_block, kv_head, batch = walk.n_block, walk.kv_head, walk.batch
        d, dv = self.head_dim, self.head_dim_v
        r_dk = cute.make_rmem_tensor_like(acc_dk, self.dtype)
        r_dv = cute.make_rmem_tensor_like(acc_dv, self.dtype)
        r_dk.store((acc_dk.load() * scale).to(self.dtype))
        r_dv.store(acc_dv.load().to(self.dtype))
        barrier = pipeline.NamedBarrier(Barrier.EPILOGUE, WARPGROUP * self.consumers)
        barrier.arrive_and_wait()  # both consumers' GEMMs have stopped reading K and V
        for vals, buf, width in ((r_dk, sK, d), (r_dv, sV, dv)):
            r2s = wgmma.acc_store_copy(self._dkv_mma(width), self.dtype)
            wgmma.store_acc(r2s, vals, self._dkv_tile(buf[None, None, 0], c, width), tidx)
        cute.arch.fence_proxy("async.shared", space="cta")
        barrier.arrive_and_wait()
        if warp == WARPGROUP // WARP:  # first consumer warp
            for atom, tma_t, buf, width in ((tma_atom_dk, tma_dk, sK, d),
                                            (tma_atom_dv, tma_dv, sV, dv)):
                g = cute.local_tile(tma_t[None, None, kv_head, batch], (self.tile_n, width),
                                    (n_block, 0))
                s_part, g_part = cpasync.tma_partition(
                    atom, 0, cute.make_layout(1),
                    cute.group_modes(buf[None, None, 0], 0, 2), cute.group_modes(g, 0, 2),
                )
                cute.copy(atom, s_part, g_part)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    def _dkv_tile(self, buf, c, width: int):
        """Consumer c's part of a (tile_n, width) dK or dV tile: its 64 keys."""
        return cute.local_tile(buf, (KEYS_PER_CONSUMER, width), (c, 0))

    # ------------------------------------------------------------------ tiled MMAs
    # Fresh per GEMM issue (wgmma.py says why). Each is one warpgroup's.
    def _sdp_mma(self):
        """S^T = K Q^T and dP^T = V dO^T: (64 keys, tile_m queries), both K-major."""
        k_major = OperandMajorMode.K
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, k_major, k_major, Float32, (1, 1, 1),
            (KEYS_PER_CONSUMER, self.tile_m),
        )

    def _dkv_mma(self, width: int):
        """dV += P^T dO (width Dv) and dK += dS^T Q (width D): (64 keys, width), A from
        registers."""
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32,
            (1, 1, 1), (KEYS_PER_CONSUMER, width), warpgroup.OperandSource.RMEM,
        )

    def _dq_rows_of(self, sdS, c):
        """The (rows, tile_n, stages) dS that consumer c's dQ GEMM reads: every row, or
        (dq_by_rows) its own 64."""
        if cutlass.const_expr(not self.dq_by_rows):
            return sdS
        return cute.local_tile(sdS, (self.dq_rows, self.tile_n, cute.size(sdS, mode=[2])),
                               (c, 0, 0))

    def _dq_mma(self):
        """dQ = dS K: (dq_rows, dq_cols), 64 rows per wgmma (a 128-row tile split by
        columns takes two); dS and K^T both MN-major in shared memory."""
        mn_major = OperandMajorMode.MN
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, mn_major, mn_major, Float32, (1, 1, 1),
            (64, self.dq_cols),
        )


class _Tiles:
    """A consumer's per-CTA views, read-only in its loop: the wgmma operand fragments of
    the five GEMMs (static views of shared memory), its accumulators and staging views
    (the fields are the kernel's own: _consumer_tiles)."""

    def __init__(self, **views):
        self.__dict__.update(views)


def walk_steps(walk: Walk):
    """How many query tiles this CTA's consumers step through (_walk_tiles)."""
    return walk.heads[1] * (walk.m_end - walk.m_begin)


def _bulk_reduce_add_f32(dst, src, num_bytes: int):
    """cp.reduce.async.bulk add of `num_bytes` fp32 from shared `src` to global `dst`
    (one bulk_group copy; commit and wait with the cp_async_bulk_* ops)."""
    cute.arch.inline_ptx(
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [{$r0}], [{$r1}], {$r2};",
        read_only_args=[dst, src, Int32(num_bytes)],
    )
