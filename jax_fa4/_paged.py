"""`paged_attention`: attention over a paged KV cache, for inference.

A cache holds K and V in pages of `page_size` keys, (num_pages, page_size, Hkv, D / Dv);
sequence b's key j lives in page page_table[b, j // page_size] at slot j % page_size, for
j < kv_lengths[b]. On the kernel paths the paged variant of the segment kernel reads the
pages in place (kernels/sm90/paged.py), split-KV and pack-GQA included, for page sizes
that are multiples of PAGE_ROWS at the head dims with paged kernels (64, 128, 256). Other
calls gather the pages a batch's table names into a dense (B, max_pages * page_size,
Hkv, D) copy that `attention` runs with kv_lengths; on a GPU that says so once.

A call may also append its own tokens' keys and values (k_new, v_new): the paged kernels
write them into their pages before reading them (kernels/sm90/paged.py), so a decode
step needs no scatter of its own; the other paths scatter them first (`append`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_fa4 import (_api, _fallback, _ffi_calls, _float8, _forward_only, _kernel_select,
                     _kv_float8, _pack_gqa, _path, _segment_plan, _sharding, _validate)

# Keys per TMA copy of the paged kernels (kernels/sm90/paged.py PAGE_ROWS, ffi kPageRows):
# the page sizes they take are multiples of it.
PAGE_ROWS = 16
GATHER_WARNING = (
    "jax_fa4.paged_attention gathers the pages of this call into a dense copy of K and V "
    "before attention (the paged kernels run on Hopper GPUs, at page sizes that are "
    f"multiples of {PAGE_ROWS} and head dims 64, 128 and 256): it reads the cache about "
    "three times per step")


def paged_attention(q, k_cache, v_cache, page_table, kv_lengths, *, k_new=None, v_new=None,
                    causal=True, window=None, softcap=None, sinks=None, softmax_scale=None,
                    return_lse=False, implementation=None, k_descale=None, v_descale=None):
    """Attention of q over the keys and values of a paged cache.

    q (B, Sq, Hq, D); k_cache (num_pages, page_size, Hkv, D); v_cache (num_pages,
    page_size, Hkv, Dv); page_table (B, max_pages) int32; kv_lengths (B,) int32 ->
    out (B, Sq, Hq, Dv), plus lse (B, Hq, Sq) float32 when `return_lse`.

    Sequence b's keys are its first kv_lengths[b] cache positions: key j at page
    page_table[b, j // page_size], slot j % page_size. Sq >= 1 query rows (a decode step,
    speculative tokens, a prefill chunk) are aligned bottom-right with each sequence's
    length: with causal, query i sees keys j <= kv_lengths[b] - Sq + i. window, softcap,
    sinks and softmax_scale are those of `attention`.

    Runtime values are defined for every int32: lengths are clipped to [0, max_pages *
    page_size] (a sequence of length 0 gives out = 0, lse = -inf, or the sink with
    sinks), and a page id outside [0, num_pages) reads the nearest valid page
    (clipped), never outside the cache.
    k_new (B, Sq, Hkv, D), v_new (B, Sq, Hkv, Dv): the keys and values of q's own Sq
    tokens, appended first: written at keys L - Sq .. L - 1 of each sequence (L its
    clipped length, which counts them; keys below 0 are dropped), through the same
    clipped page ids, and the call returns the updated caches too: (out, k_cache,
    v_cache), or (out, lse, k_cache, v_cache) with `return_lse`. The kernels write them
    in place while attending (no scatter runs before): pass the caches as state that
    the caller gives up (a loop carry under jit, or donated), or XLA copies them first.
    A slot that two sequences' tables share gets one of their rows. Such a call visits
    its key blocks first to last (the new rows' last, so that their write is done before
    they load) where a call without them goes last to first: its out and lse equal
    those of scattering first and then attending up to float rounding, not bit for bit.
    Under jax.vmap, each element's rows are scattered into its own copy of the caches
    first and the kernel attends without them.

    Float8 caches: k_cache and v_cache (and k_new, v_new) in float8_e4m3fn with a
    bfloat16 q stand for k_cache * k_descale and v_cache * v_descale, each descale None
    or float32 of shape () or (Hkv,) (jax_fa4/_kv_float8.py): the paged kernels' float8
    variants read the pages in e4m3 and convert them in shared memory; other calls take
    the gather, dequantized. out is bfloat16; a K/V head with a negative k_descale or a
    descale that is not finite gives NaN out and lse.

    implementation: as in `attention` (None: the kernels where they run). Inference only:
    jax.grad or jax.jvp through it raises NotImplementedError.
    """
    _check(q, k_cache, v_cache, page_table, kv_lengths)
    _check_new(q, k_cache, v_cache, k_new, v_new)
    descales = dict(k_descale=k_descale, v_descale=v_descale)
    table = None
    if _kv_float8.applies(q, k_cache, v_cache):
        _kv_float8.check(q, k_cache, v_cache, descales, None)
        table = _kv_float8.table(descales, k_cache.shape[2])
    elif k_descale is not None or v_descale is not None:
        raise ValueError(f"k_descale, v_descale: for {_validate.FLOAT8} caches only; got "
                         f"{jnp.dtype(k_cache.dtype).name}")
    options = dict(causal=causal, window=window, softcap=softcap,
                   softmax_scale=softmax_scale)
    spec = _kernel_spec(q, k_cache, v_cache, page_table, kv_lengths, sinks,
                        implementation=implementation, **options)

    def gathered(implementation):
        # The descales reach it as `table`, an argument: closed over, they would leak
        # out of _forward_only.call as tracers under jax.grad. lse only where
        # it is used: asked for, cuDNN (on a GPU the kernels do not run on) refuses.
        attention = functools.partial(_api.attention, **options,
                                      implementation=implementation)
        return functools.partial(_gathered, attention, return_lse or table is not None)

    if spec is None:
        if _path.gpu_devices() and implementation != "reference":
            _fallback.warn_message_once(GATHER_WARNING)
        run = gathered(implementation)
    elif spec.path == "platform":  # the kernel where lowered for CUDA, else the reference
        def run(*args):
            return jax.lax.platform_dependent(
                *args, cuda=functools.partial(_in_place, spec), default=gathered("reference"))
    else:
        run = functools.partial(_in_place, spec)
    out, lse, *caches = _forward_only.call(INFERENCE_ONLY, run, q, k_cache, v_cache,
                                           page_table, kv_lengths, sinks, k_new, v_new, table)
    if table is not None:
        out, lse = _float8.undefined_heads(out, lse, table)
    if caches:
        return (out, lse, *caches) if return_lse else (out, *caches)
    return (out, lse) if return_lse else out


def _kernel_spec(q, k_cache, v_cache, page_table, kv_lengths, sinks, *, implementation,
                 **options):
    """The spec of the paged kernel that runs this call in place, None when it takes the
    gather (another path, a page size or head dims without a paged kernel, an empty
    problem). implementation="cute" raises NotImplementedError with the reason instead."""
    page_size = k_cache.shape[1]
    batch, max_pages = page_table.shape
    float8 = _kv_float8.applies(q, k_cache, v_cache)
    dense = [jax.ShapeDtypeStruct((batch, max_pages * page_size, *c.shape[2:]),
                                  jnp.bfloat16 if float8 else c.dtype)
             for c in (k_cache, v_cache)]
    # A probe: where it finds no kernel, the gather path warns, and so does the
    # attention call it then makes (this one's return_lse is not the caller's).
    spec = _api._plan(q, *dense, return_lse=True, implementation=implementation,
                      warn=False, kv_lengths=kv_lengths, sinks=sinks, **options)
    if float8 and spec.path in ("cute", "platform"):
        # None: no float8-KV kernel for it; the gather path then dequantizes.
        spec = _kv_float8.kernel_spec(spec, _path.sizes(q, dense[0], varlen=False))
        if spec is None:
            return None
    paged = dataclasses.replace(spec, paged=True)
    reason = ""
    if spec.path not in ("cute", "platform"):
        return None
    if page_size % PAGE_ROWS:
        reason = f"the paged kernels take page sizes that are multiples of {PAGE_ROWS}"
    elif _kernel_select.kernel_head_dims(paged) != (spec.head_dim, spec.head_dim_v):
        # (None when no paged kernel holds them; never zero-padded: the caches are not.)
        reason = (f"no paged kernel for {_kernel_select.kernel_dtype(spec)} head dims "
                  f"{spec.head_dim} / {spec.head_dim_v} (built: 64, 128, 256)")
    elif 0 in q.shape[:3]:
        return None  # nothing to launch: the gather path's empty result
    if reason and implementation == "cute":
        raise NotImplementedError(reason)
    return None if reason else paged


# The operands of `_in_place` after the spec; sinks, k_new, v_new and table may be None.
_OPERANDS = ("q", "k_cache", "v_cache", "page_table", "kv_lengths", "sinks", "k_new",
             "v_new", "table")
# Operands a vmapped call may fold into the batch; the others stay shared by its elements.
_PER_SEQUENCE = ("q", "page_table", "kv_lengths")
_NEW = ("k_new", "v_new")


def _in_place(spec, *operands):
    """`_kernel` (operands as _OPERANDS), batched by vmap (`_batched`)."""
    present = tuple(x is not None for x in operands)
    return _batched(spec, present)(*(x for x in operands if x is not None))


@functools.cache
def _batched(spec, present: tuple):
    """`_kernel` on the `present` operands, with a vmap rule. The kernel call takes one
    batch of q, page tables and lengths on 4-D caches, so a vmapped call folds its axis
    into that batch where the caches, sinks and descales are shared and nothing is
    appended (the serving case: one cache, many sequences), up to what one kernel call
    takes (_kernel_select.batch_limit); otherwise (caches per element, or appended rows,
    whose updated caches are per element) it runs one call per element in a `lax.map`.
    There appended rows are scattered into the element's caches (`append`) before a
    call without them: in place, the call's cache results must alias its cache
    operands, which XLA did not keep for a cache the loop closes over (H100,
    2026-12-05: the handler refused the call). Without the rule, the FFI call would
    get 5-D caches."""
    def named(values):
        it = iter(values)
        return {name: next(it) if p else None for name, p in zip(_OPERANDS, present)}

    @jax.custom_batching.custom_vmap
    def call(*operands):
        return _kernel(spec, **named(operands))

    @call.def_vmap
    def rule(axis_size, in_batched, *operands):
        values, batched = named(operands), named(in_batched)
        q = values["q"]
        batch, seqlen_q, heads = q.shape[1:4] if batched["q"] else q.shape[:3]
        # the limit of one call as vmap over attention folds it (_sharding)
        folds = (axis_size > 0 and values["k_new"] is None
                 and not any(batched[n] for n in _OPERANDS if n not in _PER_SEQUENCE)
                 and _sharding.fold_group(spec, axis_size, batch, seqlen_q, heads) is None)
        if folds:
            def fold(name):
                x = values[name]
                if not batched[name]:
                    x = jnp.broadcast_to(x, (axis_size, *x.shape))
                return x.reshape(axis_size * batch, *x.shape[2:])

            results = call(*(fold(n) if n in _PER_SEQUENCE else values[n]
                             for n in _OPERANDS if values[n] is not None))
            results = tuple(r.reshape(axis_size, batch, *r.shape[1:]) for r in results)
        else:
            mapped = [n for n in _OPERANDS if batched[n]]
            appends = values["k_new"] is not None
            attend = _batched(spec, tuple(values[n] is not None and n not in _NEW
                                          for n in _OPERANDS)) if appends else call

            def one(xs):
                element = {**values, **dict(zip(mapped, xs))}
                if appends:
                    element = _scattered(element)
                results = attend(*(element[n] for n in _OPERANDS if element[n] is not None))
                return (*results, element["k_cache"], element["v_cache"]) if appends else results

            results = tuple(jax.lax.map(one, [values[n] for n in mapped]))
        return results, tuple(True for _ in results)

    return call


def _scattered(values):
    """`_OPERANDS` values with k_new and v_new written into their caches (`append`) and
    dropped."""
    caches = {c: append(values[c], values[n], values["page_table"], values["kv_lengths"])
              for c, n in (("k_cache", "k_new"), ("v_cache", "v_new"))}
    return {**values, **caches, "k_new": None, "v_new": None}


def _kernel(spec, q, k_cache, v_cache, page_table, kv_lengths, sinks, k_new, v_new, table):
    """The paged kernel: out and lse as `attention` gives them on the gathered keys
    (and the caches, appending); table: float8 caches' descales (_kv_float8.table)."""
    batch, seqlen_q = q.shape[:2]
    seqlen_k = page_table.shape[1] * k_cache.shape[1]
    segments = _segment_plan.padded_rows(
        spec, seqlen_q, seqlen_k, batch=batch,
        kv_lengths=jnp.clip(kv_lengths, 0, seqlen_k))
    forward = _pack_gqa.fwd if spec.pack_gqa else _ffi_calls.fwd
    appended = None if k_new is None else (k_new, v_new)
    out, lse, *caches = forward(q, k_cache, v_cache, *segments, spec=spec, pages=page_table,
                                appended=appended, descale=table)
    if sinks is not None:
        out, lse = _api._add_sinks(out, lse, sinks)
    return (out, lse, *caches)


def _gathered(attention, with_lse, q, k_cache, v_cache, page_table, kv_lengths, sinks,
              k_new, v_new, table):
    descales = {} if table is None else dict(k_descale=table[1], v_descale=table[2])
    caches = ()
    if k_new is not None:
        k_cache = append(k_cache, k_new, page_table, kv_lengths)
        v_cache = append(v_cache, v_new, page_table, kv_lengths)
        caches = (k_cache, v_cache)
    result = attention(q, gather(k_cache, page_table), gather(v_cache, page_table),
                       kv_lengths=kv_lengths, sinks=sinks, return_lse=with_lse, **descales)
    if not with_lse:  # the caller drops it: a stand-in
        batch, seqlen_q, heads = q.shape[:3]
        result = result, jnp.zeros((batch, heads, seqlen_q), jnp.float32)
    out, lse = result
    return (out, lse, *caches)


def append(cache, new, page_table, kv_lengths):
    """cache (num_pages, page_size, Hkv, X) with new (B, S, Hkv, X) written at keys L - S
    .. L - 1 of each batch, L its length clipped to [0, max_pages * page_size]; keys
    below 0 are dropped, page ids clipped to the cache."""
    num_pages, page_size = cache.shape[:2]
    s = new.shape[1]
    capacity = page_table.shape[1] * page_size
    key = jnp.clip(kv_lengths, 0, capacity)[:, None] - s + jnp.arange(s, dtype=jnp.int32)
    entry = jnp.maximum(key, 0) // page_size
    page = jnp.clip(jnp.take_along_axis(page_table, entry, axis=1), 0, num_pages - 1)
    page = jnp.where(key >= 0, page, num_pages)  # past the cache: dropped
    return cache.at[page, key % page_size].set(new, mode="drop")


def gather(cache, page_table):
    """(num_pages, page_size, Hkv, X), (B, max_pages) -> (B, max_pages * page_size, Hkv,
    X): each batch's pages in table order, ids clipped to the cache."""
    pages = jnp.clip(page_table, 0, cache.shape[0] - 1)
    dense = jnp.take(cache, pages, axis=0)
    # Sizes written out: with B or Hkv of 0, reshape cannot infer a -1.
    batch, max_pages = page_table.shape
    return dense.reshape(batch, max_pages * cache.shape[1], *cache.shape[2:])


INFERENCE_ONLY = (
    "jax_fa4.paged_attention has no gradient or other derivative (it serves inference); "
    "differentiate jax_fa4.attention on the dense keys and values instead")


def _check(q, k_cache, v_cache, page_table, kv_lengths) -> None:
    """The paged operands' shapes; `attention` checks the rest on the gathered keys."""
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not _validate.is_array(x) or len(x.shape) != 4:
            raise ValueError(f"{name} must be an array of rank 4; got {_validate.describe(x)}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            "k_cache and v_cache must have the same (num_pages, page_size, Hkv); got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    # Checked here in the caches' terms: `attention` would name the gathered shapes.
    heads_q, heads_kv = q.shape[2], k_cache.shape[2]
    if heads_q % heads_kv if heads_kv else heads_q:
        raise ValueError(f"q's heads Hq = {heads_q} must be a multiple of the caches' heads "
                         f"Hkv = {heads_kv} (GQA/MQA); got q {tuple(q.shape)}, k_cache "
                         f"{tuple(k_cache.shape)}")
    if q.shape[3] != k_cache.shape[3]:
        raise ValueError(f"q and k_cache must have the same head_dim D; got q "
                         f"{tuple(q.shape)}, k_cache {tuple(k_cache.shape)}")
    num_pages, page_size = k_cache.shape[:2]
    if num_pages < 1 or page_size < 1:
        raise ValueError(f"the cache needs at least one page of at least one key; got "
                         f"k_cache {tuple(k_cache.shape)}")
    batch = q.shape[0]
    if not (_validate.is_array(page_table) and len(page_table.shape) == 2
            and page_table.shape[0] == batch and page_table.shape[1] >= 1):
        raise ValueError(f"page_table must be an int32 array of shape (B, max_pages) with "
                         f"B = {batch} and max_pages >= 1; got "
                         f"{_validate.describe(page_table)}")
    _validate.check_int_array("page_table", page_table, tuple(page_table.shape),
                              "(B, max_pages)")
    if kv_lengths is None:
        raise ValueError("kv_lengths must be an int32 array of shape (B,); got None")
    _validate.check_int_array("kv_lengths", kv_lengths, (batch,), "(B,)")


def _check_new(q, k_cache, v_cache, k_new, v_new) -> None:
    """k_new and v_new: both or neither, shaped as q's tokens' keys and values for these
    caches, in the caches' dtype."""
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new go together: pass both or neither")
    if k_new is None:
        return
    batch, sq = q.shape[:2]
    heads_kv = k_cache.shape[2]
    for name, x, cache, dim in (("k_new", k_new, k_cache, "D"), ("v_new", v_new, v_cache, "Dv")):
        want = (batch, sq, heads_kv, cache.shape[3])
        if not _validate.is_array(x) or tuple(x.shape) != want or x.dtype != cache.dtype:
            raise ValueError(
                f"{name} must be a {jnp.dtype(cache.dtype).name} array of shape (B, Sq, "
                f"Hkv, {dim}) = {want} (q's tokens, this cache's heads); got "
                f"{_validate.describe(x)}")
