"""attention_varlen on the segment kernels with the rule of tests/README.md: out, lse, and
dq, dk, dv in both backward modes. A padded batch with q_lengths / kv_lengths is the
same problem as its sequences packed (bottom-right alignment uses the valid lengths), so
the packed results, unpacked, meet the padded float32 reference. The packing leaves
rows outside every sequence at both ends (out = 0, lse = -inf, no gradient), a
sequence with no queries and one with no keys; sequence boundaries fall inside tiles."""

import functools
import itertools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4

pytestmark = pytest.mark.gpu

HEADS = (4, 2)
SQ, SK = 300, 260  # the padded problem
# Per sequence (q length, k length).
LENGTHS = ((300, 260), (131, 77), (0, 40), (57, 0), (250, 250))
LEAD, TAIL = 5, 37  # packed rows outside every sequence, before and after
CASES_KW = (
    ("none", {}),
    ("causal", {"causal": True}),
    ("sliding-top-left", {"causal": True, "window": (60, None), "alignment": "top_left"}),
    ("window-cap2", {"window": (40, 20), "softcap": 2.0}),
)


# (D, Dv); a square one is named and seeded by D alone.
HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (256, 256), (192, 128))


def _case(dtype, head_dims, case):
    name, kwargs = case
    d, dv = head_dims
    dims = f"d{d}" if d == dv else f"d{d}v{dv}"
    return pytest.param(dtype, head_dims, kwargs, id=f"{dtype}-{dims}-{name}",
                        marks=pytest.mark.xdist_group(f"varlen-{dtype}-{dims}"))


CASES = [_case(*c) for c in itertools.product(("bfloat16", "float16"), HEAD_DIMS,
                                              CASES_KW)]


def _pack(x, lengths):
    """(B, S, ...) -> (LEAD + sum(lengths) + TAIL, ...): each row's first lengths[b]
    entries, between rows of ones that belong to no sequence."""
    ones = lambda n: jnp.ones((n, *x.shape[2:]), x.dtype)  # noqa: E731
    return jnp.concatenate([ones(LEAD), *(x[b, :n] for b, n in enumerate(lengths)),
                            ones(TAIL)])


def _unpack(y, lengths, s, fill):
    """_pack's inverse: (B, s, ...) with `fill` past each length; and the rows outside
    every sequence."""
    offsets = np.cumsum([LEAD, *lengths])
    rows = [jnp.concatenate([y[lo:hi], jnp.full((s - (hi - lo), *y.shape[1:]), fill, y.dtype)])
            for lo, hi in zip(offsets[:-1], offsets[1:])]
    return jnp.stack(rows), jnp.concatenate([y[:LEAD], y[offsets[-1]:]])


@functools.partial(jax.jit, static_argnames=("static", "deterministic", "max_seqlens"))
def _cute_vjp(q, k, v, dout, dlse, cu_q, cu_k, static, deterministic, max_seqlens):
    attn = functools.partial(jax_fa4.attention_varlen, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                             max_seqlen_q=max_seqlens[0], max_seqlen_k=max_seqlens[1],
                             return_lse=True, implementation="cute",
                             deterministic=deterministic, **dict(static))
    (out, lse), vjp = jax.vjp(attn, q, k, v)
    return out, lse, vjp((dout, dlse))


@pytest.mark.parametrize("dtype,head_dims,static", CASES)
def test_varlen_matches_reference(fa, dtype, head_dims, static):
    key = head_dims[0] if head_dims[0] == head_dims[1] else head_dims
    seed = zlib.crc32(repr(("varlen", dtype, key, sorted(static.items()))).encode())
    batch = len(LENGTHS)
    q, k, v, dout, dlse = fa.problem(seed, dtype, batch, SQ, SK, *HEADS, *head_dims)
    lq, lk = (np.array(x, np.int32) for x in zip(*LENGTHS))
    cu_q, cu_k = (jnp.asarray(np.cumsum([LEAD, *x]), jnp.int32) for x in (lq, lk))
    packed = [_pack(x, lq) for x in (q, dout)] + [_pack(x, lk) for x in (k, v)]
    pq, pdout, pk, pv = packed
    pdlse = _pack(jnp.swapaxes(dlse, 1, 2), lq).T
    assert jax_fa4.supports(pq, pk, pv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                            max_seqlen_q=SQ, max_seqlen_k=SK, **static) == (True, "")
    mask = {"causal": static.get("causal", False), "window": static.get("window"),
            "alignment": static.get("alignment", "bottom_right"),
            "softcap": static.get("softcap"),
            "segments": {"q_lengths": jnp.asarray(lq), "kv_lengths": jnp.asarray(lk)}}
    frozen = tuple(sorted(static.items()))
    for deterministic in (False, True):
        out, lse, (dq, dk, dv) = _cute_vjp(pq, pk, pv, pdout, pdlse, cu_q, cu_k,
                                           static=frozen, deterministic=deterministic,
                                           max_seqlens=(SQ, SK))
        outside = [_unpack(x, lq, SQ, 0)[1] for x in (out, dq)]
        outside += [_unpack(x, lk, SK, 0)[1] for x in (dk, dv)]
        for name, x in zip(("out", "dq", "dk", "dv"), outside):
            assert not jnp.any(x), f"{name} outside every sequence is not 0"
        lse_rows, lse_outside = _unpack(lse.T, lq, SQ, -jnp.inf)
        assert jnp.all(jnp.isneginf(lse_outside)), "lse outside every sequence"
        if not deterministic:
            fa.assert_attention("varlen forward", _unpack(out, lq, SQ, 0)[0],
                                jnp.swapaxes(lse_rows, 1, 2), q, k, v, **mask)
        grads = (_unpack(dq, lq, SQ, 0)[0], _unpack(dk, lk, SK, 0)[0],
                 _unpack(dv, lk, SK, 0)[0])
        mode = "deterministic" if deterministic else "atomic"
        fa.assert_gradients(f"varlen {mode}", grads, q, k, v, dout, dlse, **mask)
