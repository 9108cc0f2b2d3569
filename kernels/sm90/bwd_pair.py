"""The 2-CTA pair of the backward (BwdTile.pair): a cluster of two CTAs over the key
blocks 2p and 2p + 1 of one K/V head. Both walk the same query tiles in the same order
(the union of their walks, band.pair_q_tiles), so at every step each holds its own
dQ partial of the same query tile. Before any global add the pair sums them: CTA `rank` keeps
half `rank` of every consumer's partial (quads [rank * J, (rank + 1) * J) of the quad
layout, J = dq_vals / 8: one contiguous half of the accumulator part) and sends the
other half to its peer, so each query tile gets half the global reduce-adds of two
1-CTA blocks, and the deterministic order has one turn per pair.

The peer's half lands in this CTA's Q ring slot of the step, which holds exactly half
a partial (tile_m * D 16-bit values = tile_m * D / 2 fp32): consumer c's half-part in
the bytes of Q's head dims of half c, which only consumer c's dK GEMM still reads once
both consumers are past DS_READY (consumer 0's S^T GEMM, which reads all of Q, is done
by then). So each consumer pairs with the peer's same consumer alone, through its own
two barriers free[c] and full[c]. Per step, for consumer c of each CTA:

    1. once its dK GEMM is done (release_slot): each warp arrives on the peer's free[c]
       (this CTA's region c may be written); thread 0 arms this CTA's full[c] for the
       peer's bytes;
    2. once its dQ GEMM is done (send): wait on free[c], st.async the sent half into
       the peer's region c, completing the bytes on the peer's full[c]; the kept half
       waits in registers (`pending`);
    3. in the next step, once its first GEMM is issued (receive): wait on full[c], add
       the pending half to the received one in place, and hand the sum to consumer c's
       writer warp (on a named barrier of the step's parity, BwdSm90._dq_full), which
       reduce-adds it to global memory (in the pair's turn, in deterministic mode) and
       then releases the Q ring slot. Deferring the receive
       hides the exchange's round trip behind that GEMM; the walk's last step is
       received after it. The consumers issue no global adds and never wait for a
       turn: that waiting is the writers'.

Each barrier completes one phase per step: the peer's arrivals for step t + 1 follow
its wait on this CTA's step-t bytes, which follow this CTA's step-t wait on `free`.
Every access to a CTA's shared memory by its peer is one the CTA itself waits for
before it finishes, so neither exits while the other still reaches into it.

A grid with an odd number of key blocks gets one more: that block's keys lie past Sk,
so every element it sees is masked and its partial is zero.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects.nvvm import MemScopeKind

WARPS_PER_CONSUMER = 4


class Pair:
    """This CTA's side of its pair: rank (0 or 1: the half of each partial it keeps and
    adds), the peer's rank, and the exchange's barriers (module docstring): free[c] at
    barriers + c, full[c] at barriers + consumers + c."""

    def __init__(self, rank, barriers, consumers: int):
        self.rank, self.peer = rank, 1 - rank
        self.barriers, self.consumers = barriers, consumers

    def free(self, c):
        return self.barriers + c

    def full(self, c):
        return self.barriers + self.consumers + c


def init_barriers(barriers, consumers: int):
    """One thread: free[c] counts the peer's consumer-c warps, full[c] this CTA's
    consumer c (its thread 0 arms it with the bytes the peer's consumer c sends)."""
    for c in range(consumers):
        cute.arch.mbarrier_init(barriers + c, WARPS_PER_CONSUMER)
        cute.arch.mbarrier_init(barriers + consumers + c, 1)


@cute.jit
def release_slot(pair: Pair, c: Int32, tidx: Int32, part_bytes: cutlass.Constexpr,
                 deterministic: Int32):
    """Consumer c, its dK GEMM done: the peer may write region c of this CTA's Q slot;
    full[c] expects part_bytes, what the peer's consumer c sends."""
    free, full, peer = pair.free(c), pair.full(c), pair.peer
    with cute.arch.elect_one():
        # The GEMMs' reads of the slot are complete (wait_group) and nothing written
        # here is for the peer: a relaxed arrive suffices. A release one fences at
        # cluster scope (membar.gpu: 11% of the deterministic kernel's stall samples,
        # ncu), yet measured faster in deterministic calls (kernels/config.py).
        if deterministic != 0:
            cute.arch.mbarrier_arrive(free, peer_cta_rank_in_cluster=peer,
                                      scope=MemScopeKind.CLUSTER)
        else:
            cute.arch.mbarrier_arrive(free, peer_cta_rank_in_cluster=peer,
                                      scope=MemScopeKind.CLUSTER, relaxed=True)
    if tidx == 0:
        cute.arch.mbarrier_arrive_and_expect_tx(full, part_bytes)


@cute.jit
def send(pair: Pair, acc_q, pending, recv, c: Int32, step: Int32):
    """Consumer c's step `step`, its dQ GEMM done: the half of acc_q (the partial's
    (4, quads) register view) that the peer adds goes to the peer's region c (recv:
    this thread's (4, quads / 2) view of it, the same offsets as here); the kept half
    goes to `pending`."""
    quads = cute.size(acc_q, mode=[1]) // 2
    # rank 0 keeps the first half; selects, as registers take no dynamic index
    first = pair.rank == 0
    cute.arch.mbarrier_wait(pair.free(c), step % 2)
    bits = cute.recast_tensor(acc_q, Int32)
    for j in cutlass.range_constexpr(quads):
        sent = [cutlass.select_(first, bits[i, quads + j], bits[i, j]) for i in range(4)]
        cute.arch.store_async_dsmem(recv[None, j].iterator, tuple(sent), pair.full(c),
                                    pair.peer)
    for j in cutlass.range_constexpr(quads):
        for i in cutlass.range_constexpr(4):
            pending[i, j] = cutlass.select_(first, acc_q[i, j], acc_q[i, quads + j])


@cute.jit
def receive(full, pending, recv, step: Int32):
    """Once consumer c's barrier full[c] (`full`) has the bytes the peer sent at step
    `step`, adds the kept half (`pending`) to them in place (recv, as in send): each
    thread rewrites only the values it was sent."""
    cute.arch.mbarrier_wait(full, step % 2)
    for j in cutlass.range_constexpr(cute.size(pending, mode=[1])):
        for i in cutlass.range_constexpr(4):
            recv[i, j] = pending[i, j] + recv[i, j]
