"""Registry of attention backends the benchmark times side by side.

Each entry maps a name (as in ../shared/anchors) to a factory: (causal, window_left=None,
softcap=None, documents=None) -> f(q, k, v) returning the attention output for
(B, S, H, D) inputs; window_left makes causal attention a sliding window over the last
window_left + 1 keys, softcap caps the scores, documents packs each row with that many
equal documents (a backend without a feature raises NotImplementedError): jax_fa4 gives
them as segment ids, jax_fa4_varlen as attention_varlen's cu_seqlens over the flattened
batch, and jax.nn, which has neither, runs them as a batch of B * documents rows (the
dense problem without masking, possible only because the documents are equal). Backends in
DETERMINISTIC also take deterministic=True: a backward that is bitwise reproducible (the
bwd_det pass). Backends in PAGED take page_size and read K and V as a paged cache (its
pages in a fixed random order), forward only: jax_fa4_paged, `paged_attention`.
jax_fa4_lengths is jax_fa4 with kv_lengths of the whole rows (forward only), the dense
cache to hold the paged one against: same kernel family, K and V contiguous. Backends in
FP8 take q, k, v in float8_e4m3fn (bench/run.py casts them before timing; descales 1),
forward only: jax_fa4_fp8, the e4m3 kernels (its V transpose is part of the call).
Backends in KV_FP8 take k and v in float8_e4m3fn with q in bfloat16 (a float8 KV cache;
descales 1), forward only: jax_fa4_kv8, `attention`, and jax_fa4_paged_kv8, the paged
cache.
"""

import jax
import jax.numpy as jnp
import numpy as np

import jax_fa4


def _jax_fa4(causal, window_left=None, softcap=None, documents=None, deterministic=False):
    window = None if window_left is None else (window_left, None)

    def attend(q, k, v):
        ids = {}
        if documents:
            b, s = q.shape[:2]
            row = jnp.arange(s, dtype=jnp.int32) * documents // s
            ids = dict(q_segment_ids=jnp.broadcast_to(row, (b, s)),
                       kv_segment_ids=jnp.broadcast_to(row, (b, s)))
        return jax_fa4.attention(q, k, v, causal=causal, window=window, softcap=softcap,
                                 implementation="cute", deterministic=deterministic, **ids)

    return attend


def _jax_fa4_varlen(causal, window_left=None, softcap=None, documents=None,
                    deterministic=False):
    if not documents:
        raise NotImplementedError("jax_fa4_varlen runs packed documents only")
    window = None if window_left is None else (window_left, None)

    def attend(q, k, v):
        b, s = q.shape[:2]
        cu = jnp.arange(b * documents + 1, dtype=jnp.int32) * (s // documents)
        out = jax_fa4.attention_varlen(
            *(x.reshape(b * s, *x.shape[2:]) for x in (q, k, v)), cu_seqlens_q=cu,
            cu_seqlens_k=cu, max_seqlen_q=s // documents, max_seqlen_k=s // documents,
            causal=causal, window=window, softcap=softcap, implementation="cute",
            deterministic=deterministic)
        return out.reshape(q.shape[:3] + v.shape[3:])

    return attend


def _jax_fa4_paged(causal, window_left=None, softcap=None, documents=None, page_size=None):
    if not page_size or documents:
        raise NotImplementedError("jax_fa4_paged needs a page size and runs no documents")
    window = None if window_left is None else (window_left, None)

    def attend(q, k, v):
        b, s = k.shape[:2]
        if s % page_size:
            raise NotImplementedError(f"the key length {s} is not a multiple of the page size")
        # k and v as caches of b * s / page_size pages (a free reshape), read through a
        # table that visits them in a random order: the lengths are the whole rows. The
        # table is a numpy constant, so no shuffle runs inside the timed call.
        pages = b * s // page_size
        table = np.random.default_rng(0).permutation(pages).reshape(b, -1).astype(np.int32)
        k_cache, v_cache = (x.reshape(pages, page_size, *x.shape[2:]) for x in (k, v))
        return jax_fa4.paged_attention(q, k_cache, v_cache, jnp.asarray(table),
                                       jnp.full((b,), s, jnp.int32), causal=causal,
                                       window=window, softcap=softcap, implementation="cute")

    return attend


def _jax_fa4_lengths(causal, window_left=None, softcap=None, documents=None):
    """attention with kv_lengths of the whole rows: the dense cache that a paged one is
    measured against (the same per-row key ranges and plan, K/V contiguous)."""
    if documents:
        raise NotImplementedError("jax_fa4_lengths runs no documents")
    window = None if window_left is None else (window_left, None)

    def attend(q, k, v):
        b, s = k.shape[:2]
        return jax_fa4.attention(q, k, v, causal=causal, window=window, softcap=softcap,
                                 kv_lengths=jnp.full((b,), s, jnp.int32),
                                 implementation="cute")

    return attend


def _jax_fa4_fp8(causal, window_left=None, softcap=None, documents=None):
    """attention on float8 inputs (jax_fa4_fp8: q, k, v; jax_fa4_kv8: k and v)."""
    if softcap is not None or documents:
        raise NotImplementedError("the float8 backends have no softcap or documents")
    window = None if window_left is None else (window_left, None)

    def attend(q, k, v):
        return jax_fa4.attention(q, k, v, causal=causal, window=window, implementation="cute")

    return attend


def _as_documents(documents, x):
    """(B, S, ...) -> (B * documents, S / documents, ...)."""
    b, s = x.shape[:2]
    return x.reshape(b * documents, s // documents, *x.shape[2:])


def _jax_nn(implementation):
    def factory(causal, window_left=None, softcap=None, documents=None):
        if softcap is not None:
            raise NotImplementedError("jax.nn.dot_product_attention has no softcap")
        window = None if window_left is None else (window_left, 0)
        split = documents or 1

        def attend(q, k, v):
            dv = v.shape[-1]
            if dv < q.shape[-1]:  # jax.nn needs Dv == D: zero-pad v (exact), cut out back
                v = jnp.pad(v, [(0, 0)] * 3 + [(0, q.shape[-1] - dv)])
            out = jax.nn.dot_product_attention(
                *(_as_documents(split, x) for x in (q, k, v)), is_causal=causal,
                local_window_size=window, implementation=implementation)
            return out.reshape(q.shape[:3] + v.shape[3:])[..., :dv]

        return attend

    return factory


BACKENDS = {
    "jax_fa4": _jax_fa4,
    "jax_fa4_varlen": _jax_fa4_varlen,
    "jax_fa4_paged": _jax_fa4_paged,
    "jax_fa4_lengths": _jax_fa4_lengths,
    "jax_fa4_fp8": _jax_fa4_fp8,
    "jax_fa4_kv8": _jax_fa4_fp8,
    "jax_fa4_paged_kv8": _jax_fa4_paged,
    "jax_cudnn": _jax_nn("cudnn"),
    "jax_xla": _jax_nn("xla"),
}
DETERMINISTIC = ("jax_fa4", "jax_fa4_varlen")
PAGED = ("jax_fa4_paged", "jax_fa4_paged_kv8")
FP8 = ("jax_fa4_fp8",)
KV_FP8 = ("jax_fa4_kv8", "jax_fa4_paged_kv8")
