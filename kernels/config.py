"""Kernel configurations: the static choices one exported kernel is compiled for.

A `FwdConfig` or `BwdConfig` names everything that is fixed at compile time (dtype,
head_dim, banded, target arch) and derives the tile shape from it. Its `name` is the exported symbol
prefix, the key of the generated C++ kernel table and the entry in the manifest that
`jax_fa4` reads at run time. Batch, sequence lengths, head count and softmax scale are
runtime values, so `MANIFEST` stays small.

Importable without CuTe-DSL: the export step and tests read it.
"""

from __future__ import annotations

import dataclasses
import itertools

DTYPES = ("bf16", "fp16")
# float8 e4m3 q, k, v (out in bf16): forward kernels without a mask or banded, no softcap,
# segments, split or pages, at these head dims (D = Dv).
FP8_DTYPES = ("e4m3",)
FP8_HEAD_DIMS = (64, 128, 256)
HEAD_DIMS = (64, 96, 128, 256)
# (D of q and k, Dv of v and out) pairs with a kernel of their own besides D == Dv.
HEAD_DIM_PAIRS = ((192, 128),)
# Head dims (D = Dv) of the paged kernels: 96 and 192 (three 32- or 64-element swizzle
# atoms per row) abort the DSL compiler in their paged layouts (cutlass-dsl 4.8.1).
PAGED_HEAD_DIMS = (64, 128, 256)
# K and V in float8 e4m3 with bf16 q and out (a float8 KV cache): the split variants
# (decode; with one split any Sq), dense, with lengths and paged, no softcap; the kernel
# converts each landed K/V block to bf16 in shared memory (kernels/sm90/dequant.py).
KV_FP8_DTYPES = ("e4m3",)
KV_FP8_HEAD_DIMS = (64, 128, 256)
ARCHS = ("sm_90a",)

# Registers per thread after `setmaxnreg`, by number of consumer warpgroups. The
# register file holds 64K 32-bit registers; the producer warpgroup keeps the minimum.
PRODUCER_REGS = 24
CONSUMER_REGS = {1: 240, 2: 240, 3: 160}
REGISTER_FILE = 65536


def consumer_regs(consumers: int, ctas_per_sm: int) -> int:
    """Registers per consumer thread when `ctas_per_sm` CTAs of 1 + consumers
    warpgroups share an SM: each CTA launches with an equal share of the file, and its
    consumers take what the producer gives up (setmaxnreg counts in steps of 8)."""
    if ctas_per_sm == 1:
        return CONSUMER_REGS[consumers]
    share = REGISTER_FILE // (ctas_per_sm * 128 * (1 + consumers)) // 8 * 8
    return min(CONSUMER_REGS[consumers],
               (share * (1 + consumers) - PRODUCER_REGS) // consumers // 8 * 8)

# Tile schedules of the forward (Tile.schedule).
SCHEDULES = ("tile", "static", "dynamic")


@dataclasses.dataclass(frozen=True)
class Tile:
    """CTA tile: `m` query rows (64 per consumer warpgroup) x `n` keys per K/V block.
    `pingpong`: the consumers take turns issuing their GEMMs (named barriers), so one's
    softmax runs under the other's MMA; off, they issue as soon as their operands are in.
    `rescale_threshold`: FlashAttention-4's conditional rescaling (kernels/sm90/softmax.py):
    a row's max moves only when it grows by more than this many log2 units; None rescales
    on every growth. `schedule`: "tile", one CTA per tile; "static", min(tiles, SMs x
    ctas_per_sm) CTAs that take the tiles in turn, in grid order; "dynamic", the same
    CTAs taking the next tile from a counter, longest first with heads grouped to share
    L2 (kernels/sm90/schedule.py). Persistent CTAs overlap a tile's Q load and first K/V
    blocks with the previous tile's last blocks and epilogue; `q_stages` Q buffers let
    the next Q land while the current tile runs (2 where shared memory allows).
    `ctas_per_sm`: CTAs resident on one SM (consumer_regs), so that a second CTA's loads
    run while one computes; shared memory must hold them all. `q_registers`: Q is
    loaded once into registers as the A operand of Q K^T, which then reads only K from
    shared memory (16-bit q only). `defer_o_read` (persistent, q_stages >= 2): a
    tile's O store, staged in its Q buffer, is waited for (and the buffer freed) in the
    CTA's next tile, once that tile's first GEMM is issued, not at the tile's end.
    `early_row_stats`: each row's sum and LSE (and the LSE store) are computed while the
    tile's last P V GEMM runs, not after waiting for it."""

    m: int
    n: int
    kv_stages: int
    pingpong: bool = True
    rescale_threshold: float | None = None
    schedule: str = "tile"
    q_stages: int = 1
    ctas_per_sm: int = 1
    q_registers: bool = False
    defer_o_read: bool = False
    early_row_stats: bool = False

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r} not in {SCHEDULES}")

    @property
    def consumers(self) -> int:
        """Consumer warpgroups: one per 64 rows (the keys-as-M tile's few rows: one)."""
        return max(1, self.m // 64)


# Tiles per (head_dim, banded). Shared memory (bf16) is Q m*D*q_stages + (K + V)
# n*D*kv_stages of the 227 KB a CTA can use: d64 2 x 24 (non-causal) or 16 + 64 KB; d96
# 2 x 24 or 24 + 96 KB (the d128 tiles, not yet tuned); d128 2 x 32 or 32 + 128 KB; d256
# 64 + 160 KB (n = 80 because K and V blocks of 128 keys would not fit twice). d256
# without a mask on 64-key blocks (as its bands since 2026-12-03), against 80 (H200,
# 2026-12-03, alternated twice in one call), 512 / 1k / 2k / 8k / 16k: 1.030-1.031 /
# 0.987-0.988 / 0.984-0.986 / 0.970-0.971 / 0.908-1.023. Not kept.
# d64 (H100, bench, CUPTI time): 3 consumers (m=192) vs 2 (m=128), TFLOP/s at s=1k/8k:
#   non-causal 333/557 vs 323/457; causal 165/437 vs 235/458. Short causal tiles skip
#   too little work per CTA at m=192.
# Ping-pong off / on (H100, 2026-11-25, builds alternated twice in one call): d256
#   0.97-0.99 at 512-2k (either mask), 1.00 at 8k-16k; d128 1.00 non-causal, causal
#   0.95-0.97 at every length. Kept on.
# Conditional rescaling (threshold 8) / always rescaling, same runs, ratio per seqlen
#   512 / 2k / 8k / 16k: d64 1.02 / 1.02 / 1.03 / 0.97-1.04, causal 0.98 / 0.99 / 0.98 /
#   0.99; d128 1.00 / 1.00 / 1.02 / 0.98-1.09, causal 0.90-1.00 / 1.00 / 1.00 / 1.00;
#   d256 1.00 / 1.01 / 1.02 / 0.95-0.96, causal 0.98 / 1.00 / 1.01 / 1.01; D 192 / Dv
#   128 at 16k 1.02-1.04. Kept where no length lost: d64, d128 and 192 / 128 non-causal.
#   Again in the dynamic causal tiles (_DYNAMIC_BANDED, H200, 2026-12-02, alternated
#   twice): d64 causal 512 / 1k / 2k 0.97 / 0.94-0.95 / 0.92, 8k 1.00; d128 0.98-1.01.
#   Still off for causal.
# exp2 on the FMA units for k of every 8 probabilities (FlashAttention-4's emulation,
#   commit e77e4be) / MUFU only (H100, 2026-11-25, builds alternated twice in one call),
#   speed ratio at 2k / 16k: k = 1: d64 0.97 / 0.90-0.98, causal 0.99-1.00 / 1.03; d128
#   0.97-0.98 / 0.91-0.98, causal 0.95-0.96 / 0.95. k = 2: d64 0.93-0.95 / 0.96-0.98,
#   causal 0.95-1.02 / 1.00; d128 0.93 / 0.91-0.92, causal 0.93-0.98 / 0.92. k = 3:
#   0.84-0.97. Not kept: an emulated exp2 issues about 9 instructions (Hopper has no
#   packed fp32 FMA), which cost more issue slots than the MUFU time they save.
# Persistent (Q double-buffered where it fits: d64, d96, d128) / one CTA per tile, static
#   round-robin order (H100, 2026-11-25, alternated twice in one call), speed ratio at 512
#   / 2k / 16k: d64 1.13 / 1.05 / 1.03-1.05, d128 1.15 / 1.05-1.06 / 1.01-1.03, d256
#   (one Q buffer) 1.01 / 1.01 / 0.99-1.01; causal 0.88-0.90 / 0.95-0.96 / 0.94-0.96 at d64,
#   0.72 / 0.93 / 0.65 at d128, 0.67 / 0.92 / 0.59 at d256 (a static order cannot balance
#   tiles of unequal length). Kept for non-causal d64 and d128, and d96 with d128's tile
#   (not measured).
# Measured on the H100 on 2026-11-25 (second run, alternated twice in one call, against
#   one CTA per tile / the options off):
#   - d64 without a mask, m=128 instead of 192 (persistent): 1.04 at 512, 0.89-0.90 at
#     2k, 0.80-0.89 at 16k; kv_stages=3 at d64: 0.92-1.10, noise. Neither kept.
#     m=128 again on 2026-11-27, with the last block masked only where cut (4 x H100):
#     0.98-0.99 at 512, 0.88 at 768, 0.97 at 1000, 0.85 at 1536, 0.87-0.88 at 2k.
#   - Two CTAs of 64 rows per SM, one CTA per tile, ping-pong off (the split kernels'
#     shape; H200, 2026-11-26, alternated twice): d64 (128-key blocks) 0.93 at 512, 0.90
#     at 2k, 0.88 at 8k, 0.83-0.85 at 16k; d128 (64-key blocks) 0.85-0.90. Not kept.
_RESCALE = 8.0
# Split tiles two to an SM (consumer_regs: 232 per consumer thread), with shared memory
# for both: d96 keeps 128-key blocks (108 KB each), d64 and d128 take 64-key ones (40 /
# 80 KB). Against one split CTA per SM, with the combine kernel and decode-shaped
# calls on the split kernel in both (H200, 2026-11-26, alternated twice in one call;
# decode steps, 32 / 8 heads): d128 batch 1 at 8k keys 1.02-1.03x, 128k 1.02x, batch
# 64 at 8k 0.99-1.00x, paged (pages of 64) batch 1 at 8k 1.10-1.11x; d64 batch 32 at
# 1088 keys 1.13x, paged 1.58x. Also measured: twice as many splits (slots for two CTAs
# per SM) 0.86-0.87x at 8k, the combine's cost growing with them; three K/V stages at
# d64 (104 KB a CTA; H100, 2026-11-26, alternated twice): batch 32 at 1088 keys
# 0.97-0.99x, batch 1 at 1088, 8k and 128k keys 0.98-1.01x, not kept.
# d64 with 64-key blocks instead of 128 (H100, 2026-11-26, alternated twice; decode
# steps, 32 / 8 heads): batch 1 at 1088 keys 1.24-1.29x (twice the splits, 8 of two or
# three 64-key blocks for 4 of two or three 128-key ones), 2k and 8k 0.98-1.03x, 128k
# 0.93-0.96x (half the bytes in flight per CTA); batch 32 at 1088 keys (the generation
# example's step) 1.03-1.06x, at 8k 1.02-1.04x. With four K/V stages on top: 128k
# 1.05-1.07x over two stages, but batch 32 at 1088 keys 0.92-0.97x; not kept. Inside
# the generation example's decode loop too, where K/V come from DRAM (batch 32, CUPTI
# over whole runs, H100, 2026-11-26, alternated twice): four stages 73.6 ms of forward
# kernels against 71.6, 128k keys 1.03-1.05x again.
_SPLIT_TWO_PER_SM = {64: dict(n=64, ctas_per_sm=2), 96: dict(ctas_per_sm=2),
                     128: dict(n=64, ctas_per_sm=2)}
# float8-KV split kernels (kv_dtype): the bf16 split tiles, with float8 rings of
# kv_stages blocks and one converted bf16 K and V block (smem at d128: Q 16 + rings 2 x
# 16 + 32 KB, two CTAs per SM), changed here per head dim. Converting V under the Q K^T
# wgmma (K first, then the GEMM, then V; one more barrier) against both before it: d128
# decode batch 1 at 128k keys 1.015-1.030, paged 0.97-0.98, batch 64 0.99-1.01 (H100,
# 2026-11-27, alternated twice in one call); not kept. Again with Q in registers
# (_SPLIT_DENSE, same day, same method): batch 1 at 8k / 128k 0.99 / 0.98-0.99, paged
# 0.97-1.00, batch 64 0.97; not kept. Three / four float8 stages (same day, same
# method): batch 1 at 128k 1.03-1.05 / 1.03, at 8k 0.96-0.98 / 0.93, paged 0.98-1.01,
# batch 64 1.02 / 1.01; not kept (decode rows now take the keys-as-M tile, below).
_KV_FP8_SPLIT = {}
# Split tiles reading a dense cache (not paged), changed here per head dim. Q in
# registers (Q K^T reads only K from shared memory; ncu had shared memory at 71% in
# the float8-KV batch-1 step), against Q from shared memory, decode steps at d128, 32 /
# 8 heads (H100, 2026-11-27, alternated twice in one call): float8 K/V batch 1 at 8k /
# 128k keys 1.01-1.04 / 1.02-1.03, batch 64 at 128k 1.03-1.04; bf16 K/V 1.02 / 1.00,
# batch 64 1.00. Paged: bf16 0.99-1.00, float8 0.96-0.99 (ptxas spills 8 bytes in its
# float8 kernel); d64 bf16 at batch 32 over 1088 keys 0.985-0.995: neither takes it.
_SPLIT_DENSE = {128: dict(q_registers=True)}
# The keys-as-M decode tile (kernels/sm90/fwd_keys_m.py): KEYS_AS_M_ROWS query rows as
# the wgmma's N, 64-key blocks as its M, one consumer, two CTAs per SM as the split
# tiles it stands in for (so the split count is theirs). Against those 64-row tiles,
# decode steps, 32 / 8 heads (H100, 2026-11-27, alternated twice in one call): d128
# batch 1 at 8k / 128k keys, bf16 K/V 1.03-1.04 / 1.00, with kv_lengths 1.07 / 1.00,
# paged 1.06-1.07 / 1.00; float8 K/V 1.07-1.08 / 1.04, paged 1.06-1.07 / 1.05; batch 64
# at 128k bf16 1.00, float8 1.02-1.07, paged float8 1.05-1.07. d64 at batch 32 over
# 1088 keys (the generation example's step) 0.985-0.988, with kv_lengths 0.994, paged
# 1.00: d128 only. Four float8 K/V stages on top (rings 64 KB; two CTAs still fit):
# 128k 0.98, paged 0.98, batch 64 0.99-1.04; not kept. Float8 K from its ring slot
# straight into registers (the tile's K A operand; FwdKeysAsM.k_registers) against K
# converted into the 16-bit buffer (H100, 2026-11-27, alternated twice in one call):
# batch 1 at 8k / 128k 1.065-1.068 / 1.021-1.034, paged 1.041-1.046 / 1.016-1.042;
# batch 64 at 128k 1.023-1.025, paged 1.050-1.052. Always on for float8 K/V.
KEYS_AS_M_ROWS = 8
KEYS_AS_M_HEAD_DIMS = (128,)
_KEYS_AS_M_TILES = {kv_dtype: Tile(m=KEYS_AS_M_ROWS, n=64, kv_stages=2, pingpong=False,
                                    ctas_per_sm=2)
                    for kv_dtype in (None, *KV_FP8_DTYPES)}
_TILES = {
    (64, False): Tile(m=192, n=128, kv_stages=2, rescale_threshold=_RESCALE,
                      schedule="static", q_stages=2),
    (64, True): Tile(m=128, n=128, kv_stages=2),
    (96, False): Tile(m=128, n=128, kv_stages=2, schedule="static", q_stages=2),
    (96, True): Tile(m=128, n=128, kv_stages=2),
    (128, False): Tile(m=128, n=128, kv_stages=2, rescale_threshold=_RESCALE,
                      schedule="static", q_stages=2),
    (128, True): Tile(m=128, n=128, kv_stages=2),
    (256, False): Tile(m=128, n=80, kv_stages=2),
    (256, True): Tile(m=128, n=80, kv_stages=2),
    # D 192 / Dv 128: Q 48 + K 2 x 48 + V 2 x 32 = 208 KB.
    (192, False): Tile(m=128, n=128, kv_stages=2, rescale_threshold=_RESCALE),
    (192, True): Tile(m=128, n=128, kv_stages=2),
}
# Banded kernels without a split or pages (a plain band or a segment plan): the
# "dynamic" order, longest tiles first, with ping-pong off. Speed against _TILES' one
# CTA per tile with ping-pong (H100, 2026-11-25, bench.run, builds alternated twice in
# one call), causal at 512 / 2k / 8k / 16k:
#   d64   1.19 / 1.15 / 1.07 / 1.03      d96  1.10 / 1.11 / 1.01 (8k; 1.13 at 1k)
#   d128  1.01 / 1.11 / 1.07 / 1.03      d256 0.91 / 1.07 / 1.07 / 1.00 (1.01 at 1k)
#   d128 window 1024 at 2k / 8k 1.12 / 1.09; GQA 32 / 8 at 2k / 8k 1.12 / 1.06; softcap
#   at 2k 1.13. The same order with ping-pong on (its tile start gated: fwd.py
#   _start_turns) ran 0.01-0.05 below it in every cell; so did the segment kernels (8
#   packed documents per row of 4k / 16k, H100, 2026-11-26, alternated twice: d64
#   0.95-0.98, causal 0.95-0.96; d128 0.96-1.00, causal 0.95-0.99). Left out: D 192 / Dv 128 (0.85 /
#   0.95 / 1.01 / 0.96). Segment kernels joined once their step branches on the plan's
#   masked flag around the whole step (fwd.py; inside it, ptxas serialized the wgmma
#   of every persistent segment kernel, C7514): 8 packed documents per row, against
#   one CTA per tile with the branch inside (H100, 2026-11-25, alternated twice in one
#   call), rows of 16k (documents of 2k) / 4k (of 512), without a mask and causal:
#     d64   0.93 / 1.11, causal 1.01 / 1.15       d128  1.16 / 1.17, causal 1.18 / 1.18-1.20
#     d96   0.98-0.99 (16k), causal 1.02 (16k)    d256  0.98 (16k), causal 1.00 (16k)
#   The whole-step branch with one CTA per tile gave d128 1.11-1.13 and d64 0.93-0.94
#   (16k). Taken for every head dim: d64's and d256's losses are at 2k documents
#   without a mask, d64's gain at 512-token documents is larger.
#   d256 at 512 tokens runs 9% slower (one Q buffer: the next tile's Q cannot land
#   early), taken for the gain from 2k to 8k. Freeing that buffer early did not help:
#   O stored from registers (32-bit stores, no staging in the Q buffer) with the Q
#   stage released after the tile's last Q K^T GEMM, here at d256 and (one Q stage,
#   three K/V stages) at d128, and in a static persistent d256 tile without a mask
#   (branch fwd-direct-o, H200, 2026-12-03, alternated twice in one call), 512 / 1k /
#   2k / 8k: d256 0.87-0.88 / 0.91 / 0.95 / 0.98, causal 0.84 / 0.91 / 0.95 / 0.99;
#   d128 0.79 / 0.87 / 0.93 / 0.98, causal 0.76-0.82 / 0.85 / 0.91 / 0.97; with
#   conditional rescaling on top at d256, causal 0.84-0.87 / 0.91-0.92 / 0.97 / 1.00.
#   Before _start_turns the ping-pong order hung after 1 to 13 back-to-back d128
#   causal 512 calls; with it, or with ping-pong off, 30 calls one by one and 60 in flight
#   finished, twice each (tests/gpu/test_gpu_back_to_back.py runs both patterns).
#   Also measured (H100, 2026-11-27, alternated twice in one call) and not kept:
#   ping-pong on in this d64 tile, causal 512 / 1k / 2k 0.97 / 0.97-0.98 / 0.99-1.00;
#   Q in registers (Tile.q_registers) here at d64 and d128 and in _TILES[(128, False)]:
#   d64 causal 512 / 2k / 8k 0.96-0.99 / 1.03-1.04 / 0.99-1.00, without a mask
#   0.96-0.97 / 1.00-1.01 / 1.00; d128 0.98-1.02 throughout. Three K/V stages in the
#   d64 tile (H200, 2026-11-28, alternated twice in one call), causal 512 / 1k / 2k /
#   8k: 1.01-1.02 / 1.00 / 1.00 / 1.00; not kept.
# float8: fp8 wgmma takes 32 keys per k-step, so blocks are multiples of 32 keys;
# consumers with ping-pong, two (d128 without a mask: three, below). Shared memory (1
# byte a value): d128 Q 16 + K 2 x 16 + V 2 x 16 = 80 KB (three consumers with 96-key
# blocks: 24 + 2 x 12 + 2 x 12 = 72 KB); d256 32 + 64 + 64 = 160 KB (a second Q stage:
# + 16 / 24 / 32 KB). Measured on
# the H100 on 2026-11-27 (alternated twice in one call; forward at 1k / 4k / 16k tokens):
#   - Conditional rescaling at 4 log2 units (P then takes 2^4 in place of 2^8 as its
#     offset: fwd.py FP8_P_LOG2_MAX), against rescaling on every growth: d128 1.01-1.03
#     / 1.04-1.05 / 1.06-1.07, causal 0.99 / 1.00-1.02 / 1.02; d256 1.04 / 1.07 / 1.08,
#     causal 1.04 / 1.09-1.10 / 1.10.
#   - Without a mask, persistent CTAs in static order with two Q stages, against one CTA
#     per tile: d128 1.09-1.10 / 1.04-1.05 / 1.03, d256 1.05 / 1.02 / 1.01. Causal keeps
#     one CTA per tile (a static order cannot balance tiles of unequal length).
#   - d128 without a mask, blocks of 192 / 224 keys against 128 (2k / 4k / 16k; second
#     run that day): 192 0.99-1.00 / 0.99 / 1.01-1.02, 224 (32-byte swizzle on V^T's
#     224-byte rows) 0.94-0.95 / 0.98-0.99 / 0.99-1.01. Not kept.
#   - FlashAttention-4's exp2 on the FMA units (e77e4be's cubic) for k of every 8
#     probabilities, where the e4m3 tile's exp2 is as long as its wgmma (1k / 4k / 16k;
#     third run that day): d128 k = 1 1.00-1.01 / 0.99-1.00 / 0.98-0.99, causal k = 2
#     0.97-0.98 / 0.97 / 0.97-0.98; d64 k = 2 0.96-0.97 / 0.97-0.98 / 0.98-0.99, causal
#     k = 3 0.95-0.97 / 0.95 / 0.94-0.95. Not kept: issue slots, not MUFU, bind here too.
#   - d128 without a mask, three consumers (m=192) with 96-key blocks (at 128 keys the
#     scores and O leave ptxas short of registers, C7512), against two of 128 x 128:
#     1.00 / 1.07 / 1.06-1.07 (H100, 2026-11-27, alternated twice in one call; 980 ->
#     1040 TFLOP/s at 16k). ncu had shown the two-consumer tile with no unit saturated
#     (tensor 50%, MUFU 54%, issue 41%, 0.52 eligible warps per scheduler): a third
#     chain of GEMM and softmax feeds both. Kept.
_FP8_TILES = {
    (head_dim, banded): Tile(m=128, n=128, kv_stages=2, rescale_threshold=4.0,
                             schedule="tile" if banded else "static",
                             q_stages=1 if banded else 2)
    for head_dim in FP8_HEAD_DIMS for banded in (False, True)}
_FP8_TILES[(128, False)] = dataclasses.replace(_FP8_TILES[(128, False)], m=192, n=96)
# Packed documents without a mask trail the dense kernel on the same documents as a
# batch most at d64 (the dense one takes 192 rows; the segment kernels 64 rows two to an
# SM since 2026-11-28, _SEGMENT_TILES, 128 before): d64's 192-row tile in the segment
# variant makes ptxas spill 268 bytes at the consumers' 160 registers (2026-11-27), so
# it was not built.
_DYNAMIC_BANDED = {
    head_dim: dataclasses.replace(tile, pingpong=False, schedule="dynamic",
                                  q_stages=1 if head_dim == 256 else 2)
    for (head_dim, banded), tile in _TILES.items()
    if banded and head_dim in (64, 96, 128, 256)
}
# Tiles for rows that see many keys (FwdConfig.long_rows; jax_fa4's _path.with_long_rows
# picks them), per (head_dim, banded). Banded, from LONG_BAND_KEYS keys a row: d64 with
# three consumers (192 rows). Against _DYNAMIC_BANDED's 128 rows (4 x H100, 2026-11-27,
# alternated twice in one call, d64 causal, 16k tokens a batch): 1.16 at 8k, 1.19 at 16k,
# 0.99-1.005 at 2k, 0.85-0.86 at 1k, 0.86-0.87 at 512; a window of 1024 at 2k and 16k
# 0.93. With ping-pong on: 1.09 / 1.12 at 8k / 16k, 0.93 at 2k. Packed documents (the
# segment kernels, which spill at 192 rows) 0.69-0.92: built for dense calls only.
# d256 with 80-key blocks, where shorter bands take 64 (below).
# Without a mask, from LONG_FULL_ROWS queries and keys: d128 with three consumers (192
# rows) on 80-key blocks, as the e4m3 d128 tile (_FP8_TILES) runs three. Against
# _TILES' 128 x 128 (H200, 2026-12-03, alternated twice in one call; 16k tokens a
# batch): 512 0.88-0.89, 2k 1.03, 8k 1.03-1.04, 16k 1.04. 96-key blocks spill 32 bytes
# (ptxas) and ran 0.51; 64-key blocks 0.91 / 1.00 / 0.99 / 0.99. The build with both
# tiles against main's (same method; bench/results/h200/2026-12-03-ab-fwd-d128-long-
# rows.jsonl), 1k (the 128-row tile) / 2k / 4k / 8k / 16k: 0.995-1.000 / 1.030-1.031 /
# 1.034-1.036 / 1.032-1.039 / 1.033-1.046; cuDNN in one run with it 1.08 / 1.09 / 1.10 /
# 1.09 from 2k. The same 192 x 80 tile for d128 bands (the dynamic order, no spill),
# causal 4k / 8k / 16k: 0.920-0.921 / 0.964-0.966 / 0.967-0.970; not built.
_LONG_ROWS = {(64, True): dataclasses.replace(_DYNAMIC_BANDED[64], m=192),
              (256, True): _DYNAMIC_BANDED[256],
              (128, False): dataclasses.replace(_TILES[(128, False)], m=192, n=80)}
# d256 with 64-key blocks (Q 64 + K and V 2 x 64 KB), whose 128-row tiles' band edges
# fall on block edges, against 80 keys (Q 64 + 2 x 80 KB). n=64 for every band (H200,
# 2026-12-03, alternated twice in one call), causal 512 / 1k / 2k / 8k: 1.037-1.050 /
# 1.031 / 1.010-1.012 / 0.994; under ncu (512, causal) 102.8 against 107.6 us, 25.0
# against 26.0 million instructions. So rows that see fewer than LONG_BAND_KEYS keys
# take 64 and longer ones keep 80 (_LONG_ROWS); that build against main's module
# 87231f66 (same method; bench/results/h200/2026-12-03-ab-fwd-d256-n64.jsonl): causal
# 512 / 1k / 2k 1.034-1.046 / 1.026-1.033 / 1.010-1.014, 4k / 8k / 16k (the long band)
# 0.999-1.002; eight packed documents per row of 4k / 16k (the segment kernels take 64
# too) 1.133-1.136 / 1.011-1.012, causal 1.115-1.122 / 1.025-1.027.
_DYNAMIC_BANDED[256] = dataclasses.replace(_DYNAMIC_BANDED[256], n=64)
# Segment kernels (not split, not paged) per head dim, where they differ from
# _DYNAMIC_BANDED: d64 with 64-row tiles, two persistent CTAs per SM (one consumer
# warpgroup each, 80 KB of shared memory). Against _DYNAMIC_BANDED's 128 rows, one CTA
# per SM (H200, 2026-11-28, alternated twice in one call, on two machines): 8 packed
# documents per row of 16k / 4k 1.07-1.08 / 1.03, causal 1.03 / 1.02; dense calls with
# kv_lengths (the segment kernel on whole rows) at 512 / 2k / 8k 1.00 / 1.06-1.07 /
# 1.08-1.11, causal 1.03-1.04 / 1.04-1.05 / 1.09. On an H100 (same method): documents
# 1.07-1.09 / 1.02-1.04, causal 1.03 / 1.01; kv_lengths 0.86-0.87 / 1.03-1.04 /
# 1.06-1.09, causal 0.97 / 1.03 / 1.07-1.09: whole-row lengths at 512 tokens lose 13%
# there (kept for the longer rows; choosing the tile by Sk would need both exported,
# as long_rows does for the plain band). The same tile for the plain band
# kernel lost (causal 512 / 2k / 8k 0.89 / 1.01 / 1.00), and at d128 (64-key blocks, so
# that two fit) 0.78-0.95 plain and 0.79-0.85 on documents.
_SEGMENT_TILES = {64: dataclasses.replace(_DYNAMIC_BANDED[64], m=64, ctas_per_sm=2)}
# The O store's read waited for in the next tile (Tile.defer_o_read), in every
# persistent tile of two Q stages, against waiting at the tile's end (H200, 2026-11-28,
# alternated twice in one call; 512 / 2k): d64 causal 1.027-1.029, d128 causal
# 0.995-0.999, d64 without a mask (the static 192-row ping-pong tile) 0.93-0.94, d128
# without a mask 0.97-0.99. So d64's dynamic banded tile alone (not _LONG_ROWS's or
# _SEGMENT_TILES', derived from it above) takes it. That build against main's (H200,
# 2026-11-29, alternated twice in one call), d64 causal 512 / 1k / 2k: 1.023-1.030 /
# 1.012-1.022 / 1.020-1.021; 8k (the _LONG_ROWS tile) and d128 0.998-1.002.
# Three Q stages on top (H200, 2026-12-02, same method), causal 512 / 1k / 2k:
# 0.991-0.993 / 0.996-1.004 / 0.998-1.000. Not kept.
_DYNAMIC_BANDED[64] = dataclasses.replace(_DYNAMIC_BANDED[64], defer_o_read=True)
# Row sums and LSE while the tile's last P V GEMM runs (Tile.early_row_stats), against
# after its wait (H200, 2026-12-02, alternated twice in one call): 8 packed documents
# per row of 16k, d64 1.017-1.019, causal 1.016-1.022; d128 1.026-1.027, causal
# 1.033-1.035. Dense causal 512 / 2k / 8k: d64 0.998-1.005 / 1.002-1.007 / 0.992, d128
# 0.995-1.012 / 0.995-0.996 / 0.990-0.991, d256 0.999-1.007 throughout; without a mask
# at 512 / 2k 0.996-1.008. So the segment kernels alone take it. The d96 and d256 segment
# kernels with it, against without (H200, 2026-12-02, same method; bench/results/h200/
# 2026-12-02-ab-fwd-gated-all-causal-rescale.jsonl): documents d96 1.057-1.058, causal
# 1.055-1.058; d256 0.999-1.002, so d256 goes without.
_SEGMENT_TILES = {
    64: dataclasses.replace(_SEGMENT_TILES[64], early_row_stats=True),
    96: dataclasses.replace(_DYNAMIC_BANDED[96], early_row_stats=True),
    128: dataclasses.replace(_DYNAMIC_BANDED[128], early_row_stats=True),
}


@dataclasses.dataclass(frozen=True)
class _KernelConfig:
    """What every exported kernel is compiled for; subclasses set `kind` and `tile`."""

    dtype: str
    head_dim: int
    # The banded variant: query row i sees the keys j with lo <= j - i <= hi, a runtime
    # band (causal masks and sliding windows); `full` kernels see every key.
    banded: bool
    arch: str = "sm_90a"
    # Logit soft-capping, c * tanh(s / c) with a runtime c: banded variants only (a call
    # without a mask runs them with an unbounded band), so that it adds one kernel per
    # (dtype, head_dim) and direction rather than two.
    softcap: bool = False
    # Segment ids, lengths and varlen: per-row key ranges and ids, and a per-tile list
    # of the blocks to visit, all runtime arrays (kernels/sm90/segments.py). Banded
    # variants only; the band itself comes in the per-row key ranges.
    segments: bool = False
    # Dv of v and out; None means D. Pairs with D != Dv are HEAD_DIM_PAIRS.
    head_dim_v: int | None = None
    # Split-KV (forward only): the grid also runs over a runtime number of splits of each
    # tile's key blocks; each split writes its fp32 partial out, normalized, and its LSE,
    # which jax_fa4 combines. Banded variants only, like softcap.
    split: bool = False
    # Paged K/V (forward only, segment variants: lengths always come with pages): K and V
    # are read in place from a cache of pages through a runtime page table; built for
    # PAGED_HEAD_DIMS.
    paged: bool = False
    # K and V dtype when it differs from q's (KV_FP8_DTYPES; None: dtype).
    kv_dtype: str | None = None
    # The decode tile of split variants (kernels/sm90/fwd_keys_m.py): each block's keys
    # as the wgmma's M and the tile's KEYS_AS_M_ROWS query rows as its N; calls whose
    # rows fit run it, the others the 64-row split tile.
    keys_as_m: bool = False
    # The tile for rows that see many keys (_LONG_ROWS): dense 16-bit forwards without
    # softcap, banded or not, where _LONG_ROWS has one.
    long_rows: bool = False

    kind = ""

    def __post_init__(self):
        if self.dtype in FP8_DTYPES:
            if (self.kind != "fwd" or self.softcap or self.segments or self.split
                    or self.paged or self.head_dim not in FP8_HEAD_DIMS
                    or self.head_dim_v not in (None, self.head_dim)):
                raise ValueError(f"{self.dtype} kernels are forwards at head dims "
                                 f"{FP8_HEAD_DIMS} without softcap, segments, splits or pages")
        elif self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} not in {DTYPES + FP8_DTYPES}")
        if self.kv_dtype is not None and (
                self.kv_dtype not in KV_FP8_DTYPES or self.kind != "fwd"
                or self.dtype != "bf16" or not self.split or self.softcap
                or self.head_dim not in KV_FP8_HEAD_DIMS
                or self.head_dim_v not in (None, self.head_dim)):
            raise ValueError(f"kv_dtype {self.kv_dtype!r}: {KV_FP8_DTYPES} K/V are bf16 "
                             f"split forwards at head dims {KV_FP8_HEAD_DIMS} without softcap")
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        if self.head_dim_v != self.head_dim:
            if (self.head_dim, self.head_dim_v) not in HEAD_DIM_PAIRS:
                raise ValueError(f"head dims (D, Dv) = ({self.head_dim}, {self.head_dim_v}) "
                                 f"not in {HEAD_DIM_PAIRS}")
        elif self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim {self.head_dim} not in {HEAD_DIMS}")
        if self.arch not in ARCHS:
            raise ValueError(f"arch {self.arch!r} not in {ARCHS}")
        if (self.softcap or self.segments or self.split) and not self.banded:
            raise ValueError("softcap, segment and split kernels are banded: they need "
                             "banded=True")
        if (self.split or self.paged) and self.kind != "fwd":
            raise ValueError("split-KV and paged K/V are forward variants")
        if self.paged and not self.segments:
            raise ValueError("paged kernels are segment variants (they take lengths)")
        if self.keys_as_m and not (self.split and self.head_dim in KEYS_AS_M_HEAD_DIMS
                                   and self.head_dim_v == self.head_dim and not self.softcap):
            raise ValueError(f"keys_as_m tiles are split forwards at head dims "
                             f"{KEYS_AS_M_HEAD_DIMS} without softcap")
        if self.long_rows and not (
                self.kind == "fwd" and self.dtype in DTYPES
                and (self.head_dim, self.banded) in _LONG_ROWS
                and self.head_dim_v == self.head_dim
                and not (self.softcap or self.segments or self.split or self.paged)):
            raise ValueError(f"long_rows tiles are dense 16-bit forwards without softcap at "
                             f"(head_dim, banded) {tuple(_LONG_ROWS)}")

    @property
    def name(self) -> str:
        mask = "banded" if self.banded else "full"
        arch = self.arch.removesuffix("a").replace("_", "")
        cap = "_softcap" if self.softcap else ""
        seg = "_segments" if self.segments else ""
        seg += "_split" if self.split else ""
        seg += "_paged" if self.paged else ""
        seg += f"_kv_{self.kv_dtype}" if self.kv_dtype else ""
        seg += "_keysm" if self.keys_as_m else ""
        seg += "_long" if self.long_rows else ""
        dims = f"d{self.head_dim}" + (f"v{self.head_dim_v}" if self.head_dim_v != self.head_dim
                                      else "")
        return f"{self.kind}_{arch}_{self.dtype}_{dims}_{mask}{cap}{seg}"

    def manifest_entry(self) -> dict:
        """The record the native module exposes for this kernel."""
        return {
            "name": self.name,
            "kind": self.kind,
            "arch": self.arch,
            "dtype": self.dtype,
            "head_dim": self.head_dim,
            "head_dim_v": self.head_dim_v,
            "banded": self.banded,
            "softcap": self.softcap,
            "segments": self.segments,
            "split": self.split,
            "paged": self.paged,
            "kv_dtype": self.kv_dtype or self.dtype,
            "keys_as_m": self.keys_as_m,
            "long_rows": self.long_rows,
            "tile_m": self.tile.m,
            "tile_n": self.tile.n,
            "ctas_per_sm": getattr(self.tile, "ctas_per_sm", 1),
        }


class FwdConfig(_KernelConfig):
    kind = "fwd"

    @property
    def tile(self) -> Tile:
        """Split variants (chosen when the tiles do not fill the GPU) and paged ones
        (the page walk's registers and a persistent loop spill and serialize wgmma:
        ptxas C7514) run one CTA per tile. Split tiles have 64 rows, one consumer
        warpgroup: a decode step's packed rows (a group's query heads, 4 for 32 / 8
        heads) fill less than one, and a second consumer only adds MMA on padding and
        its share of the issue slots. Against _TILES' 128 rows with ping-pong, a decode
        step (32 / 8 heads of 128 unless said; H100, 2026-11-25, alternated twice in
        one call): batch 1 1.21x at 8k keys, 1.01x at 128k; batch 4 at 32k 1.00x, d64
        1.01-1.02x. Also measured there: three K/V stages on top (d <= 128) 1.21x /
        0.99x, batch 4 0.98-0.99x; 128 rows with ping-pong off 0.92-0.93x / 0.99x, and
        with three K/V stages 0.91x / 0.98x.
        Where two such CTAs fit in shared memory they share an SM (_SPLIT_TWO_PER_SM),
        so that one's loads run while the other computes; see there."""
        if self.dtype in FP8_DTYPES:
            return _FP8_TILES[(self.head_dim, self.banded)]
        if self.keys_as_m:
            return _KEYS_AS_M_TILES[self.kv_dtype]
        if self.long_rows:
            return _LONG_ROWS[(self.head_dim, self.banded)]
        if self.segments and not (self.split or self.paged) and self.head_dim in _SEGMENT_TILES:
            return _SEGMENT_TILES[self.head_dim]
        if self.banded and not (self.split or self.paged) and self.head_dim in _DYNAMIC_BANDED:
            return _DYNAMIC_BANDED[self.head_dim]
        if self.split:
            tile = dataclasses.replace(_TILES[(self.head_dim, True)], m=64, pingpong=False,
                                       **_SPLIT_TWO_PER_SM.get(self.head_dim, {}))
            if self.kv_dtype:
                tile = dataclasses.replace(tile, **_KV_FP8_SPLIT.get(self.head_dim, {}))
            if not self.paged:
                tile = dataclasses.replace(tile, **_SPLIT_DENSE.get(self.head_dim, {}))
            return tile
        return _TILES[(self.head_dim, self.banded)]


@dataclasses.dataclass(frozen=True)
class BwdTile:
    """Backward CTA tile: `n` keys stay in shared memory while the kernel walks the
    queries `m` rows at a time through a `q_stages`-deep ring. Two consumer warpgroups
    either take 64 keys each, or, with `split_head_dim`, share all `n` keys and take
    half of the head dims each (d256: 64 x 256 fp32 dK and dV per warpgroup would not
    fit in registers). Either way dQ is added in one part per consumer (`dq_parts`):
    column halves of all `m` rows, or with `dq_by_rows` each consumer's 64 rows over
    every head dim (one wgmma of N = D instead of m / 64 of N = D / 2)."""

    m: int
    n: int
    q_stages: int
    split_head_dim: bool = False
    consumers: int = 2
    # The main kernel runs as a cluster of two CTAs over adjacent key blocks
    # (kernels/sm90/bwd_pair.py): the pair sums its dQ partials through distributed
    # shared memory, so each query tile takes half the global adds and half the turns.
    # Split-head-dim tiles only: the peer's half lands in the Q ring slot the step has
    # finished with, where the pair's sum waits for the writer warps' bulk add.
    pair: bool = False
    # The dV GEMM waits until dS is computed (P^T and dS^T both 16-bit, FA3's order;
    # BwdSm90.late_dv); otherwise it is issued on P^T beside the dP^T GEMM. Tiles of
    # more than 64 rows need it (below).
    late_dv: bool = False
    # Each consumer's dQ part is its 64 rows over every head dim (tiles of 64 rows a
    # consumer, not split by head dims), not all rows over half of them (below).
    dq_by_rows: bool = False

    def __post_init__(self):
        assert not self.dq_by_rows or (self.m == 64 * self.consumers
                                       and not self.split_head_dim)
        # A pair's consumer hands step k's dQ sum to its writer warp on a named barrier
        # during step k + 1 without waiting (bwd_split._finish_pair), and the last
        # step's right after it; only the Q ring, whose slots the writer frees, keeps
        # it from arriving twice on one barrier before the writer's wait there. With
        # two stages and the two barriers of BwdSm90._dq_full, taken by the step's
        # parity, every hand-off waits for a slot freed after the writer's wait for
        # the one before on its barrier; with three, the last hand-off would not, the
        # barrier's rounds slip and the writer waits forever (with one barrier that
        # hung D 192 / Dv 128, 2026-12-02); with one stage, step 1 waits for a slot
        # only step 1's hand-off frees (read from the code).
        assert not self.pair or self.q_stages == 2, "2-CTA pairs need q_stages == 2"

    @property
    def dq_parts(self) -> int:
        return self.consumers


# Shared memory (16-bit): Q and dO rings 2 * 2 * m*D, K and V n*D each, staged dS^T (and
# P^T when split) 2 * m*n (each): d128 64 + 64 + 32 KB + 32 KB fp32 dQ staging; d256
# 128 + 64 + 32 KB.
# d64 with m=128 (H100, 2026-11-25, alternated twice with m=64 in one call): 0.95-0.99
# of m=64 at 512-2k (causal 0.95), 0.97-1.03 at 8k-16k: m=64 kept. Its ptxas serializes
# the wgmma for want of registers (C7512), which m=64 does not (and, since the dV GEMM
# is issued late, m=128 does not either: _BWD_TALL_TILES).
# Also measured then (same method, options off / on):
# programmatic dependent launch of the main kernel and postprocess, 0.92-0.99
# in every cell but two (d128 and d256 causal 16k, 0.97-1.02); L2 head groups for the
# banded launches, 0.77-0.83 at 512, 0.95-0.97 at 2k, 0.98-1.07 at 16k. Neither kept.
# The ceiling of fewer dQ adds (the atomic backward with its dQ adds skipped, a wrong
# result, probe branch fb2999d; H100, 2026-11-25, alternated twice, 2k and 16k): d64
# 0.98-1.09x, d128 1.00-1.10x, d256 1.31-1.47x. A 2-CTA pair that halves the adds can
# buy at most about half of that, so d64's gap to upstream FA4 lies in the main
# kernel's own work (per-kernel CUPTI at 8k: 6.48 ms against cuDNN's 5.67).
# Also measured (H100, 2026-11-26, alternated twice in one call, against these tiles):
# d64 with m=128 and dS computed from the 16-bit P (P rounded as the numerics rule's
# `lp` rounds it; that frees the fp32 P, so ptxas no longer serializes the wgmma, C7512)
# 0.93-0.98; the 16-bit P alone at d128 (m=64) 0.89-0.95: converting P back to fp32
# sits on the softmax's path. Q and dO rings of 4 stages at d64 and 3 at d96: 0.96-1.04
# and 0.94-1.09, while the unchanged d128 cells of the same runs spread 0.88-1.03: no
# gain above the noise. None kept.
# d64 with one consumer of 64 keys and two CTAs per SM (232 registers a consumer thread;
# H100, 2026-11-27, alternated twice in one call) against these tiles: atomic without a
# mask 1.00-1.05 (512 / 2k / 8k / 16k), causal 0.98 / 1.02 / 0.84-0.87 / 0.50-0.51,
# deterministic 0.68-0.96 (twice the key blocks: twice the dQ adds and turns, and every
# Q and dO tile read by twice the CTAs). Not kept. At d128 one consumer takes all of
# dQ's columns and ptxas serializes its wgmma (C7512).
# The deterministic grid with K/V heads along x and key blocks along y (one short
# chain of turns per head in a wave, where key blocks along x put one head's blocks in
# one long chain): 1.03-1.05 at 2k without a mask, 0.89-1.00 causal, and at 16k
# 0.64-0.99 without a mask, 0.47-0.61 causal (H100, 2026-11-27, alternated twice in one
# call; d64, d128, d256). Not kept: the blocks of one head in flight together share its
# Q, dO and dQ tiles in L2, which outweighs the chain.
# The 2-CTA pair (BwdTile.pair, kernels/sm90/bwd_pair.py) at d256 and D 192 / Dv 128
# against these tiles 1-CTA (H100, 2026-11-27, alternated twice in one call), 2k / 16k:
# with each step's exchange received in the next step, behind its first GEMM,
# deterministic d256 1.14 / 1.08-1.09, causal 1.06-1.07 / 1.10; 192/128 1.07-1.08 /
# 0.99, causal 1.07 / 1.07; atomic d256 0.95 / 0.97, causal 0.89 / 0.95-0.99; 192/128
# 0.87 / 0.89, causal 0.90-0.91 / 1.03. With the exchange finished inside its own step
# (pair2): atomic 0.82-0.98, deterministic 0.93-1.05; with one barrier pair for both
# consumers and the slot freed after the dQ GEMM (pair1): atomic 0.71-0.85. The pair
# runs in step with its peer, where the atomic 1-CTA kernel's adds are
# fire-and-forget, so at first only deterministic calls (whose turns already tie the
# blocks of a tile together) took it; since the writer warps and the relaxed arrive
# (below), every call does.
# Also measured and not kept (same method, against the pair): each CTA of the pair
# loading half of the Q and dO tiles and multicasting it to both: deterministic d256
# 0.90-0.91 without a mask, 1.00-1.01 causal; 192/128 0.98-0.99 / 1.02-1.04 (a slot
# refills only once both CTAs have released it). The deterministic adds (turn, adds,
# fence, flag) of the previous step moved from behind the first GEMM to behind the dV
# and dK GEMMs: d256 0.96-0.99.
# What the consumers' deterministic adds cost (H100, 2026-11-27, alternated twice in
# one call, d256, 2k / 16k, against that pair): without the wait for the turn (a wrong
# order) 0.92-0.94 without a mask, 0.99-1.00 causal: the chain of turns is not it;
# without the fence before the flag 1.13-1.16: each step waited for its reds to land.
# So the pair's sum is now staged in the Q ring slot and added by the writer warps
# (cp.reduce.async.bulk; the turn, the wait for the adds and the flag are theirs):
# deterministic 1.22-1.27 without a mask, 1.28-1.34 causal against that pair (D 192 /
# Dv 128: 1.32-1.44), about 0.83-0.89 of the atomic 1-CTA kernel. Atomic calls paired
# the same way ran 0.86-0.93 of the 1-CTA kernel, until ncu put 11% of the stall
# samples on the membar.gpu of the consumers' release arrive on the peer's free[c]:
# with a relaxed arrive the atomic pair runs 1.04-1.14x the 1-CTA kernel at d256
# (D 192 / Dv 128: 1.04-1.08, causal 2k 0.97-0.98), and every call of these kernels
# is paired. Deterministic calls keep the release arrive: relaxed, they ran 0.97-1.01
# (192 / 128: 0.94-0.99). Also measured on the writer-warp pair and not kept: the dO
# slot released after the step's dV GEMM instead of with the Q slot, 0.99-1.01; atomic
# banded pairs launched with the K/V heads fastest (x = 2 * K/V head + rank, y = the
# pair: every head's longest pairs first, as the 1-CTA launch does), causal d256 512 /
# 2k / 16k 1.01 / 1.00 / 0.95-0.96, 192 / 128 2k / 16k 0.96 / 0.90.
# The writer passing a tile's turn one tile late (waiting for its adds to complete
# behind the next tile's turn and copy; branch det-deferred-flag), against the writer
# above (H200, 2026-11-28, alternated twice in one call), deterministic d256 2k / 8k /
# 16k: 0.97 / 0.99 / 0.96-0.97, causal 0.98 / 0.97 / 0.97. Not kept.
# What the turns cost the pairs (H200, 2026-12-04, alternated twice in one call, 2k /
# 16k, against module bd45a8fc; bench/results/h200/2026-12-04-ab-bwd-det-turn-probes
# .jsonl and -chain-probes.jsonl), wrong-order probes of the writer's deterministic
# adds: the turn passed on without waiting for the adds to complete, d256 1.00, 192 /
# 128 1.00-1.01; no wait for the turn, d256 1.11-1.13, causal 1.08-1.10, 192 / 128
# 1.03-1.06, causal 1.08-1.09; pairs two or four to a turn (chains of a half or a
# quarter the length), d256 1.01-1.03, causal 0.99-1.00. So neither the adds' latency
# nor the chain's length costs the tenth, but the wait itself, between the consumers'
# hand-off and the add, while the Q slot holding the sum waits with it. The turn
# waited for before the hand-off instead (the semaphore polled while the consumers
# compute; module f3416a41): 192 / 128 1.10-1.12, causal 1.07-1.08; d64 and d128
# (1-CTA) 0.96-1.02; d256's first deterministic call (2k, no mask) did not finish in
# 150 s. Not understood, so not kept (docs/performance.md has the change).
# Also not kept: a writer lane per Q stage, each handed its sums on an mbarrier of
# its stage (module 743a7417), hung at once: PipelineTmaAsync's release signals from
# lane 0 only, so lane 1's was lost; and lanes of one warp reconverge after each
# divergent wait, so their waits would not overlap anyway (two writer warps a consumer
# would; the producer warpgroup has one warp spare). The 1-CTA writer freeing sdQ once
# read, before waiting for its adds to complete (module ddde886a), deterministic d64 /
# d128: 0.99-1.01 / 0.95-1.03, within the noise.
# 2-CTA pairs on the tiles split by keys (d64 tall, d96, d128; branch bwd-pair-sdq): the
# peer's dQ half-part lands in sdQ, which shrinks to half-parts, and the writer warp
# frees it once its bulk add has read the pair's sum (ptxas: no spills at d64, where
# the 1-CTA kernel spills 12 bytes). Correct (the backward and determinism tests at d64,
# d96 and d128: 246 passed), and slower in almost every cell against these tiles 1-CTA
# (H200, 2026-11-29, alternated twice in one call, 2k / 8k / 16k): d64 0.95 /
# 0.91-1.00 / 0.96-0.98, causal 0.86 / 0.94-0.97 / 0.93-0.95; d128 0.95 / 0.93 /
# 0.97-0.98, causal 0.87 / 0.93-0.97 / 0.95-1.02; deterministic d64 0.96 / 1.01-1.04 /
# 0.98, causal 0.86-0.88 / 0.88-0.91 / 0.93-0.96; d128 0.98 / 0.93-1.03 / 0.97-0.98,
# causal 0.89-0.91 / 0.88-0.97 / 0.98-1.07. At these head dims the global adds were
# never the bound (ceiling of skipping them all 1.00-1.10, above), and the pair's
# exchange and lock-step walk (the union of both blocks' query tiles: causal pairs run
# one or two masked tiles more per block, launched key blocks fastest) cost more than
# half the adds save. Not kept.
_BWD_TILES = {
    64: BwdTile(m=64, n=128, q_stages=2),
    # The late dV GEMM against the early one (2 x H200, 2026-11-28, alternated twice in
    # one call, 512 / 2k / 8k / 16k): d96 atomic 1.03 / 1.04 / 1.03-1.07 / 1.01-1.02,
    # causal 1.01-1.02 / 1.04-1.05 / 1.05-1.12 / 1.01-1.02; deterministic 1.00 / 1.01-1.02
    # / 1.03-1.04 / 1.00-1.01, causal 1.01-1.02 / 1.02 / 1.03-1.05 / 0.99-1.11. d128 lost:
    # atomic 0.99 / 0.99 / 0.95-0.96 / 0.97-1.01, causal 0.99 / 0.98-1.00 / 0.94-1.00 /
    # 0.87-0.92.
    96: BwdTile(m=64, n=128, q_stages=2, late_dv=True),
    128: BwdTile(m=64, n=128, q_stages=2),
    256: BwdTile(m=64, n=64, q_stages=2, split_head_dim=True, pair=True),
    # D 192 / Dv 128: Q 48 + dO 32 + K 24 + V 16 + P^T and dS^T 32 KB. With three Q
    # stages its first deterministic backward at 2k never finished (H200, 2026-12-02):
    # pairs need two (BwdTile.__post_init__ says why).
    192: BwdTile(m=64, n=64, q_stages=2, split_head_dim=True, pair=True),
}


# (head_dim, banded) of kernels without softcap, on taller query tiles than _BWD_TILES
# (their softcap variants spill there: ptxas -v, d64 128 rows, 688 bytes). d64 on
# 128-row tiles (FA3's), which ptxas no longer serializes with the dV GEMM issued late,
# against 64 rows (2 x H200, 2026-11-28, alternated twice in one call, 512 / 2k / 8k /
# 16k): atomic 1.09 / 1.17 / 1.12-1.16 / 1.12-1.15, causal 1.04 / 1.13 / 1.22 / 1.12;
# deterministic 1.07 / 1.11 / 1.07-1.10 / 1.12-1.15, causal 1.08-1.09 / 1.14-1.15 /
# 1.18 / 1.14-1.18. Its segment variant too (ptxas spills 128 bytes in the masked
# steps), same method, eight tile-aligned documents per row, 4k / 16k: 1.06 /
# 1.11-1.12, causal 0.99 / 1.06, deterministic 1.10-1.11 / 1.11, causal 1.02 / 1.09;
# six unaligned documents per 16k row 0.99-1.01, causal 0.99.
# dQ by rows on these tiles (one wgmma of N = 64 a consumer where two of N = 32 read dS
# twice), against dQ by column halves (4 x H200, 2026-11-28, alternated twice in one
# call, 2k / 8k / 16k): atomic 1.07 / 1.06-1.15 / 1.09-1.10, causal 1.05 / 1.02-1.17 /
# 1.03-1.06; deterministic 1.06-1.07 / 1.01-1.04 / 1.08-1.10, causal 1.05 / 0.96-0.99 /
# 1.06-1.07. With the dK GEMM after the dQ GEMM on top (bwd.py _step; every 1-CTA
# kernel), against neither: atomic 1.07-1.08 / 1.06-1.10 / 1.09-1.11, causal 1.11 /
# 1.04-1.23 / 1.08-1.12; deterministic 1.07-1.08 / 1.03-1.05 / 1.08-1.10, causal
# 1.09-1.10 / 1.14 / 1.12.
# Measured in the runs of the 128-row tiles and not kept (branch bwd-tiles-m80): d128 on
# 80-row tiles (FA3's and upstream FA4's without a mask; dQ^T = K^T dS^T, as 80 rows are
# not a multiple of wgmma's M; dV late, ptxas spills 8 bytes): atomic 0.96 / 1.02 /
# 0.97-1.01 / 0.99-1.01, causal 0.91 / 0.98 / 1.03-1.12 / 1.00-1.01. With the dK GEMM
# last, ptxas serializes that kernel's wgmma (C7512); with dK first it is the kernel
# measured here, so it was not built again.
# Also measured and not kept (H200, 2026-12-04, alternated twice in one call, 2k / 16k;
# bench/results/h200/2026-12-04-ab-bwd-dq-red.jsonl): atomic calls adding each dQ
# partial from the consumers' registers with red.global.add.v4.f32 (eight a thread and
# step, in the accumulator's quad layout), with no staging, fence or writer warp, every
# tile of d64 to d128 (module 258c8889, against bd45a8fc): d64 0.96-0.99, causal
# 0.97-1.00; d96 0.92-0.96, causal 0.94-0.98; d128 0.94-0.95, causal 0.88-0.96
# (deterministic calls, unchanged, 0.96-1.02). The writer's bulk reduce-add costs the
# consumers less than their own vector reduce-adds. Not profiled.
# Also measured and not kept (branch bwd-deferred-q-release; H200, 2026-11-28,
# alternated twice in one call, 2k / 16k): the dK GEMM reading dS^T from shared memory
# (where the dQ GEMM reads it) and waited for in the next tile, after that tile's first
# GEMMs are issued, so that it runs on across the tile boundary (with dS^T in
# registers ptxas serializes the wgmma for want of them, C7512): d64 0.97 / 0.97-0.99,
# causal 0.91-0.93 / 0.93-0.94; d96 0.97-0.98 / 0.97-0.98, causal 0.96 / 0.96-0.98; d128
# 0.98-0.99 / 0.97-0.98, causal 0.96 / 0.94-0.98.
_BWD_TALL_TILES = {
    (64, False): BwdTile(m=128, n=128, q_stages=2, late_dv=True, dq_by_rows=True),
    (64, True): BwdTile(m=128, n=128, q_stages=2, late_dv=True, dq_by_rows=True),
}


class BwdConfig(_KernelConfig):
    """One exported backward: preprocess, the KV-stationary main kernel and postprocess,
    launched in order by one entry point. Atomic vs deterministic dQ is a runtime flag."""

    kind = "bwd"

    @property
    def tile(self) -> BwdTile:
        if not self.softcap and (self.head_dim, self.banded) in _BWD_TALL_TILES:
            return _BWD_TALL_TILES[(self.head_dim, self.banded)]
        return _BWD_TILES[self.head_dim]

    # Deterministic calls without a band of at most this many key blocks launch the K/V
    # heads fastest rather than the key blocks (the atomic order): with key blocks
    # fastest, each wave starts a head's blocks together and every block waits its
    # predecessors' turns, one more each. Heads fastest always against key blocks
    # fastest (H200, 2026-11-28, two calls, alternated twice in each, 512 / 2k / 4k /
    # 8k / 16k): d64 1.12 / 1.18 / 1.05-1.10 / 0.97-0.98 / 0.92-0.94, d128 1.07 / 1.09 /
    # 0.98-1.02 / 0.93-1.01 / 0.95-0.96 (L2 locality lost). Up to 32 blocks: 2k 1.17 /
    # 1.09, 4k 1.09-1.13 / 0.96-1.06, 8k and 16k 0.97-1.02.
    det_heads_fastest_blocks = 32
    # 2-CTA pairs (d256, D 192 / Dv 128) of 64-key blocks, up to this many pairs. Heads
    # fastest up to 32 pairs against key blocks fastest (4 x H200, 2026-11-28, alternated
    # twice in one call beside the test suite on the other GPUs; 512 / 2k / 4k / 8k):
    # d256 1.09 / 1.04 / 0.97-0.98 / 1.01, 192 / 128 2k / 4k / 16k 1.07 / 0.95 / 1.01.
    # Up to 16 pairs (4 x H200, 2026-11-28, GPUs 0-2 running the suite): d256 1.09 /
    # 1.03-1.04 / 1.00-1.01 / 1.00-1.01, 192 / 128 512 / 2k / 4k 1.12 / 1.07 / 1.00-1.01.
    det_heads_fastest_pairs = 16
    # Atomic banded calls (1-CTA) of at most this many key blocks launch the K/V heads
    # fastest, every head's longest blocks first; longer ones launch key blocks fastest,
    # one head's blocks together, so that its Q and dO stay in L2 (every head at once
    # would not fit). Key blocks fastest past 16 blocks against heads fastest always
    # (H200, 2026-11-28, alternated twice in one call, causal 4k / 8k / 16k): d64
    # 0.95 / 0.93-1.02 / 1.03-1.04, d128 0.97 / 0.91-0.98 / 0.95-1.05; at 16k again
    # (second call): d64 1.03, d128 1.02-1.17, d96 0.99-1.01. Past 16 blocks in groups
    # of K/V heads whose Q and dO fit in 32 MB (kernels/tile_order.py; branch
    # bwd-banded-l2-groups) against this order (third call, 4k / 8k / 16k): d64
    # 0.98-1.00 / 1.02-1.14 / 0.87-0.99, d128 0.99 / 0.94-1.07 / 0.94-0.99: within that
    # call's noise, not kept.
    banded_heads_fastest_blocks = 64
    # Atomic calls without a band walk their query tiles from tile n too, as
    # deterministic ones do (BwdSm90._shift), so that the blocks' adds at every step go
    # to different tiles. Not measured yet.
    shift_atomic_walks = False

    @property
    def pair(self) -> bool:
        """Whether this kernel runs as a 2-CTA pair: segment
        variants walk a per-block plan, so two blocks need not visit the same query
        tiles, and stay 1-CTA."""
        return self.tile.pair and not self.segments

    def manifest_entry(self) -> dict:
        return {**super().manifest_entry(), "dq_parts": self.tile.dq_parts}


# (banded, softcap, segments) of the variants built per (dtype, head_dim).
_VARIANTS = ((False, False, False), (True, False, False), (True, True, False),
             (True, False, True), (True, True, True))
# (D, Dv) of every kernel: the square head dims, then the pairs.
_DIMS = tuple((h, h) for h in HEAD_DIMS) + HEAD_DIM_PAIRS
FWD_MANIFEST: tuple[FwdConfig, ...] = tuple(
    FwdConfig(dtype=d, head_dim=h, head_dim_v=hv, banded=c, softcap=cap, segments=seg,
              split=split, paged=paged)
    for paged, split in ((False, False), (False, True), (True, False), (True, True))
    for d, (h, hv), (c, cap, seg) in itertools.product(DTYPES, _DIMS, _VARIANTS)
    if (c or not split) and (seg or not paged)
    and (not paged or h == hv and h in PAGED_HEAD_DIMS)
)
FWD_MANIFEST += tuple(FwdConfig(dtype=d, head_dim=h, banded=c)
                      for d in FP8_DTYPES for h in FP8_HEAD_DIMS for c in (False, True))
FWD_MANIFEST += tuple(FwdConfig(dtype="bf16", kv_dtype=kv, head_dim=h, banded=True,
                                segments=seg, split=True, paged=paged)
                      for kv in KV_FP8_DTYPES for h in KV_FP8_HEAD_DIMS
                      for seg, paged in ((False, False), (True, False), (True, True)))
FWD_MANIFEST += tuple(FwdConfig(dtype=d, kv_dtype=kv, head_dim=h, banded=True, split=True,
                                segments=seg, paged=paged, keys_as_m=True)
                      for d, kv in (("bf16", None), ("bf16", "e4m3"))
                      for h in KEYS_AS_M_HEAD_DIMS
                      for seg, paged in ((False, False), (True, False), (True, True)))
FWD_MANIFEST += tuple(FwdConfig(dtype=d, head_dim=h, banded=banded, long_rows=True)
                      for d in DTYPES for h, banded in _LONG_ROWS)
BWD_MANIFEST: tuple[BwdConfig, ...] = tuple(
    BwdConfig(dtype=d, head_dim=h, head_dim_v=hv, banded=c, softcap=cap, segments=seg)
    for d, (h, hv), (c, cap, seg) in itertools.product(DTYPES, _DIMS, _VARIANTS)
)
MANIFEST = FWD_MANIFEST + BWD_MANIFEST
