"""kernels/tile_order.py, the tile orders of the persistent kernels: every order is a
permutation of the grid, and the grouped one keeps its promises (groups that fit the
L2 budget, x slowest inside a group)."""

import importlib.util
import itertools
import pathlib

import pytest

# kernels/ is not installed with the package: load the repository's file.
_SPEC = importlib.util.spec_from_file_location(
    "tile_order", pathlib.Path(__file__).resolve().parents[2] / "kernels" / "tile_order.py")
tile_order = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(tile_order)

GRIDS = list(itertools.product((1, 2, 7, 16), (1, 3, 8), (1, 2, 5)))


@pytest.mark.parametrize("extent_x,heads,batch", GRIDS)
def test_grid_order_is_x_fastest(extent_x, heads, batch):
    tiles = [tile_order.in_grid_order(t, extent_x, heads) for t in range(extent_x * heads * batch)]
    assert tiles == [(x, h, b) for b in range(batch) for h in range(heads) for x in range(extent_x)]


@pytest.mark.parametrize("extent_x,heads,batch", GRIDS)
@pytest.mark.parametrize("ctas", (1, 2, 5, 132, 264))
def test_grid_steps_walk_each_ctas_share(extent_x, heads, batch, ctas):
    # The "static" schedule: CTA c of `ctas` takes tiles c, c + ctas, ... by adding
    # the stride's digits, and must meet exactly the tiles the flat index names.
    count = extent_x * heads * batch
    stride = min(count, ctas)

    def select(c, a, b):
        return a if c else b

    step = tile_order.in_grid_order(stride, extent_x, heads)
    for first in range(stride):
        tile = tile_order.in_grid_order(first, extent_x, heads)
        for t in range(first, count, stride):
            assert tile == tile_order.in_grid_order(t, extent_x, heads)
            tile = tile_order.grid_step(tile, step, extent_x, heads, select)


@pytest.mark.parametrize("extent_x,heads,batch", GRIDS)
@pytest.mark.parametrize("group", (1, 2, 3, 4, 64))
def test_l2_groups_permute_the_grid(extent_x, heads, batch, group):
    pairs = heads * batch
    group = min(group, pairs)
    order = [tile_order.in_l2_groups(t, extent_x, heads, pairs, group)
             for t in range(extent_x * pairs)]
    assert sorted(order) == sorted(itertools.product(range(extent_x), range(heads), range(batch)))
    # Group by group, each pair's x = 0 .. extent_x - 1 in turn, pairs fastest.
    expected = []
    for first in range(0, pairs, group):
        members = range(first, min(first + group, pairs))
        expected += [(x, p % heads, p // heads) for x in range(extent_x) for p in members]
    assert order == expected


@pytest.mark.parametrize("length,position_bytes,pairs,want", [
    (16384, 512, 64, 4),      # d128 K + V at 16k: 8 MB a pair, 4 fit in 32 MB
    (2048, 512, 64, 32),
    (512, 512, 16, 16),       # all pairs fit: capped at the pair count
    (1 << 20, 1024, 8, 1),    # one pair overflows the budget: still 1
    (0, 512, 4, 4),           # no keys
])
def test_pairs_per_group(length, position_bytes, pairs, want):
    assert tile_order.pairs_per_group(pairs, length, position_bytes) == want
