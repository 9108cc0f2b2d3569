"""AttentionSpec: every static choice of one attention call, validated at construction.

The spec is the custom_vjp static argument, the key into the kernel manifest and the
source of the FFI attributes. Only dtypes, head counts and head dims are read from the
operands: batch and sequence lengths stay runtime values (one kernel serves every size),
and of the runtime feature arrays (sinks, segment ids, lengths, cu_seqlens) only their
presence is static. The constructors check the inputs with `_validate` and put them in
canonical form: equal calls give equal specs. The spec names the kernel variant it
needs (`banded`, `segment_kernel`); which built kernel runs it, and whether one can, is
`_kernel_select`'s question.

Refusals: `ValueError` for malformed input, `NotImplementedError(reason)` (raised by the
caller with `_kernel_select.kernel_support`'s reason) for a capability gap, both before
tracing.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jax_fa4 import _validate

# How the forward runs (set by `_path` after it checked the platform):
#   "cute": the kernel, unconditionally.
#   "platform": the kernel when lowered for CUDA, the reference for any other platform.
#   "cudnn": jax.nn's cuDNN path when lowered for CUDA, the reference elsewhere (a GPU
#       where the kernels cannot run, `_fallback`).
#   "reference": the pure-JAX reference.
PATHS = ("cute", "platform", "cudnn", "reference")

# Where query row i is aligned on the key axis (see `_masks`).
ALIGNMENTS = ("bottom_right", "top_left")


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    dtype: str  # numpy name of the q/k/v dtype, e.g. "bfloat16"
    head_dim: int  # D of q and k
    causal: bool  # the band's right side is 0: query i sees no key after a(i)
    softmax_scale: float
    return_lse: bool
    path: str = "reference"  # one of PATHS, set by _path once it checked the platform
    # Backward kernel: dq accumulated in a fixed order (bitwise reproducible) instead of
    # with atomic adds. The forward and the reference are deterministic either way.
    deterministic: bool = False
    # Features; the defaults are the plain call. Canonical: equal calls give equal specs.
    head_dim_v: int | None = None  # Dv of v and out; None at construction means D
    group_size: int = 1  # Hq // Hkv, query heads per KV head (GQA/MQA when > 1)
    alignment: str = "bottom_right"  # of causal / window; "bottom_right" when neither
    window_left: int | None = None  # band's left side; None: unbounded
    window_right: int | None = None  # band's right side; None: unbounded or causal
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap)
    has_sinks: bool = False
    # float8_e4m3fn q, k, v (dequantized by their descales): out's dtype; None for the
    # others, whose out has q's dtype.
    out_dtype: str | None = None
    has_segment_ids: bool = False
    has_q_lengths: bool = False
    has_kv_lengths: bool = False
    varlen: bool = False  # attention_varlen: sequences packed along one axis (cu_seqlens)
    # The kernels run each group's query heads as rows of one problem (`_pack_gqa`):
    # chosen by `_path` for grouped calls with few query rows.
    pack_gqa: bool = False
    # Split-KV (`_split_kv`): the forward runs the split kernel, which cuts each query
    # tile's key blocks into num_splits runs, one CTA each, and combines their partial
    # results; chosen by `_path` for calls with too few query tiles to fill the GPU,
    # and for decode-shaped calls even with one run.
    split_kernel: bool = False
    num_splits: int = 1
    # The split kernel's decode tile (keys as the wgmma's M, a few query rows as its N):
    # chosen by `_path` where the rows fit it and it was built.
    keys_as_m: bool = False
    # The tile for rows that see many keys (`_path.with_long_rows`): dense forwards,
    # banded or not, where one was built.
    long_rows: bool = False
    # Paged K/V (`_paged`): the forward reads k and v as caches of pages through a page
    # table (the segment kernel's paged variant); inference only, set by `_paged`.
    paged: bool = False
    # float8_e4m3fn K and V with bfloat16 q (`_kv_float8`): the split kernels' float8 KV
    # variants, which take a descale table; set by `_kv_float8` on the kernel paths.
    kv_float8: bool = False

    def __post_init__(self):
        if self.path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}; got {self.path!r}")
        if self.alignment not in ALIGNMENTS:
            raise ValueError(f"alignment must be one of {ALIGNMENTS}; got {self.alignment!r}")
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        if not isinstance(self.num_splits, int) or self.num_splits < 1:
            raise ValueError(f"num_splits must be an int >= 1; got {self.num_splits!r}")
        if self.num_splits > 1 and not self.split_kernel:
            raise ValueError("num_splits > 1 needs split_kernel")
        if self.keys_as_m and not self.split_kernel:
            raise ValueError("keys_as_m needs split_kernel")
        if self.long_rows and (self.split_kernel or self.segment_kernel or self.paged):
            raise ValueError("long_rows needs a dense call: no split_kernel, segments or "
                             "pages")

    @classmethod
    def from_inputs(cls, q, k, v, *, causal, softmax_scale, return_lse,
                    alignment="bottom_right", window=None, softcap=None, sinks=None,
                    q_segment_ids=None, kv_segment_ids=None, q_lengths=None,
                    kv_lengths=None, deterministic=False, descales=None,
                    out_dtype=None) -> AttentionSpec:
        """Validates q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv) (arrays or
        ShapeDtypeStructs), the feature arrays and the static arguments. `descales`
        (name -> None or array), from callers that take float8_e4m3fn q, k, v (with
        `out_dtype`); None refuses them."""
        dims = _validate.check_operands(q, k, v, varlen=False, float8=descales is not None)
        out_dtype = _validate.check_float8(dims[0], dims[4], descales or {}, out_dtype)
        batch, sq, sk = q.shape[0], q.shape[1], k.shape[1]
        _validate.check_segments_and_lengths(
            batch, sq, sk, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
            q_lengths=q_lengths, kv_lengths=kv_lengths)
        if alignment == "top_left" and sq == sk and q_lengths is None and kv_lengths is None:
            alignment = "bottom_right"  # the same band when Sq == Sk: keeps the kernel path
        spec = cls._build(
            dims, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse,
            alignment=alignment, window=window, softcap=softcap, sinks=sinks,
            has_segment_ids=q_segment_ids is not None, has_q_lengths=q_lengths is not None,
            has_kv_lengths=kv_lengths is not None, out_dtype=out_dtype,
            deterministic=_validate.static_bool("deterministic", deterministic))
        if (sq == 1 and spec.causal and spec.alignment == "bottom_right"
                and spec.window_left is None):
            # A decode step: the one query sits at the last valid key and sees them all.
            spec = dataclasses.replace(spec, causal=False)
        return spec

    @classmethod
    def from_varlen_inputs(cls, q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           max_seqlen_k, causal, softmax_scale, return_lse,
                           alignment="bottom_right", window=None, softcap=None,
                           sinks=None, deterministic=False) -> AttentionSpec:
        """Validates q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv),
        cu_seqlens_q / cu_seqlens_k (num_seqs + 1,) int32 and the static arguments."""
        dims = _validate.check_operands(q, k, v, varlen=True)
        _validate.check_cu_seqlens(cu_seqlens_q, cu_seqlens_k)
        # FlashAttention's bounds: checked as its static ints, and not kept (nothing reads
        # them), so that calls differing only in them share one spec.
        _validate.static_int("max_seqlen_q", max_seqlen_q)
        _validate.static_int("max_seqlen_k", max_seqlen_k)
        return cls._build(
            dims, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse,
            alignment=alignment, window=window, softcap=softcap, sinks=sinks, varlen=True,
            deterministic=_validate.static_bool("deterministic", deterministic))

    @classmethod
    def _build(cls, dims, *, causal, softmax_scale, return_lse, alignment, window, softcap,
               sinks, **flags) -> AttentionSpec:
        dtype, head_dim, head_dim_v, heads_q, heads_kv = dims
        _validate.check_sinks(sinks, heads_q)
        causal, left, right = _validate.band(_validate.static_bool("causal", causal), window)
        if alignment not in ALIGNMENTS:
            raise ValueError(f"alignment must be one of {ALIGNMENTS}; got {alignment!r}")
        if not causal and left is None and right is None:
            alignment = "bottom_right"  # no band: alignment means nothing
        return cls(
            dtype=dtype, head_dim=head_dim, causal=causal,
            softmax_scale=_validate.static_scale(softmax_scale, head_dim),
            return_lse=_validate.static_bool("return_lse", return_lse),
            head_dim_v=head_dim_v, group_size=heads_q // heads_kv if heads_kv else 1,
            alignment=alignment, window_left=left, window_right=right,
            softcap=_validate.static_softcap(softcap),
            has_sinks=sinks is not None, **flags)

    def with_path(self, path: str) -> AttentionSpec:
        return dataclasses.replace(self, path=path)

    def with_top_left_window(self, window) -> AttentionSpec:
        """This spec with the band `window` (left, right), top-left aligned, in place of
        its own (None: no band), in `_build`'s canonical form: the local band of one
        chunk pair of the automatic ring (`_ring.Cut`), where query and key chunks start
        at the pair's own first positions. The long-row tile, chosen for the whole
        call, is dropped."""
        causal, left, right = _validate.band(False, window)
        banded = causal or (left, right) != (None, None)
        return dataclasses.replace(self, causal=causal, window_left=left, window_right=right,
                                   alignment="top_left" if banded else "bottom_right",
                                   long_rows=False)

    @property
    def segments(self) -> bool:
        """Whether the call carries the segment kernels' per-row arrays (rows, keys of
        `_segment_plan`) from the caller's segment ids, lengths or varlen sequences."""
        return self.has_segment_ids or self.has_q_lengths or self.has_kv_lengths or self.varlen

    @property
    def segment_kernel(self) -> bool:
        """Whether this runs the segment kernel variant (kernels/sm90/segments.py), which
        takes visibility from per-row arrays and a plan: with `segments`, and for a band
        under pack-GQA, whose rows are no positions (`_pack_gqa` makes those arrays on
        each shard)."""
        packed_band = self.pack_gqa and (self.causal or self.window != (None, None))
        return self.segments or packed_band

    @property
    def banded(self) -> bool:
        """Whether this runs the kernel variant with a runtime band (kernels/sm90/mask.py):
        a band limits the keys a query sees (causal or a window), or softcap or segments,
        which are built into that variant only (an unbounded band stands for no mask)."""
        return (self.causal or self.window != (None, None) or self.softcap is not None
                or self.segment_kernel)

    @property
    def window(self) -> tuple[int | None, int | None]:
        """(left, right) of the band beyond causal, the form the reference takes."""
        return self.window_left, self.window_right

    def reference_options(self) -> dict:
        """The static keyword arguments of `_reference.reference_attention[_varlen]`."""
        return dict(causal=self.causal, softmax_scale=self.softmax_scale,
                    alignment=self.alignment, window=self.window, softcap=self.softcap)

    def ffi_attributes(self) -> dict:
        """Attributes of the `jax_fa4_fwd` custom call: banded (the banded kernel) -> i1,
        softmax_scale -> f32, the band's window_left / window_right -> i32 (-1:
        unbounded; causal is a right side of 0), top_left -> i1 (ffi/handler_common.h
        MakeBand), softcap -> f32 (0: none), split_kernel -> i1 (the banded kernel's
        split variant) and num_splits -> i32 (its runs per tile), kv_float8 -> i1 (float8
        K/V and a descale operand), keys_as_m -> i1 (the split kernel's decode tile),
        long_rows -> i1 (the tile for rows that see many keys)."""
        return {**self._band_attributes(self.banded or self.split_kernel),
                "split_kernel": self.split_kernel, "num_splits": np.int32(self.num_splits),
                "kv_float8": self.kv_float8, "keys_as_m": self.keys_as_m,
                "long_rows": self.long_rows}

    def bwd_ffi_attributes(self) -> dict:
        """Attributes of the `jax_fa4_bwd` custom call: the forward's band attributes
        and deterministic -> i1 (the backward never splits)."""
        return {**self._band_attributes(self.banded), "deterministic": self.deterministic}

    def _band_attributes(self, banded: bool) -> dict:
        def side(value):  # < 2^31 (_validate.band); MakeBand clamps the band to +-2^30
            return np.int32(-1 if value is None else value)

        return {"banded": banded, "softmax_scale": np.float32(self.softmax_scale),
                "window_left": side(self.window_left),
                "window_right": side(0 if self.causal else self.window_right),
                "top_left": self.alignment == "top_left",
                "softcap": np.float32(self.softcap or 0.0)}

