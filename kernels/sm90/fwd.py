"""FlashAttention forward for Hopper (sm_90a), warp-specialized, TMA + wgmma.

Math, per (batch b, head h), with runtime scale s (scale_log2 = s * log2(e)):
    S = Q K^T,  P = softmax(s * S) over the visible keys,  O = P V,
    LSE_i = log(sum_j exp(s * S_ij)),  natural log; a row with no visible key gives
    O_i = 0 and LSE_i = -inf.  Visibility: kernels/sm90/mask.py (the banded variant
    takes a runtime band lo <= j - i <= hi: causal, windows, either alignment).
    Softcap variants (banded) replace s * S_ij by c * tanh(s * S_ij / c) for a runtime
    cap c (kernels/sm90/softcap.py). Segment variants (banded) take visibility from
    runtime per-row arrays and visit the key blocks a plan lists (kernels/sm90/segments.py).
    Split variants (banded; split-KV for few tiles over many keys) cut each tile's visits
    into num_splits runs (kernels/band.py split_visits), one CTA each; a split writes
    O_s = its own softmax(s * S) V over its keys, in fp32, and LSE_s (0 and -inf when it
    sees no key), and a second kernel launched after it combines them into out and lse
    (kernels/sm90/combine.py); launched with one split (calls that fill the GPU), the
    kernel writes out and lse itself and no combine runs; calls whose rows fit 8 run the
    keys-as-M tile instead (kernels/sm90/fwd_keys_m.py, a subclass). Paged variants (segment
    variants) read K and V in place from a cache of pages through a page table
    (kernels/sm90/paged.py).

Operands (legend in kernels/README.md): mQ (B, Sq, H, D), mK and mV (B, Sk, H, D),
mO (B, Sq, H, D), all row-major in dtype; mLSE (B, H, Sq) fp32; segment variants also
mRows, mKeys, mPlan (int32, segments.py); split variants write their partials to mOpart
(B * num_splits, Sq, H, Dv) and mLSEpart (B * num_splits, H, Sq) in fp32, batch-major,
and their combine (or, with one split, the kernel) writes mO and mLSE in the caller's
layout (unpack_group: combine.py);
mTileCounter (1, 1, 1) int32 is the "dynamic" schedule's. B, Sq, Sk, H and num_splits
are runtime values, and so are the band's lo and hi and the softcap; dtype, D, banded, softcap and segments are
compiled in (kernels/config.py).

Tiles are (tile of tile_m query rows, head, batch), and per split in split variants;
banded grids run the longest tiles first. The tile config's `schedule`
(kernels/sm90/schedule.py): one CTA per tile, or min(tiles, SMs x ctas_per_sm)
persistent CTAs that take the tiles in turn, in grid order ("static") or from a
counter ("dynamic", the producer handing each tile, decoded, to the consumers through a
ring in shared memory). Each role loops over its CTA's tiles, and the Q, K and V rings run on
across them, so the next tile's loads overlap this tile's last blocks and epilogue.
Warpgroup roles:
  0      producer: warp 0 issues TMA for each tile's Q into a q_stages-deep ring, then
         its K and V blocks into two kv_stages-deep rings (separate pipelines, so
         S = Q K^T can start before V has landed); the other warps idle with few
         registers.
  1..C   consumers, 64 query rows each. Key blocks are visited last to first (segment
         variants: in their plan's order). Each step issues S_j = Q K_j^T and
         O += P_{j-1} V_{j-1} back to back (wgmma, P from registers), then runs the
         online softmax of S_j while the PV product is still on the tensor cores. With
         the tile's `pingpong`, named barriers make the consumers take turns issuing
         their wgmma, so one's softmax hides under the other's MMA.
  Epilogue: O / rowsum -> registers -> shared memory (the consumer's own Q buffer)
         -> TMA store, which clips the rows past Sq; LSE is written by row owners.
         Split variants store their fp32 O from registers, rows past Sq skipped. The
         Q stage is released once the store has read it: at the tile's end, or with
         the tile's `defer_o_read` in the CTA's next tile, once its first GEMM is
         issued (_free_previous_q).
The roles get what they share in holders, as in bwd.py: Gmem (TMA atoms and tensors,
mLSE), Scalars (the launch's runtime values), Smem (the shared-memory views) and Launch
(what every tile's walk reads), built once in `kernel`, and per tile a Walk (its query
tile, head, batch and key blocks; the dynamic schedule's consumers take part of it,
Planned, from the producer).

Build: kernels/export.py compiles and exports it ahead of time (no GPU needed).
Test and time it through jax_fa4 on an H100: tests/gpu, bench/.
"""

import enum

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float8E4M3FN, Float16, Float32, Int32, Int64
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from kernels import band
from kernels.config import PRODUCER_REGS, FwdConfig, consumer_regs
from kernels.sm90 import combine, dequant, mask, paged, schedule, segments, softcap, wgmma
from kernels.sm90.fragments import (acc_as_fp8_operand_a, acc_as_operand_a, convert,
                                    convert_to_fp8_operand_a, rows_cols)
from kernels.sm90.softmax import OnlineSoftmax

WARPGROUP = 128
CONSUMER_ROWS = 64  # query rows per consumer warpgroup: one wgmma M
ROWS_PER_THREAD = 2  # accumulator rows a thread owns (fragments.py)
DTYPES = {"bf16": BFloat16, "fp16": Float16, "e4m3": Float8E4M3FN}
# float8 kernels write out in bf16, and their P times 2^(FP8_P_LOG2_MAX - t) (softmax.py
# p_offset; t the tile's rescale threshold, 0 without): P stays below 2^FP8_P_LOG2_MAX,
# inside e4m3's largest finite 448, and above its subnormals for scores within 14 - t
# log2 units of the row's max.
OUT_DTYPES = {"e4m3": BFloat16}
FP8_P_LOG2_MAX = 8.0
# Paged variants: the producer warp that appends a call's new K/V rows to the cache
# (warps 0 and 1 load).
APPEND_WARP = 2


class Barrier(enum.IntEnum):
    """Named barrier ids; 0 is __syncthreads. Consumer c uses TURN + c and EPILOGUE + c."""

    TURN = 1  # consumer c waits here for its turn to issue wgmma (ping-pong)
    EPILOGUE = 4  # consumer c's threads before its TMA store of O
    TILE_START = 7  # consumer 0 has begun a tile (_start_turns)
    DEQUANT = 8  # kv_dtype variants' consumer around its K/V conversion (dequant.py)
    COLUMNS = 9  # keys-as-M tile: the warps' column maxima and sums (fwd_keys_m.py)
    P_STORED = 10  # keys-as-M tile: P^T is in shared memory for O^T += V^T P^T


@cute.jit
def unpacked_row(row: Int32, head: Int32, group: Int32):
    """(position, query head) of packed row `row` of K/V head `head` under pack-GQA's
    group g: row r is query head head * g + r % g at position r // g."""
    position = row // group
    return position, head * group + (row - position * group)


def _seq_major(t: cute.Tensor) -> cute.Tensor:
    """(B, S, H, D) -> (S, D, H, B): a TMA box walks (S, D) inside one (head, batch)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))


class Gmem:
    """What one CTA reads and writes in global memory: the TMA (atom, tensor) pairs of
    q, k, v (loads) and o (store; split variants: atom None, tensor the fp32 partials),
    each tensor (S, D, H, B) (kernels/sm90/paged.py for paged K and V), and mLSE
    (Sq, H, B); split variants' `final`: (out, lse, g), the caller's out and lse
    (combine.unpacked) and its pack-GQA group, which a launch with one split writes
    directly; float8 variants' `descale` (1, 3, Hkv) (FwdSm90.__call__; None otherwise)."""

    def __init__(self, q, k, v, o, mLSE, final=None, descale=None):
        self.q, self.k, self.v, self.o, self.mLSE = q, k, v, o, mLSE
        self.final, self.descale = final, descale


class Scalars:
    """The launch's runtime values, the same for every CTA: the softmax scale in base 2,
    the band [band_lo, band_hi] of mask.py, softcap_scale (softcap.py), Sq, Sk and the
    number of splits (1 in variants without)."""

    def __init__(self, scale_log2, band_lo, band_hi, softcap_scale, seqlen_q, seqlen_k,
                 num_splits):
        self.scale_log2, self.band_lo, self.band_hi = scale_log2, band_lo, band_hi
        self.softcap_scale, self.seqlen_q, self.seqlen_k = softcap_scale, seqlen_q, seqlen_k
        self.num_splits = num_splits


# Int32 values a tile of the dynamic schedule takes in the ring (FwdSm90._handoff).
HANDOFF_FIELDS = 8


def _publish(producer, ring, values):
    """Hand a tile's values (FwdSm90._handoff) to the consumers through the next ring
    slot (every lane of the producer warp writes them and arrives); x = -1 ends the
    walk."""
    handle = producer.acquire_and_advance()
    for i, value in enumerate(values):
        ring[i, handle.index] = value
    handle.commit()
    return producer


def _receive(consumer, ring, fields: int):
    """The next tile's values from the ring (every consumer thread reads them, then
    frees its share of the slot)."""
    handle = consumer.wait_and_advance()
    values = tuple(ring[i, handle.index] for i in range(fields))
    handle.release()
    return consumer, values


class Launch:
    """What FwdSm90._walk reads besides the tile, the same for every CTA: the launch's
    Scalars and Gmem, and the per-batch tensors of segment variants (mRows, mKeys,
    mPlan: segments.py) and of paged ones (`paged`: mPages, mK, mV, mNewK, mNewV), None
    in the others."""

    def __init__(self, run, gmem, mRows, mKeys, mPlan, paged):
        self.run, self.gmem = run, gmem
        self.mRows, self.mKeys, self.mPlan, self.paged = mRows, mKeys, mPlan, paged


class Planned:
    """What the dynamic schedule's producer computed of a tile's Walk and hands the
    consumers with it (FwdSm90._handoff): its block range (mask.kv_block_range's
    n_begin, n_end, masked_end, masked_begin) and, in segment variants, its plan row's
    first entry (0 in others)."""

    def __init__(self, n_begin, n_end, masked_end, masked_begin, first):
        self.n_begin, self.n_end = n_begin, n_end
        self.masked_end, self.masked_begin, self.first = masked_end, masked_begin, first


class Walk:
    """Which tile a CTA computes, for all its roles: query tile m_block of `head` in
    `batch`; its key blocks [n_begin, n_end), visited from the last down, of which the
    last masked_end and the first masked_begin need element masking
    (mask.kv_block_range; split variants: this split's run of them), or in segment
    variants the visits 0 .. n_end - 1 of its plan; seg, the segment views
    (segments.Views; None in other variants); out_batch, the batch of out and lse it
    writes (split variants: this split's); cache, paged variants' paged.Cache."""

    def __init__(self, m_block, head, batch, n_begin, n_end, masked_end, masked_begin, seg,
                 out_batch, cache):
        self.m_block, self.head, self.batch = m_block, head, batch
        self.n_begin, self.n_end = n_begin, n_end
        self.masked_end, self.masked_begin = masked_end, masked_begin
        self.seg, self.out_batch, self.cache = seg, out_batch, cache


class Smem:
    """This CTA's shared memory: the Q ring sQ (CONSUMER_ROWS, D, q_stages * consumers),
    stage s of consumer c at s * consumers + c, and the K and V rings sK (tile_n, D,
    kv_stages), sV (Dv, tile_n, kv_stages); paged variants' `appended`, the mbarrier the
    append warp arrives on once its rows are in the cache (FwdSm90._append).
    `loads`: the (K, V) rings TMA fills, shaped as sK and sV: sK and sV themselves, or in
    kv_dtype variants float8 rings, while sK and sV hold one converted block each.
    `scratch`: what a subclass's consumer keeps besides (FwdSm90._scratch; None here)."""

    def __init__(self, sQ, sK, sV, appended=None, loads=None, scratch=None):
        self.sQ, self.sK, self.sV, self.appended = sQ, sK, sV, appended
        self.loads = (sK, sV) if loads is None else loads
        self.scratch = scratch


class FwdSm90:
    def __init__(self, cfg: FwdConfig):
        self.dtype = DTYPES[cfg.dtype]
        self.out_dtype = OUT_DTYPES.get(cfg.dtype, self.dtype)
        # float8 (e4m3) q, k, v: V comes transposed (keys contiguous, as fp8 wgmma takes
        # its B operand only K-major), P is rounded to e4m3 for O += P V, per-K/V-head
        # descales scale the scores and out, and out is stored from registers (bf16 O
        # does not fit the fp8 Q buffer it is staged in otherwise).
        self.fp8 = cfg.dtype == "e4m3"
        # float8 K and V with bf16 q (kv_dtype): TMA fills float8 rings, and the consumer
        # converts each block into one 16-bit K and V buffer (pv_dtype below) before its
        # wgmma (dequant.py); descales as in float8 variants (q's 1).
        self.kv_fp8 = cfg.kv_dtype is not None
        self.kv_dtype = DTYPES[cfg.kv_dtype] if self.kv_fp8 else self.dtype
        self.descaled = self.fp8 or self.kv_fp8
        # The P V operands' dtype: q's, but fp16 with float8 K/V, where V converts in one
        # instruction per pair (cvt.rn.f16x2.e4m3x2; bf16 takes three more, through
        # fp32) and P, in [0, 1], keeps 3 more bits (values below 2^-24 flush to 0).
        self.pv_dtype = Float16 if self.kv_fp8 else self.dtype
        self.head_dim = cfg.head_dim
        self.head_dim_v = cfg.head_dim_v
        self.banded = cfg.banded
        self.softcap = cfg.softcap
        self.segments = cfg.segments
        self.split = cfg.split
        self.paged = cfg.paged
        self.tile_m = cfg.tile.m
        self.tile_n = cfg.tile.n
        self.kv_stages = cfg.tile.kv_stages
        self.schedule = cfg.tile.schedule
        self.persistent = self.schedule != "tile"
        self.q_stages = cfg.tile.q_stages if self.persistent else 1
        self.consumers = cfg.tile.consumers
        self.pingpong = cfg.tile.pingpong
        self.rescale_threshold = cfg.tile.rescale_threshold
        assert not self.fp8 or (self.rescale_threshold or 0) <= FP8_P_LOG2_MAX
        self.threads = WARPGROUP * (1 + self.consumers)
        # Query rows of one Q buffer (one consumer's): a wgmma M here.
        self.q_rows = CONSUMER_ROWS
        self.ctas_per_sm = cfg.tile.ctas_per_sm
        self.consumer_regs = consumer_regs(self.consumers, self.ctas_per_sm)
        self.q_registers = cfg.tile.q_registers
        assert not (self.q_registers and self.fp8)
        self.defer_o_read = cfg.tile.defer_o_read
        self.early_row_stats = cfg.tile.early_row_stats
        # the dynamic ring hands a tile's whole block range (_handoff): no split of it
        assert not (self.split and self.schedule == "dynamic")
        # the next tile's Q needs a stage of its own; O is staged only through TMA
        assert not self.defer_o_read or (self.q_stages >= 2 and not (self.split or self.fp8))
        # Paged variants (one tile per CTA) load V from a second producer warp: their
        # key blocks are many small TMA copies (16-key pieces), whose coordinates kept
        # one warp issuing late (ncu: 5x the dense producer's instructions, consumers
        # waiting for K/V inside the loop). Batch-1 decode over pages of 64, 8k keys,
        # 32 / 8 heads of 128: 1.08-1.09x (kernel 10.6 -> 9.3 us), 128k 1.01x, d64
        # batch 32 at 1088 keys 0.99-1.00x (H100, 2026-11-26, alternated twice).
        self.v_warp = self.paged and self.schedule == "tile"
        # Smem.appended borrows the dynamic schedule's tile ring.
        assert not (self.paged and self.schedule == "dynamic")

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mTileCounter: cute.Tensor,
        mOpart: cute.Tensor | None,
        mLSEpart: cute.Tensor | None,
        mRows: cute.Tensor | None,
        mKeys: cute.Tensor | None,
        mPlan: cute.Tensor | None,
        mPages: cute.Tensor | None,
        mNewK: cute.Tensor | None,
        mNewV: cute.Tensor | None,
        mDescale: cute.Tensor | None,
        scale_log2: Float32,
        band_lo: Int32,
        band_hi: Int32,
        softcap_scale: Float32,
        num_splits: Int32,
        num_sms: Int32,
        unpack_group: Int32,
        stream: cuda.CUstream,
    ):
        """mOpart, mLSEpart: split variants' partials (None otherwise: not in the ABI).
        mRows, mKeys, mPlan: segment variants only; mPages, mNewK, mNewV: paged
        variants only, and then mK, mV are the caches, into which the kernel appends
        the new rows mNewK, mNewV (paged.py). num_splits and unpack_group: split
        variants only (others are launched with 1 and ignore them). float8 variants:
        mV is V^T, (B, Hkv * Dv, Skp) with each head's Dv rows of Skp keys (Skp >= Sk, a
        multiple of 32, keys past Sk zero), whose keys run in the order of fragments.py
        (float8 P) within each 32; mDescale (1, 3, Hkv) fp32, the q, k and v descales of each
        K/V head; None otherwise. num_sms: the
        device's SM count, the most CTAs a persistent launch runs. mTileCounter (1, 1,
        1) int32: the "dynamic" schedule's counter of tiles taken, zeroed by the
        handler before the launch; others leave it alone."""
        dt, d, dv = self.dtype, self.head_dim, self.head_dim_v
        # Split variants' kernel writes the partials; its combine, mO and mLSE.
        o_dst, lse_dst = (mOpart, mLSEpart) if cutlass.const_expr(self.split) else (mO, mLSE)
        q, k, o = _seq_major(mQ), _seq_major(mK), _seq_major(o_dst)
        # V^T (D, Sk, H, B): V is the B operand of O = P V with head_dim contiguous.
        if cutlass.const_expr(self.fp8):
            keys, rows = mV.shape[2], mV.shape[1]
            vt = cute.make_tensor(mV.iterator, cute.make_layout(
                (dv, keys, rows // dv, mV.shape[0]), stride=(keys, 1, dv * keys, rows * keys)))
        else:
            vt = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[3, 1, 2, 0]))
        lse = cute.make_tensor(lse_dst.iterator, cute.select(lse_dst.layout, mode=[2, 1, 0]))

        sQ_layout = self._q_smem_layout()
        # The wgmma's K and V buffers: the rings, or one converted block (kv_fp8).
        sK_layout, sV_layout = self._kv_layouts(dt, 1 if self.kv_fp8 else self.kv_stages)
        loadK_layout, loadV_layout = sK_layout, sV_layout
        if cutlass.const_expr(self.kv_fp8):
            loadK_layout, loadV_layout = self._kv_layouts(self.kv_dtype, self.kv_stages)
        sO_one = self._o_smem_layout()
        sQ_one = cute.slice_(sQ_layout, (None, None, 0))
        sK_one = cute.slice_(loadK_layout, (None, None, 0))
        sV_one = cute.slice_(loadV_layout, (None, None, 0))

        load = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_q, tma_q = cpasync.make_tiled_tma_atom(load, q, sQ_one, (self.q_rows, d))
        if cutlass.const_expr(self.paged):
            # One TMA box per PAGE_ROWS keys, each from its own page.
            k_pieces, v_pieces = paged.piece_layouts(self.kv_dtype, d, dv, 1)
            tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(
                load, k, cute.slice_(k_pieces, (None, None, 0)), (paged.PAGE_ROWS, d))
            tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(
                load, vt, cute.slice_(v_pieces, (None, None, 0)), (dv, paged.PAGE_ROWS))
        else:
            tma_atom_k, tma_k = cpasync.make_tiled_tma_atom(load, k, sK_one, (self.tile_n, d))
            tma_atom_v, tma_v = cpasync.make_tiled_tma_atom(load, vt, sV_one, (dv, self.tile_n))
        # Split variants store their fp32 partials from registers: `o` itself.
        tma_atom_o, tma_o = None, o
        if cutlass.const_expr(not (self.split or self.fp8)):
            tma_atom_o, tma_o = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), o, sO_one, (CONSUMER_ROWS, dv)
            )
        self.q_bytes = cute.size_in_bytes(dt, sQ_one) * self.consumers
        self.k_bytes = cute.size_in_bytes(self.kv_dtype, sK_one)
        self.v_bytes = cute.size_in_bytes(self.kv_dtype, sV_one)

        def aligned(dtype, layout):
            return cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(layout)], 1024]

        fields = dict(
            q_mbar=cute.struct.MemRange[Int64, 2 * self.q_stages],
            tile_mbar=cute.struct.MemRange[Int64, 2 * self.q_stages],
            tile_ring=cute.struct.MemRange[Int32, HANDOFF_FIELDS * self.q_stages],
            k_mbar=cute.struct.MemRange[Int64, 2 * self.kv_stages],
            v_mbar=cute.struct.MemRange[Int64, 2 * self.kv_stages],
            sQ=aligned(dt, sQ_layout), sK=aligned(dt, sK_layout),
            sV=aligned(self.pv_dtype, sV_layout), **self._scratch_fields())
        if cutlass.const_expr(self.kv_fp8):
            fields.update(loadK=aligned(self.kv_dtype, loadK_layout),
                          loadV=aligned(self.kv_dtype, loadV_layout))
        self.storage = cute.struct(type("Storage", (), {"__annotations__": fields}))
        splits = num_splits if cutlass.const_expr(self.split) else Int32(1)
        out, out_lse = None, None
        if cutlass.const_expr(self.split):
            out, out_lse = combine.unpacked(mO, mLSE, unpack_group)
        grid = (cute.ceil_div(q.shape[0], self.tile_m) * splits, q.shape[2], q.shape[3])
        if cutlass.const_expr(self.persistent):
            grid = (cutlass.min(grid[0] * grid[1] * grid[2], num_sms * self.ctas_per_sm),
                    1, 1)
        self.kernel(
            tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_o, tma_o,
            lse, out, out_lse, mTileCounter, mRows, mKeys, mPlan,
            (mPages, mK, mV, mNewK, mNewV) if cutlass.const_expr(self.paged) else None,
            mDescale, scale_log2,
            band_lo, band_hi, softcap_scale, splits,
            sQ_layout, sK_layout, sV_layout,
            (loadK_layout, loadV_layout) if cutlass.const_expr(self.kv_fp8) else None,
        ).launch(
            grid=grid, block=[self.threads, 1, 1], stream=stream,
            min_blocks_per_mp=self.ctas_per_sm,
            # Several CTAs per SM need the whole carveout as shared memory (100 %;
            # stated, so that the compile asks no device).
            preferred_smem_carveout=100 if self.ctas_per_sm > 1 else None,
        )
        # One split's partials would be the result: the kernel wrote out and lse itself.
        if cutlass.const_expr(self.split):
            if num_splits > 1:
                combine.SplitCombine(dt, dv).launch(
                    mOpart, mLSEpart, out, out_lse, num_splits, unpack_group, stream)

    @cute.kernel
    def kernel(
        self,
        tma_atom_q: cute.CopyAtom,
        tma_q: cute.Tensor,
        tma_atom_k: cute.CopyAtom,
        tma_k: cute.Tensor,
        tma_atom_v: cute.CopyAtom,
        tma_v: cute.Tensor,
        tma_atom_o: cute.CopyAtom | None,
        tma_o: cute.Tensor,
        mLSE: cute.Tensor,
        mOut: cute.Tensor | None,
        mOutLSE: cute.Tensor | None,
        mTileCounter: cute.Tensor,
        mRows: cute.Tensor | None,
        mKeys: cute.Tensor | None,
        mPlan: cute.Tensor | None,
        paged_tensors,
        mDescale: cute.Tensor | None,
        scale_log2: Float32,
        band_lo: Int32,
        band_hi: Int32,
        softcap_scale: Float32,
        num_splits: Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        load_layouts,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = cute.arch.make_warp_uniform(tidx // WARPGROUP)

        storage = utils.SmemAllocator().allocate(self.storage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        loads = None
        if cutlass.const_expr(self.kv_fp8):
            loadK_layout, loadV_layout = load_layouts
            loads = (storage.loadK.get_tensor(loadK_layout.outer, swizzle=loadK_layout.inner),
                     storage.loadV.get_tensor(loadV_layout.outer, swizzle=loadV_layout.inner))

        # Paged variants ("tile" schedule) leave the tile ring's barriers unused: the
        # first is the append warp's (Smem.appended), one arrival.
        appended = storage.tile_mbar.data_ptr() if cutlass.const_expr(self.paged) else None
        if warp == 0:
            for atom in (tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o):
                if cutlass.const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)
            if cutlass.const_expr(self.paged):
                with cute.arch.elect_one():
                    cute.arch.mbarrier_init(appended, 1)
        # Q is released once the consumer's O store has read its buffer (one release
        # per consumer); K and V once per consumer warp.
        q_producer, q_consumer = self._pipeline(storage.q_mbar.data_ptr(), self.q_stages,
                                                self.q_bytes, self.consumers)
        k_producer, k_consumer = self._pipeline(storage.k_mbar.data_ptr(), self.kv_stages,
                                                self.k_bytes, 4 * self.consumers)
        v_producer, v_consumer = self._pipeline(storage.v_mbar.data_ptr(), self.kv_stages,
                                                self.v_bytes, 4 * self.consumers)
        if cutlass.const_expr(self.schedule == "dynamic"):
            # The producer warp hands tile indices to every consumer thread.
            tile_producer, tile_consumer = pipeline.PipelineAsync.create(
                barrier_storage=storage.tile_mbar.data_ptr(),
                num_stages=self.q_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                         WARPGROUP * self.consumers),
                defer_sync=True,
            ).make_participants()
            tile_ring = storage.tile_ring.get_tensor(
                cute.make_layout((HANDOFF_FIELDS, self.q_stages)))
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        seqlen_q = tma_q.shape[0]
        seqlen_k = tma_k.shape[0]
        if cutlass.const_expr(self.paged):
            seqlen_k = paged_tensors[0].shape[2] * tma_k.shape[0]
        final = None
        if cutlass.const_expr(self.split):
            final = (mOut, mOutLSE, mOut.shape[2] // tma_q.shape[2])
        gmem = Gmem((tma_atom_q, tma_q), (tma_atom_k, tma_k), (tma_atom_v, tma_v),
                    (tma_atom_o, tma_o), mLSE, final, mDescale)
        run = Scalars(scale_log2, band_lo, band_hi, softcap_scale, seqlen_q, seqlen_k,
                      num_splits)
        smem = Smem(sQ, sK, sV, appended, loads, self._scratch(storage))
        launch = Launch(run, gmem, mRows, mKeys, mPlan, paged_tensors)
        extent_x = cute.ceil_div(seqlen_q, self.tile_m)
        if cutlass.const_expr(self.split):
            extent_x = extent_x * num_splits
        grid = schedule.Grid(extent_x, tma_q.shape[2], tma_q.shape[3])

        if wg == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp == 0:
                if cutlass.const_expr(self.schedule == "dynamic"):
                    # Longest first, from the block index, then from the counter; the
                    # ring carries each tile with its walk's numbers (_handoff), then
                    # the end.
                    order = schedule.pairs_per_group(grid, seqlen_k, self._key_bytes())
                    stride, _, _ = cute.arch.grid_dim()
                    t, _, _ = cute.arch.block_idx()
                    while t < grid.count:
                        tile = schedule.in_l2_groups(grid, order, t)
                        walk = self._walk(tile, launch)
                        tile_producer = _publish(tile_producer, tile_ring,
                                                 self._handoff(tile, walk))
                        q_producer, k_producer, v_producer = self.load(
                            gmem, smem, walk, q_producer, k_producer, v_producer)
                        t = schedule.take_next(mTileCounter.iterator, stride)
                    tile_producer = _publish(
                        tile_producer, tile_ring,
                        (Int32(-1),) + (Int32(0),) * (HANDOFF_FIELDS - 1))
                else:
                    tile, step, count = self._share(grid)
                    x, head, batch = tile
                    for i in cutlass.range(count, unroll=1):
                        q_producer, k_producer, v_producer = self.load(
                            gmem, smem, self._walk((x, head, batch), launch), q_producer,
                            k_producer, v_producer,
                            "qk" if cutlass.const_expr(self.v_warp) else "qkv")
                        x, head, batch = self._next_tile(grid, (x, head, batch), step)
            if cutlass.const_expr(self.v_warp):
                if warp == 1:
                    tile = cute.arch.block_idx()
                    q_producer, k_producer, v_producer = self.load(
                        gmem, smem, self._walk(tile, launch), q_producer, k_producer,
                        v_producer, "v")
            if cutlass.const_expr(self.paged):
                if warp == APPEND_WARP:
                    self._append(self._walk(cute.arch.block_idx(), launch), smem)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            c, ctid = wg - 1, tidx % WARPGROUP
            if cutlass.const_expr(self.schedule == "dynamic"):
                tile_consumer, values = _receive(tile_consumer, tile_ring, HANDOFF_FIELDS)
                x, head, batch, n_begin, n_end, masked_end, masked_begin, first = values
                done = Int32(0)
                while x >= 0:
                    q_consumer, k_consumer, v_consumer = self.mma_softmax_epilogue(
                        gmem, run, self._walk((x, head, batch), launch, Planned(
                            n_begin, n_end, masked_end, masked_begin, first)), smem,
                        q_consumer, k_consumer, v_consumer, c, ctid, warp, done)
                    done += 1
                    tile_consumer, values = _receive(tile_consumer, tile_ring,
                                                     HANDOFF_FIELDS)
                    x, head, batch, n_begin, n_end, masked_end, masked_begin, first = values
            else:
                tile, step, count = self._share(grid)
                x, head, batch = tile
                for i in cutlass.range(count, unroll=1):
                    q_consumer, k_consumer, v_consumer = self.mma_softmax_epilogue(
                        gmem, run, self._walk((x, head, batch), launch), smem, q_consumer,
                        k_consumer, v_consumer, c, ctid, warp, i)
                    x, head, batch = self._next_tile(grid, (x, head, batch), step)
            if cutlass.const_expr(self.defer_o_read):
                # the last tile's O store must have read shared memory before the exit
                if warp % 4 == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)

    def _key_bytes(self) -> int:
        """Bytes of K and V per key (16-bit dtypes)."""
        return 2 * (self.head_dim + self.head_dim_v)

    def _share(self, grid):
        """(first tile, step, count) of this CTA's tiles: "static" takes every
        stride-th tile of the grid (schedule.static_share); "tile" its one tile."""
        if cutlass.const_expr(self.schedule == "static"):
            return schedule.static_share(grid)
        return cute.arch.block_idx(), None, 1

    def _next_tile(self, grid, tile, step):
        if cutlass.const_expr(self.schedule == "static"):
            return schedule.static_next(grid, tile, step)
        return tile

    def _handoff(self, tile, walk: Walk):
        """What the producer hands the consumers for a tile of the dynamic schedule:
        the tile, decoded, then its Planned values, so that a consumer's tile start does
        neither the range's arithmetic nor the plan's global loads (_walk's `planned`)."""
        first = walk.seg.first if cutlass.const_expr(self.segments) else Int32(0)
        return tuple(tile) + (walk.n_begin, walk.n_end, walk.masked_end, walk.masked_begin,
                              first)

    def _walk(self, tile, launch: Launch, planned: Planned | None = None) -> Walk:
        """The Walk of grid tile (x, head, batch); `planned`: what the producer already
        computed of it (dynamic schedule's consumers)."""
        run, gmem = launch.run, launch.gmem
        mRows, mKeys, mPlan = launch.mRows, launch.mKeys, launch.mPlan
        num_splits = run.num_splits
        tma_q, tma_k = gmem.q[1], gmem.k[1]
        bx, head, batch = tile
        m_block, split = bx, Int32(0)
        tiles = cute.ceil_div(run.seqlen_q, self.tile_m)
        if cutlass.const_expr(self.split):
            m_block = bx // num_splits
            split = bx - m_block * num_splits
        if cutlass.const_expr(self.banded):
            m_block = tiles - 1 - m_block  # longest-first: banded tiles grow with m_block
        cache = None
        if cutlass.const_expr(self.paged):
            # The cache's rows are pages; the batch's keys are its table's pages in turn.
            mPages, mK, mV, mNewK, mNewV = launch.paged
            kv_head = mask.kv_head(head, tma_q.shape[2], tma_k.shape[2])
            new = paged.NewRows(mNewK[batch, None, kv_head, None],
                                mNewV[batch, None, kv_head, None],
                                mK[None, None, kv_head, None], mV[None, None, kv_head, None],
                                mRows[batch, None, None])
            cache = paged.Cache(mPages[batch, 0, None], tma_k.shape[0], tma_k.shape[3],
                                kv_head, new)
        if cutlass.const_expr(planned is None):
            n_begin, n_end, masked_end, masked_begin = mask.kv_block_range(
                m_block, run.seqlen_k, run.band_lo, run.band_hi, self.tile_m, self.tile_n,
                self.banded
            )
        else:
            n_begin, n_end = planned.n_begin, planned.n_end
            masked_end, masked_begin = planned.masked_end, planned.masked_begin
        seg = None
        if cutlass.const_expr(self.segments and planned is not None):
            seg = segments.Views(mRows[batch, None, None], mKeys[batch, 0, None],
                                 mPlan[batch, m_block, None], run.seqlen_q, count=n_end,
                                 first=planned.first)
        elif cutlass.const_expr(self.segments):
            # The plan's blocks replace the band's: visits 0 .. count - 1 (this split's).
            plan_row = mPlan[batch, m_block, None]
            count = plan_row[0]
            if cutlass.const_expr(self.split):
                first, end = band.split_visits(count, split, num_splits, cutlass.min)
                count = end - first
                # An empty split reads the row's first entry, which every row has.
                plan_row = segments.skip_visits(plan_row, cutlass.select_(count > 0, first, Int32(0)))
            seg = segments.Views(mRows[batch, None, None], mKeys[batch, 0, None],
                                 plan_row, run.seqlen_q, count=count)
            n_begin, n_end = Int32(0), seg.count
        elif cutlass.const_expr(self.split):
            first, end = band.split_visits(n_end - n_begin, split, num_splits, cutlass.min)
            n_begin, n_end, masked_end, masked_begin = band.split_blocks(
                n_begin, n_end, masked_end, masked_begin, first, end, cutlass.min, cutlass.max)
        out_batch = batch
        if cutlass.const_expr(self.split):
            out_batch = batch * num_splits + split
        return Walk(m_block, head, batch, n_begin, n_end, masked_end, masked_begin, seg,
                    out_batch, cache)

    def _pipeline(self, barriers, stages, tx_bytes, releases):
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=barriers,
            num_stages=stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            # PipelineTmaAsync releases from lane 0 of each releasing warp
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, releases),
            tx_count=tx_bytes,
            defer_sync=True,
        ).make_participants()
    # ------------------------------------------------------------------ producer
    @cute.jit
    def load(self, gmem: Gmem, smem: Smem, walk: Walk, q_producer, k_producer, v_producer,
             parts: cutlass.Constexpr = "qkv"):
        """The walk's tile: its Q into the next Q stage (also for a tile without keys,
        whose consumers stage their zero O there), then its key blocks, K one block ahead
        of V; returns the advanced producers. `parts`: "qkv" all of it; "qk" Q and the K
        blocks, "v" the V blocks (two producer warps: v_warp)."""
        (tma_atom_q, tma_q), (tma_atom_k, tma_k), (tma_atom_v, tma_v) = gmem.q, gmem.k, gmem.v
        sQ, (sK, sV) = smem.sQ, smem.loads
        m_block, head, batch, seg = walk.m_block, walk.head, walk.batch, walk.seg
        n_begin, n_end = walk.n_begin, walk.n_end
        d = self.head_dim
        gQ = cute.local_tile(tma_q[None, None, head, batch], (self.q_rows, d), (None, 0))
        if cutlass.const_expr("q" in parts):
            q_producer = self._load_q(tma_atom_q, gQ, sQ, m_block, q_producer)
        if n_end > n_begin:
            load_k, load_v = self._kv_loaders(tma_atom_k, tma_k, tma_atom_v, tma_v, sK, sV,
                                              head, batch, tma_q.shape[2], walk.cache,
                                              smem.appended)
            visits = n_end - n_begin
            if cutlass.const_expr(parts == "qk"):
                for i in cutlass.range(visits, unroll=1):
                    k_producer = load_k(k_producer, self._kv_block(i, n_end, seg))
            elif cutlass.const_expr(parts == "v"):
                for i in cutlass.range(visits, unroll=1):
                    v_producer = load_v(v_producer, self._kv_block(i, n_end, seg))
            else:
                k_producer, v_producer = self._load_kv(load_k, load_v, visits, n_end, seg,
                                                       k_producer, v_producer)
        return q_producer, k_producer, v_producer

    @cute.jit
    def _append(self, walk: Walk, smem: Smem):
        """Paged: store the walk's new K and V rows that fall in its key blocks into
        their pages, then arrive on smem.appended, which the loading warps wait for
        (only when there are new rows)."""
        if walk.cache.new.k.shape[0] > 0:
            # An appending call's plan runs upwards, so the walk goes from its last
            # visit down and stops after the first block that starts at or below the
            # first new key: a decode step stores after one plan read, not one per
            # visit.
            first_new = paged.first_new_key(walk.cache)
            i = walk.n_end - walk.n_begin - 1
            more = i >= 0
            while more:
                block = self._kv_block(i, walk.n_end, walk.seg)
                paged.append_rows(block, first_new, walk.cache, self.tile_n)
                i = i - 1
                more = (i >= 0) & (block * self.tile_n > first_new)
            # The blocks' TMA copies (the async proxy) must see every lane's stores.
            cute.arch.fence_proxy("async.global")
            cute.arch.sync_warp()
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive(smem.appended)

    @cute.jit
    def _load_q(self, tma_atom_q, gQ, sQ, m_block, q_producer):
        """Q tile m_block, one consumer's rows at a time, into the next Q stage."""
        q_handle = q_producer.acquire_and_advance()
        for c in cutlass.range_constexpr(self.consumers):
            tQsQ, tQgQ = cpasync.tma_partition(
                tma_atom_q, 0, cute.make_layout(1),
                cute.group_modes(sQ[None, None, q_handle.index * self.consumers + c], 0, 2),
                cute.group_modes(gQ, 0, 2),
            )
            cute.copy(
                tma_atom_q, tQgQ[None, m_block * self.consumers + c], tQsQ,
                tma_bar_ptr=q_handle.barrier,
            )
        return q_producer

    @cute.jit
    def _load_kv(self, load_k, load_v, visits, n_end, seg, k_producer, v_producer):
        """K and V of the visits, from one warp: consumers take K_j before V_{j+1}
        (blocks are visited last to first), so K runs one block ahead of V."""
        k_block, _ = self._first_block(n_end, seg)
        k_producer = load_k(k_producer, k_block)
        for i in cutlass.range(1, visits, unroll=1):
            v_block = k_block
            k_block = self._kv_block(i, n_end, seg)
            k_producer = load_k(k_producer, k_block)
            v_producer = load_v(v_producer, v_block)
        v_producer = load_v(v_producer, k_block)
        return k_producer, v_producer

    def _kv_loaders(self, tma_atom_k, tma_k, tma_atom_v, tma_v, sK, sV, head, batch,
                    heads, cache, appended):
        """load_k(producer, block), load_v(producer, block): wait for a free ring slot,
        TMA key block `block` of K (of V) into it; each returns the advanced producer.
        Paged variants load the block in pieces, each from its page (paged.py), once
        the append warp has stored the call's new rows (`appended`, when it has any)."""
        d, dv = self.head_dim, self.head_dim_v
        if cutlass.const_expr(self.paged):
            pieces = self.tile_n // paged.PAGE_ROWS
            k_pieces, v_pieces = paged.piece_layouts(self.kv_dtype, d, dv,
                                                     pieces * self.kv_stages)
            k_ring = cute.make_tensor(sK.iterator, k_pieces.outer)
            v_ring = cute.make_tensor(sV.iterator, v_pieces.outer)

            def load_paged(producer, block, atom, tma_cache, ring, box, keys_major):
                pages = paged.block_pages(block, cache, self.tile_n)
                handle = producer.acquire_and_advance()
                paged.load_block(atom, tma_cache, ring, handle.index * pieces, block, pages,
                                 cache, self.tile_n, box, keys_major, handle.barrier,
                                 appended)
                return producer

            return (lambda producer, block: load_paged(producer, block, tma_atom_k, tma_k,
                                                       k_ring, (paged.PAGE_ROWS, d), True),
                    lambda producer, block: load_paged(producer, block, tma_atom_v, tma_v,
                                                       v_ring, (dv, paged.PAGE_ROWS), False))
        kv_head = mask.kv_head(head, heads, tma_k.shape[2])
        gK = cute.local_tile(tma_k[None, None, kv_head, batch], (self.tile_n, d), (None, 0))
        gV = cute.local_tile(tma_v[None, None, kv_head, batch], (dv, self.tile_n), (0, None))
        tKsK, tKgK = cpasync.tma_partition(
            tma_atom_k, 0, cute.make_layout(1),
            cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2),
        )
        tVsV, tVgV = cpasync.tma_partition(
            tma_atom_v, 0, cute.make_layout(1),
            cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2),
        )
        return (lambda producer, block: self._tma_block(producer, tma_atom_k,
                                                        tKgK[None, block], tKsK),
                lambda producer, block: self._tma_block(producer, tma_atom_v,
                                                        tVgV[None, block], tVsV))

    @cute.jit
    def _first_block(self, n_end: Int32, seg, seqlen_k=None):
        """(key block, masked) of visit 0: the last block, which the band may cut, or
        the plan's first entry and its mask (segments.py). Without a band only the key
        length can cut a block: given seqlen_k, the last is masked only where it is
        partial (_tail_mask_only)."""
        block, masked = n_end - 1, Int32(1)
        if cutlass.const_expr(self.segments):
            block, masked = segments.decode(seg.first)
        elif cutlass.const_expr(self._tail_mask_only and seqlen_k is not None):
            masked = Int32(n_end * self.tile_n > seqlen_k)
        return block, masked

    @property
    def _tail_mask_only(self) -> bool:
        """Visit 0 (the last key block) masked only where the key length cuts it, a
        branch per tile, instead of always: 16-bit kernels without a band. Against
        always (H100, 2026-11-27, alternated twice in one call), without a mask at 512 /
        2k / 16k tokens: d64 1.09-1.12 / 1.03-1.04 / 1.06, d128 1.03-1.04 / 1.01-1.02 /
        1.03-1.10 (16k beside a running test suite). The e4m3 d128 kernel, whose 96-key
        blocks these lengths always cut, ran 0.98 with the branch: e4m3 keeps the mask."""
        return not (self.banded or self.fp8)

    @cute.jit
    def _kv_block(self, i: Int32, n_end: Int32, seg):
        """The key block of visit i: from the last block down, or the plan's."""
        block = n_end - 1 - i
        if cutlass.const_expr(self.segments):
            block, _ = segments.visit(seg.plan_row, i)
        return block

    @staticmethod
    def _tma_block(producer, atom, src, ring):
        """Wait for a free ring slot, TMA one block into it; returns the advanced
        producer so that loops rebind it (the tracer carries rebinds, not mutations)."""
        handle = producer.acquire_and_advance()
        cute.copy(atom, src, ring[None, handle.index], tma_bar_ptr=handle.barrier)
        return producer

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def mma_softmax_epilogue(self, gmem: Gmem, run: Scalars, walk: Walk, smem: Smem,
                             q_consumer, k_consumer, v_consumer, c: Int32, tidx: Int32,
                             warp: Int32, tiles_before: Int32):
        """Consumer c: S = Q K^T, online softmax and O += P V over the walk's key blocks
        (the last visited block first; _step per block after it), then out and LSE to
        the walk's out_batch; returns the advanced ring consumers. tiles_before: the
        tiles this CTA ran before this one."""
        sQ, sK, sV = smem.sQ, smem.sK, smem.sV
        m_block, seg = walk.m_block, walk.seg
        n_begin, n_end = walk.n_begin, walk.n_end
        masked_end, masked_begin = walk.masked_end, walk.masked_begin
        softcap_scale = run.softcap_scale
        dv, tile_n = self.head_dim_v, self.tile_n
        q_handle = q_consumer.wait_and_advance()
        sQc = sQ[None, None, q_handle.index * self.consumers + c]
        # O is staged in this consumer's own Q buffer (Dv <= D: it fits), in O's layout.
        sOc = None
        if cutlass.const_expr(not self.fp8):
            sOc = cute.make_tensor(sQc.iterator, self._o_smem_layout().outer)
        pv_mma = self._pv_mma()
        thr_qk = self._qk_mma().get_slice(tidx)
        thr_pv = pv_mma.get_slice(tidx)
        tSsQ = thr_qk.partition_A(sQc)
        tSrQ = thr_qk.make_fragment_A(tSsQ)
        if cutlass.const_expr(self.q_registers):
            cute.autovec_copy(tSsQ, tSrQ)
        tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))
        tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sV))
        s_shape = thr_qk.partition_shape_C((CONSUMER_ROWS, tile_n))
        acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((CONSUMER_ROWS, dv)))
        acc_o.fill(0.0)
        coord_s = rows_cols(thr_qk.partition_C(cute.make_identity_tensor((CONSUMER_ROWS, tile_n))))
        scale_log2, v_descale = self._scales(gmem, run, walk)
        softmax = OnlineSoftmax.create(scale_log2, ROWS_PER_THREAD, self.rescale_threshold,
                                       self._p_offset())
        o_scale = cute.make_rmem_tensor((ROWS_PER_THREAD,), Float32)
        # P in the input dtype, viewed as the register A operand of O += P V.
        acc_layout = thr_qk.make_fragment_C(s_shape).layout
        if cutlass.const_expr(self.fp8):
            r_p = cute.make_rmem_tensor((cute.size(acc_layout),), self.dtype)
            tOrP = cute.make_tensor(r_p.iterator, acc_as_fp8_operand_a(acc_layout))
        else:
            r_p = cute.make_rmem_tensor(acc_layout, self.pv_dtype)
            tOrP = cute.make_tensor(r_p.iterator, acc_as_operand_a(r_p.layout))
        row0 = m_block * self.tile_m + c * CONSUMER_ROWS
        coord_o = rows_cols(thr_pv.partition_C(cute.make_identity_tensor((CONSUMER_ROWS, dv))))
        tiled_r2s = None
        if cutlass.const_expr(not self.fp8):
            tiled_r2s = wgmma.acc_store_copy(pv_mma, self.dtype)
        tiles = _Tiles(thr_qk=thr_qk, s_shape=s_shape, tSrQ=tSrQ, tSrK=tSrK, tOrV=tOrV,
                       tOrP=tOrP, r_p=r_p, acc_o=acc_o, coord_s=coord_s, softmax=softmax,
                       o_scale=o_scale, c=c, row0=row0, coord_o=coord_o,
                       tiled_r2s=tiled_r2s, sOc=sOc, v_descale=v_descale, smem=smem,
                       ctid=tidx)
        inv_sum = cute.make_rmem_tensor((ROWS_PER_THREAD,), Float32)
        lse = cute.make_rmem_tensor((ROWS_PER_THREAD,), Float32)

        if n_end > n_begin:
            self._start_turns(c)

            # First visited block: S and softmax only; its PV runs in the next step.
            n_last, first_masked = self._first_block(n_end, seg, run.seqlen_k)
            acc_s = thr_qk.make_fragment_C(s_shape)
            k_handle = k_consumer.wait_and_advance()
            k_at, _ = self._operands(tiles, k_handle, None)
            self._wait_turn(c)
            wgmma.gemm(self._qk_mma(), acc_s, tSrQ, tSrK[None, None, None, k_at], True)
            self._pass_turn(c)
            if cutlass.const_expr(self.defer_o_read):
                self._free_previous_q(q_handle, tiles_before, warp)
            warpgroup.wait_group(0)
            self._release(k_handle)
            s_rc = rows_cols(acc_s)
            if cutlass.const_expr(self.softcap):
                softcap.cap_scores(s_rc, softcap_scale)
            if cutlass.const_expr(self.segments):
                segments.mask_as_planned(first_masked, lambda kind, runs: self._mask(
                    s_rc, coord_s, row0, n_last, run, seg, kind, runs))
            elif cutlass.const_expr(self._tail_mask_only):
                if first_masked != 0:
                    self._mask(s_rc, coord_s, row0, n_last, run, seg)
            else:
                self._mask(s_rc, coord_s, row0, n_last, run, seg)
            softmax.step(s_rc, o_scale)
            self._convert_p(acc_s, r_p)

            if cutlass.const_expr(self.segments):
                for i in cutlass.range(1, n_end, unroll=1):
                    n_block, block_mask = segments.visit(seg.plan_row, i)
                    # A branch on the plan's mask around the whole step, not around
                    # the mask inside it: there, between the QK wgmma and its wait,
                    # it made ptxas serialize the wgmma of persistent kernels (C7514).
                    if block_mask == segments.IDS:
                        k_consumer, v_consumer = self._step(
                            True, n_block, tiles, run, seg, k_consumer, v_consumer)
                    elif block_mask == segments.RANGES:
                        k_consumer, v_consumer = self._step(
                            True, n_block, tiles, run, seg, k_consumer, v_consumer,
                            segments.RANGES)
                    elif block_mask != segments.NO_MASK:
                        k_consumer, v_consumer = self._step(
                            True, n_block, tiles, run, seg, k_consumer, v_consumer,
                            segments.RUNS, block_mask)
                    else:
                        k_consumer, v_consumer = self._step(
                            False, n_block, tiles, run, seg, k_consumer, v_consumer)
            else:
                # Downwards: the rest of the top masked blocks, the whole ones, and the
                # ones the band's left edge cuts.
                for i in cutlass.range(masked_end - 1, unroll=1):
                    k_consumer, v_consumer = self._step(
                        True, n_last - 1 - i, tiles, run, seg, k_consumer, v_consumer)
                n_whole_top = n_end - masked_end - 1
                for i in cutlass.range(n_end - n_begin - masked_end - masked_begin, unroll=1):
                    k_consumer, v_consumer = self._step(
                        False, n_whole_top - i, tiles, run, seg, k_consumer, v_consumer)
                for i in cutlass.range(masked_begin, unroll=1):
                    k_consumer, v_consumer = self._step(
                        True, n_begin + masked_begin - 1 - i, tiles, run, seg, k_consumer,
                        v_consumer)

            # PV of the last visited block.
            self._rescale(acc_o, o_scale)
            v_handle = v_consumer.wait_and_advance()
            _, v_at = self._operands(tiles, None, v_handle)
            wgmma.gemm(self._pv_mma(), acc_o, tOrP, tOrV[None, None, None, v_at], False)
            if cutlass.const_expr(self.early_row_stats):
                # The row sums and LSE need only the softmax state: beside the GEMM.
                self._row_stats(tiles, gmem, run, walk, tidx, inv_sum, lse)
            warpgroup.wait_group(0)
            self._release(v_handle)
            if c == 0:
                self._wait_turn(c)  # the turn the last consumer passed after its last step

        if cutlass.const_expr(self.early_row_stats):
            if n_end <= n_begin:
                self._row_stats(tiles, gmem, run, walk, tidx, inv_sum, lse)
        else:
            self._row_stats(tiles, gmem, run, walk, tidx, inv_sum, lse)
        if cutlass.const_expr(self.defer_o_read):
            if n_end <= n_begin:  # no GEMM to hide the wait behind
                self._free_previous_q(q_handle, tiles_before, warp)
        self.epilogue(tiles, gmem, run, walk, tidx, warp, inv_sum, lse)
        # The Q stage is free once every warp of this consumer is past its last read:
        # the O store's (its issuing warp waited for it), or split variants' last wgmma.
        if cutlass.const_expr(self.split):
            pipeline.NamedBarrier(Barrier.EPILOGUE + c, WARPGROUP).arrive_and_wait()
        if cutlass.const_expr(not self.defer_o_read):
            if warp % 4 == 0:
                q_handle.release()
        return q_consumer, k_consumer, v_consumer

    @cute.jit
    def _free_previous_q(self, q_handle, tiles_before: Int32, warp: Int32):
        """Tile.defer_o_read: the previous tile's O store (issued by the consumer's
        first warp) reads the Q stage before this tile's (q_handle's); once that read
        is done, the stage is freed for the producer."""
        if warp % 4 == 0:
            if tiles_before > 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
                previous = (q_handle.index + self.q_stages - 1) % self.q_stages
                q_handle.get_origin().consumer_release(
                    pipeline.PipelineState(self.q_stages, Int32(0), previous, Int32(0)))

    @cute.jit
    def _scales(self, gmem: Gmem, run: Scalars, walk: Walk):
        """(scale_log2, v_descale) of the walk's head: the softmax scale in base 2 and
        the factor of out, times its K/V head's descales in float8 variants."""
        scale_log2, v_descale = run.scale_log2, Float32(1.0)
        if cutlass.const_expr(self.descaled):
            kv_head = mask.kv_head(walk.head, gmem.q[1].shape[2], gmem.k[1].shape[2])
            scale_log2 = (scale_log2 * gmem.descale[0, 0, kv_head]
                          * gmem.descale[0, 1, kv_head])
            v_descale = gmem.descale[0, 2, kv_head]
        return scale_log2, v_descale

    @cute.jit
    def _step(self, is_masked: cutlass.Constexpr, n_block: Int32, tiles,
              run: Scalars, seg, k_consumer, v_consumer,
              kind: cutlass.Constexpr = segments.IDS, runs=None):
        """S_j = Q K_j^T and O += P_{j+1} V_{j+1} on the tensor cores, softmax of S_j
        overlapping the PV product (j = n_block; P_{j+1} is in r_p); returns the advanced
        ring consumers. is_masked: element masking (segment variants: the plan flags
        the block, and kind and runs as _mask)."""
        thr_qk, s_shape, tSrQ, tSrK = tiles.thr_qk, tiles.s_shape, tiles.tSrQ, tiles.tSrK
        tOrV, tOrP, r_p, acc_o = tiles.tOrV, tiles.tOrP, tiles.r_p, tiles.acc_o
        coord_s, softmax, o_scale = tiles.coord_s, tiles.softmax, tiles.o_scale
        c, row0, softcap_scale = tiles.c, tiles.row0, run.softcap_scale
        acc_s = thr_qk.make_fragment_C(s_shape)
        k_handle = k_consumer.wait_and_advance()
        v_handle = None
        if cutlass.const_expr(self.kv_fp8):  # both blocks are converted before either GEMM
            v_handle = v_consumer.wait_and_advance()
        k_at, v_at = self._operands(tiles, k_handle, v_handle)
        self._wait_turn(c)
        wgmma.gemm(self._qk_mma(), acc_s, tSrQ, tSrK[None, None, None, k_at], True)
        self._rescale(acc_o, o_scale)
        if cutlass.const_expr(not self.kv_fp8):
            v_handle = v_consumer.wait_and_advance()
            v_at = v_handle.index
        wgmma.gemm(self._pv_mma(), acc_o, tOrP, tOrV[None, None, None, v_at], False)
        self._pass_turn(c)
        warpgroup.wait_group(1)
        self._release(k_handle)
        s_rc = rows_cols(acc_s)
        if cutlass.const_expr(self.softcap):
            softcap.cap_scores(s_rc, softcap_scale)
        if cutlass.const_expr(is_masked):
            self._mask(s_rc, coord_s, row0, n_block, run, seg, kind, runs)
        softmax.step(s_rc, o_scale)
        warpgroup.wait_group(0)
        self._release(v_handle)
        self._convert_p(acc_s, r_p)
        return k_consumer, v_consumer

    @cute.jit
    def _operands(self, tiles, k_handle, v_handle):
        """(K stage, V stage) of the wgmma for the landed ring slots k_handle and
        v_handle (either None: not needed): the slots themselves, or in kv_fp8 variants
        the one bf16 buffer of each, into which the consumer converts the slots, then
        frees them."""
        if cutlass.const_expr(not self.kv_fp8):
            return (None if k_handle is None else k_handle.index,
                    None if v_handle is None else v_handle.index)
        smem = tiles.smem
        (ringK, ringV), pairs = smem.loads, []
        if cutlass.const_expr(k_handle is not None):
            pairs.append((ringK[None, None, k_handle.index], smem.sK[None, None, 0], 1))
        if cutlass.const_expr(v_handle is not None):
            pairs.append((ringV[None, None, v_handle.index], smem.sV[None, None, 0], 0))
        dequant.dequantize(pairs, Barrier.DEQUANT + tiles.c, tiles.ctid, WARPGROUP)
        for handle in (k_handle, v_handle):
            if cutlass.const_expr(handle is not None):
                handle.release()
        return 0, 0

    def _release(self, handle):
        """Free a K or V ring slot once its wgmma is done (kv_fp8 variants freed it after
        the conversion)."""
        if cutlass.const_expr(not self.kv_fp8):
            handle.release()

    @cute.jit
    def _row_stats(self, tiles, gmem: Gmem, run: Scalars, walk: Walk, tidx: Int32,
                   inv_sum: cute.Tensor, lse: cute.Tensor):
        """Each row's factor of O (1 / rowsum, times the V descale in float8 variants)
        into inv_sum and its LSE into lse, which goes to mLSE here except in split
        variants (their epilogue stores it)."""
        tiles.softmax.finalize(inv_sum, lse)
        if cutlass.const_expr(self.descaled):
            for r in cutlass.range_constexpr(ROWS_PER_THREAD):
                inv_sum[r] = inv_sum[r] * tiles.v_descale
        if cutlass.const_expr(not self.split):
            self._store_lse(tiles.coord_o, tiles.row0, lse, gmem.mLSE, walk.head,
                            walk.out_batch, run, tidx)

    @cute.jit
    def epilogue(self, tiles, gmem: Gmem, run: Scalars, walk: Walk, tidx: Int32, warp: Int32,
                 inv_sum: cute.Tensor, lse: cute.Tensor):
        """O / rowsum of the walk's tile, to its out_batch (split variants: the partials
        and LSE, or with one split the caller's out and lse); inv_sum and lse from
        _row_stats."""
        acc_o, coord_o, row0 = tiles.acc_o, tiles.coord_o, tiles.row0
        head, batch, mLSE = walk.head, walk.out_batch, gmem.mLSE
        self._rescale(acc_o, inv_sum)

        if cutlass.const_expr(self.split):
            if run.num_splits == 1:
                self._store_final(tiles, gmem.final, lse, run, walk, tidx)
            else:
                self._store_lse(coord_o, row0, lse, mLSE, head, batch, run, tidx)
                self._store_direct(tiles, tiles.acc_o, gmem.o[1], run, walk)
        else:
            if cutlass.const_expr(self.fp8):
                r_o = cute.make_rmem_tensor_like(tiles.acc_o, self.out_dtype)
                r_o.store(tiles.acc_o.load().to(self.out_dtype))
                self._store_direct(tiles, r_o, gmem.o[1], run, walk)
            else:
                self._store_o(tiles, gmem.o, walk, tidx, warp)

    @cute.jit
    def _store_lse(self, coord_o, row0, lse, mLSE, head, batch, run: Scalars, tidx: Int32):
        """LSE (Sq, H, B): the first thread of each quad owns its two rows."""
        if tidx % 4 == 0:
            for r in cutlass.range_constexpr(ROWS_PER_THREAD):
                row = row0 + coord_o[r, 0][0]
                if row < run.seqlen_q:
                    mLSE[row, head, batch] = lse[r]

    @cute.jit
    def _store_o(self, tiles, o, walk: Walk, tidx: Int32, warp: Int32):
        """O: registers -> this consumer's Q buffer (its wgmma reads are complete) -> TMA
        (o: the atom and tensor), which clips the rows past Sq."""
        tiled_r2s, acc_o, sOc, c = tiles.tiled_r2s, tiles.acc_o, tiles.sOc, tiles.c
        tma_atom_o, tma_o = o
        m_block, head, batch = walk.m_block, walk.head, walk.out_batch
        dv = self.head_dim_v
        r_o = cute.make_rmem_tensor_like(acc_o, self.dtype)
        r_o.store(acc_o.load().to(self.dtype))
        wgmma.store_acc(tiled_r2s, r_o, sOc, tidx)
        cute.arch.fence_proxy("async.shared", space="cta")
        pipeline.NamedBarrier(Barrier.EPILOGUE + c, WARPGROUP).arrive_and_wait()
        if warp % 4 == 0:
            gO = cute.local_tile(
                tma_o[None, None, head, batch], (CONSUMER_ROWS, dv),
                (m_block * self.consumers + c, 0),
            )
            tOsO, tOgO = cpasync.tma_partition(
                tma_atom_o, 0, cute.make_layout(1),
                cute.group_modes(sOc, 0, 2), cute.group_modes(gO, 0, 2),
            )
            cute.copy(tma_atom_o, tOsO, tOgO)
            cute.arch.cp_async_bulk_commit_group()
            if cutlass.const_expr(not self.defer_o_read):  # else _free_previous_q waits
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _store_direct(self, tiles, values, mO, run: Scalars, walk: Walk):
        """`values` (the O accumulator's layout: fp32 partials of split variants, or O in
        out_dtype of float8 variants) straight into mO (Sq, Dv, H, B), each thread its
        own elements; rows past Sq are skipped."""
        coord_o, row0, head, batch = tiles.coord_o, tiles.row0, walk.head, walk.out_batch
        values_rc = rows_cols(values)
        for r in cutlass.range_constexpr(ROWS_PER_THREAD):
            row = row0 + coord_o[r, 0][0]
            if row < run.seqlen_q:
                for col in cutlass.range_constexpr(cute.size(values_rc, mode=[1])):
                    mO[row, coord_o[r, col][1], head, batch] = values_rc[r, col]

    @cute.jit
    def _store_final(self, tiles, final, lse, run: Scalars, walk: Walk, tidx: Int32):
        """The one split's O (in dtype) and LSE straight into the caller's out (B, Sq /
        g, H * g, Dv) and lse (B, H * g, Sq / g), rows unpacked by unpacked_row. Bit for bit the combine's result for one
        split (weight exp(0) = 1, LSE + log 1), without its launch: a decode step at
        head_dim 64, batch 32, 32 / 8 heads over 1088 keys (the generation example's)
        1.05-1.10x, dense, with lengths or paged; at batch 1 (several splits) 0.98-0.99x
        (H100, 2026-11-26, alternated twice in one call)."""
        out, out_lse, group = final
        coord_o, row0, head, batch = tiles.coord_o, tiles.row0, walk.head, walk.batch
        r_o = cute.make_rmem_tensor_like(tiles.acc_o, self.dtype)
        r_o.store(tiles.acc_o.load().to(self.dtype))
        o_rc = rows_cols(r_o)
        for r in cutlass.range_constexpr(ROWS_PER_THREAD):
            row = row0 + coord_o[r, 0][0]
            if row < run.seqlen_q:
                position, q_head = unpacked_row(row, head, group)
                if tidx % 4 == 0:
                    out_lse[batch, q_head, position] = lse[r]
                for col in cutlass.range_constexpr(cute.size(o_rc, mode=[1])):
                    out[batch, position, q_head, coord_o[r, col][1]] = o_rc[r, col]

    # ------------------------------------------------------------------ helpers
    @cute.jit
    def _mask(self, s_rc, coord_s, row0: Int32, n_block: Int32, run: Scalars, seg,
              kind: cutlass.Constexpr = segments.IDS, runs=None):
        """Element masking of key block n_block: the band's, or, in segment variants,
        the plan's for the blocks it flags: `kind` of mask (and the RUNS mask itself,
        `runs`) as segments.mask_block takes them."""
        seqlen_k, band_lo, band_hi = run.seqlen_k, run.band_lo, run.band_hi
        col0 = n_block * self.tile_n
        if cutlass.const_expr(self.segments):
            segments.mask_block(s_rc, coord_s, row0, col0, seg.rows, seg.keys,
                                seg.seqlen_q, seqlen_k, kind=kind, runs=runs)
        else:
            mask.mask_block(s_rc, coord_s, row0, col0, seqlen_k, band_lo, band_hi, self.banded)

    def _p_offset(self) -> float:
        if not self.fp8:
            return 0.0
        return FP8_P_LOG2_MAX - (self.rescale_threshold or 0.0)

    def _convert_p(self, acc_s, r_p):
        """P (the softmax's fp32 scores, in place in acc_s) into r_p for O += P V."""
        if cutlass.const_expr(self.fp8):
            convert_to_fp8_operand_a(acc_s, r_p)
        else:
            convert(acc_s, r_p)

    # Fresh tiled MMAs per GEMM issue (wgmma.py says why).
    def _qk_mma(self):
        k_major = OperandMajorMode.K
        q_source = (warpgroup.OperandSource.RMEM if self.q_registers
                    else warpgroup.OperandSource.SMEM)
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, k_major, k_major, Float32, (1, 1, 1),
            (CONSUMER_ROWS, self.tile_n), q_source,
        )

    def _pv_mma(self):
        v_major = OperandMajorMode.K if self.fp8 else OperandMajorMode.MN
        return sm90_utils.make_trivial_tiled_mma(
            self.pv_dtype, self.pv_dtype, OperandMajorMode.K, v_major, Float32,
            (1, 1, 1), (CONSUMER_ROWS, self.head_dim_v), warpgroup.OperandSource.RMEM,
        )

    def _kv_layouts(self, dtype, stages: int):
        """sK (tile_n, D, stages) and sV (Dv, tile_n, stages) in dtype as the wgmma reads
        them (float8 variants' V^T K-major), paged variants' with each PAGE_ROWS keys
        contiguous (paged.py)."""
        d, dv = self.head_dim, self.head_dim_v
        if cutlass.const_expr(self.paged):
            return paged.ring_layouts(dtype, d, dv, self.tile_n, stages)
        v_major = LayoutEnum.ROW_MAJOR if self.fp8 else LayoutEnum.COL_MAJOR
        return (sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR,
                                              (CONSUMER_ROWS, self.tile_n, d), dtype, stages),
                sm90_utils.make_smem_layout_b(v_major, (CONSUMER_ROWS, dv, self.tile_n),
                                              dtype, stages))

    def _q_smem_layout(self):
        """The Q ring (q_rows, D, q_stages * consumers): Q as the A operand of Q K^T."""
        qk_tiler = (CONSUMER_ROWS, self.tile_n, self.head_dim)
        return sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, qk_tiler, self.dtype,
                                             self.q_stages * self.consumers)

    def _scratch_fields(self) -> dict:
        """Shared-memory fields a subclass's consumer adds to the storage struct."""
        return {}

    def _scratch(self, storage):
        """Smem.scratch: views of _scratch_fields in the allocated storage."""
        return None

    def _o_smem_layout(self):
        """One consumer's O tile (CONSUMER_ROWS, Dv) in shared memory, for the TMA store."""
        tiler = (CONSUMER_ROWS, self.tile_n, self.head_dim_v)
        staged = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tiler, self.dtype, 1)
        return cute.slice_(staged, (None, None, 0))

    @cute.jit
    def _rescale(self, acc, row_scale):
        acc_rc = rows_cols(acc)
        if cutlass.const_expr(self.rescale_threshold is None):
            for r in cutlass.range_constexpr(ROWS_PER_THREAD):
                for col in cutlass.range_constexpr(cute.size(acc_rc, mode=[1])):
                    acc_rc[r, col] = acc_rc[r, col] * row_scale[r]
        else:
            if OnlineSoftmax.needs_rescale(row_scale):
                for r in cutlass.range_constexpr(ROWS_PER_THREAD):
                    for col in cutlass.range_constexpr(cute.size(acc_rc, mode=[1])):
                        acc_rc[r, col] = acc_rc[r, col] * row_scale[r]

    @cute.jit
    def _start_turns(self, c: Int32):
        """Consumer 0 issues first in a tile: the last consumer passes it the turn, but
        only once consumer 0 has begun the tile, so after consumer 0 took (at the end of
        the previous tile) the last consumer's final pass. Two passes without a wait in
        between would complete the named barrier without consumer 0, which then waits
        for good: in persistent CTAs the last consumer can reach its next tile first."""
        if cutlass.const_expr(self.pingpong and self.consumers > 1):
            gate = pipeline.NamedBarrier(Barrier.TILE_START, 2 * WARPGROUP)
            if c == 0:
                gate.arrive()
            if c == self.consumers - 1:
                gate.arrive_and_wait()
                self._pass_turn(c)

    def _wait_turn(self, c):
        if self.pingpong:
            pipeline.NamedBarrier(Barrier.TURN + c, 2 * WARPGROUP).arrive_and_wait()

    def _pass_turn(self, c):
        if self.pingpong:
            nxt = 1 - c if self.consumers == 2 else (c + 1) % self.consumers
            pipeline.NamedBarrier(Barrier.TURN + nxt, 2 * WARPGROUP).arrive()


class _Tiles:
    """A consumer's per-CTA views, read-only in its loop over key blocks: the wgmma
    operand fragments, the O accumulator, P's registers, the online softmax and the
    coordinates (mma_softmax_epilogue names them)."""

    def __init__(self, **views):
        self.__dict__.update(views)
