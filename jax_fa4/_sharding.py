"""How XLA partitions the kernel calls under sharded `jit`, and how `vmap` batches them.

Attention is independent per (batch, head): a device that holds a batch and/or head
shard of the operands computes the same shard of the results with the kernel, with no
communication. The forward (q, k, v -> out, lse) and the backward (q, k, v, out, dout,
lse, dlse -> dq, dk, dv) are each wrapped in `custom_partitioning` with a Shardy rule
that passes batch and heads through. A sharded sequence runs ring attention on each
device (`_ring`: K/V chunks travel with `ppermute`, partial results merge through their
LSE; with segment ids, lengths or varlen, the key ids travel too and each row's global
key range is cut to the chunk at hand). A sharded head_dim, or a sequence sharded unlike q's, would need XLA to gather
whole arrays; rather than let it do that silently, partitioning fails with an error that
names the sharded axis and what to use instead.

The pure-JAX reference path (features the kernels lack, float32) is plain jnp, which XLA
would partition over a sharded sequence by gathering K/V on every device. `guard` runs
its q, k, v through an identity under the same rule, which passes batch and head
sharding through and refuses a sharded sequence.

`custom_partitioning` has no batching rule, so `custom_vmap` calls it again with the
vmapped axes in front, which the partitioning passes through as it does the batch (so a
vmapped axis and a sharded batch behind it stay where they are), and each device folds
them into its batch (exact, since batch elements are independent), in groups where
the merged batch would pass what one kernel call takes; a descale table (no batch axis)
that varies along the vmapped axis makes it one call per element instead.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jax_fa4 import _kernel_select

# Where each array keeps its sequence axis, for those not laid out (B, S, H, D): row
# statistics (B, H, Sq) and the segment kernels' rows (B, 3, Sq) and keys (B, Sk).
_SEQ_AXIS = {"lse": 2, "dlse": 2, "rows": 2, "keys": 1}


@dataclasses.dataclass(frozen=True)
class Signature:
    """Operand and result names of one kernel call, in order, and its Shardy rule over
    the factors b batch, h key/value heads (pass through), sq, sk sequence lengths, d / e
    head_dim of q-k / v. Query heads are the factor `{hq}`: h, or (h g) with g query
    heads per key/value head (GQA/MQA). Only b and h may be sharded; partitioning
    refuses the others."""

    operands: tuple[str, ...]
    results: tuple[str, ...]
    rule: str
    # Why a call of this signature without a ring refuses a sharded sequence; empty: it
    # runs the pure-JAX reference (the default reason).
    no_ring: str = ""


FORWARD = Signature(("q", "k", "v"), ("out", "lse"),
                    "b sq {hq} d, b sk h d, b sk h e -> b sq {hq} e, b {hq} sq")
BACKWARD = Signature(("q", "k", "v", "out", "dout", "lse", "dlse"), ("dq", "dk", "dv"),
                     "b sq {hq} d, b sk h d, b sk h e, b sq {hq} e, b sq {hq} e, b {hq} sq, "
                     "b {hq} sq -> b sq {hq} d, b sk h d, b sk h e")


# The float8 forward (jax_fa4/_float8.py): its descale table (3, Hkv) follows k's heads.
FLOAT8 = Signature(("q", "k", "v", "descale"), ("out", "lse"),
                   "b sq {hq} d, b sk h d, b sk h e, t h -> b sq {hq} e, b {hq} sq",
                   no_ring="float8 attention has no ring yet")
# The float8 K/V forward (jax_fa4/_kv_float8.py): bf16 q, the same operands.
KV_FLOAT8 = dataclasses.replace(FLOAT8, no_ring="attention with float8 K/V has no ring yet")

# The reference path's identity: the forward's operands, each to itself.
GUARD = Signature(FORWARD.operands, FORWARD.operands,
                  " -> ".join([FORWARD.rule.split(" -> ")[0]] * 2))


def _with_segments(signature: Signature) -> Signature:
    """The segment kernels' signature: rows (B, 3, Sq) and keys (B, Sk) join the
    operands (kernels/sm90/segments.py)."""
    operands, results = signature.rule.split(" -> ")
    return Signature(signature.operands + ("rows", "keys"), signature.results,
                     f"{operands}, b t sq, b sk -> {results}")


FORWARD_SEGMENTS = _with_segments(FORWARD)
BACKWARD_SEGMENTS = _with_segments(BACKWARD)
KV_FLOAT8_SEGMENTS = _with_segments(KV_FLOAT8)


def sharded(fn, signature: Signature, ring):
    """fn(spec, *operands) -> results, every operand and result batch-first, made
    partitionable over batch and heads (and the sequence, through
    ring(fn, spec, axis_name, *operands) on each device; ring None refuses a sharded
    sequence) and batchable by vmap. Returns f(spec) -> op(*operands).

    vmapped axes stay leading axes of the partitioned call, passed through as the batch
    is, and fold into the batch on each device: folded before partitioning, a vmapped
    axis left whole in front of a sharded batch would make XLA gather the batch."""

    def shardings(spec, mesh, arg_shapes, names, lead):
        axes = _axes(signature, spec, mesh, arg_shapes, ring is not None, lead)
        return tuple(NamedSharding(mesh, _partition_spec(name, *axes)) for name in names)

    @functools.cache
    def partitioned(group_size, one_kv_head, lead):
        # The rule's query-head factor depends on the grouping, so one op per grouping.
        # With one key/value head (MQA) the query heads are a factor of their own: Shardy
        # refuses a compound factor (h g) whose h has size 1.
        def run(spec, *operands):
            return _fold_leading(spec, functools.partial(fn, spec), signature, lead, operands)

        def partition(spec, mesh, arg_shapes, result_shape):
            _, _, _, seq = _axes(signature, spec, mesh, arg_shapes, ring is not None, lead)
            per_device = (functools.partial(fn, spec) if seq is None
                          else functools.partial(ring, fn, spec, seq))
            return (mesh,
                    lambda *operands: _fold_leading(spec, per_device, signature, lead,
                                                    operands),
                    shardings(spec, mesh, arg_shapes, signature.results, lead),
                    shardings(spec, mesh, arg_shapes, signature.operands, lead))

        def infer_sharding_from_operands(spec, mesh, arg_shapes, result_shape):
            # Used by the GSPMD partitioner (Shardy uses the rule).
            return shardings(spec, mesh, arg_shapes, signature.results, lead)

        op = custom_partitioning(run, static_argnums=(0,))
        grouped = group_size > 1 and not one_kv_head
        hq = "(h g)" if grouped else "g" if group_size > 1 else "h"
        op.def_partition(partition=partition,
                         sharding_rule=_leading_rule(signature, signature.rule.format(hq=hq),
                                                     lead),
                         infer_sharding_from_operands=infer_sharding_from_operands,
                         **({"g": group_size} if grouped else {}))
        return op

    @functools.cache
    def for_spec(spec):
        @jax.custom_batching.custom_vmap
        def batched(*operands):
            # operands[0] is q (..., B, Sq, Hq, D) and operands[1] k (..., B, Sk, Hkv, D)
            # in every signature, behind any vmapped axes.
            lead = operands[0].ndim - 4
            op = partitioned(spec.group_size, operands[1].shape[-2] == 1, lead)
            return op(spec, *operands)

        @batched.def_vmap
        def stack(axis_size, in_batched, *operands):
            shared = [name == "descale" for name in signature.operands]
            if any(b and s for b, s in zip(in_batched, shared)):
                # A table per element: the kernels take one per call.
                every = tuple(x if b else jnp.broadcast_to(x, (axis_size, *x.shape))
                              for x, b in zip(operands, in_batched))
                return (jax.lax.map(lambda args: batched(*args), every),
                        (True,) * len(signature.results))
            operands = (x if b or s else jnp.broadcast_to(x, (axis_size, *x.shape))
                        for x, b, s in zip(operands, in_batched, shared))
            return tuple(batched(*operands)), (True,) * len(signature.results)

        return batched

    return for_spec


def _leading_rule(signature: Signature, rule: str, lead: int) -> str:
    """The Shardy rule with `lead` vmapped axes (factors l0, l1, ...) in front of every
    operand but the descale table, and of every result."""
    if not lead:
        return rule
    prefix = " ".join(f"l{i}" for i in range(lead)) + " "
    operands, results = rule.split(" -> ")
    operands = ", ".join(term if name == "descale" else prefix + term
                         for name, term in zip(signature.operands, operands.split(", ")))
    return f"{operands} -> {', '.join(prefix + term for term in results.split(', '))}"


def _fold_leading(spec, call, signature: Signature, lead: int, operands):
    """call(*operands) with the `lead` vmapped axes in front of the batch merged into it
    (the descale table has none), and split off its results again. Where the merged
    batch would pass what one kernel call takes (_kernel_select.batch_limit), the
    elements go in groups, one call per group in a `lax.map`."""
    if not lead:
        return call(*operands)
    outer, batch = operands[0].shape[:lead], operands[0].shape[lead]
    elements = math.prod(outer)
    group = fold_group(spec, elements, batch, *operands[0].shape[lead + 1:lead + 3])
    groups = 1 if group is None else elements // group
    merged = elements * batch if group is None else group * batch
    # Shapes written out: a size of 0 leaves no -1 to infer.
    folded = [(name, x if name == "descale"
               else x.reshape(groups, merged, *x.shape[lead + 1:]))
              for name, x in zip(signature.operands, operands)]

    def one_group(xs):  # the batched operands of one group, in order
        it = iter(xs)
        return call(*(x if name == "descale" else next(it) for name, x in folded))

    batched = [x for name, x in folded if name != "descale"]
    if groups == 1:
        results = [r[None] for r in one_group([x[0] for x in batched])]
    else:
        results = jax.lax.map(one_group, batched)
    return tuple(r.reshape(*outer, batch, *r.shape[2:]) for r in results)


def fold_group(spec, elements, batch, seqlen_q, heads) -> int | None:
    """How many vmapped elements one kernel call takes: None for all of them, else the
    most that divide them and keep the batch within _kernel_select.batch_limit (each
    element's own batch passed the per-call checks)."""
    if spec.path not in ("cute", "platform") or not all(
            isinstance(n, int) for n in (elements, batch)):
        return None
    limit = _kernel_select.batch_limit(spec, seqlen_q, heads)
    if limit is None or elements * batch <= limit:
        return None
    return max(g for g in range(1, limit // batch + 1) if elements % g == 0)


def _identity(spec, *operands):
    return operands


_guarded = sharded(_identity, GUARD, None)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def guard(spec, q, k, v):
    """(q, k, v) unchanged, for the reference path: under a sharded `jit`, batch and
    head shardings pass through and a sharded sequence raises (with the reason the call
    runs the reference) instead of letting XLA gather K/V. Linear, so differentiable in
    both modes."""
    return _guarded(spec)(q, k, v)


@guard.defjvp
def _guard_jvp(spec, primals, tangents):
    return guard(spec, *primals), tangents


def _partition_spec(name, leading, batch, heads, seq) -> PartitionSpec:
    """`name`'s sharding: q's vmapped axes (`leading`), batch, heads and sequence."""
    if name == "descale":
        return PartitionSpec(None, heads)
    if name in ("lse", "dlse"):
        return PartitionSpec(*leading, batch, heads, seq)
    if name == "rows":
        return PartitionSpec(*leading, batch, None, seq)
    if name == "keys":
        return PartitionSpec(*leading, batch, seq)
    return PartitionSpec(*leading, batch, seq, heads, None)


def _sharded_dims(arg) -> tuple:
    """The mesh axes of each of arg's dims (None where whole)."""
    spec = tuple(arg.sharding.spec)
    return spec + (None,) * (len(arg.shape) - len(spec))


def _axes(signature: Signature, spec, mesh, arg_shapes, ring: bool, lead: int):
    """(vmapped axes, batch, heads, sequence): the mesh axes q (the first operand) is
    sharded over, behind its `lead` vmapped axes (which every operand and result but the
    descale table has, sharded as q's).
    A sequence-sharded q takes the ring (every operand's sequence on the same axes);
    refused: a sharded head_dim, a sequence sharded differently from q's, a sharded
    sequence without a ring, a sequence the mesh axes do not divide, a band ring that is
    causal or windowed over query and key sequences of different lengths (the segment
    ring takes any), and a head sharding that does not split the key/value heads (the
    second operand) into whole groups."""
    q_dims = _sharded_dims(arg_shapes[0])
    leading, q_spec = q_dims[:lead], q_dims[lead:]
    seq, heads = q_spec[1], q_spec[2]
    # the operands' shapes behind the vmapped axes: q's and k's
    q_shape, k_shape = arg_shapes[0].shape[lead:], arg_shapes[1].shape[lead:]
    for name, arg in zip(signature.operands, arg_shapes):
        if name == "descale":  # (3, Hkv): no sequence or head_dim; its heads follow k's
            continue
        dims = _sharded_dims(arg)[lead:]
        if name not in _SEQ_AXIS and dims[3] is not None:
            raise NotImplementedError(
                f"jax_fa4.attention: {name} is sharded along its head_dim axis "
                f"({arg.sharding.spec}); the attention kernel needs whole head_dims on each "
                "device. Shard batch, heads or the sequence instead.")
        arg_seq = dims[_SEQ_AXIS.get(name, 1)]
        if arg_seq is not None and arg_seq != seq:
            raise NotImplementedError(
                f"jax_fa4.attention: {name} is sharded along its sequence axis "
                f"({arg.sharding.spec}) and q {'is not' if seq is None else 'differently'} "
                f"({arg_shapes[0].sharding.spec}); ring attention needs q, k and v sharded "
                "along their sequence over the same mesh axes.")
    if seq is not None and not ring and signature.no_ring:
        raise NotImplementedError(
            f"jax_fa4.attention: {signature.no_ring}, so it is not partitioned over a "
            f"sequence sharded along {seq!r}: XLA would gather K/V on every device. Shard "
            "batch or heads.")
    if seq is not None and not ring:
        reason = (_kernel_select.kernel_support(spec)[1]
                  or "implementation='reference', or a GPU the kernels do not run on")
        raise NotImplementedError(
            f"jax_fa4.attention: this call runs the pure-JAX reference ({reason}), which "
            f"is not partitioned over a sequence sharded along {seq!r}: XLA would gather "
            "K/V on every device. Shard batch or heads, or call jax_fa4.ring_attention "
            "inside jax.shard_map.")
    # The segment ring takes any band and lengths: they are in the rows, in global indices.
    band_ring = seq is not None and "rows" not in signature.operands
    banded = spec.causal or spec.window != (None, None)
    uneven = [n for n in (q_shape[1], k_shape[1])
              if seq is not None and n % _axes_size(mesh, seq)]
    if uneven:
        # jit's inputs split evenly, but a sharding constraint inside it may not: the
        # last device's chunk is then padded with values XLA leaves unspecified. The band
        # ring places the band by chunk and would take those rows for keys; the segment
        # ring would read their rows and key ids, and its backward their dout.
        raise NotImplementedError(
            f"jax_fa4.attention: a sequence of {uneven[0]} is sharded over "
            f"{_axes_size(mesh, seq)} devices ({seq!r}), which do not divide it; the ring "
            "needs equal chunks. Pad the sequence to a multiple and pass kv_lengths (and "
            "q_lengths) for the padding, or shard batch or heads.")
    if band_ring and banded and q_shape[1] != k_shape[1]:
        raise NotImplementedError(
            "jax_fa4.attention: causal or windowed attention over a sharded sequence needs "
            f"queries and keys of one length (got {q_shape[1]} and {k_shape[1]}): the "
            "ring reads the band in global positions, shared by both. With kv_lengths (or "
            "q_lengths) it runs the segment ring, which takes any lengths.")
    if heads is not None and k_shape[2] % _axes_size(mesh, heads):
        raise NotImplementedError(
            f"jax_fa4.attention: the heads are sharded {_axes_size(mesh, heads)} ways "
            f"({heads}), which does not divide the {k_shape[2]} key/value heads: "
            "each device needs the key/value heads of its query heads. Shard the heads by a "
            "divisor of Hkv, or shard the batch.")
    return leading, q_spec[0], heads, seq


def _axes_size(mesh, axes) -> int:
    names = axes if isinstance(axes, tuple) else (axes,)
    size = 1
    for name in names:
        size *= mesh.shape[name]
    return size
