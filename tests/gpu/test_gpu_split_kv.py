"""Split-KV (jax_fa4/_split_kv.py) through the kernels: decode-like calls whose grid
leaves SMs idle run the split variant; against the rule of tests/README.md, bitwise
stable across runs, and within an output rounding of the same call unsplit. Every
feature the split variant carries: pack-GQA, causal (bottom-right, several queries),
windows (splits left empty), softcap, sinks, lengths (empty and clipped), every head
dim, gradients (the backward never splits); and decode shapes that fill the GPU, which
take the split kernel with one run."""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4
from jax_fa4 import _api, _split_kv

pytestmark = pytest.mark.gpu

# (D, Dv) of every built head-dim pair.
HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256))
# (name, Sq, attention keyword arguments); sinks and lengths are made per problem.
FEATURES = (
    ("decode", 1, {}),
    ("speculative-causal", 4, dict(causal=True)),
    ("chunk-causal", 64, dict(causal=True)),
    ("window", 3, dict(causal=True, window=(300, 0))),
    ("softcap", 1, dict(softcap=20.0)),
    ("sinks", 2, dict(causal=True, sinks=True)),
    ("lengths", 1, dict(kv_lengths=True)),
    ("lengths-causal", 5, dict(causal=True, kv_lengths=True)),
)
SEQLEN_K = 4099  # odd: the last key block holds a tail
HEADS, HEADS_KV, BATCH = 8, 2, 2


def _case(dtype, head_dims, feature):
    d, dv = head_dims
    dims = f"d{d}" if d == dv else f"d{d}v{dv}"
    return pytest.param(dtype, head_dims, feature, id=f"{dtype}-{dims}-{feature[0]}",
                        marks=pytest.mark.xdist_group(f"split-{dtype}-{dims}"))


CASES = ([_case("bfloat16", h, f) for h in HEAD_DIMS for f in FEATURES]
         + [_case("float16", (128, 128), f) for f in FEATURES])


def _arrays(seed, options):
    """sinks (H,) and kv_lengths (B,) where the feature asks for them: one sequence with
    no key, one past Sk (clipped to Sk)."""
    options = dict(options)
    rng = np.random.default_rng(seed)
    if options.pop("sinks", False):
        options["sinks"] = jnp.asarray(rng.standard_normal(HEADS) * 2, jnp.float32)
    if options.pop("kv_lengths", False):
        options["kv_lengths"] = jnp.asarray([0, SEQLEN_K + 500], jnp.int32)[:BATCH]
        if options.get("causal"):
            options["kv_lengths"] = jnp.asarray([1000, SEQLEN_K + 500], jnp.int32)
    return options


def _run(q, k, v, options):
    """out, lse of one jitted call (traced afresh: the split count is chosen while
    tracing) and the split count it ran with (0: the unsplit kernel)."""
    features = {n: x for n, x in options.items() if n != "causal"}
    spec = _api._plan(q, k, v, causal=options.get("causal", False), softmax_scale=None,
                      return_lse=True, implementation="cute", **features)
    fn = jax.jit(lambda *a: jax_fa4.attention(*a, return_lse=True, implementation="cute",
                                              **options))
    return (*fn(q, k, v), spec.num_splits if spec.split_kernel else 0)


def _assert_near_unsplit(name, out, lse, whole, lse_whole):
    """The split kernel sums fp32 partials and rounds once, as the unsplit kernel does:
    the two differ by at most about one rounding of out."""
    ulp = float(jnp.finfo(out.dtype).eps) * float(jnp.max(jnp.abs(whole.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(whole, np.float32),
                               atol=2 * ulp, rtol=0, err_msg=name)
    finite = np.isfinite(np.asarray(lse_whole))
    assert np.array_equal(finite, np.isfinite(np.asarray(lse))), name
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(lse_whole)[finite],
                               rtol=2e-6, atol=2e-6, err_msg=name)


@pytest.mark.parametrize("dtype,head_dims,feature", CASES)
def test_split_matches_reference_and_unsplit(fa, monkeypatch, dtype, head_dims, feature):
    name, sq, options = feature
    seed = zlib.crc32(repr(("split", dtype, head_dims, name)).encode())
    q, k, v, *_ = fa.problem(seed, dtype, BATCH, sq, SEQLEN_K, HEADS, HEADS_KV, *head_dims)
    options = _arrays(seed, options)

    out, lse, splits = _run(q, k, v, options)
    assert splits > 1, f"{name}: expected a split grid"
    mask = {n: options[n] for n in ("sinks", "window", "softcap") if n in options}
    if "kv_lengths" in options:
        mask["segments"] = {"kv_lengths": options["kv_lengths"]}
    fa.assert_attention(f"split {name}", out, lse, q, k, v,
                        causal=options.get("causal", False), **mask)

    again, lse_again, _ = _run(q, k, v, options)
    assert np.array_equal(np.asarray(out), np.asarray(again)), f"{name}: out not stable"
    assert np.array_equal(np.asarray(lse), np.asarray(lse_again)), f"{name}: lse not stable"

    # Every grid "fills" the GPU and decode shapes keep the unsplit kernel: no split.
    monkeypatch.setattr(_split_kv, "FILL", 0.0)
    monkeypatch.setattr(_split_kv, "DECODE_SHAPED", False)
    whole, lse_whole, unsplit = _run(q, k, v, options)
    assert unsplit == 0
    _assert_near_unsplit(name, out, lse, whole, lse_whole)


@pytest.mark.parametrize("head_dims", [(64, 64), (128, 128), (256, 256)])
@pytest.mark.parametrize("name,sq,options", [FEATURES[0], FEATURES[1], FEATURES[6]])
def test_decode_shapes_that_fill_the_gpu_run_one_split(fa, monkeypatch, head_dims, name,
                                                      sq, options):
    """A decode-shaped call whose grid fills the GPU takes the split kernel with one run
    per tile (_split_kv.DECODE_SHAPED): against the rule, and within an output rounding
    of the unsplit kernel."""
    batch = 64  # x 2 K/V heads: 128 tiles of the packed rows, one wave
    seed = zlib.crc32(repr(("one split", head_dims, name)).encode())
    q, k, v, *_ = fa.problem(seed, "bfloat16", batch, sq, 1031, HEADS, HEADS_KV, *head_dims)
    options = dict(options)
    if options.pop("kv_lengths", False):
        options["kv_lengths"] = jnp.asarray(
            np.random.default_rng(seed).integers(0, 1400, batch), jnp.int32)
    out, lse, splits = _run(q, k, v, options)
    assert splits == 1, f"{name}: expected the split kernel with one run, got {splits}"
    mask = {"segments": {"kv_lengths": options["kv_lengths"]}} if "kv_lengths" in options else {}
    fa.assert_attention(f"one split {name}", out, lse, q, k, v,
                        causal=options.get("causal", False), **mask)
    monkeypatch.setattr(_split_kv, "DECODE_SHAPED", False)
    whole, lse_whole, unsplit = _run(q, k, v, options)
    assert unsplit == 0
    _assert_near_unsplit(name, out, lse, whole, lse_whole)


@pytest.mark.parametrize("batch,sq,causal", [(1, 1, False), (1, 1, True), (2, 2, False),
                                             (64, 1, False)])
def test_keys_as_m_tile_matches_the_64_row_tile(fa, monkeypatch, batch, sq, causal):
    """Decode rows that fit the keys-as-M tile (Sq x group <= its 8 rows, no segment
    variant: packed causal rows of several positions take the segment kernel) run it,
    with several splits or (batch 64) one: against the rule, bitwise stable, and within
    an output rounding of the 64-row split tile with the same splits."""
    seed = zlib.crc32(repr(("keys as M", batch, sq, causal)).encode())
    q, k, v, *_ = fa.problem(seed, "bfloat16", batch, sq, SEQLEN_K, HEADS, HEADS_KV, 128)
    spec = _api._plan(q, k, v, causal=causal, softmax_scale=None, return_lse=True,
                      implementation="cute")
    assert spec.split_kernel and spec.keys_as_m, spec
    out, lse, splits = _run(q, k, v, dict(causal=causal))
    fa.assert_attention(f"keys as M b{batch} sq{sq}", out, lse, q, k, v, causal=causal)
    again, lse_again, _ = _run(q, k, v, dict(causal=causal))
    assert np.array_equal(np.asarray(out), np.asarray(again)), "out not stable"
    assert np.array_equal(np.asarray(lse), np.asarray(lse_again)), "lse not stable"
    monkeypatch.setattr(_split_kv, "KEYS_AS_M", False)
    rows64, lse64, splits64 = _run(q, k, v, dict(causal=causal))
    assert splits64 == splits
    _assert_near_unsplit("keys as M vs 64 rows", out, lse, rows64, lse64)


@functools.partial(jax.jit, static_argnames=("causal",))
def _vjp(q, k, v, dout, dlse, causal):
    attn = functools.partial(jax_fa4.attention, causal=causal, return_lse=True,
                             implementation="cute")
    (out, lse), vjp = jax.vjp(attn, q, k, v)
    return out, lse, vjp((dout, dlse))


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_through_a_split_forward(fa, causal):
    q, k, v, dout, dlse = fa.problem(7, "bfloat16", 1, 64, SEQLEN_K, HEADS, HEADS_KV, 128)
    assert _api._plan(q, k, v, causal=causal, softmax_scale=None, return_lse=True,
                      implementation="cute").num_splits > 1
    out, lse, grads = _vjp(q, k, v, dout, dlse, causal=causal)
    fa.assert_attention("split grad fwd", out, lse, q, k, v, causal=causal)
    fa.assert_gradients("split grad", grads, q, k, v, dout, dlse, causal=causal)
