"""FlashAttention backward for Hopper at head_dim 256 and at D 192 / Dv 128: the kernel
of kernels/sm90/bwd.py with the head dims, not the keys, split between the two consumer
warpgroups.

At d256 one warpgroup's dK and dV for 64 keys would take 256 fp32 registers per
thread, and a 64-key block of K and V plus 2-stage Q and dO rings already fill shared
memory; at 192 / 128, 160 registers of dK and dV leave no room for S^T and dP^T. So
both consumers work on the same 64 keys, each on half of the head dims of dK and of dV
(half h), and the two (keys x queries) GEMMs are shared out:

    consumer 0:  S^T = K Q^T    -> P^T (mask, exp2)     -> shared     (P_READY)
    consumer 1:  dP^T = V dO^T  -> dS^T = P^T (dP^T - Dsum) -> shared (DS_READY)

Softcap variants: consumer 0 also stages P^T times the cap's slope in dS^T's slot, and
consumer 1 reads that in place of P^T (kernels/sm90/softcap.py).
    both, from shared P^T and dS^T:
        dV_h += P^T dO_h,   dK_h += dS^T Q_h,   dQ_h = dS K_h

P^T and dS^T are staged per ring stage, so a consumer may start the next query tile
while the other still reads this one. A 1-CTA kernel has no room to stage dQ for bulk
adds: each consumer adds its dQ_h from registers with red.global.add.v4.f32, 16 bytes
per instruction, into the same quad layout as bwd.py (a warp instruction covers 512
contiguous bytes), so the postprocess is shared; deterministic mode orders these adds
with the same per-(query tile, half) semaphores. That is the segment variants' path:
the others run as 2-CTA pairs over adjacent key blocks, which sum their dQ halves
through distributed shared memory in the Q ring slot of the step, where the writer
warps of bwd.py take the sum (kernels/sm90/bwd_pair.py).
"""

import enum

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

from kernels.config import BwdConfig
from kernels.sm90 import bwd, bwd_pair, softcap, wgmma
from kernels.sm90.bwd import (KEYS_PER_CONSUMER, QUAD, WARPGROUP, BwdSm90, Gmem, Scalars,
                               Smem, Walk, _Tiles, acc_quads, dq_quads, walk_steps)
from kernels.sm90.fragments import rows_cols


class Barrier(enum.IntEnum):
    """Named barrier ids; bwd.Barrier.EPILOGUE (6) is used by the shared epilogue."""

    P_READY = 1  # consumer 0 -> consumer 1: P^T of this query tile is staged
    DS_READY = 2  # both consumers: P^T and dS^T of this query tile are staged
    # 1-CTA kernels, within consumer c (DQ_TURN + c): deterministic turn taken / adds
    # done (past bwd.Barrier's ids, which pairs use for their writer warps)
    DQ_TURN = 9


class BwdSm90SplitD(BwdSm90):
    staged_dq = False
    # Per ring stage: dS^T in stages [0, q_stages), P^T in [q_stages, 2 * q_stages).
    staged_s_tiles = 2
    col_parts = 2

    def __init__(self, cfg: BwdConfig):
        super().__init__(cfg)
        assert cfg.tile.split_head_dim and self.tile_n == KEYS_PER_CONSUMER
        # each consumer's share of dV's columns (dq_cols: of dQ's and dK's)
        self.dv_cols = self.head_dim_v // self.consumers

    def _consumer_tiles(self, walk: Walk, smem: Smem, storage, c: Int32, tidx: Int32):
        """Consumer c's operand fragments and accumulators: its share of S^T / dP^T and
        half c of the head dims (_Tiles; the walk and epilogue are bwd.py's)."""
        sQ, sdO, sK, sV, sdS = smem.sQ, smem.sdO, smem.sK, smem.sV, smem.sdS
        tm, tn, dc, stages = self.tile_m, self.tile_n, self.dq_cols, self.q_stages
        thr_sdp = self._sdp_mma().get_slice(tidx)
        thr_dk = self._dkv_mma(self.head_dim).get_slice(tidx)
        thr_dv = self._dkv_mma(self.head_dim_v).get_slice(tidx)
        thr_dq = self._dq_mma().get_slice(tidx)
        s_tiles = cute.local_tile(sdS, (tm, tn, stages), (0, 0, None))
        sdS_now, sP = s_tiles[None, None, None, 0], s_tiles[None, None, None, 1]

        def half(t, cols):  # dims [c * cols, (c + 1) * cols) of a (dims, rows, stages) view
            return cute.local_tile(t, (cols, tm, stages), (c, 0, 0))

        frags = _Tiles(
            k=thr_sdp.make_fragment_A(thr_sdp.partition_A(sK[None, None, 0])),
            q=thr_sdp.make_fragment_B(thr_sdp.partition_B(sQ)),
            v=thr_sdp.make_fragment_A(thr_sdp.partition_A(sV[None, None, 0])),
            do=thr_sdp.make_fragment_B(thr_sdp.partition_B(sdO)),
            p_t=thr_dv.make_fragment_A(thr_dv.partition_A(wgmma.transposed(sP))),
            ds_t=thr_dk.make_fragment_A(thr_dk.partition_A(wgmma.transposed(sdS_now))),
            do_t=thr_dv.make_fragment_B(thr_dv.partition_B(
                half(wgmma.transposed(sdO), self.dv_cols))),
            q_t=thr_dk.make_fragment_B(thr_dk.partition_B(half(wgmma.transposed(sQ), dc))),
            ds=thr_dq.make_fragment_A(thr_dq.partition_A(sdS_now)),
            k_t=thr_dq.make_fragment_B(thr_dq.partition_B(cute.local_tile(
                wgmma.transposed(sK[None, None, 0]), (dc, tn), (c, 0)))),
        )
        acc_dv = thr_dv.make_fragment_C(thr_dv.partition_shape_C((tn, self.dv_cols)))
        acc_dk = thr_dk.make_fragment_C(thr_dk.partition_shape_C((tn, dc)))
        acc_dv.fill(0.0)
        acc_dk.fill(0.0)
        key0 = walk.n_block * tn
        pair_views = {}
        if cutlass.const_expr(self.pair):
            # per ring stage and consumer, the half-part the peer sends lands in the
            # stage's Q slot, as fp32 in the quad layout; the kept half waits in
            # `pending` for the next step, and the step's ring stage in `prev_stage`
            half = tm * dc // 2
            prev_stage = cute.make_rmem_tensor(cute.make_layout(1), Int32)
            prev_stage.fill(0)
            pair_views = dict(
                recv_slots=cute.make_tensor(
                    cute.recast_ptr(storage.sQ.data_ptr(), dtype=Float32),
                    cute.make_layout((half, self.consumers, stages))),
                pending=cute.make_rmem_tensor(
                    cute.make_layout((QUAD, self.dq_vals // QUAD // 2)), Float32),
                prev_stage=prev_stage,
            )
        return _Tiles(frags=frags, sP=sP, sdS_now=sdS_now, acc_dv=acc_dv, acc_dk=acc_dk,
                      c=c, tidx=tidx, key0=key0, **pair_views)

    @cute.jit
    def _step(self, is_masked: cutlass.Constexpr, m: Int32, head: Int32, visit: Int32,
              masked: Int32, tiles, gmem: Gmem, run: Scalars, walk: Walk, smem: Smem,
              q_consumer, do_consumer):
        """One query tile, step `visit` of this key block's walk (BwdSm90._walk_tiles);
        returns the advanced ring consumers. Segment variants mask when the plan's
        `masked` flag says so."""
        frags, sP, sdS_now = tiles.frags, tiles.sP, tiles.sdS_now
        acc_dv, acc_dk, c, tidx, key0 = tiles.acc_dv, tiles.acc_dk, tiles.c, tiles.tidx, tiles.key0
        sLSE2, sDsum, scale_log2 = smem.sLSE2, smem.sDsum, run.scale_log2
        softcap_scale = run.softcap_scale
        tm = self.tile_m
        sdp_mma = self._sdp_mma()
        thr_sdp = sdp_mma.get_slice(tidx)
        thr_dq = self._dq_mma().get_slice(tidx)
        s_shape = thr_sdp.partition_shape_C((KEYS_PER_CONSUMER, tm))
        coord = thr_sdp.partition_C(cute.make_identity_tensor((KEYS_PER_CONSUMER, tm)))
        r2s = wgmma.acc_store_copy(sdp_mma, self.dtype)
        q_handle = q_consumer.wait_and_advance()
        do_handle = do_consumer.wait_and_advance()
        stage = q_handle.index
        p_rows = wgmma.transposed(sP)[None, None, stage]  # (keys, queries)
        ds_rows = wgmma.transposed(sdS_now)[None, None, stage]
        acc = thr_sdp.make_fragment_C(s_shape)
        vals = cute.make_rmem_tensor(acc.layout, self.dtype)
        steps_before = (head - walk.heads[0]) * (walk.m_end - walk.m_begin)
        step = steps_before + (visit - walk.m_begin)
        if c == 0:
            wgmma.gemm(self._sdp_mma(), acc, frags.k, frags.q[None, None, None, stage], True)
            if cutlass.const_expr(self.pair):  # the previous step's exchange, behind the GEMM
                self._finish_pair(tiles, step, smem, walk)
            warpgroup.wait_group(0)
            s_rc = rows_cols(acc)
            slope = cute.make_rmem_tensor(acc.layout, self.dtype)
            if cutlass.const_expr(self.softcap):
                softcap.cap_scores_and_slope(s_rc, rows_cols(slope), softcap_scale)
            if cutlass.const_expr(is_masked):
                self._mask_kq(s_rc, rows_cols(coord), key0, m, run, walk.seg, masked)
            for i in cutlass.range_constexpr(cute.size(acc)):
                lse2 = sLSE2[coord[i][1], stage]
                acc[i] = cute.math.exp2(acc[i] * scale_log2 - lse2, fastmath=True)
            vals.store(acc.load().to(self.dtype))
            wgmma.store_acc(r2s, vals, p_rows, tidx)
            if cutlass.const_expr(self.softcap):
                for i in cutlass.range_constexpr(cute.size(acc)):
                    slope[i] = (acc[i] * slope[i].to(Float32)).to(self.dtype)
                wgmma.store_acc(r2s, slope, ds_rows, tidx)
            cute.arch.fence_proxy("async.shared", space="cta")
            self._pair_barrier(Barrier.P_READY).arrive()
        else:
            wgmma.gemm(self._sdp_mma(), acc, frags.v, frags.do[None, None, None, stage], True)
            if cutlass.const_expr(self.pair):
                self._finish_pair(tiles, step, smem, walk)
            warpgroup.wait_group(0)
            self._pair_barrier(Barrier.P_READY).arrive_and_wait()
            # Each thread reads the elements it then overwrites with dS^T: no other thread
            # writes them (the store follows the fragment layout).
            p_frag = thr_sdp.partition_C(ds_rows if self.softcap else p_rows)
            for i in cutlass.range_constexpr(cute.size(acc)):
                dsum = sDsum[coord[i][1], stage]
                acc[i] = p_frag[i].to(Float32) * (acc[i] - dsum)
            vals.store(acc.load().to(self.dtype))
            wgmma.store_acc(r2s, vals, ds_rows, tidx)
            cute.arch.fence_proxy("async.shared", space="cta")
        self._pair_barrier(Barrier.DS_READY).arrive_and_wait()

        wgmma.gemm(self._dkv_mma(self.head_dim_v), acc_dv, frags.p_t[None, None, None, stage],
                   frags.do_t[None, None, None, stage], False)
        wgmma.gemm(self._dkv_mma(self.head_dim), acc_dk, frags.ds_t[None, None, None, stage],
                   frags.q_t[None, None, None, stage], False)
        acc_dq = thr_dq.make_fragment_C(thr_dq.partition_shape_C((tm, self.dq_cols)))
        wgmma.gemm(self._dq_mma(), acc_dq, frags.ds[None, None, None, stage], frags.k_t, True)
        if cutlass.const_expr(self.pair):
            # dK has read Q's half c: the peer's half-part may land there (bwd_pair)
            half_vals = self.dq_vals // 2
            warpgroup.wait_group(1)
            bwd_pair.release_slot(walk.pair, c, tidx, WARPGROUP * half_vals * 4,
                                  run.deterministic)
            warpgroup.wait_group(0)
            bwd_pair.send(walk.pair, acc_quads(acc_dq, self.dq_vals), tiles.pending,
                          self._received(tiles, stage), c, step)
            tiles.prev_stage[0] = stage
        else:
            warpgroup.wait_group(0)
            q_handle.release()
            do_handle.release()
            self._add_dq(acc_quads(acc_dq, self.dq_vals), m, head, visit, c, tidx, gmem, run,
                         walk)
        return q_consumer, do_consumer

    @cute.jit
    def _finish_walk(self, tiles, run: Scalars, smem: Smem, walk: Walk):
        """After the last step: a pair's last exchange (_finish_pair)."""
        if cutlass.const_expr(self.pair):
            self._finish_pair(tiles, walk_steps(walk), smem, walk)

    @cute.jit
    def _finish_pair(self, tiles, step: Int32, smem: Smem, walk: Walk):
        """Step step - 1's exchange, if there was one (bwd_pair.receive): the pair's sum
        of the kept half staged where the peer's half landed, for consumer c's writer
        warp (BwdSm90.dq_writer), which adds it and releases the Q slot; the dO slot is
        released here."""
        c, stage = tiles.c, tiles.prev_stage[0]
        full, recv = walk.pair.full(c), self._received(tiles, stage)
        _, do_ring = smem.rings
        if step > 0:
            bwd_pair.receive(full, tiles.pending, recv, step - 1)
            cute.arch.fence_proxy("async.shared", space="cta")
            self._dq_full(c, step - 1).arrive()
            do_ring.consumer_release(
                pipeline.PipelineState(self.q_stages, Int32(0), stage, Int32(0)))

    def _received(self, tiles, stage):
        """This thread's (4, quads / 2) view of its consumer's half-part in the Q ring
        slot of `stage`, where the peer's half lands (the same offsets in the peer)."""
        return dq_quads(tiles.recv_slots[None, tiles.c, stage].iterator, self.dq_vals // 2,
                        tiles.tidx)

    @cute.jit
    def _add_dq(
        self, src, m: Int32, head: Int32, visit: Int32, c: Int32, tidx: Int32, gmem: Gmem,
        run: Scalars, walk: Walk,
    ):
        """1-CTA kernels: adds consumer c's dQ partial for query tile m of `head` (visit
        `visit` of the walk), src (4, dq_vals / 4) in quads (bwd.py), to its part of the
        accumulator from registers; in deterministic mode only on this key block's turn,
        then passes the turn on. (Pairs stage the pair's sum for writer warps.)"""
        mdQaccum, mSem, deterministic = gmem.mdQaccum, gmem.mSem, run.deterministic
        batch = walk.batch
        slot = m * self.consumers + c
        part = self.dq_part
        dst = dq_quads(mdQaccum[batch, head, None].iterator + slot * part, self.dq_vals, tidx)
        flag = mSem[batch, head, None].iterator + slot
        turn_barrier = pipeline.NamedBarrier(Barrier.DQ_TURN + c, WARPGROUP)
        if deterministic != 0:
            if tidx == 0:
                self._wait_turn(flag, self._dq_turn(m, visit, run, walk), 1)
            turn_barrier.arrive_and_wait()
        for j in cutlass.range_constexpr(cute.size(src, mode=[1])):
            cute.arch.red(dst[None, j].iterator, src[None, j].load(), op="add",
                          dtype=Float32, sem="relaxed", scope="gpu")
        if deterministic != 0:
            cute.arch.fence_acq_rel_gpu()  # this thread's adds, before the next turn
            turn_barrier.arrive_and_wait()
            if tidx == 0:
                cute.arch.atomic_add(flag, Int32(1), sem="release", scope="gpu")

    def _pair_barrier(self, barrier_id):
        return pipeline.NamedBarrier(barrier_id, WARPGROUP * self.consumers)

    def _dkv_tile(self, buf, c, width: int):
        """Consumer c's part of a (tile_n, width) dK or dV tile: all keys, half c of the
        head dims."""
        return cute.local_tile(buf, (self.tile_n, width // self.consumers), (0, c))

    def _dkv_mma(self, width: int):
        """dV_h += P^T dO_h (width Dv) and dK_h += dS^T Q_h (width D): (64 keys,
        width / 2), both operands from shared memory."""
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32,
            (1, 1, 1), (KEYS_PER_CONSUMER, width // self.consumers),
        )
