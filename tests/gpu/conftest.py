"""The numerics rule (tests/README.md), FlashAttention's, shared by the GPU tests.

A result passes when

    max|got - ref| <= RTOL * max|lp - ref| + ATOL

where ref is the reference computed in float32 on the (upcast) inputs and lp is the same
math with every step in the input dtype: the kernel may be at most twice as wrong as
straightforward low-precision math. For dq, dk, dv: backward_references. Exposed as the
`fa` fixture.
"""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_fa4 import _masks
from jax_fa4._reference import reference_attention, reference_backward

RTOL = 2.0
SOFTCAP_RTOL = 3.0  # tests/README.md: tanh adds a rounding step the baseline takes in float32
# Twice the float32 rounding error at magnitude 0.3 (eps is the relative spacing of
# float32 numbers). It only matters where the low-precision math is exact.
ATOL = 2 * float(np.finfo(np.float32).eps) * 0.3


# Static options; the band (causal, window) is traced (`_band`), so that one shape's
# references compile once for all the bands a test file tries. softcap stays static: a
# traced cap rounded the last bits differently.
_STATIC = ("softmax_scale", "compute_dtype", "alignment", "softcap")
# A band side that no offset reaches (offsets are under 2**31 - 2**30 in size): it
# stands for an unbounded side in a traced band.
UNBOUNDED = 2**30


def _band(causal, window):
    """The band's sides (left, right) as a traced int32 pair, None without a band: the
    form the jitted references take it in."""
    left, right = _masks._band_sides(causal, window)
    if left is None and right is None:
        return None
    return jnp.asarray([UNBOUNDED if left is None else left,
                        UNBOUNDED if right is None else right], jnp.int32)


def _window(band):
    """`_band`'s pair as the (causal, window) options of the reference functions."""
    return dict(causal=False, window=None if band is None else (band[0], band[1]))


# `segments`: None or a dict of attention's segment ids / lengths arrays (None entries
# allowed), passed as a traced argument.


def _visible(q, k, segments, band, alignment):
    """The (B, Sq, Sk) visibility of a call with segment ids or lengths; None without."""
    if not segments:
        return None
    return _masks.padded(q.shape[-3], k.shape[-3], alignment=alignment, **_window(band),
                         **segments).mask


@functools.partial(jax.jit, static_argnames=_STATIC)
def _reference(q, k, v, sinks, segments, band, *, softmax_scale, compute_dtype, alignment,
               softcap):
    return reference_attention(q, k, v, softmax_scale=softmax_scale,
                               compute_dtype=compute_dtype, sinks=sinks, alignment=alignment,
                               softcap=softcap, **_window(band), **(segments or {}))


@functools.partial(jax.jit, static_argnames=_STATIC)
def _reference_backward(q, k, v, dout, dlse, sinks, segments, band, *, softmax_scale,
                        compute_dtype, alignment, softcap):
    # With sinks, the FlashAttention backward from the sunk out and lse is still exact
    # for q, k, v: the sink is a key with no value, so D = rowsum(dO * O) - dlse holds.
    mask = {"alignment": alignment, "softcap": softcap, **_window(band)}
    out, lse = reference_attention(q, k, v, softmax_scale=softmax_scale,
                                   compute_dtype=compute_dtype, sinks=sinks, **mask,
                                   **(segments or {}))
    return reference_backward(q, k, v, out, lse, dout, dlse, softmax_scale=softmax_scale,
                              compute_dtype=compute_dtype, **mask,
                              visible=_visible(q, k, segments, band, alignment))


@functools.partial(jax.jit, static_argnames=_STATIC + ("pieces",))
def _dv_floor(q, k, v, dout, sinks, segments, band, *, softmax_scale, compute_dtype,
              alignment, softcap, pieces=1):
    """dv of the FlashAttention backward computed exactly but for the one rounding the
    algorithm itself makes: P, from float32 S and lse, rounded to compute_dtype before
    dV = P^T dO in float32. dv is the only gradient whose error can come down to that
    floor (few rows, as in MQA at Sq = 17: a sum of 68 products), where max|lp - ref|,
    a single draw of half-ulp roundings, can sit below it: the exact algorithm measured
    2.06x max|lp - ref| on such a draw.

    pieces > 1: a ring backward (one kernel per chunk pair) rounds each pair's dv to the
    input dtype, sums the pairs in float32 and rounds the sum. The floor rounds the dv
    of each of `pieces` equal, contiguous query pieces before the float32 sum, and
    counts the last rounding as a whole half ulp away from the exact sum: the pieces'
    error moves the sum across a rounding midpoint as often as not, and at the largest
    entries half an ulp is most of the error (4 GPUs, causal window (700, 0): dv up to
    9.4, half an ulp 0.031; the ring measured 0.043 against max|lp - ref| 0.021)."""
    f32 = [x.astype(jnp.float32) for x in (q, k, v, dout)]
    mask = {"alignment": alignment, **_window(band)}
    _, lse = reference_attention(*f32[:3], softmax_scale=softmax_scale, sinks=sinks,
                                 softcap=softcap, **mask, **(segments or {}))
    *lead, sq, _, _ = q.shape
    heads_kv = k.shape[-2]
    grouped = lambda x: x.reshape(*lead, sq, heads_kv, -1, x.shape[-1])  # noqa: E731
    s = jnp.einsum("...qhgd,...khd->...hgqk", grouped(f32[0]), f32[1],
                   precision="highest") * jnp.float32(softmax_scale)
    if softcap is not None:
        s = jnp.float32(softcap) * jnp.tanh(s / jnp.float32(softcap))
    lse = lse.reshape(*lead, heads_kv, -1, sq)[..., None]
    visible = jnp.isfinite(lse)
    band = _masks.padded(sq, k.shape[-3], **mask, **(segments or {})).mask
    if band is not None:
        visible = visible & (band[:, None, None] if band.ndim == 3 else band)
    p = jnp.where(visible, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)), 0.0)
    p = p.astype(compute_dtype).astype(jnp.float32)
    if sq % pieces:
        raise ValueError(f"{pieces} query pieces do not divide Sq = {sq}")
    p = p.reshape(*p.shape[:-2], pieces, sq // pieces, p.shape[-1])
    do = f32[3].reshape(*lead, pieces, sq // pieces, heads_kv, -1, dout.shape[-1])
    dv = jnp.einsum("...hgpqk,...pqhgd->...pkhd", p, do, precision="highest")
    summed = dv.astype(v.dtype).astype(jnp.float32).sum(axis=-4)
    if pieces == 1:
        return summed.astype(v.dtype)
    exact = dv.sum(axis=-4)
    magnitude = jnp.abs(summed)
    half_ulp = jnp.exp2(jnp.floor(jnp.log2(magnitude)) - jnp.finfo(v.dtype).nmant - 1)
    away = jnp.where(summed >= exact, 1.0, -1.0)
    return jnp.where(magnitude > 0, summed + away * half_ulp, summed)


# The last backward_references call of the running test: (its inputs, its options, its
# result). Tests check both dq modes (atomic, deterministic) of one problem in turn
# against the same references, which the second call then takes from here.
_LAST_BACKWARD = []


@pytest.fixture(autouse=True)
def _forget_backward_references():
    """Each test's references go with it (the large tests' fill much of the GPU)."""
    yield
    _LAST_BACKWARD.clear()


def _same(a, b) -> bool:
    """The same arguments: arrays (immutable) by identity, dicts and sequences entry by
    entry, other values by equality."""
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b)))
    if isinstance(a, dict) or isinstance(b, dict):
        return (isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys()
                and all(_same(a[key], b[key]) for key in a))
    if isinstance(a, (jax.Array, np.ndarray)) or isinstance(b, (jax.Array, np.ndarray)):
        return a is b
    return type(a) is type(b) and a == b


def backward_references(q, k, v, dout, dlse, **options):
    """_backward_references, reused when called again with the same inputs and options
    (`_LAST_BACKWARD`)."""
    inputs = (q, k, v, dout, dlse)
    if _LAST_BACKWARD and _same(_LAST_BACKWARD[0], inputs) and _same(_LAST_BACKWARD[1], options):
        return _LAST_BACKWARD[2]
    _LAST_BACKWARD.clear()  # before the new ones: one set at a time
    result = _backward_references(*inputs, **options)
    _LAST_BACKWARD[:] = [inputs, options, result]
    return result


def _backward_references(q, k, v, dout, dlse, *, causal, softmax_scale=None, sinks=None,
                         alignment="bottom_right", window=None, softcap=None, segments=None,
                         pieces=1):
    """-> ((dq, dk, dv) float32, (dq, dk, dv) in the input dtype's math): the gradients
    for the cotangents dout of out (B, Sq, H, D) and dlse of lse (B, H, Sq) float32.

    The float32 one is the exact gradient. The low-precision baseline is the FlashAttention
    backward (the kernels' algorithm) with every intermediate rounded to the input dtype
    (`reference_backward`), after the low-precision forward; for dv, the worse of that and
    the algorithm's own rounding floor (`_dv_floor`; `pieces` > 1 for a ring's pairs)."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    f32 = [x.astype(jnp.float32) for x in (q, k, v, dout)]
    band, mask = _band(causal, window), {"alignment": alignment, "softcap": softcap}
    ref = _reference_backward(*f32, dlse, sinks, segments, band, softmax_scale=scale,
                              compute_dtype="float32", **mask)
    lp = _reference_backward(q, k, v, dout.astype(q.dtype), dlse, sinks, segments, band,
                             softmax_scale=scale, compute_dtype=jnp.dtype(q.dtype).name, **mask)
    floor = _dv_floor(q, k, v, dout, sinks, segments, band, softmax_scale=scale,
                      compute_dtype=jnp.dtype(q.dtype).name, pieces=pieces, **mask)
    err = lambda x: float(jnp.max(jnp.abs(x.astype(jnp.float32) - ref[2])))  # noqa: E731
    return ref, (*lp[:2], max(lp[2], floor, key=err))


def references(q, k, v, *, causal, softmax_scale=None, sinks=None, alignment="bottom_right",
               window=None, softcap=None, segments=None):
    """-> ((out_ref, lse_ref) float32, (out_lp, lse_lp) in the input dtype's math)."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    band, mask = _band(causal, window), {"alignment": alignment, "softcap": softcap}
    ref = _reference(*f32, sinks, segments, band, softmax_scale=scale,
                     compute_dtype="float32", **mask)
    lp = _reference(q, k, v, sinks, segments, band, softmax_scale=scale,
                    compute_dtype=jnp.dtype(q.dtype).name, **mask)
    return ref, lp


@jax.jit
def _rule_stats(got, ref, lp):
    # One compiled function per shape: eager ops would compile a kernel each.
    got, ref, lp = (x.astype(jnp.float32) for x in (got, ref, lp))
    blind = jnp.isneginf(ref)

    def max_err(x):
        return jnp.max(jnp.where(blind, 0.0, jnp.abs(x - ref)), initial=0.0)

    return dict(
        inf_mismatch=jnp.any(jnp.isneginf(got) != blind),
        # Poison check: everything else must be finite (no NaN, no unwritten garbage).
        nonfinite=jnp.any(~(jnp.isfinite(got) | blind)),
        lp_nonfinite=jnp.any(~(jnp.isfinite(lp) | blind)),
        err=max_err(got),
        lp_err=max_err(lp),
    )


def assert_rule(what, got, ref, lp, rtol=RTOL, atol=ATOL):
    """The rule above; -inf entries of ref (rows that see no key) must be -inf in got."""
    assert got.shape == ref.shape == lp.shape, f"{what}: shapes {got.shape}, {ref.shape}"
    stats = jax.device_get(_rule_stats(got, ref, lp))
    assert not stats["inf_mismatch"], f"{what}: -inf entries differ from the reference"
    assert not stats["nonfinite"], f"{what}: non-finite values"
    assert not stats["lp_nonfinite"], f"{what}: the low-precision baseline overflowed"
    err, lp_err = float(stats["err"]), float(stats["lp_err"])
    bound = rtol * lp_err + atol
    assert err <= bound, (f"{what}: max|got - ref| = {err:.3e} > {rtol} * max|lp - ref| "
                          f"({lp_err:.3e}) + atol ({atol:.1e}) = {bound:.3e}")
    return err


def assert_lse(what, lse, lse_ref, lse_lp, q, k, *, softmax_scale=None, rtol=RTOL,
               softcap=None, sinks=None):
    """lse against the rule, with its own floor (tests/README.md), and without softcap
    also within the float32 bound of `_float32_lse_bound`: lse_lp rounds the scores to
    the input dtype, which the kernels do not. The bound is a worst case: it tightens
    short and causal rows (11x at d64 causal 128 x 128) and is looser than the rule on
    long ones (d256 at 4k), both far above the kernels' measured error."""
    lse_scale = float(_largest_finite(lse_ref))
    floor = 2 * float(np.finfo(np.float32).eps) * max(lse_scale, 0.3)
    err = assert_rule(what, lse, lse_ref, lse_lp, rtol=rtol, atol=floor)
    if softcap is None:
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        keys = k.shape[-3] + (sinks is not None)
        bound = _float32_lse_bound(q, k, scale, keys, lse_scale)
        assert err <= bound, (f"{what}: max|got - ref| = {err:.3e} > its float32 bound "
                              f"{bound:.3e}")


@jax.jit
def _largest_finite(x):
    return jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0), initial=0.0)


@jax.jit
def _largest_norm(x):
    """The largest L2 norm of x's rows (its last axis)."""
    return jnp.max(jnp.linalg.norm(x.astype(jnp.float32), axis=-1))


def _float32_lse_bound(q, k, scale, keys, lse_scale):
    """How far two lse computed in float32 from the same inputs may be apart (a kernel's
    and the float32 reference's), without softcap. A score sums D products: IEEE float32
    in any order is off by at most D eps sum_d |q_d k_d|; the tensor cores' truncating
    accumulation by at most about 2 D eps times the same. With S = scale max_i |q_i|
    max_j |k_j| (the rows' largest L2 norms; Cauchy-Schwarz bounds every score's sum by
    it), the two sides' scores differ by at most 3 D eps S, taken as 4 D, and lse, whose
    gradient in the scores is a distribution, by at most that. Scaling and subtracting
    the max add a few eps S. The row's sum of `keys` exponentials (approximate exp2 and
    a rescale per key tile in the kernel) is off by at most about `keys` eps relative on
    each side, which lse takes as absolute; the log adds a few eps of lse."""
    eps = float(np.finfo(np.float32).eps)
    s = scale * float(_largest_norm(q)) * float(_largest_norm(k))
    return eps * ((4 * q.shape[-1] + 4) * s + 3 * keys + 8 * max(lse_scale, 1.0))


def assert_attention(what, out, lse, q, k, v, *, causal, softmax_scale=None, **mask):
    """out and lse of attention(q, k, v) against the rule; mask: sinks, alignment,
    window, softcap, segments as `references` takes them."""
    (out_ref, lse_ref), (out_lp, lse_lp) = references(q, k, v, causal=causal,
                                                      softmax_scale=softmax_scale, **mask)
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    assert_rule(f"{what} out", out, out_ref, out_lp, rtol=_rtol(mask))
    assert_lse(f"{what} lse", lse, lse_ref, lse_lp, q, k, softmax_scale=softmax_scale,
               rtol=_rtol(mask), softcap=mask.get("softcap"), sinks=mask.get("sinks"))


def assert_gradients(what, grads, q, k, v, dout, dlse, *, causal, softmax_scale=None,
                     **mask):
    """dq, dk, dv for the cotangents (dout, dlse) against the rule (mask: as
    assert_attention, and backward_references' `pieces`)."""
    ref, lp = backward_references(q, k, v, dout, dlse, causal=causal,
                                  softmax_scale=softmax_scale, **mask)
    for name, got, x, r, l in zip(("dq", "dk", "dv"), grads, (q, k, v), ref, lp):
        assert got.dtype == x.dtype, f"{what} {name}: dtype {got.dtype}"
        assert_rule(f"{what} {name}", got, r, l, rtol=_rtol(mask))


def _rtol(mask) -> float:
    return RTOL if mask.get("softcap") is None else SOFTCAP_RTOL


def normal(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def problem(seed, dtype, batch, sq, sk, heads, heads_kv, head_dim, head_dim_v=None):
    """q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv), dout (B, Sq, H, Dv), in
    dtype (Dv defaults to D); dlse (B, H, Sq) float32: one draw per integer seed."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    kq, kk, kv, kdo, kdl = jax.random.split(jax.random.key(seed), 5)
    q = normal(kq, (batch, sq, heads, head_dim), dtype)
    k = normal(kk, (batch, sk, heads_kv, head_dim), dtype)
    v = normal(kv, (batch, sk, heads_kv, head_dim_v), dtype)
    return (q, k, v, normal(kdo, (batch, sq, heads, head_dim_v), dtype),
            jax.random.normal(kdl, (batch, heads, sq), jnp.float32))


@pytest.fixture(scope="session")
def fa():
    return types.SimpleNamespace(RTOL=RTOL, references=references, assert_rule=assert_rule,
                                 assert_lse=assert_lse,
                                 assert_attention=assert_attention, normal=normal,
                                 problem=problem,
                                 backward_references=backward_references,
                                 assert_gradients=assert_gradients)
