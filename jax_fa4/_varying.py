"""The type of values over `shard_map`'s manual mesh axes, the one place that sets it.

Inside `shard_map`, JAX types each value as varying over some of the manual mesh axes.
jnp carries that type from operands to results, but `ffi_call` results and fresh
constants come out invariant, and a cotangent can vary over axes its primal does not.
`vary_like` and `sum_like` give such values the type plain jnp code would have; outside
`shard_map` they return their input. A module of its own because the FFI calls, the
rings and the custom_vjp need it, and none of them should depend on the partitioning
rules (`_sharding`) for it.
"""

from __future__ import annotations

import jax


def vary_like(refs, values):
    """Inside shard_map, type `values` (a tuple) as varying over every manual mesh axis
    that one of the arrays `refs` varies over, as computing them from `refs` with jnp
    would: ffi_call results and fresh constants are typed invariant, and branches and
    merges must agree."""
    varying = tuple(sorted(set().union(*(jax.typeof(r).manual_axis_type.varying for r in refs))))
    if not varying:
        return values
    return tuple(jax.lax.pcast(x, varying, to="varying") for x in values)


def sum_like(refs, cotangents):
    """Inside shard_map, each cotangent summed over the manual mesh axes it varies over
    and its primal in `refs` does not: an input replicated over an axis gets the sum of
    every device's contribution (the transpose of the implicit pvary)."""
    def reduce(ref, ct):
        extra = jax.typeof(ct).manual_axis_type.varying - jax.typeof(ref).manual_axis_type.varying
        return jax.lax.psum(ct, tuple(sorted(extra))) if extra else ct

    return tuple(map(reduce, refs, cotangents))
