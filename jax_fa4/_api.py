"""Public entry points: `attention`, `attention_varlen`, `supports`, `kernels`. Each
validates its call into a spec (`_spec`), fixes its path and kernel layout (`_path`)
and runs it."""

from __future__ import annotations

import inspect

import jax.numpy as jnp

from jax_fa4 import (_fallback, _float8, _forward_only, _kernel_select, _kv_float8, _masks,
                     _path, _registry, _segment_plan, _sharding, _vjp)
from jax_fa4._reference import reference_attention, reference_attention_varlen
from jax_fa4._spec import AttentionSpec

IMPLEMENTATIONS = (None, "cute", "reference")


def attention(q, k, v, *, causal=False, softmax_scale=None, return_lse=False,
              implementation=None, alignment="bottom_right", window=None, softcap=None,
              sinks=None, q_segment_ids=None, kv_segment_ids=None, q_lengths=None,
              kv_lengths=None, deterministic=False, q_descale=None, k_descale=None,
              v_descale=None, out_dtype=None):
    """Softmax attention, FlashAttention-style.

    q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv) -> out (B, Sq, Hq, Dv), plus
    lse (B, Hq, Sq) float32 (natural log) when `return_lse`.

    Scores: s_ij = softmax_scale * q_i . k_j, then softcap; over the keys j that row i
    sees, p_ij = exp(s_ij - lse_i), out_i = sum_j p_ij v_j, lse_i = log(sum_j exp(s_ij))
    (+ exp(sink) inside the log with sinks). A query row that sees no key gives out = 0
    and lse = -inf (lse = sink with sinks), without NaN in values or gradients.

    GQA / MQA: Hkv must divide Hq; query head h reads KV head h // (Hq // Hkv). With few
        query rows (decode steps) the kernels run a group's query heads as rows of one
        problem, reading K/V once per group (pack-GQA, `_pack_gqa`).
    Split-KV: when the query tiles x heads x batch leave SMs idle (decode steps with few
        sequences), the forward kernel splits each tile's keys across CTAs and combines
        their partial results in fp32 (`_split_kv`; fixed per shape, the backward is
        unchanged).
    Dv: v may have its own head_dim; out has Dv. D 192 / Dv 128 has kernels of its own;
        other head dims the kernels were not built for run on inputs zero-padded to the
        built (D, Dv) that holds them with the least D + Dv (`kernels()`), up to 256.
    softmax_scale: static Python number, default 1 / sqrt(D).
    alignment: where query row i sits on the key axis, a(i), for causal and window:
        "bottom_right" (default, FlashAttention): a(i) = i + Lk - Lq, so the last valid
        query meets the last valid key; "top_left" (jax.nn's is_causal, jnp.tril):
        a(i) = i. Lq, Lk are the valid lengths: q_lengths[b] / kv_lengths[b] when given
        (each clipped to [0, S]), else Sq / Sk.
    causal: query i sees key j iff j <= a(i).
    window: (left, right), static non-negative ints or None (unbounded): query i sees key
        j iff a(i) - left <= j <= a(i) + right. causal=True is right = 0: it combines
        with (left, None) or (left, 0), and window (None, 0) is causal.
    softcap: static number > 0: scores become softcap * tanh(s / softcap), applied to the
        scaled scores s (FlashAttention; Gemma 2's attn_logit_softcapping), before masking.
    sinks: (Hq,) float array (computed in float32; differentiable): one learnable logit per
        head, in the units of the scaled (and softcapped) scores, added to every row's
        softmax denominator with no value: p_ij = exp(s_ij) / (sum_j exp(s_ij) + exp(sink_h)).
    q_segment_ids (B, Sq), kv_segment_ids (B, Sk): int32, given together: query i sees key
        j only when their ids are equal (documents packed in one row). Positions for
        causal / window stay the indices in the padded row (no reset per segment: for
        per-document alignment use `attention_varlen`). The kernels skip the key blocks
        whose ids cannot match a query tile's (by each block's range of ids: sorted,
        packed ids skip well; any ids are correct).
    q_lengths, kv_lengths: (B,) int32: query rows i >= q_lengths[b] are padding (out = 0,
        lse = -inf, even with sinks) and keys j >= kv_lengths[b] are invisible (their
        blocks are skipped). They also set Lq, Lk of bottom-right alignment (a decode
        step with a padded KV cache: Sq = 1, kv_lengths = the cache lengths). Any int32
        value is defined: lengths are clipped to [0, Sq] / [0, Sk] first, on every path.
    float8: q, k, v of float8_e4m3fn stand for q * q_descale, k * k_descale, v *
        v_descale; each descale is None (1) or a float32 array, one per tensor (shape ())
        or per K/V head (Hkv,; a query head takes its K/V head's q descale). out has
        out_dtype: static, bfloat16 (default), float16 or float32. Forward only: a
        gradient through q, k, v or a descale raises NotImplementedError. On Hopper the
        e4m3 kernels run calls without a mask or with a causal / window band, with GQA
        and sinks, at head dims up to 256 (64, 128, 256 built; others zero-padded to
        them): q and k in e4m3 on the tensor cores, P rounded to e4m3 for P V, out
        written in bfloat16 (then cast to out_dtype). Softcap, segment ids and lengths
        run the reference on the dequantized inputs in float32 (with a warning on a GPU),
        as does every call without a GPU. A K/V head whose q and k descales multiply to
        a negative number, or with a descale that is not finite, gives NaN out and lse.
        Under a sharded jit it partitions over batch and heads; a sharded sequence is
        refused (no float8 ring yet).
        Descales and out_dtype are refused with other dtypes, other float8 formats
        everywhere, and float8 by attention_varlen.
    float8 K/V (a float8 KV cache): bfloat16 q with k, v of float8_e4m3fn stand for
        attention over q, k * k_descale, v * v_descale (descales as above; no q_descale
        or out_dtype: out is bfloat16). Forward only. On Hopper the float8-KV kernels
        run it at head dims up to 256 without softcap (K/V read in e4m3 and converted
        in shared memory: half the bytes of a bfloat16 cache), any Sq, with masks, GQA,
        lengths, segment ids and sinks; other calls dequantize K and V into bfloat16
        first (with a warning on a GPU). paged_attention takes float8 caches the same way.
    deterministic: static bool, for the backward kernel: False (default) accumulates dq
        with atomic adds, fast, but the summation order and so the last bits of dq can
        change from run to run; True accumulates in a fixed order, bitwise reproducible
        and somewhat slower. The forward and the reference are deterministic either way.
    Segment ids, lengths, sinks and descales are runtime arrays (traced); all other
    arguments are static. Segment ids may hold any int32 values (only equality matters).

    implementation: None picks the kernel where it runs (Hopper GPU, supported
        configuration; decided per platform at lowering, so the same jitted function
        also runs on CPU) and the pure-JAX reference elsewhere. On a CUDA GPU where the
        kernel cannot run (another GPU, a configuration without a kernel) it runs cuDNN
        through jax.nn.dot_product_attention when that computes the same call, else the
        reference, and warns once with the reason (`supports` says which beforehand). A
        native module that fails to import beside a Hopper GPU raises RuntimeError with
        the cause, unless JAX_FA4_ALLOW_NO_NATIVE=1 (then it warns and falls back). "cute"
        forces the kernel and raises NotImplementedError with the reason when it cannot
        run here, its gradient too where no backward kernel was built (every feature
        above runs in the kernels; sinks are applied to the kernels' out and lse);
        "reference" forces the reference.

    Differentiable in reverse mode, and the cotangent of a returned lse flows into dq, dk,
    dv (and dsinks). Where the forward runs the kernel, so does the backward kernel
    (`deterministic` picks its dq accumulation); the reference path differentiates the
    reference. Forward mode (jvp) works on the reference path only (the kernel paths are
    a custom_vjp); calls the kernels take run the kernel path on a machine without a GPU
    too (the reference inside it, so that they also lower for CUDA), so forward mode
    there needs implementation="reference".
    """
    arrays = dict(sinks=sinks, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                  q_lengths=q_lengths, kv_lengths=kv_lengths)
    descales = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    if _kv_float8.applies(q, k, v):
        out, lse = _kv_float8_attention(
            q, k, v, descales, out_dtype, arrays, causal=causal,
            softmax_scale=softmax_scale, return_lse=return_lse,
            implementation=implementation, alignment=alignment, window=window,
            softcap=softcap, deterministic=deterministic)
        return (out, lse) if return_lse else out
    spec = _plan(q, k, v, causal=causal, softmax_scale=softmax_scale,
                 return_lse=return_lse, implementation=implementation, alignment=alignment,
                 window=window, softcap=softcap, deterministic=deterministic,
                 descales=descales, out_dtype=out_dtype, **arrays)
    arrays.update(q_lengths=_masks.clip_lengths(q_lengths, q.shape[1]),
                  kv_lengths=_masks.clip_lengths(kv_lengths, k.shape[1]))
    table = None
    if spec.out_dtype is not None:  # float8: the e4m3 kernel, or the reference dequantized
        table = _float8.descale_table(descales, k.shape[-2])
        if spec.path == "reference":
            q, k, v = _float8.dequantize(q, k, v, table)
    out, lse = _run(spec, q, k, v, **arrays, descales=table)
    if spec.out_dtype is not None:
        out, lse = _float8.undefined_heads(out, lse, table)
        out = out.astype(spec.out_dtype)
    return (out, lse) if spec.return_lse else out


def _kv_float8_attention(q, k, v, descales, out_dtype, arrays, **options):
    """(out, lse) of a call with bfloat16 q and float8 K/V (`_kv_float8`)."""
    _kv_float8.check(q, k, v, descales, out_dtype)
    spec = _plan(q, _kv_float8.as_bfloat16(k), _kv_float8.as_bfloat16(v), **options,
                 **arrays)
    sizes = _path.sizes(q, k, varlen=False)
    kernel_spec = _kv_float8.kernel_spec(spec, sizes)
    arrays.update(q_lengths=_masks.clip_lengths(arrays["q_lengths"], q.shape[1]),
                  kv_lengths=_masks.clip_lengths(arrays["kv_lengths"], k.shape[1]))
    table = _kv_float8.table(descales, k.shape[-2])
    q, k, v = _forward_only.values((q, k, v), _kv_float8.FORWARD_ONLY)
    if kernel_spec is not None:
        out, lse = _run(kernel_spec, q, k, v, **arrays, descales=table)
    else:
        if spec.path != "reference":
            _kv_float8.warn_dequantized(spec, sizes)
        out, lse = _run(spec, q, *_kv_float8.dequantized(k, v, table), **arrays)
    return _float8.undefined_heads(out, lse, table)


def attention_varlen(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     causal=False, softmax_scale=None, return_lse=False,
                     implementation=None, alignment="bottom_right", window=None,
                     softcap=None, sinks=None, deterministic=False):
    """Attention over sequences of different lengths packed along one axis
    (FlashAttention's flash_attn_varlen_func).

    q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv) -> out (total_q, Hq, Dv),
    plus lse (Hq, total_q) float32 when `return_lse`.

    cu_seqlens_q, cu_seqlens_k: (num_seqs + 1,) int32 runtime arrays, cumulative
        offsets: sequence s is q rows cu_seqlens_q[s] .. cu_seqlens_q[s+1] - 1 and k/v
        rows cu_seqlens_k[s] .. cu_seqlens_k[s+1] - 1. Empty sequences are valid; q rows
        outside every sequence give out = 0 and lse = -inf. Any int32 values are
        defined, on every path: each offset is first clipped to [0, total] (total_q or
        total_k), then raised to the largest offset before it (a running maximum), so
        an offset past the packed length ends its sequence at the end and a decreasing
        one makes an empty sequence.
    max_seqlen_q, max_seqlen_k: static ints, taken for FlashAttention's signature and
        not read: the kernels size their grid from total_q and total_k and skip the
        blocks no sequence joins, and the reference needs no bound; any value gives the
        same result.
    Every sequence is an independent `attention` call: positions, alignment (bottom-right
    meets the sequence's last query and key) and window are per sequence. The kernels run
    the packed axis as one row with segment ids, so a query tile visits only its
    sequences' key blocks. The other arguments are those of `attention`.
    """
    _check_implementation(implementation)
    spec = AttentionSpec.from_varlen_inputs(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal,
        softmax_scale=softmax_scale, return_lse=return_lse, alignment=alignment,
        window=window, softcap=softcap, sinks=sinks, deterministic=deterministic)
    spec = _path.plan(spec, implementation, _path.sizes(q, k, varlen=True))
    cu_seqlens_q = _masks.clip_offsets(cu_seqlens_q, q.shape[0])
    cu_seqlens_k = _masks.clip_offsets(cu_seqlens_k, k.shape[0])
    # The packed axis is the sequence: a unit batch axis gives it the batch-first layout
    # of the guard and the kernels.
    q, k, v = q[None], k[None], v[None]
    if spec.path == "reference":
        q, k, v = _sharding.guard(spec, q, k, v)
        out, lse = reference_attention_varlen(
            q[0], k[0], v[0], cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            sinks=sinks, **spec.reference_options())
    else:
        total_q, total_k = q.shape[1], k.shape[1]
        out, lse = _kernel_path(
            spec, q, k, v,
            lambda: _segment_plan.varlen_rows(spec, cu_seqlens_q, cu_seqlens_k, total_q,
                                              total_k),
            sinks, lambda: ~_masks.sequence_index(cu_seqlens_q, total_q)[1][None])
        out, lse = out[0], lse[0]
    return (out, lse) if spec.return_lse else out


class Support(tuple):
    """(ok, reason), a pair as before, and `.path`: what implementation=None runs here,
    "kernel", "cudnn" (jax.nn's cuDNN path) or "reference"."""

    def __new__(cls, ok: bool, reason: str, path: str):
        support = super().__new__(cls, (ok, reason))
        support.path = path
        return support


def supports(q, k, v, **kwargs) -> Support:
    """Whether `attention(q, k, v, **kwargs, implementation="cute")` would run here
    (`attention_varlen`'s, when kwargs hold cu_seqlens_q or cu_seqlens_k), and what
    `implementation=None` would run.

    Takes arrays or jax.ShapeDtypeStruct (feature arrays too) and the keyword arguments
    of `attention` / `attention_varlen`. Returns (True, "") or (False, reason): the reason
    names what is missing (a dtype or head_dim without a kernel, the native module, a
    Hopper GPU, a grid dimension), and then the path implementation=None takes instead;
    `.path` is "kernel", "cudnn" or "reference". Where "cute" would run but
    implementation=None does not (GPUs other than Hopper beside one), the reason says
    why. Malformed input raises ValueError; a GPU machine whose native module failed to
    import raises implementation=None's RuntimeError. With implementation="reference",
    `.path` is "reference" (ok and reason still answer for "cute").
    """
    implementation = kwargs.pop("implementation", None)
    _check_implementation(implementation)
    varlen = "cu_seqlens_q" in kwargs or "cu_seqlens_k" in kwargs
    entry = attention_varlen if varlen else attention
    # Unknown or missing arguments named in the entry point's terms (the spec's
    # constructor would name itself).
    try:
        inspect.signature(entry).bind(q, k, v, **kwargs)
    except TypeError as e:
        raise TypeError(f"supports(): {e}; it takes the arguments of "
                        f"jax_fa4.{entry.__name__}") from None
    kwargs = {"causal": False, "softmax_scale": None, "return_lse": False, **kwargs}
    if varlen:
        spec = AttentionSpec.from_varlen_inputs(q, k, v, **kwargs)
    else:
        descales = {name: kwargs.pop(name, None)
                    for name in ("q_descale", "k_descale", "v_descale")}
        if _kv_float8.applies(q, k, v):
            # The float8-KV kernel where one takes the call, else the bfloat16 call that
            # dequantized K/V make.
            _kv_float8.check(q, k, v, descales, kwargs.pop("out_dtype", None))
            spec = AttentionSpec.from_inputs(q, _kv_float8.as_bfloat16(k),
                                             _kv_float8.as_bfloat16(v), **kwargs)
            spec = _kv_float8.kernel_spec(spec.with_path("cute"),
                                          _path.sizes(q, k, varlen=False)) or spec
        else:
            spec = AttentionSpec.from_inputs(q, k, v, descales=descales, **kwargs)
    sizes = _path.sizes(q, k, varlen=varlen)
    ok, reason = _path.kernel_runs_here(spec, sizes)
    if implementation == "reference":
        return Support(ok, reason, "reference")
    path, none_reason, why = _path.decide(spec, sizes)
    if path == "platform":  # the kernel on CUDA: here, if a Hopper GPU is visible
        path = "kernel" if ok else "reference"
    if path == "kernel":
        return Support(True, "", path)
    runs = f"implementation=None runs {_fallback.RUNS[path]}" + (f" ({why})" if why else "")
    # ok here: "cute" would run the kernel, but not every GPU is a Hopper
    return Support(ok, f"{runs}: {none_reason}" if ok else f"{reason}; {runs}", path)


def kernels() -> list[dict]:
    """The compiled kernels (name, kind, arch, dtype, kv_dtype (of k and v), head_dim,
    head_dim_v, banded, softcap, segments, split, paged, keys_as_m (the split forwards'
    decode tile), long_rows (the dense forwards' tile for rows that see many keys),
    tile_m, tile_n, ctas_per_sm, and dq_parts for backward kernels); [] when the native
    module is not built."""
    return _registry.manifest()


def _plan(q, k, v, *, causal, softmax_scale, return_lse, implementation, warn=True,
          **features) -> AttentionSpec:
    """Validates everything and fixes the path, before anything is traced (warn:
    `_path.choose`'s)."""
    _check_implementation(implementation)
    spec = AttentionSpec.from_inputs(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                     return_lse=return_lse, **features)
    return _path.plan(spec, implementation, _path.sizes(q, k, varlen=False), warn)


def _run(spec: AttentionSpec, q, k, v, *, sinks, q_segment_ids, kv_segment_ids, q_lengths,
         kv_lengths, descales=None):
    """descales: float8 calls on the kernel paths, _float8.descale_table's."""
    if spec.path == "cudnn":  # no lse: _fallback.cudnn_support refuses return_lse
        return _fallback.attention(spec, q, k, v, q_lengths=q_lengths,
                                   kv_lengths=kv_lengths), None
    if spec.path == "reference":
        # Handles empty problems itself: rows that see no key.
        q, k, v = _sharding.guard(spec, q, k, v)
        return reference_attention(q, k, v, **spec.reference_options(), sinks=sinks,
                                   q_segment_ids=q_segment_ids,
                                   kv_segment_ids=kv_segment_ids, q_lengths=q_lengths,
                                   kv_lengths=kv_lengths)
    batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
    return _kernel_path(
        spec, q, k, v,
        lambda: _segment_plan.padded_rows(
            spec, seqlen_q, seqlen_k, batch=batch, q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids, q_lengths=q_lengths, kv_lengths=kv_lengths),
        sinks, lambda: jnp.arange(seqlen_q) >= q_lengths[:, None], descales)


def _kernel_path(spec: AttentionSpec, q, k, v, segments, sinks, padding, descales=None):
    """The kernel (or per-platform) paths on batch-first q (B, Sq, H, D), k, v.
    segments() gives the segment kernels' (rows, keys) when spec.segments; padding() the
    (B, Sq) rows that are no query, which keep lse = -inf with sinks (q_lengths, rows
    outside every varlen sequence). descales: float8 calls' (_float8.descale_table),
    whose out comes back in bf16."""
    batch, seqlen_q, heads, _ = q.shape
    seqlen_k = k.shape[1]
    if 0 in (batch, heads, seqlen_q, seqlen_k):
        # Shapes are static, so empty problems never reach a kernel: no visible key
        # means out = 0 and lse = -inf (empty arrays when B, H or Sq is 0).
        out_dtype = q.dtype if descales is None else jnp.bfloat16
        out = jnp.zeros((*q.shape[:-1], v.shape[-1]), out_dtype)
        lse = jnp.full((batch, heads, seqlen_q), -jnp.inf, jnp.float32)
    else:
        out, lse = _kernel_attention(spec, q, k, v, segments() if spec.segments else (),
                                     descales)
    if spec.has_sinks:
        out, lse = _add_sinks(out, lse, sinks)
        if spec.has_q_lengths or spec.varlen:
            lse = jnp.where(padding()[:, None, :], -jnp.inf, lse)
    return out, lse


def _kernel_attention(spec: AttentionSpec, q, k, v, segments=(), descales=None):
    """The kernel paths at the kernels' head dims: q and k zero-padded along D, v along
    Dv, to theirs when (D, Dv) is not built (exact; spec keeps the softmax scale of the
    true D), out cut back to Dv. Autodiff of the pad and the cut carries the gradients."""
    kernel_spec = _kernel_select.for_kernel(spec)
    dims = (kernel_spec.head_dim, kernel_spec.head_dim_v)

    def run(spec, q, k, v):
        if spec.kv_float8:
            return _kv_float8.forward(spec, q, k, v, descales, tuple(segments))
        if descales is not None:
            return _float8.forward(spec, q, k, v, descales)
        return _vjp.attention(spec, q, k, v, segments)

    if (spec.head_dim, spec.head_dim_v) == dims:
        return run(spec, q, k, v)

    def pad(x, width):
        return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])

    out, lse = run(kernel_spec, pad(q, dims[0]), pad(k, dims[0]), pad(v, dims[1]))
    return out[..., :spec.head_dim_v], lse


def _add_sinks(out, lse, sinks):
    """Attention sinks on the kernels' result: one more logit per head, with no value,
    joins each row's softmax denominator Z, so out scales by Z / (Z + e^sink) =
    exp(lse - lse') with lse' = logaddexp(lse, sink). Exact, and differentiable through
    the kernels' backward (its lse cotangent). One fused elementwise pass over out."""
    sink = sinks.astype(jnp.float32)[:, None]  # (H, 1) against lse (B, H, Sq)
    lse_sunk = jnp.logaddexp(lse, sink)
    # A row that sees no key keeps out = 0 (its weight is exp(-inf) = 0); a -inf sink
    # on such a row would make lse' = -inf, where the weight is defined as 0 too. A NaN
    # sink gives NaN out and lse, as the reference does.
    empty = lse_sunk == -jnp.inf
    weight = jnp.exp(lse - jnp.where(empty, 0.0, lse_sunk))
    weight = jnp.where(empty, 0.0, weight)
    scaled = out.astype(jnp.float32) * jnp.swapaxes(weight, -1, -2)[..., None]
    return scaled.astype(out.dtype), lse_sunk


def _check_implementation(implementation) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATIONS}; got {implementation!r}")
