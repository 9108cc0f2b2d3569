"""The deterministic backward's shifted launch (kernels/band.py shifted_walk,
shifted_turn; kernels/sm90/bwd.py _shift, _q_tile, _dq_turn; ffi/attention_bwd.cc),
simulated: CTAs dispatched in grid order (key blocks fastest, then K/V heads) onto a GPU
that holds a fixed number of them, each walking its query tiles and adding its dQ
partial to a tile only on its turn.

Shifted turns wait on blocks launched after a block too, so all of a K/V head's CTAs
must be resident together: the FFI shifts only where they fit in half the GPU. These
runs check that no such launch stalls for good on a GPU holding just the head's CTAs,
or twice as many, and that every tile gets exactly one add from every block, in random
step times.
"""

import random

import pytest


def simulate(band, blocks, tiles, heads, width, holds, rng):
    """Runs one batch of the launch (`band`: kernels/band.py); returns the adds per
    (head, tile), or None where it stalls with CTAs left."""
    walks = [band.shifted_walk(n, blocks, tiles, 1) for n in range(blocks)]
    assert all(turns == blocks for _, turns in walks)
    # a block's CTAs (a pair's two) are dispatched together, as one cluster
    pending = [(h, first) for h in range(heads) for first, _ in walks]
    pending.reverse()
    running, adds = [], {}
    while pending or running:
        while pending and (len(running) + 1) * width <= holds:
            head, first = pending.pop()
            running.append([head, first, 0, rng.random()])
        moved = False
        for cta in sorted(running, key=lambda c: c[3]):  # random order of progress
            head, first, visit, _ = cta
            m = (visit + first) % tiles  # _q_tile
            if adds.get((head, m), 0) == band.shifted_turn(first, m, blocks, tiles):
                adds[(head, m)] = adds.get((head, m), 0) + 1
                cta[2], cta[3], moved = visit + 1, rng.random(), True
        running = [c for c in running if c[2] < tiles]
        if not moved and not (pending and (len(running) + 1) * width <= holds):
            return None
    return adds


@pytest.mark.parametrize("width", [1, 2])
def test_shifted_launch_never_stalls(kernel_band, width):
    rng = random.Random(11)
    for _ in range(150):
        tiles = rng.randint(1, 120)
        blocks, heads = rng.randint(1, min(tiles, 40)), rng.randint(1, 8)
        for holds in (blocks * width, 2 * blocks * width):
            where = (blocks, tiles, heads, width, holds)
            adds = simulate(kernel_band, blocks, tiles, heads, width, holds, rng)
            assert adds is not None, f"stalled: {where}"
            assert adds == {(h, m): blocks for h in range(heads) for m in range(tiles)}, where


def test_a_head_past_the_gpu_would_stall(kernel_band):
    # The check has teeth: a head of 8 pairs (16 CTAs) on a GPU holding 10.
    assert simulate(kernel_band, 8, 16, 1, 2, 10, random.Random(0)) is None
