"""Paged variants of the forward: K and V come from a cache of pages, read in place.

Operands: mK (P, page_size, Hkv, D) and mV (P, page_size, Hkv, Dv), P pages of
page_size keys each, and mPages (B, 1, max_pages) int32: key j of batch b is slot
j % page_size of page mPages[b, 0, j // page_size]. The kernel sees Sk = max_pages *
page_size keys per batch (lengths cut them further, through the segment rows).

Every block of tile_n keys is loaded as tile_n / PAGE_ROWS TMA copies of PAGE_ROWS keys,
each from the page that holds them, so any page size that is a multiple of PAGE_ROWS
works. The K and V rings use the swizzle atoms wgmma expects, tiled so that each piece of
PAGE_ROWS keys is contiguous in shared memory (head dims first, then keys), one TMA box.
Page ids are clamped to [0, P) and table entries past max_pages to the last one: a block
that runs past the table (the Sk tail) loads a real page and the mask hides it.

A call may append the keys and values of its Sq new tokens (mNewK (B, Sq, Hkv, D), mNewV
(B, Sq, Hkv, Dv); Sq 0: none) at keys L - Sq .. L - 1 of each batch, L its clipped length,
whose query rows see them: an otherwise idle producer warp stores the new rows that
fall in the CTA's key blocks into their pages (`append_rows`), and no scatter runs
before the kernel; the loads of those blocks wait for it (fwd.py), so that their TMA
copies read the rows. An appending call's plan lists blocks upwards
(jax_fa4/_ffi_calls.py): the blocks with new rows are a CTA's last, whose loads find the
append done. L is the last query row's key_end (the rows' bottom-right alignment: that row
sees the keys up to L, and none when L is 0).
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync
from cutlass.tensor_utils import LayoutEnum

from kernels.sm90 import segments

PAGE_ROWS = 16  # keys per TMA copy; page sizes are multiples of it


def _atom(layout: LayoutEnum, dtype, major_size: int):
    kind = sm90_utils.get_smem_layout_atom(layout, dtype, major_size)
    return sm90_utils.make_smem_layout_atom(kind, dtype)


def ring_layouts(dtype, head_dim: int, head_dim_v: int, tile_n: int, stages: int):
    """sK (tile_n, D, stages) and sV (Dv, tile_n, stages), as make_smem_layout_b makes
    them but with each PAGE_ROWS keys contiguous."""
    k_atom = _atom(LayoutEnum.ROW_MAJOR, dtype, head_dim)
    v_atom = _atom(LayoutEnum.COL_MAJOR, dtype, head_dim_v)
    return (cute.tile_to_shape(k_atom, (tile_n, head_dim, stages), order=(1, 0, 2)),
            cute.tile_to_shape(v_atom, (head_dim_v, tile_n, stages), order=(0, 1, 2)))


def piece_layouts(dtype, head_dim: int, head_dim_v: int, pieces: int):
    """The rings above as `pieces` PAGE_ROWS-key pieces: K (PAGE_ROWS, D, pieces) and V
    (Dv, PAGE_ROWS, pieces), the same bytes in the same places."""
    k_atom = _atom(LayoutEnum.ROW_MAJOR, dtype, head_dim)
    v_atom = _atom(LayoutEnum.COL_MAJOR, dtype, head_dim_v)
    return (cute.tile_to_shape(k_atom, (PAGE_ROWS, head_dim, pieces), order=(1, 0, 2)),
            cute.tile_to_shape(v_atom, (head_dim_v, PAGE_ROWS, pieces), order=(0, 1, 2)))


class NewRows:
    """One CTA's new keys and values to append: k (Sq, D) and v (Sq, Dv) of its batch
    and K/V head, the caches' rows of that head k_cache (P, page_size, D) and v_cache,
    and its batch's segment rows (3, Sq rows of the kernel), whose last key_end is the
    batch's length L."""

    def __init__(self, k, v, k_cache, v_cache, rows):
        self.k, self.v, self.k_cache, self.v_cache, self.rows = k, v, k_cache, v_cache, rows


class Cache:
    """One CTA's view of its pages: the batch's table row, the PAGE_ROWS-key pieces per
    page (page_size, the cache's rows per page, / PAGE_ROWS), the number of pages, the
    key/value head and the rows it appends (NewRows)."""

    def __init__(self, pages, page_size, num_pages, kv_head, new: NewRows):
        self.pages = pages
        self.page_size = page_size
        self.pieces_per_page = page_size // PAGE_ROWS
        self.num_pages, self.kv_head = num_pages, kv_head
        self.new = new


@cute.jit
def _pieces(block: Int32, cache: Cache, tile_n: cutlass.Constexpr):
    """[(table entry, piece within its page)] of each PAGE_ROWS-key piece of key block
    `block`: one runtime division for the block's first piece, then steps. Against a
    division per piece (page_size is a runtime value): batch-1 decode over pages of 64,
    8k keys, 32 / 8 heads of 128, 1.06x (its kernel 11.3 -> 10.3 us), pages of 16
    1.04-1.05x, 128k keys level (H100, 2026-11-26, alternated twice in one call)."""
    first = block * (tile_n // PAGE_ROWS)
    entry = first // cache.pieces_per_page
    piece = first - entry * cache.pieces_per_page
    out = []
    for _ in cutlass.range_constexpr(tile_n // PAGE_ROWS):
        out.append((entry, piece))
        piece = piece + 1
        wrap = piece == cache.pieces_per_page
        entry = cutlass.select_(wrap, entry + 1, entry)
        piece = cutlass.select_(wrap, Int32(0), piece)
    return out


@cute.jit
def block_pages(block: Int32, cache: Cache, tile_n: cutlass.Constexpr):
    """The page of each PAGE_ROWS-key piece of key block `block`, clamped, in registers:
    read before the producer waits for a free ring slot, so that the table's latency
    hides under that wait (a batch-1 decode step over pages of 64, 32 / 8 heads of 128:
    1.04-1.05x at 128k keys, level at 8k; H200, 2026-11-26, alternated twice)."""
    last_entry = cute.size(cache.pages) - 1
    pages = cute.make_rmem_tensor((tile_n // PAGE_ROWS,), Int32)
    for i, (entry, _) in enumerate(_pieces(block, cache, tile_n)):
        page = cache.pages[cutlass.min(entry, last_entry)]
        pages[i] = cutlass.max(cutlass.min(page, cache.num_pages - 1), 0)
    return pages


@cute.jit
def load_block(atom, tma_cache, pieces_ring, first_piece: Int32, block: Int32, pages,
               cache: Cache, tile_n: cutlass.Constexpr, box: cutlass.Constexpr,
               keys_major: cutlass.Constexpr, barrier, appended):
    """TMA key block `block` into pieces first_piece .. of pieces_ring, PAGE_ROWS keys
    at a time, each from its page (block_pages); all complete on `barrier`.
    keys_major: K's (PAGE_ROWS, D) boxes; else V^T's (Dv, PAGE_ROWS); `box` is that
    shape. A block that takes some of the call's new rows first waits for the append
    warp (`appended`): an appending call's plan runs upwards, so those blocks come last
    and find the append done; the other blocks load at once."""
    if cache.new.k.shape[0] > 0:
        if (block + 1) * tile_n > first_new_key(cache):
            cute.arch.mbarrier_wait(appended, 0)
    for i, (_, piece) in enumerate(_pieces(block, cache, tile_n)):
        rows = tma_cache[None, None, cache.kv_head, pages[i]]
        g = cute.local_tile(rows, box, (None, 0) if keys_major else (0, None))
        s_part, g_part = cpasync.tma_partition(
            atom, 0, cute.make_layout(1),
            cute.group_modes(pieces_ring, 0, 2), cute.group_modes(g, 0, 2),
        )
        cute.copy(atom, g_part[None, piece], s_part[None, first_piece + i],
                  tma_bar_ptr=barrier)


@cute.jit
def first_new_key(cache: Cache):
    """The key of new row 0: L - Sq (negative when L < Sq: those rows are dropped)."""
    rows = cache.new.rows
    return rows[segments.KEY_END, rows.shape[1] - 1] - cache.new.k.shape[0]


@cute.jit
def append_rows(block: Int32, start: Int32, cache: Cache, tile_n: cutlass.Constexpr):
    """Store the new K and V rows whose keys fall in key block `block` into their pages;
    `start` is first_new_key. Each lane copies 16 bytes of a row; the warp takes 32 * 16
    bytes of rows at a time (a decode step's one row: a single pass)."""
    new = cache.new
    count = new.k.shape[0]
    first_key = block * tile_n
    lo = cutlass.max(first_key - start, 0)
    hi = cutlass.min(first_key + tile_n - start, count)
    lane = cute.arch.lane_idx()
    last_entry = cute.size(cache.pages) - 1
    for src, dst in ((new.k, new.k_cache), (new.v, new.v_cache)):
        chunk = 16 * 8 // src.element_type.width  # elements per 16 bytes
        lanes_per_row = src.shape[1] // chunk  # head dims of the paged kernels: <= 32
        row, part = lane // lanes_per_row, lane % lanes_per_row
        for i in cutlass.range(lo + row, hi, 32 // lanes_per_row, unroll=1):
            key = start + i  # >= first_key >= 0
            entry = key // cache.page_size
            page = cache.pages[cutlass.min(entry, last_entry)]
            page = cutlass.max(cutlass.min(page, cache.num_pages - 1), 0)
            cute.autovec_copy(
                cute.local_tile(src[i, None], (chunk,), (part,)),
                cute.local_tile(dst[page, key - entry * cache.page_size, None], (chunk,),
                                (part,)))
