"""The order persistent kernels take their tiles in: the integer arithmetic of
kernels/sm90/schedule.py, shared with the CPU tests.

A grid is extent_x x heads x batch tiles: (x, head, batch), x the fastest dimension of
a one-tile launch. The functions take `mn` / `mx`: the DSL's min / max on runtime Int32
in the kernels, Python's in the tests. Every division has a non-negative numerator
(the DSL's truncates toward zero).
"""

# The share of the H100's 50 MB L2 that one group's reused operands may take.
L2_BYTES = 32 << 20


def in_grid_order(t, extent_x, heads):
    """Tile t of the grid flattened with x fastest: (x, head, batch)."""
    rest = t // extent_x
    return t - rest * extent_x, rest % heads, rest // heads


def grid_step(tile, step, extent_x, heads, select):
    """Tile `tile` + `step` tiles of the grid flattened with x fastest, both given as
    (x, head, batch) digits (in_grid_order): added digit by digit with carries, no
    division. Each digit of step is below its radix, so each carry is 0 or 1.
    `select(c, a, b)`: a where c else b."""
    x = tile[0] + step[0]
    x_carry = x >= extent_x
    head = tile[1] + step[1] + select(x_carry, 1, 0)
    h_carry = head >= heads
    return (select(x_carry, x - extent_x, x), select(h_carry, head - heads, head),
            tile[2] + step[2] + select(h_carry, 1, 0))


def pairs_per_group(pairs, length, position_bytes, mn=min, mx=max):
    """How many of the `pairs` (head, batch) pairs go in one group: as many whose reused
    operands (`length` positions of `position_bytes` bytes: the forward's K and V) fit
    in L2_BYTES; at least 1."""
    return mx(mn((L2_BYTES // position_bytes) // mx(length, 1), pairs), 1)


def in_l2_groups(t, extent_x, heads, pairs, group, mn=min):
    """Tile t of the grouped order: (x, head, batch). The (head, batch) pairs, heads
    fastest, go in groups of `group` (the last may be smaller); inside a group, x is
    the slowest, so x = 0 of every pair in the group comes first."""
    per_group = group * extent_x
    g = t // per_group
    r = t - g * per_group
    size = mn(group, pairs - g * group)
    x = r // size
    pair = g * group + (r - x * size)
    return x, pair % heads, pair // heads
