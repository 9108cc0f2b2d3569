"""What `implementation=None` runs on a CUDA GPU where the kernels cannot: cuDNN through
`jax.nn.dot_product_attention` when it takes the call, else the reference; either way
the user is told once, with the reason.

cuDNN's flash attention in `jax.nn` takes bf16 / fp16 with D = Dv, a multiple of 8, up
to 128 (256 from Hopper on), GQA, a top-left causal mask with an optional left window,
and lengths. jax 0.11 refuses its backward for odd Sq or Sk (seen on an H100), and
whether a gradient follows is not known here, so odd lengths take the reference. It has
no softcap, sinks, segment ids or packed sequences, returns its lse in the output dtype
(too coarse for `return_lse`), and its backward is not documented as reproducible:
those calls run the reference.
"""

from __future__ import annotations

import os
import warnings

import jax
import jax.numpy as jnp

from jax_fa4 import _kernel_select, _segment_plan
from jax_fa4._reference import reference_attention
from jax_fa4._spec import AttentionSpec

# Set to 1 to let a GPU machine whose native module failed to import run the fallback
# (with a warning) instead of raising.
ALLOW_NO_NATIVE = "JAX_FA4_ALLOW_NO_NATIVE"

# What each fallback path is, in words for the warning and `supports`.
RUNS = {"cudnn": "cuDNN through jax.nn.dot_product_attention",
        "reference": "the pure-JAX reference (O(Sq * Sk) memory per head)"}

_warned: set[str] = set()


def cudnn_support(spec: AttentionSpec, seqlen_q: int, seqlen_k: int,
                  hopper: bool) -> tuple[bool, str]:
    """Whether jax.nn's cuDNN path computes exactly this call's attention; else why not."""
    if _kernel_select.kernel_dtype(spec) is None or spec.out_dtype is not None:
        return False, f"cuDNN takes bfloat16 or float16, not {spec.dtype}"
    limit = 256 if hopper else 128
    if spec.head_dim != spec.head_dim_v or spec.head_dim % 8 or spec.head_dim > limit:
        return False, (f"cuDNN takes D = Dv, a multiple of 8 up to {limit}; got "
                       f"D {spec.head_dim}, Dv {spec.head_dim_v}")
    if seqlen_q % 2 or seqlen_k % 2:
        return False, f"jax.nn's cuDNN path needs even Sq and Sk; got {seqlen_q}, {seqlen_k}"
    for present, what in ((spec.softcap is not None, "softcap"), (spec.has_sinks, "sinks"),
                          (spec.has_segment_ids, "segment ids"),
                          (spec.varlen, "packed sequences (attention_varlen)"),
                          (spec.return_lse, "return_lse (its lse is in the output dtype)"),
                          (spec.deterministic, "deterministic=True")):
        if present:
            return False, f"jax.nn's cuDNN path has no {what}"
    if spec.window_right is not None or (spec.window_left is not None and not spec.causal):
        return False, "cuDNN's windows are causal with a left side only"
    # No right side is left here, so a band is causal.
    lengths = spec.has_q_lengths or spec.has_kv_lengths
    if spec.causal and spec.alignment == "bottom_right" and (lengths or seqlen_q != seqlen_k):
        return False, "cuDNN's causal mask is top-left: bottom-right needs Sq == Sk, no lengths"
    return True, ""


def attention(spec: AttentionSpec, q, k, v, *, q_lengths, kv_lengths):
    """out (B, Sq, Hq, D) of the call through jax.nn's cuDNN path when lowered for CUDA,
    the reference elsewhere. Only for specs `cudnn_support` accepts; lengths already
    clipped (`_masks.clip_lengths`)."""
    def cudnn(q, k, v):
        return through_jax_nn(spec, q, k, v, q_lengths=q_lengths, kv_lengths=kv_lengths)

    def reference(q, k, v):
        return reference_attention(q, k, v, **spec.reference_options(),
                                   q_lengths=q_lengths, kv_lengths=kv_lengths)[0]

    return jax.lax.platform_dependent(q, k, v, cuda=cudnn, default=reference)


def through_jax_nn(spec: AttentionSpec, q, k, v, *, q_lengths, kv_lengths,
                   implementation: str = "cudnn"):
    """The call as `jax.nn.dot_product_attention` arguments (top-left causal, a
    (left, 0) window, both lengths or neither), run by its `implementation`."""
    batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
    lengths = {}
    if spec.has_q_lengths or spec.has_kv_lengths:
        full = lambda n: jnp.full((batch,), n, jnp.int32)  # noqa: E731
        lengths = dict(
            query_seq_lengths=q_lengths if spec.has_q_lengths else full(seqlen_q),
            key_value_seq_lengths=kv_lengths if spec.has_kv_lengths else full(seqlen_k))
    out = jax.nn.dot_product_attention(
        q, k, v, scale=spec.softmax_scale, is_causal=spec.causal,
        local_window_size=None if spec.window_left is None else (spec.window_left, 0),
        implementation=implementation, **lengths)
    # Rows that see no key (past q_lengths, no key inside kv_lengths or the window) are
    # out = 0 here as everywhere in jax_fa4, whatever the library leaves there.
    rows, _ = _segment_plan.padded_rows(spec, seqlen_q, seqlen_k, batch=batch,
                                        q_lengths=q_lengths, kv_lengths=kv_lengths)
    sees = (rows[:, 1] > rows[:, 0])[:, :, None, None]
    return jnp.where(sees, out, jnp.zeros_like(out))


def native_allowed() -> bool:
    """JAX_FA4_ALLOW_NO_NATIVE: "1" allows it, unset, "" or "0" does not; any other
    value is refused rather than read as either."""
    value = os.environ.get(ALLOW_NO_NATIVE, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{ALLOW_NO_NATIVE} takes 1 (allow running without the native "
                         f"module) or 0; got {value!r}")
    return value == "1"


def warn_once(reason: str, path: str) -> None:
    """One RuntimeWarning per distinct (reason, path) in a process."""
    warn_message_once(f"jax_fa4: the kernels cannot run this call on this GPU ({reason}); "
                      f"running {RUNS[path]} instead. Pass implementation='reference' or 'cute' "
                      "to choose explicitly.")


def warn_message_once(message: str) -> None:
    """A RuntimeWarning the first time `message` is seen in a process."""
    if message not in _warned:
        _warned.add(message)
        # Attributed to the caller's line, the first frame outside this package.
        warnings.warn(message, RuntimeWarning,
                      skip_file_prefixes=(os.path.dirname(__file__),))
