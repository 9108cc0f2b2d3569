"""The split forward's decode tile: each block's keys as the wgmma's M, the tile's query
rows as its N.

The split tile of kernels/sm90/fwd.py holds a decode step's rows (a group's g query
heads: 4 for 32 / 8 heads) in a 64-row wgmma, so per 64-key block the tensor cores do
16x the useful work. Here both products are turned around, so that the few rows are the
small N (Tile.m, 8) and the block's 64 keys the M:

    S^T (keys x N) = K Q^T     A = K (keys x D, K-major) and B = Q (N x D), shared memory
    O^T (Dv x N) += V^T P^T    A = V^T read M-major from the V buffer (Dv / 64 wgmma of
                               M = 64), B = P^T (keys x N) from shared memory

The softmax runs down the columns of S^T (softmax.ColumnSoftmax): a column's 64 keys lie
in 8 lanes of each of the 4 warps, whose maxima (and in the end sums) meet in shared
memory (ColumnExchange). P^T goes to one of two buffers: the O^T product of one block
reads one while the softmax of the next fills the other. Per block that is two named
barriers (the column maxima, P^T stored) and 8x less tensor-core work than the 64-row
tile.

float8 K goes from its ring slot straight into registers as S^T's A operand, converted
there (_load_k), against a copy of Q whose D columns are permuted to match, made once per
tile (_permute_q): no 16-bit K block is written or read (the K buffer FwdSm90 allocates
stays unused). The rest is the split kernel's (FwdSm90): the producer and rings (float8
V converted by dequant.py into the 16-bit V buffer; paged variants' pages and appended
rows), the walk over key blocks from the last down (segment variants: their plan), the
masking of the transposed block (mask.mask_block_kq, or segments.mask_block with the
keys along its rows), the fp32 partials or, with one split, the caller's out and lse.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.tensor_utils import LayoutEnum

from kernels.sm90 import mask, segments, wgmma
from kernels.sm90.fragments import convert, rows_cols
from kernels.sm90.fwd import (CONSUMER_ROWS, WARPGROUP, Barrier, FwdSm90, Gmem, Scalars,
                              Walk, _Tiles, unpacked_row)
from kernels.sm90.softmax import ColumnSoftmax

KEYS = CONSUMER_ROWS  # keys per block: one wgmma M
WARPS = WARPGROUP // 32
P_STAGES = 2  # P^T buffers: one read by O^T += V^T P^T while the next is written


def cols_rows(t: cute.Tensor) -> cute.Tensor:
    """An accumulator-shaped tensor as (cols, rows): rows_cols transposed."""
    rc = rows_cols(t)
    return cute.make_tensor(rc.iterator, cute.select(rc.layout, mode=[1, 0]))


class ColumnExchange:
    """Reduces values of the thread's query columns over the warpgroup: `cols`, the
    column of each value (cols_rows' rows of the thread's accumulator); `red` (WARPS, N)
    fp32 in shared memory; `ctid`, the thread's index in the warpgroup."""

    def __init__(self, red, cols, ctid):
        self.red, self.cols, self.ctid = red, cols, ctid

    @cute.jit
    def allreduce(self, values: cute.Tensor, op):
        """values[r] = op over the warpgroup's values of column cols[r], in a fixed
        order (butterflies over the 8 lanes, then warps 0 to 3): every thread gets the
        same bits. The next call's writes to `red` come after a barrier of the caller's
        (P^T stored, or the end of the walk), which every read here precedes."""
        for r in cutlass.range_constexpr(cute.size(values)):
            v = values[r]
            for offset in (4, 8, 16):
                v = op(v, cute.arch.shuffle_sync_bfly(v, offset=offset))
            values[r] = v
        red, cols = self.red, self.cols
        warp, lane = self.ctid // 32, self.ctid % 32
        if lane < 4:
            for r in cutlass.range_constexpr(cute.size(values)):
                red[warp, cols[r]] = values[r]
        pipeline.NamedBarrier(Barrier.COLUMNS, WARPGROUP).arrive_and_wait()
        for r in cutlass.range_constexpr(cute.size(values)):
            v = red[0, cols[r]]
            for w in cutlass.range_constexpr(1, WARPS):
                v = op(v, red[w, cols[r]])
            values[r] = v


class FwdKeysAsM(FwdSm90):
    def __init__(self, cfg):
        super().__init__(cfg)
        assert self.split and not (self.softcap or self.fp8)
        assert self.consumers == 1 and self.tile_n == KEYS and not self.q_registers
        assert self.tile_m % 8 == 0 and self.head_dim_v % KEYS == 0
        self.q_rows = self.tile_m
        # float8 K/V: K goes from its float8 block straight into registers, as the A
        # operand of S^T (converted there), which takes Q with its D columns permuted
        # to match (_permute_q): no 16-bit K block is written or read.
        self.k_registers = self.kv_fp8

    def _q_smem_layout(self):
        """The Q ring (N, D, q_stages): Q as the B operand of S^T = K Q^T."""
        return sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR,
                                             (KEYS, self.tile_m, self.head_dim), self.dtype,
                                             self.q_stages)

    def _p_smem_layout(self):
        """P^T (N, keys, P_STAGES) as the B operand of O^T += V^T P^T, N contiguous: a
        thread's two adjacent columns of one key are one 32-bit store."""
        return sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR,
                                             (KEYS, self.tile_m, self.tile_n), self.pv_dtype,
                                             P_STAGES)

    def _qp_smem_layout(self):
        """One Q buffer (N, D, 1) as _q_smem_layout's: Q with its D columns permuted."""
        return sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR,
                                             (KEYS, self.tile_m, self.head_dim), self.dtype, 1)

    def _scratch_fields(self) -> dict:
        p_layout = self._p_smem_layout()
        fields = dict(
            sP=cute.struct.Align[cute.struct.MemRange[self.pv_dtype, cute.cosize(p_layout)],
                                 1024],
            red=cute.struct.MemRange[Float32, WARPS * self.tile_m])
        if self.k_registers:
            qp_layout = self._qp_smem_layout()
            fields["sQp"] = cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(qp_layout)], 1024]
        return fields

    def _scratch(self, storage):
        """(sP, red, sQp: the permuted Q, None without k_registers)."""
        p_layout = self._p_smem_layout()
        sQp = None
        if cutlass.const_expr(self.k_registers):
            qp_layout = self._qp_smem_layout()
            sQp = storage.sQp.get_tensor(qp_layout.outer, swizzle=qp_layout.inner)
        return (storage.sP.get_tensor(p_layout.outer, swizzle=p_layout.inner),
                storage.red.get_tensor(cute.make_layout((WARPS, self.tile_m))), sQp)

    # K in registers: thread t = lane % 4 of warp w loads the D / 4 consecutive values
    # D / 4 t .. D / 4 (t + 1) - 1 of keys 16 w + lane / 4 and + 8 (whole 16-byte runs of
    # the float8 row), and its A fragment's value (c, r, h) of k-slice s, column
    # 16 s + 8 h + 2 t + c of the wgmma's K, is row r's value 4 s + 2 h + c: Q's column
    # 16 s + 8 h + 2 t + c holds Q's D column D / 4 t + 4 s + 2 h + c. The fragment is
    # the wgmma's compact one ((2, 2, 2), 1, D / 16): the GEMM reads each k-slice's 8
    # values as 4 consecutive register pairs (a strided view was read as if compact).
    def _k_fragment_layout(self):
        return cute.make_layout(((2, 2, 2), 1, self.head_dim // 16),
                                stride=((1, 2, 4), 0, 8))

    @cute.jit
    def _permute_q(self, sQc, sQp, tidx):
        """sQp = sQc with its D columns in the K fragment's order (_k_fragment_layout),
        visible to the wgmma: once per tile."""
        d, per = self.head_dim, self.head_dim // 4
        for i in cutlass.range_constexpr(self.tile_m * d // WARPGROUP):
            at = tidx + i * WARPGROUP
            n = at // d
            f = at - n * d
            s, h, t, c = f // 16, (f // 8) % 2, (f // 2) % 4, f % 2
            sQp[n, f, 0] = sQc[n, per * t + 4 * s + 2 * h + c]
        cute.arch.fence_proxy("async.shared", space="cta")
        pipeline.NamedBarrier(Barrier.P_STORED, WARPGROUP).arrive_and_wait()

    @cute.jit
    def _load_k(self, block, r_k, tidx):
        """The thread's K values of the float8 block (keys, D) into r_k (2, D / 4) in
        dtype: 16-byte loads, converted in registers."""
        per = self.head_dim // 4
        warp, lane = tidx // 32, tidx % 32
        runs = cute.zipped_divide(block, (1, 16))
        for i in cutlass.range_constexpr(2):
            row = 16 * warp + lane // 4 + 8 * i
            for j in cutlass.range_constexpr(per // 16):
                values = cute.make_rmem_tensor((16,), block.element_type)
                cute.autovec_copy(runs[None, (row, (lane % 4) * (per // 16) + j)], values)
                wide = cute.make_rmem_tensor((16,), self.dtype)
                wide.store(values.load().to(self.dtype))
                # Value b = 16 j + e of row i is (c, r, h) = (b % 2, i, b // 2 % 2) of
                # k-slice b // 4: a pair at a time into the compact fragment.
                for e in range(0, 16, 2):
                    b = 16 * j + e
                    at = 2 * i + 4 * ((b // 2) % 2) + 8 * (b // 4)
                    pair = cute.make_tensor(r_k.iterator + at, cute.make_layout(2))
                    pair.store(cute.make_tensor(wide.iterator + e, cute.make_layout(2)).load())

    # Fresh tiled MMAs per GEMM issue (wgmma.py says why).
    def _st_mma(self):
        k_major = OperandMajorMode.K
        k_source = (warpgroup.OperandSource.RMEM if self.k_registers
                    else warpgroup.OperandSource.SMEM)
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, k_major, k_major, Float32, (1, 1, 1),
            (KEYS, self.tile_m), k_source)

    def _ot_mma(self):
        mn_major = OperandMajorMode.MN
        return sm90_utils.make_trivial_tiled_mma(
            self.pv_dtype, self.pv_dtype, mn_major, mn_major, Float32, (1, 1, 1),
            (KEYS, self.tile_m), warpgroup.OperandSource.SMEM)

    @cute.jit
    def mma_softmax_epilogue(self, gmem: Gmem, run: Scalars, walk: Walk, smem, q_consumer,
                             k_consumer, v_consumer, c, tidx, warp, tiles_before):
        """The one consumer: S^T = K Q^T, the column softmax and O^T += V^T P^T over the
        walk's key blocks (the last visited first; _block_step per block after it),
        then out and LSE to the walk's out_batch; returns the advanced ring consumers.
        (tiles_before, FwdSm90's: one tile a CTA here.)"""
        sP, red, sQp = smem.scratch
        n, dv, tile_n = self.tile_m, self.head_dim_v, self.tile_n
        n_begin, n_end = walk.n_begin, walk.n_end
        q_handle = q_consumer.wait_and_advance()
        thr_st = self._st_mma().get_slice(tidx)
        thr_ot = self._ot_mma().get_slice(tidx)
        acc_o = thr_ot.make_fragment_C(thr_ot.partition_shape_C((dv, n)))
        acc_o.fill(0.0)
        # Each value's (key, query row) in the block.
        coord_s = rows_cols(thr_st.partition_C(cute.make_identity_tensor((tile_n, n))))
        cols = [coord_s[0, j][1] for j in range(cute.size(coord_s, mode=[1]))]
        scale_log2, v_descale = self._scales(gmem, run, walk)
        sQc = smem.sQ[None, None, q_handle.index]
        r_k = None
        if cutlass.const_expr(self.k_registers):
            self._permute_q(sQc, sQp, tidx)
            sQc = sQp[None, None, 0]
            r_k = cute.make_rmem_tensor((self.head_dim // 2,), self.dtype)
            tSrK = cute.make_tensor(r_k.iterator, self._k_fragment_layout())
        else:
            tSrK = thr_st.make_fragment_A(thr_st.partition_A(smem.sK))
        tiles = _Tiles(
            thr_st=thr_st, s_shape=thr_st.partition_shape_C((tile_n, n)), tSrK=tSrK,
            r_k=r_k, tSrQ=thr_st.make_fragment_B(thr_st.partition_B(sQc)),
            tOrV=thr_ot.make_fragment_A(thr_ot.partition_A(smem.sV)),
            tOrP=thr_ot.make_fragment_B(thr_ot.partition_B(sP)), sP=sP, acc_o=acc_o,
            coord_s=coord_s, columns=ColumnExchange(red, cols, tidx),
            softmax=ColumnSoftmax.create(scale_log2, len(cols), self.rescale_threshold),
            o_scale=cute.make_rmem_tensor((len(cols),), Float32),
            row0=walk.m_block * self.tile_m, v_descale=v_descale, smem=smem, c=c, ctid=tidx)

        if n_end > n_begin:
            # First visited block: S^T and softmax only; its O^T product runs in the next
            # step.
            seg = walk.seg
            n_last, first_masked = self._first_block(n_end, seg)
            acc_s = thr_st.make_fragment_C(tiles.s_shape)
            k_consumer, k_handle = self._issue_st(acc_s, tiles, k_consumer)
            warpgroup.wait_group(0)
            if cutlass.const_expr(k_handle is not None):
                self._release(k_handle)
            if cutlass.const_expr(self.segments):
                segments.mask_as_planned(first_masked, lambda kind, runs: self._mask(
                    acc_s, n_last, tiles, run, seg, kind, runs))
            else:
                self._mask(acc_s, n_last, tiles, run, seg)
            self._softmax(acc_s, tiles)
            self._store_p(acc_s, tiles, 0)
            if cutlass.const_expr(self.segments):
                for i in cutlass.range(1, n_end, unroll=1):
                    n_block, block_mask = segments.visit(seg.plan_row, i)
                    # The branch around the whole step, as FwdSm90's.
                    if block_mask == segments.IDS:
                        k_consumer, v_consumer = self._block_step(
                            True, n_block, i, tiles, run, seg, k_consumer, v_consumer)
                    elif block_mask == segments.RANGES:
                        k_consumer, v_consumer = self._block_step(
                            True, n_block, i, tiles, run, seg, k_consumer, v_consumer,
                            segments.RANGES)
                    elif block_mask != segments.NO_MASK:
                        k_consumer, v_consumer = self._block_step(
                            True, n_block, i, tiles, run, seg, k_consumer, v_consumer,
                            segments.RUNS, block_mask)
                    else:
                        k_consumer, v_consumer = self._block_step(
                            False, n_block, i, tiles, run, seg, k_consumer, v_consumer)
            else:
                # Downwards: the rest of the top masked blocks, the whole ones, and the
                # ones the band's left edge cuts; visit i is block n_end - 1 - i.
                masked_end, masked_begin = walk.masked_end, walk.masked_begin
                for i in cutlass.range(1, masked_end, unroll=1):
                    k_consumer, v_consumer = self._block_step(
                        True, n_end - 1 - i, i, tiles, run, seg, k_consumer, v_consumer)
                for i in cutlass.range(masked_end, n_end - n_begin - masked_begin, unroll=1):
                    k_consumer, v_consumer = self._block_step(
                        False, n_end - 1 - i, i, tiles, run, seg, k_consumer, v_consumer)
                for i in cutlass.range(n_end - n_begin - masked_begin, n_end - n_begin,
                                       unroll=1):
                    k_consumer, v_consumer = self._block_step(
                        True, n_end - 1 - i, i, tiles, run, seg, k_consumer, v_consumer)

            # O^T product of the last visited block.
            self._rescale_columns(acc_o, tiles.o_scale)
            v_handle = v_consumer.wait_and_advance()
            _, v_at = self._operands(tiles, None, v_handle)
            wgmma.gemm(self._ot_mma(), acc_o, tiles.tOrV[None, None, None, v_at],
                       tiles.tOrP[None, None, None, (n_end - n_begin - 1) % P_STAGES], False)
            warpgroup.wait_group(0)
            self._release(v_handle)

        self._epilogue(tiles, thr_ot, gmem, run, walk)
        # The Q stage is free once every warp is past its last S^T product.
        pipeline.NamedBarrier(Barrier.EPILOGUE + c, WARPGROUP).arrive_and_wait()
        if warp % 4 == 0:
            q_handle.release()
        return q_consumer, k_consumer, v_consumer

    @cute.jit
    def _block_step(self, is_masked: cutlass.Constexpr, n_block, visit, tiles, run: Scalars,
                    seg, k_consumer, v_consumer, kind: cutlass.Constexpr = segments.IDS,
                    runs=None):
        """Visit `visit` (>= 1), key block j = n_block: S^T_j = K_j Q^T and O^T +=
        V^T P^T of the previous visit on the tensor cores, the softmax of S^T_j
        overlapping the second (P^T of visit i is in buffer i % P_STAGES); returns the
        advanced ring consumers. is_masked: element masking (segment variants: the plan
        flags the block, and kind and runs as _mask)."""
        acc_s = tiles.thr_st.make_fragment_C(tiles.s_shape)
        k_consumer, k_handle = self._issue_st(acc_s, tiles, k_consumer)
        self._rescale_columns(tiles.acc_o, tiles.o_scale)
        # float8 V converts into the V buffer while S^T runs.
        v_handle = v_consumer.wait_and_advance()
        _, v_at = self._operands(tiles, None, v_handle)
        wgmma.gemm(self._ot_mma(), tiles.acc_o, tiles.tOrV[None, None, None, v_at],
                   tiles.tOrP[None, None, None, (visit + 1) % P_STAGES], False)
        warpgroup.wait_group(1)
        if cutlass.const_expr(k_handle is not None):
            self._release(k_handle)
        if cutlass.const_expr(is_masked):
            self._mask(acc_s, n_block, tiles, run, seg, kind, runs)
        self._softmax(acc_s, tiles)
        warpgroup.wait_group(0)
        self._release(v_handle)
        self._store_p(acc_s, tiles, visit % P_STAGES)
        return k_consumer, v_consumer

    @cute.jit
    def _issue_st(self, acc_s, tiles, k_consumer):
        """Wait for the next K block and issue S^T = K Q^T on it; returns the advanced
        K consumer and the ring slot to free once the product is done (None where K went
        into registers and its slot is free already)."""
        k_handle = k_consumer.wait_and_advance()
        if cutlass.const_expr(self.k_registers):
            self._load_k(tiles.smem.loads[0][None, None, k_handle.index], tiles.r_k,
                         tiles.ctid)
            k_handle.release()
            wgmma.gemm(self._st_mma(), acc_s, tiles.tSrK, tiles.tSrQ, True)
            return k_consumer, None
        k_at, _ = self._operands(tiles, k_handle, None)
        wgmma.gemm(self._st_mma(), acc_s, tiles.tSrK[None, None, None, k_at], tiles.tSrQ, True)
        return k_consumer, k_handle

    @cute.jit
    def _mask(self, acc_s, n_block, tiles, run: Scalars, seg,
              kind: cutlass.Constexpr = segments.IDS, runs=None):
        """Element masking of S^T for key block n_block: the band's, or, in segment
        variants, the plan's: `kind` and `runs` as segments.mask_block takes them."""
        key0 = n_block * self.tile_n
        if cutlass.const_expr(self.segments):
            segments.mask_block(rows_cols(acc_s), tiles.coord_s, tiles.row0, key0, seg.rows,
                                seg.keys, seg.seqlen_q, run.seqlen_k, keys_along_rows=True,
                                kind=kind, runs=runs)
        else:
            mask.mask_block_kq(rows_cols(acc_s), tiles.coord_s, key0, tiles.row0,
                               run.seqlen_k, run.band_lo, run.band_hi, self.banded)

    @cute.jit
    def _softmax(self, acc_s, tiles):
        """The column softmax of S^T: the probabilities in place of the scores, the
        columns' O^T factors in o_scale."""
        tiles.softmax.step(cols_rows(acc_s), tiles.o_scale, tiles.columns)

    @cute.jit
    def _store_p(self, acc_s, tiles, stage):
        """P^T of the block into buffer `stage`, visible to the next O^T product. The
        product that last read that buffer was waited for by every warp before the
        previous block's barrier here."""
        r_p = cute.make_rmem_tensor(acc_s.layout, self.pv_dtype)
        convert(acc_s, r_p, piece=cute.size(acc_s))
        cute.autovec_copy(r_p, tiles.thr_st.partition_C(
            wgmma.transposed(tiles.sP[None, None, stage])))
        cute.arch.fence_proxy("async.shared", space="cta")
        pipeline.NamedBarrier(Barrier.P_STORED, WARPGROUP).arrive_and_wait()

    @cute.jit
    def _rescale_columns(self, acc, col_scale):
        acc_cr = cols_rows(acc)
        for q in cutlass.range_constexpr(cute.size(acc_cr, mode=[0])):
            for r in cutlass.range_constexpr(cute.size(acc_cr, mode=[1])):
                acc_cr[q, r] = acc_cr[q, r] * col_scale[q]

    @cute.jit
    def _epilogue(self, tiles, thr_ot, gmem: Gmem, run: Scalars, walk: Walk):
        """O^T / column sums and the columns' LSE, to the walk's out_batch: the fp32
        partials, or with one split the caller's out (in dtype) and lse, unpacking
        pack-GQA's rows as FwdSm90._store_final does. Rows past Sq are skipped; the
        LSE is written by the 4 threads whose columns cover all N."""
        cols = tiles.columns.cols
        inv_sum = cute.make_rmem_tensor((len(cols),), Float32)
        lse = cute.make_rmem_tensor((len(cols),), Float32)
        tiles.softmax.finalize(inv_sum, lse, tiles.columns)
        if cutlass.const_expr(self.descaled):
            for q in cutlass.range_constexpr(len(cols)):
                inv_sum[q] = inv_sum[q] * tiles.v_descale
        self._rescale_columns(tiles.acc_o, inv_sum)
        # Each value's (head dim, query row).
        coord_o = thr_ot.partition_C(cute.make_identity_tensor((self.head_dim_v, self.tile_m)))
        if run.num_splits == 1:
            self._store_final_columns(tiles, coord_o, lse, gmem.final, run, walk)
        else:
            self._store_partial_columns(tiles, coord_o, lse, gmem.o[1], gmem.mLSE, run, walk)

    @cute.jit
    def _store_final_columns(self, tiles, coord_o, lse, final, run: Scalars, walk: Walk):
        """The one split's O (in dtype) and LSE into the caller's out (B, Sq / g, H * g,
        Dv) and lse (B, H * g, Sq / g), as FwdSm90._store_final."""
        out, out_lse, group = final
        cols, row0, head = tiles.columns.cols, tiles.row0, walk.head
        r_o = cute.make_rmem_tensor_like(tiles.acc_o, self.dtype)
        r_o.store(tiles.acc_o.load().to(self.dtype))
        for i in cutlass.range_constexpr(cute.size(r_o)):
            row = row0 + coord_o[i][1]
            if row < run.seqlen_q:
                position, q_head = unpacked_row(row, head, group)
                out[walk.batch, position, q_head, coord_o[i][0]] = r_o[i]
        if tiles.ctid < 4:
            for q in cutlass.range_constexpr(len(cols)):
                row = row0 + cols[q]
                if row < run.seqlen_q:
                    position, q_head = unpacked_row(row, head, group)
                    out_lse[walk.batch, q_head, position] = lse[q]

    @cute.jit
    def _store_partial_columns(self, tiles, coord_o, lse, mO, mLSE, run: Scalars, walk: Walk):
        """This split's fp32 O into mO (Sq, Dv, H, B) and its LSE into mLSE (Sq, H, B)."""
        cols, row0, head, batch = tiles.columns.cols, tiles.row0, walk.head, walk.out_batch
        acc_o = tiles.acc_o
        for i in cutlass.range_constexpr(cute.size(acc_o)):
            row = row0 + coord_o[i][1]
            if row < run.seqlen_q:
                mO[row, coord_o[i][0], head, batch] = acc_o[i]
        if tiles.ctid < 4:
            for q in cutlass.range_constexpr(len(cols)):
                row = row0 + cols[q]
                if row < run.seqlen_q:
                    mLSE[row, head, batch] = lse[q]
