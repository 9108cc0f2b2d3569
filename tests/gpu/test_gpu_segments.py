"""The segment kernels (segment ids, lengths, and either with a band) with the rule of
tests/README.md: out, lse, and dq, dk, dv in both backward modes, against the float32
reference with the same visibility. Packed documents have boundaries inside tiles, so
key blocks are skipped, visited whole and masked; unsorted ids make every visited block
a masked one; lengths leave padding rows (out = 0, lse = -inf) and a batch row of
length 0; GQA heads share the plan; softcap runs the softcap segment variant."""

import functools
import itertools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4

pytestmark = pytest.mark.gpu

BATCH, HEADS = 2, (4, 2)
SEQLENS = ((203, 113), (1000, 1000))
# (name, attention keyword arguments other than the runtime arrays, which arrays)
CASES_KW = (
    ("packed", {}, "packed"),
    ("packed-causal", {"causal": True}, "packed"),
    ("packed-sliding", {"causal": True, "window": (100, None)}, "packed"),
    ("unsorted", {}, "unsorted"),
    ("lengths-causal", {"causal": True}, "lengths"),
    ("lengths-top-left", {"causal": True, "alignment": "top_left"}, "lengths"),
    ("packed-causal-cap2", {"causal": True, "softcap": 2.0}, "packed"),
    ("lengths-cap2", {"softcap": 2.0}, "lengths"),
)


def _arrays(kind, seed, sq, sk):
    """The segment ids or lengths of one case, as numpy int32 arrays."""
    rng = np.random.default_rng(seed)
    if kind == "lengths":
        return {"q_lengths": np.array([sq * 3 // 4, 0], np.int32),
                "kv_lengths": np.array([sk, sk // 2 + 1], np.int32)}
    if kind == "unsorted":
        return {"q_segment_ids": rng.integers(0, 3, (BATCH, sq)).astype(np.int32),
                "kv_segment_ids": rng.integers(0, 3, (BATCH, sk)).astype(np.int32)}
    # Packed documents: the same boundaries, as fractions of each sequence.
    cuts = np.sort(rng.random((BATCH, 5)), -1)
    ids = {}
    for name, s in (("q_segment_ids", sq), ("kv_segment_ids", sk)):
        pos = (np.arange(s) + 0.5) / s
        ids[name] = (pos[None, :, None] > cuts[:, None, :]).sum(-1).astype(np.int32)
    return ids


# (D, Dv); a square one is named and seeded by D alone.
HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (256, 256), (192, 128))


def _case(dtype, head_dims, case, seqlens):
    (name, kwargs, kind), (sq, sk) = case, seqlens
    d, dv = head_dims
    dims = f"d{d}" if d == dv else f"d{d}v{dv}"
    return pytest.param(dtype, head_dims, kwargs, kind, sq, sk,
                        id=f"{dtype}-{dims}-{name}-sq{sq}-sk{sk}",
                        marks=pytest.mark.xdist_group(f"segments-{dtype}-{dims}"))


CASES = [_case(*c) for c in itertools.product(("bfloat16", "float16"), HEAD_DIMS,
                                              CASES_KW, SEQLENS)]


@functools.partial(jax.jit, static_argnames=("static", "deterministic"))
def _cute_vjp(q, k, v, dout, dlse, arrays, static, deterministic):
    attn = functools.partial(jax_fa4.attention, return_lse=True, implementation="cute",
                             deterministic=deterministic, **dict(static), **arrays)
    (out, lse), vjp = jax.vjp(attn, q, k, v)
    return out, lse, vjp((dout, dlse))


@pytest.mark.parametrize("dtype,head_dims,static,kind,sq,sk", CASES)
def test_segments_match_reference(fa, dtype, head_dims, static, kind, sq, sk):
    key = head_dims[0] if head_dims[0] == head_dims[1] else head_dims
    seed = zlib.crc32(repr(("segments", dtype, key, sorted(static.items()), kind,
                            sq, sk)).encode())
    q, k, v, dout, dlse = fa.problem(seed, dtype, BATCH, sq, sk, *HEADS, *head_dims)
    arrays = {name: jnp.asarray(x) for name, x in _arrays(kind, seed, sq, sk).items()}
    assert jax_fa4.supports(q, k, v, **static, **arrays) == (True, "")
    mask = {"causal": static.get("causal", False), "window": static.get("window"),
            "alignment": static.get("alignment", "bottom_right"),
            "softcap": static.get("softcap"), "segments": arrays}
    frozen = tuple(sorted(static.items()))
    for deterministic in (False, True):
        out, lse, grads = _cute_vjp(q, k, v, dout, dlse, arrays, static=frozen,
                                    deterministic=deterministic)
        if not deterministic:
            fa.assert_attention(f"{kind} forward", out, lse, q, k, v, **mask)
        mode = "deterministic" if deterministic else "atomic"
        fa.assert_gradients(f"{kind} {mode}", grads, q, k, v, dout, dlse, **mask)
