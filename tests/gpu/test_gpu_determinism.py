"""Bitwise reproducibility of the deterministic backward (and of the forward) over many
runs, beyond the causal d128 / d256 cases of test_gpu_transforms.py: no mask, a window,
segment ids, varlen, GQA and d256 without a mask. Each case has several key blocks per
query tile, so several CTAs add into every dq tile in the order the semaphores set:
without a band, walks shifted so that block n starts at query tile n where a K/V head
has no more key blocks than query tiles and its CTAs fit in half the SMs
(ffi/attention_bwd.cc), else ascending turns (up to 32 key blocks launched K/V heads
first, past that key blocks first).
At d256 and D 192 / Dv 128 the deterministic backward runs 2-CTA pairs
(kernels/sm90/bwd_pair.py): a window, causal GQA over an odd number of key blocks (900
keys: 15 blocks of 64, the last pair's second block past Sk) and causal 192 / 128."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fa4

pytestmark = pytest.mark.gpu

# Runs compared with the first; JAX_FA4_DETERMINISM_RUNS=1000 for the long check that
# resolving a backward change asks for (tests/README.md).
RUNS = int(os.environ.get("JAX_FA4_DETERMINISM_RUNS", "20"))
SQ = SK = 1000


def _ids(b, s, documents=5):
    cuts = np.linspace(0, s, documents + 1)[1:-1].astype(int) + 7  # inside tiles
    return jnp.asarray(np.searchsorted(cuts, np.arange(s), side="right")[None].repeat(b, 0),
                       jnp.int32)


CASES = {
    "d128-none": dict(d=128, kwargs={}),
    # more key blocks than query tiles (ascending turns), past the bound up to which
    # deterministic calls launch the K/V heads fastest
    "d64-none-sk4200": dict(d=64, kwargs={}, sk=4200),
    # 71 key blocks: more CTAs a K/V head than half of any Hopper's SMs (ascending turns)
    "d128-none-s9000": dict(d=128, kwargs={}, sq=9000, sk=9000),
    "d128-window": dict(d=128, kwargs={"window": (300, 100)}),
    "d64-segments-causal": dict(d=64, kwargs={"causal": True}, segments=True),
    "d128-varlen-causal": dict(d=128, kwargs={"causal": True}, varlen=True),
    "d128-gqa-8-2": dict(d=128, kwargs={}, heads=(8, 2)),
    "d256-none": dict(d=256, kwargs={}),
    "d192v128-none": dict(d=192, dv=128, kwargs={}),
    "d256-window": dict(d=256, kwargs={"window": (300, 100)}),
    "d256-causal-gqa-8-2-sk900": dict(d=256, kwargs={"causal": True}, heads=(8, 2), sk=900),
    "d192v128-causal": dict(d=192, dv=128, kwargs={"causal": True}),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES)
def test_deterministic_backward_is_bitwise_reproducible(fa, case):
    heads, varlen = case.get("heads", (4, 4)), case.get("varlen", False)
    q, k, v, dout, dlse = fa.problem(31, "bfloat16", 2, case.get("sq", SQ), case.get("sk", SK),
                                     *heads, case["d"], case.get("dv"))
    kwargs = dict(case["kwargs"], return_lse=True, implementation="cute", deterministic=True)
    if case.get("segments"):
        kwargs.update(q_segment_ids=_ids(2, SQ), kv_segment_ids=_ids(2, SK))
    if varlen:
        q, k, v, dout = (x.reshape(-1, *x.shape[2:]) for x in (q, k, v, dout))
        dlse = jnp.swapaxes(dlse, 0, 1).reshape(heads[0], -1)
        cu = jnp.array([0, 130, 700, 1000, 1333, 2000], jnp.int32)
        attn = functools.partial(jax_fa4.attention_varlen, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                 max_seqlen_q=SQ, max_seqlen_k=SK, **kwargs)
    else:
        attn = functools.partial(jax_fa4.attention, **kwargs)

    @jax.jit
    def forward_and_backward(q, k, v, dout, dlse):
        (out, lse), vjp = jax.vjp(attn, q, k, v)
        return (out, lse), vjp((dout, jnp.where(jnp.isfinite(lse), dlse, 0.0)))

    first = jax.device_get(forward_and_backward(q, k, v, dout, dlse))
    names = ("out", "lse", "dq", "dk", "dv")
    for run in range(RUNS):
        again = forward_and_backward(q, k, v, dout, dlse)
        for name, a, b in zip(names, jax.tree.leaves(again), jax.tree.leaves(first)):
            a = np.asarray(a)
            assert a.tobytes() == b.tobytes(), f"run {run}: {name} differs from the first run"
