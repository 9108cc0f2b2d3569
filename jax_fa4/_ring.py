"""Ring attention's building blocks, shared by `ring_attention` (inside `shard_map`) and
the automatic path of a sequence-sharded `jit` (`ring_forward` / `ring_backward`, and
`segment_ring_forward` / `segment_ring_backward` for the segment kernels, which the
partitioner runs per device).

The sequence is split into n contiguous chunks along a mesh axis, one per device.
K/V chunks travel around the ring, one hop per step; each device attends its queries
to the chunk it holds and merges the partial results through their LSE. The backward
runs the FlashAttention backward of each chunk pair from the global out and lse, and
the dK/dV accumulators travel with their chunk, taking one last hop home. Where the
band makes work uneven along the sequence, the automatic rings first trade chunk
halves into the zigzag layout (`_Layout`) and run every pair of halves.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax

from jax_fa4 import _segment_plan
from jax_fa4._varying import vary_like


def chunk_pair(band, length, chunks, q_chunk, kv_chunk, run, nothing, *args):
    """One query chunk against one key/value chunk, of `length` positions each, out of
    `chunks` chunks of the sequence: run(lo, hi, *args) where key j of the chunk is
    visible from query i of the chunk iff lo <= j - i <= hi (None: unbounded side), or
    nothing(*args) when no pair is visible.

    band: (left, right) of the global self-attention band, key position - query
    position in [-left, right] (None: unbounded; causal is right = 0). Chunk ids may be
    traced: one lax.switch branch per distinct local band, each static."""
    left, right = band
    cases, index = {}, []
    for d in range(1 - chunks, chunks):  # kv_chunk - q_chunk
        lo = None if left is None or -left - d * length <= 1 - length else -left - d * length
        hi = None if right is None or right - d * length >= length - 1 else right - d * length
        hidden = (lo is not None and lo >= length) or (hi is not None and hi <= -length)
        index.append(cases.setdefault(None if hidden else (lo, hi), len(cases)))
    branches = [functools.partial(run, *case) if case else nothing for case in cases]
    if len(branches) == 1:
        return branches[0](*args)
    which = jnp.asarray(index, jnp.int32)[kv_chunk - q_chunk + chunks - 1]
    return lax.switch(which, branches, *args)


CAUSAL = (None, 0)  # `chunk_pair`'s band of causal attention
_FULL = (None, None)


def causal_zigzag_pairs(step, me):
    """The chunk pairs a causal ring in the zigzag layout runs at `step` on device `me`
    (traced): (q part, kv part, band) over the device's two halves (me, 2n-1-me) and
    the two it holds, (c, 2n-1-c) of device c = me - step. At step 0 those are its own:
    both diagonals and its late queries on its early keys. Later the late queries see
    all of c, and one more full pair is visible: the early queries on c where c came
    from an earlier device (step <= me), else the late queries on 2n-1-c. That pair's
    parts are a traced index for `pick` rather than a `lax.switch` (`chunk_pair`),
    which on GPU stops the stream to read its branch on the host."""
    if step == 0:
        return [(0, 0, CAUSAL), (1, 1, CAUSAL), (1, 0, _FULL)]
    late = (step > me).astype(jnp.int32)
    return [(1, 0, _FULL), (late, late, _FULL)]


def pick(parts, i):
    """parts[i], for i a Python int or a traced 0 / 1 (a select); None parts stay None."""
    if isinstance(i, int) or parts[0] is None:
        return parts[i if isinstance(i, int) else 0]
    return jnp.where(i == 0, parts[0], parts[1])


def merge_picked(acc, i, part):
    """Merge part (out, lse) into acc[i] (i as `pick`'s). A traced i merges into every
    part, with weight 0 (lse -inf) where it picks another."""
    for j in range(len(acc)):
        if isinstance(i, int) and i != j:
            continue
        p = part if isinstance(i, int) else (part[0], jnp.where(i == j, part[1], -jnp.inf))
        acc[j] = p if acc[j] is None else merge(acc[j], p)


def add_picked(acc, i, value):
    """acc[i] += value (i as `pick`'s; a traced i adds zeros to the other part)."""
    for j in range(len(acc)):
        if isinstance(i, int):
            if i == j:
                acc[j] = acc[j] + value
        else:
            acc[j] = acc[j] + jnp.where(i == j, value, 0.0)


@dataclasses.dataclass(frozen=True)
class Cut:
    """How one chunk pair runs its band lo <= j - i <= hi (`chunk_pair`'s): as `window`
    (left, right), top-left aligned (None: no band), over the pair's queries from `rows`
    on and its keys from `keys` on. A band that misses the diagonal is moved onto it by
    dropping the keys no query sees (lo > 0) or the queries that see no key (hi < 0), so
    neither side of the window is negative, as the kernels need."""

    rows: int
    keys: int
    window: tuple[int | None, int | None] | None

    @staticmethod
    def of(lo, hi) -> Cut:
        if lo is not None and lo > 0:
            return Cut(0, lo, (0, None if hi is None else hi - lo))
        if hi is not None and hi < 0:
            return Cut(-hi, 0, (None if lo is None else hi - lo, 0))
        if (lo, hi) == (None, None):
            return Cut(0, 0, None)
        return Cut(0, 0, (None if lo is None else -lo, hi))

    def run_rows(self, x, axis=1):
        """The rows of x (the pair's queries along `axis`) that the pair runs."""
        return _after(x, self.rows, axis)

    def run_keys(self, x):
        """The keys of x (the pair's keys along axis 1) that the pair runs."""
        return _after(x, self.keys, 1)

    def with_unseen(self, part, q, k, v):
        """part (out, lse) of the rows the pair ran, with the rows it dropped in front:
        they saw no key (`unseen`)."""
        if not self.rows:
            return part
        out, lse = vary_like((q, k, v), unseen(q[:, :self.rows], v))
        return (jnp.concatenate([out, part[0]], axis=1),
                jnp.concatenate([lse, part[1]], axis=2))

    def with_zeros(self, dq, dk, dv):
        """Gradients of the rows and keys the pair ran, with zeros in front for those it
        dropped: they took no part in it."""
        return (_zeros_before(dq, self.rows), _zeros_before(dk, self.keys),
                _zeros_before(dv, self.keys))


def _after(x, count, axis):
    """x from index `count` on along `axis`; None stays None."""
    if x is None or not count:
        return x
    return lax.slice_in_dim(x, count, x.shape[axis], axis=axis)


def _zeros_before(x, count):
    return jnp.pad(x, [(0, 0), (count, 0)] + [(0, 0)] * (x.ndim - 2))


def unseen(q, v):
    """(out, lse) of queries that saw no key: zeros (fp32) and -inf."""
    b, s, h, _ = q.shape
    return (jnp.zeros((b, s, h, v.shape[-1]), jnp.float32),
            jnp.full((b, h, s), -jnp.inf, jnp.float32))


def merge(a, b):
    """Combine two softmax-normalized partial results through their LSE. A side that
    saw no key (lse = -inf) gets weight 0, also when both did (no NaN)."""
    (o_a, l_a), (o_b, l_b) = a, b
    lse = jnp.logaddexp(l_a, l_b)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    w_a, w_b = jnp.exp(l_a - safe), jnp.exp(l_b - safe)

    def rows(w):  # (B, H, S) -> (B, S, H, 1), the layout of out
        return jnp.swapaxes(w, 1, 2)[..., None]

    return o_a * rows(w_a) + o_b * rows(w_b), lse


def ring_forward(attend, spec, axis_name, q, k, v):
    """The automatic path's forward on one device of a sequence-sharded `jit`: q, k, v
    hold this device's contiguous chunks of the `axis_name`-sharded sequence;
    attend(spec, q, k, v) -> (out, lse) runs one chunk pair (the kernel call) with the
    pair's band (`Cut`). Returns this device's (out, lse), merged over the ring. Rings
    whose work is uneven along the sequence run in the zigzag layout (`_Layout`),
    balanced, and hand back contiguous chunks."""
    run = functools.partial(_pair_forward, attend, spec)
    n, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
    layout = _Layout.of(spec, axis_name, n, q, k)
    q_parts, k, v = (layout.parts(x, 1) for x in (q, k, v))
    causal_zigzag = layout.zigzag and _band(spec) == CAUSAL
    acc = [None] * len(q_parts)
    for step in range(n):
        if step:
            k, v = hop((k, v), axis_name, n)
        if causal_zigzag:
            for qi, ki, band in causal_zigzag_pairs(step, me):
                merge_picked(acc, qi, run(*band, pick(q_parts, qi), pick(k, ki), pick(v, ki)))
            continue
        for k_part, v_part, c in zip(k, v, layout.chunks((me - step) % n)):
            for i, (q_part, a) in enumerate(zip(q_parts, layout.chunks(me))):
                part = chunk_pair(_band(spec), layout.length, layout.total, a, c, run,
                                  lambda q, k, v: unseen(q, v), q_part, k_part, v_part)
                acc[i] = part if acc[i] is None else merge(acc[i], part)
    out = layout.whole([o.astype(q.dtype) for o, _ in acc], 1)
    return out, layout.whole([lse for _, lse in acc], 2)


def ring_backward(differentiate, spec, axis_name, q, k, v, out, dout, lse, dlse):
    """The automatic path's backward: differentiate(spec, q, k, v, out, dout, lse, dlse)
    -> (dq, dk, dv) runs the FlashAttention backward of one chunk pair from the global
    out and lse (so P and D are the whole sequence's); in the forward's layout."""
    n, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
    layout = _Layout.of(spec, axis_name, n, q, k)
    q_rows = _query_parts(layout, q, out, dout, lse, dlse)
    k, v = layout.parts(k, 1), layout.parts(v, 1)
    dq = [_zeros(r[0]) for r in q_rows]
    dk, dv = [_zeros(x) for x in k], [_zeros(x) for x in v]
    causal_zigzag = layout.zigzag and _band(spec) == CAUSAL
    for step in range(n):
        if step:
            k, v, dk, dv = hop((k, v, dk, dv), axis_name, n)
        if causal_zigzag:
            for qi, ki, band in causal_zigzag_pairs(step, me):
                rows = tuple(pick(column, qi) for column in zip(*q_rows))
                parts = _pair_backward(differentiate, spec, rows, *band, pick(k, ki),
                                       pick(v, ki))
                add_picked(dq, qi, parts[0])
                add_picked(dk, ki, parts[1])
                add_picked(dv, ki, parts[2])
            continue
        for j, c in enumerate(layout.chunks((me - step) % n)):
            for i, a in enumerate(layout.chunks(me)):
                def nothing(k, v, q=q_rows[i][0]):
                    return _zeros(q), _zeros(k), _zeros(v)

                run = functools.partial(_pair_backward, differentiate, spec, q_rows[i])
                parts = chunk_pair(_band(spec), layout.length, layout.total, a, c, run,
                                   nothing, k[j], v[j])
                dq[i], dk[j], dv[j] = dq[i] + parts[0], dk[j] + parts[1], dv[j] + parts[2]
    dk, dv = hop((dk, dv), axis_name, n)
    return (layout.whole([g.astype(q.dtype) for g in dq], 1),
            layout.whole([g.astype(k[0].dtype) for g in dk], 1),
            layout.whole([g.astype(v[0].dtype) for g in dv], 1))


def _pair_forward(attend, spec, lo, hi, q, k, v):
    """`ring_forward`'s chunk pair with band lo <= j - i <= hi: (out fp32, lse)."""
    cut = Cut.of(lo, hi)
    out, lse = attend(spec.with_top_left_window(cut.window), cut.run_rows(q),
                      cut.run_keys(k), cut.run_keys(v))
    return cut.with_unseen((out.astype(jnp.float32), lse), q, k, v)


def _pair_backward(differentiate, spec, rows, lo, hi, k, v):
    """`ring_backward`'s chunk pair with band lo <= j - i <= hi, on the same rows and
    keys as the forward's: rows (q, out, dout, lse, dlse) of the query part -> (dq, dk,
    dv) fp32."""
    cut = Cut.of(lo, hi)
    q, out, dout, lse, dlse = ([cut.run_rows(x) for x in rows[:3]]
                               + [cut.run_rows(x, 2) for x in rows[3:]])
    grads = differentiate(spec.with_top_left_window(cut.window), q, cut.run_keys(k),
                          cut.run_keys(v), out, dout, lse, dlse)
    return cut.with_zeros(*(g.astype(jnp.float32) for g in grads))


def segment_ring_forward(attend, spec, axis_name, q, k, v, rows, keys):
    """`ring_forward` for the segment kernels: rows (B, 3, Sq) hold this device's query
    rows' key ranges in global key indices and keys (B, Sk) this device's key ids, which
    travel with K/V. Each step runs attend(spec, q, k, v, rows, keys) per query part and
    key part on the rows cut to that key part (`_cut_rows`); the band is in the rows, so
    any band and lengths work, and blocks a row cannot see are skipped by the plan. The
    layout is the band ring's (`_Layout`): zigzag halves where the band makes work
    uneven, contiguous chunks otherwise."""
    n, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
    layout = _Layout.of(spec, axis_name, n, q, k)
    q_parts, row_parts = layout.parts(q, 1), layout.parts(rows, 2)
    k, v, keys = (layout.parts(x, 1) for x in (k, v, keys))
    acc = [None] * len(q_parts)
    for step in range(n):
        if step:
            k, v, keys = hop((k, v, keys), axis_name, n)
        for k_part, v_part, key_part, c in zip(k, v, keys, layout.chunks((me - step) % n)):
            for i, (q_part, r) in enumerate(zip(q_parts, row_parts)):
                out, lse = attend(spec, q_part, k_part, v_part, _cut_rows(r, c, key_part),
                                  key_part)
                part = out.astype(jnp.float32), lse
                acc[i] = part if acc[i] is None else merge(acc[i], part)
    out = layout.whole([o.astype(q.dtype) for o, _ in acc], 1)
    return out, layout.whole([lse for _, lse in acc], 2)


def segment_ring_backward(differentiate, spec, axis_name, q, k, v, out, dout, lse, dlse,
                          rows, keys):
    """`ring_backward` for the segment kernels (see `segment_ring_forward`)."""
    n, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
    layout = _Layout.of(spec, axis_name, n, q, k)
    q_rows = _query_parts(layout, q, out, dout, lse, dlse, rows)
    k, v, keys = (layout.parts(x, 1) for x in (k, v, keys))
    dq = [_zeros(r[0]) for r in q_rows]
    dk, dv = [_zeros(x) for x in k], [_zeros(x) for x in v]
    for step in range(n):
        if step:
            k, v, keys, dk, dv = hop((k, v, keys, dk, dv), axis_name, n)
        for j, c in enumerate(layout.chunks((me - step) % n)):
            for i, (q_i, out_i, dout_i, lse_i, dlse_i, r) in enumerate(q_rows):
                grads = differentiate(spec, q_i, k[j], v[j], out_i, dout_i, lse_i, dlse_i,
                                      _cut_rows(r, c, keys[j]), keys[j])
                dq[i], dk[j], dv[j] = (acc + g.astype(jnp.float32)
                                       for acc, g in zip((dq[i], dk[j], dv[j]), grads))
    dk, dv = hop((dk, dv), axis_name, n)
    return (layout.whole([g.astype(q.dtype) for g in dq], 1),
            layout.whole([g.astype(k[0].dtype) for g in dk], 1),
            layout.whole([g.astype(v[0].dtype) for g in dv], 1))


def _cut_rows(rows, chunk, keys):
    """rows (global key indices) cut to the key part `keys` (B, length), global part
    `chunk` of equal parts (traced), in the part's own indices."""
    length = keys.shape[1]
    return _segment_plan.chunk_rows(rows, chunk * length, length)


def _query_parts(layout, q, out, dout, lse, dlse, *rows):
    """Per query part of `layout`: its (q, out, dout, lse, dlse, *rows), each split along
    its sequence axis (2 for the row statistics and the segment rows)."""
    arrays = [layout.parts(x, 1) for x in (q, out, dout)]
    arrays += [layout.parts(x, 2) for x in (lse, dlse, *rows)]
    return list(zip(*arrays))


def _zeros(x):
    return jnp.zeros(x.shape, jnp.float32)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How the automatic rings (band and segment) lay out one device's contiguous chunk
    r of n.

    A query's work is the keys it sees. Where that grows or shrinks along the sequence,
    contiguous chunks would leave the devices at one end most of it, so the ring splits
    each chunk in halves and trades them (two ppermutes) until device r holds halves r
    and 2n-1-r of the 2n: the zigzag layout, an early half and a late one on each
    device. That evens out a band open on one side only (causal: query p sees p + 1
    keys, so mirrored positions p and S-1-p see S + 1 together) and a causal window
    (left, 0), whose work grows over the first `left` positions: the causal case, as far
    as the window is wide next to the sequence. Other windows (bounded on both sides,
    right side above 0: bidirectional local attention) give every query about
    left + right + 1 keys but near both ends, as even as no mask: their chunks stay
    whole, one kernel call per chunk pair instead of four and no trades. So do chunks
    of odd length, and query and key chunks of different lengths (only the segment ring
    takes those): `length` is one part's, of queries and keys alike."""

    axis_name: str
    n: int
    zigzag: bool
    length: int  # of one part

    @staticmethod
    def of(spec, axis_name, n, q, k):
        """The layout of q's and k's chunks (sequence along axis 1)."""
        left, right = _band(spec)
        uneven = right == 0 or (left is None) != (right is None)
        zigzag = uneven and n > 1 and q.shape[1] == k.shape[1] and q.shape[1] % 2 == 0
        return _Layout(axis_name, n, zigzag, q.shape[1] // 2 if zigzag else q.shape[1])

    @property
    def total(self) -> int:
        """Parts in the whole sequence."""
        return 2 * self.n if self.zigzag else self.n

    def chunks(self, device):
        """Global part ids device `device` holds, in order."""
        return (device, 2 * self.n - 1 - device) if self.zigzag else (device,)

    def _dest(self, half):
        return half if half < self.n else 2 * self.n - 1 - half

    def parts(self, x, axis):
        """This device's contiguous chunk of x (sequence along `axis`) -> its parts."""
        if not self.zigzag:
            return [x]
        n = self.n
        first, second = jnp.split(x, 2, axis=axis)
        # Half h goes to device _dest(h). Even and odd halves each form a permutation,
        # and a device receives one of each: its half d through the even one iff d is
        # even (d and 2n-1-d differ in parity).
        even = lax.ppermute(first, self.axis_name, [(r, self._dest(2 * r)) for r in range(n)])
        odd = lax.ppermute(second, self.axis_name,
                           [(r, self._dest(2 * r + 1)) for r in range(n)])
        d_even = lax.axis_index(self.axis_name) % 2 == 0
        return [jnp.where(d_even, even, odd), jnp.where(d_even, odd, even)]

    def whole(self, parts, axis):
        """Inverse of `parts`: this device's parts -> its contiguous chunk."""
        if not self.zigzag:
            return parts[0]
        n = self.n
        d_even = lax.axis_index(self.axis_name) % 2 == 0
        even = jnp.where(d_even, parts[0], parts[1])
        odd = jnp.where(d_even, parts[1], parts[0])
        first = lax.ppermute(even, self.axis_name, [(self._dest(2 * r), r) for r in range(n)])
        second = lax.ppermute(odd, self.axis_name,
                              [(self._dest(2 * r + 1), r) for r in range(n)])
        return jnp.concatenate([first, second], axis=axis)


def _band(spec):
    """The automatic path's global band (left, right), causal as right = 0 (`chunk_pair`'s
    form). Positions are global indices of query and key alike: `_sharding` refuses a
    band over query and key sequences of different lengths."""
    return spec.window_left, 0 if spec.causal else spec.window_right


def hop(values, axis_name, n):
    """Device i sends `values` to device i + 1 (mod n)."""
    return lax.ppermute(values, axis_name, [(i, (i + 1) % n) for i in range(n)])

