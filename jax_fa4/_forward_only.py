"""Calls without a derivative: the float8 and paged paths serve inference.

A custom_jvp whose rule raises, so that reverse mode (jax.grad, jax.vjp) and forward
mode (jax.jvp, jax.jacfwd) both stop with the path's own message; a custom_vjp had
refused forward mode with JAX's generic TypeError. The rule runs only where an operand
carries a tangent: calls on values that no derivative depends on run as usual.
"""

import functools

import jax


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def call(message: str, fn, *args):
    """fn(*args), through which any derivative raises NotImplementedError(message). Traced
    values go in args: closed over by fn, they escape as JAX's UnexpectedTracerError."""
    return fn(*args)


@call.defjvp
def _refuse(message, fn, primals, tangents):
    raise NotImplementedError(message)


def _identity(x):
    return x


def values(x, message: str):
    """x (an array or a pytree of them); a derivative through any of them raises
    NotImplementedError(message). Operands wrapped together raise together: a gradient
    of lse with respect to v, which lse does not depend on, raises with q's and k's
    instead of being zero."""
    return call(message, _identity, x)
