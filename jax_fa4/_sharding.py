"""How XLA partitions the kernel forward under sharded `jit`, and how `vmap` batches it.

Attention is independent per (batch, head): a device that holds a batch and/or head
shard of q, k and v computes the same shard of out and lse with the kernel, with no
communication. The forward is wrapped in `custom_partitioning` with a Shardy rule that
passes batch and heads through. Sharding the sequence or head_dim would need whole
sequences on every device; rather than let XLA gather them silently, partitioning fails
with an error that names the sharded axis and what to use instead.

`custom_partitioning` has no batching rule, so `custom_vmap` folds vmapped axes into the
batch dimension (exact, since batch elements are independent) and calls it again.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

# Factors: b batch, h heads (pass through); sq, sk sequence lengths, d / e head_dim of
# q-k / v. Only b and h may be sharded; `_partition` refuses the others.
_RULE = "b sq h d, b sk h d, b sk h e -> b sq h e, b h sq"
_SEQ, _HEAD_DIM = 1, 3  # axes of q, k, v (B, S, H, D)


def sharded(forward):
    """forward(spec, q, k, v) -> (out, lse) for (B, S, H, D) operands, made partitionable
    over batch and heads and batchable by vmap. Returns f(spec) -> op(q, k, v)."""
    op = custom_partitioning(forward, static_argnums=(0,))

    def partition(spec, mesh, arg_shapes, result_shape):
        batch, heads = _batch_and_head_axes(arg_shapes)
        operand = NamedSharding(mesh, PartitionSpec(batch, None, heads, None))
        results = (operand, NamedSharding(mesh, PartitionSpec(batch, heads, None)))
        return mesh, functools.partial(forward, spec), results, (operand,) * 3

    def infer_sharding_from_operands(spec, mesh, arg_shapes, result_shape):
        # Used by the GSPMD partitioner (Shardy uses _RULE).
        batch, heads = _batch_and_head_axes(arg_shapes)
        return (NamedSharding(mesh, PartitionSpec(batch, None, heads, None)),
                NamedSharding(mesh, PartitionSpec(batch, heads, None)))

    op.def_partition(partition=partition, sharding_rule=_RULE,
                     infer_sharding_from_operands=infer_sharding_from_operands)

    @functools.cache
    def for_spec(spec):
        @jax.custom_batching.custom_vmap
        def batched(q, k, v):
            return op(spec, q, k, v)

        @batched.def_vmap
        def fold(axis_size, in_batched, q, k, v):
            q, k, v = (x if b else jnp.broadcast_to(x, (axis_size, *x.shape))
                       for x, b in zip((q, k, v), in_batched))
            out, lse = batched(*(x.reshape(-1, *x.shape[2:]) for x in (q, k, v)))
            return ((out.reshape(axis_size, -1, *out.shape[1:]),
                     lse.reshape(axis_size, -1, *lse.shape[1:])), (True, True))

        return batched

    return for_spec


def vary_like(ref, values):
    """Inside shard_map, type `values` (a tuple) as varying over the same manual mesh
    axes as `ref`: ffi_call results and fresh constants are typed invariant, and
    branches and merges must agree."""
    varying = tuple(sorted(jax.typeof(ref).manual_axis_type.varying))
    if not varying:
        return values
    return tuple(jax.lax.pcast(x, varying, to="varying") for x in values)


def _batch_and_head_axes(arg_shapes):
    """The mesh axes q is sharded over along batch and heads; refuses any sharding of
    the sequence or head_dim of q, k or v."""
    for name, arg in zip(("q", "k", "v"), arg_shapes):
        spec = tuple(arg.sharding.spec) + (None,) * (4 - len(arg.sharding.spec))
        for axis, what in ((_SEQ, "sequence"), (_HEAD_DIM, "head_dim")):
            if spec[axis] is not None:
                raise NotImplementedError(
                    f"jax_fa4.attention: {name} is sharded along its {what} axis "
                    f"({arg.sharding.spec}); the attention kernel needs whole sequences and "
                    "head_dims on each device. Shard batch and/or heads instead (or use "
                    "context parallelism for long sequences).")
    q_spec = tuple(arg_shapes[0].sharding.spec) + (None,) * 4
    return q_spec[0], q_spec[2]
