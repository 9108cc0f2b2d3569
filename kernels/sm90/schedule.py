"""Which tiles a forward CTA computes, and in which order (kernels/config.py
Tile.schedule); the arithmetic is kernels/tile_order.py.

A tile is (x, head, batch) of the grid a one-tile launch has: x the query tile (times
the split in split variants), then head and batch.
  "tile"     one CTA per tile: its block index.
  "static"   min(tiles, SMs x ctas_per_sm) CTAs; CTA c takes tiles c, c + CTAs, ... of the grid
             flattened with x fastest, so CTAs running side by side share a head's K
             and V in L2.
  "dynamic"  the same CTAs; each takes its block index first, then the next free tile
             from a counter in global memory that the handler zeroes before the launch.
             The order is longest first with L2 in mind: (head, batch) pairs in groups
             whose K and V fit in tile_order.L2_BYTES, and inside a group x slowest, so
             banded tiles (longest at x = 0: fwd.py reverses them) run in decreasing
             length while their group's K and V stay in L2.
For "dynamic" the producer warp takes the tiles and hands each to the consumers through
a ring in shared memory, decoded to (x, head, batch) so that the consumers' tile starts
do no integer division; x = -1 ends the walk. For "static" each CTA steps from tile to
tile by adding digits (static_next), for the same reason. At 512 tokens a tile's whole
life is a few microseconds, and those divisions cost d64 causal 4-5% and d64 without a
mask about 2% there (docs/performance.md, the forward's dynamic schedule).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from kernels import tile_order


class Grid:
    """The tile grid: extent_x query tiles (times splits), heads, batch; count tiles.
    Functions below take it: the DSL would carry an object whose methods a runtime
    branch calls as a runtime value, which a plain object cannot be."""

    def __init__(self, extent_x, heads, batch):
        self.extent_x, self.heads, self.batch = extent_x, heads, batch
        self.count = extent_x * heads * batch


def in_grid_order(grid: Grid, t):
    return tile_order.in_grid_order(t, grid.extent_x, grid.heads)


def static_share(grid: Grid):
    """(first, step, count): this CTA's tiles are first + i * stride, i < count, in the
    grid flattened with x fastest; first and step (the stride) as (x, head, batch)
    digits, which static_next adds, so a tile start does no division."""
    first, _, _ = cute.arch.block_idx()
    stride, _, _ = cute.arch.grid_dim()
    return (in_grid_order(grid, first), in_grid_order(grid, stride),
            cute.ceil_div(grid.count - first, stride))


def static_next(grid: Grid, tile, step):
    """The tile `step` after `tile` (static_share's digits)."""
    def select(c, a, b):
        return cutlass.select_(c, Int32(a), Int32(b))
    return tile_order.grid_step(tile, step, grid.extent_x, grid.heads, select)


def pairs_per_group(grid: Grid, length, position_bytes):
    return tile_order.pairs_per_group(grid.heads * grid.batch, length, position_bytes,
                                      cutlass.min, cutlass.max)


def in_l2_groups(grid: Grid, group, t):
    return tile_order.in_l2_groups(t, grid.extent_x, grid.heads, grid.heads * grid.batch,
                                   group, cutlass.min)


@cute.jit
def take_next(counter, stride):
    """The next free tile: one lane bumps the counter, the warp shares its old value."""
    lane = cute.arch.lane_idx()
    old = Int32(0)
    if lane == 0:
        old = cute.arch.atomic_add(counter, Int32(1))
    return cute.arch.shuffle_sync(old, 0) + stride
