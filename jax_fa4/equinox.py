"""Drop-in `equinox.nn.MultiheadAttention` whose attention runs through jax_fa4.

    from jax_fa4 import equinox as fa4
    mha = fa4.MultiheadAttention(num_heads, size, causal=True, key=key)  # same arguments
    mha = fa4.MultiheadAttention.wrap(existing_eqx_mha, causal=True)     # same weights
    y = jax.vmap(mha)(x, x, x)                                            # per example

Same fields, weights and call signature as Equinox's module (per example, vmapped over
the batch; jax_fa4 folds that vmap into the kernel's batch). Causal attention is a
static field (top-left, `jnp.tril`), because a mask built under jit cannot be read; a
concrete all-visible or causal mask is accepted, any other mask and active dropout are
refused with the alternative.
"""

from __future__ import annotations

import dataclasses
import warnings

import equinox as eqx
import jax

from jax_fa4 import _adapters
from jax_fa4._api import attention as _attention


class MultiheadAttention(eqx.nn.MultiheadAttention):
    causal: bool = eqx.field(static=True, default=False)

    def __init__(self, *args, causal: bool = False, **kwargs):
        """The arguments of `equinox.nn.MultiheadAttention`, plus `causal`."""
        super().__init__(*args, **kwargs)
        self.causal = causal

    @classmethod
    def wrap(cls, module: eqx.nn.MultiheadAttention, *, causal: bool = False):
        """The same weights as `module`, attention through jax_fa4."""
        new = object.__new__(cls)
        for field in dataclasses.fields(module):
            object.__setattr__(new, field.name, getattr(module, field.name))
        object.__setattr__(new, "causal", causal)
        return new

    def __call__(self, query, key_, value, mask=None, *, key=None, inference=None,
                 deterministic=None, process_heads=None):
        """query (Sq, query_size), key_ / value (Sk, ...) -> (Sq, output_size)."""
        del key  # only dropout would use it, and active dropout is refused
        if deterministic is not None:
            inference = deterministic
            warnings.warn("MultiheadAttention()(deterministic=...) is deprecated in favour "
                          "of MultiheadAttention()(inference=...)")
        # Equinox's rule: the call's inference, when given, overrides the dropout's own.
        dropout_active = not (self.dropout.inference if inference is None else inference)
        # Inference first: p may be an array, traced under filter_jit (its value unknown).
        p = self.dropout.p
        if dropout_active and (isinstance(p, jax.core.Tracer) or p > 0.0):
            _adapters.refuse("attention dropout",
                             "construct with dropout_p=0.0, or call with inference=True")
        if key_.shape[0] != value.shape[0]:
            raise ValueError("key and value must both be sequences of equal length; got "
                             f"{key_.shape[0]} and {value.shape[0]}")
        # Equinox's mask: (q_len, kv_len) or per head, (num_heads, q_len, kv_len)
        scores = (self.num_heads, query.shape[0], key_.shape[0])
        causal = self.causal or _adapters.mask_kind(mask, scores) == "causal"

        q = self._project(self.query_proj, query)
        k = self._project(self.key_proj, key_)
        v = self._project(self.value_proj, value)
        if process_heads is not None:
            shapes = (q.shape, k.shape, v.shape)
            q, k, v = process_heads(q, k, v)
            if (q.shape, k.shape, v.shape) != shapes:
                raise ValueError("process_heads must not change the shape of the heads.")
        out = _attention(q[None], k[None], v[None], causal=causal, alignment="top_left")[0]
        return jax.vmap(self.output_proj)(out.reshape(query.shape[0], -1))
