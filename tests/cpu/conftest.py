"""Fixtures for the CPU tests."""

import importlib
import pathlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_fa4 import _fallback, _registry

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def bench_module(monkeypatch):
    """load(name) -> the checkout's bench.<name>. bench is not installed, and the tests
    import the installed jax_fa4 (the pytest executable keeps the checkout off sys.path)."""
    monkeypatch.syspath_prepend(str(REPO))
    return lambda name: importlib.import_module(f"bench.{name}")


@pytest.fixture
def kernel_band(monkeypatch):
    """The checkout's kernels/band.py, the launch arithmetic the kernels and the FFI
    share (kernels/ is not installed, and the checkout is not on pytest's path)."""
    monkeypatch.syspath_prepend(str(REPO))
    return importlib.import_module("kernels.band")


@pytest.fixture
def expected_manifest(monkeypatch) -> list[dict]:
    """kernels/config.py MANIFEST as the native module reports it (no CuTe-DSL needed)."""
    monkeypatch.syspath_prepend(str(REPO))
    from kernels.config import MANIFEST

    return [config.manifest_entry() for config in MANIFEST]


@pytest.fixture
def built(monkeypatch, expected_manifest):
    """The kernel path as if the native module were built.

    Uses the real module when it is built; otherwise stands in for it with the manifest
    of kernels/config.py. That is enough to select the kernel path, trace it and lower
    it for CUDA on this machine; nothing is registered, so nothing could run on a GPU.
    """
    if _registry.native_reason():
        monkeypatch.setattr(_registry, "_ffi", types.SimpleNamespace())
        monkeypatch.setattr(_registry, "_MANIFEST", tuple(expected_manifest))
    assert not _registry.native_reason()


@pytest.fixture(autouse=True)
def on_cpu():
    """These tests are about the CPU path: on a GPU machine they still run on the CPU."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """The fallback warns once per reason and process: each test starts unwarned."""
    monkeypatch.setattr(_fallback, "_warned", set())


def _run_path(attend, implementation, q, k, v):
    """attend(implementation, q, k, v) -> (out, lse), jitted with the gradients of
    sum(out) + sum(finite lse): ((out, lse), (dq, dk, dv))."""
    def loss(q, k, v):
        out, lse = attend(implementation, q, k, v)
        finite_lse = jnp.where(jnp.isfinite(lse), lse, 0)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(finite_lse), (out, lse)

    (_, result), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        q, k, v)
    return result, grads


def _assert_paths_agree(attend, q, k, v):
    """The default path (the kernel path; on CPU the reference from the segment kernels'
    rows and keys) against implementation="reference": out, lse (-inf where the
    reference's is) and the gradients. Returns the default's out, lse."""
    (out, lse), grads = _run_path(attend, None, q, k, v)
    (ref_out, ref_lse), ref_grads = _run_path(attend, "reference", q, k, v)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(ref_lse))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32),
                               atol=1e-2)
    np.testing.assert_allclose(np.where(np.isinf(lse), 0, lse),
                               np.where(np.isinf(ref_lse), 0, ref_lse), rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32),
                                   atol=3e-2)
    return out, lse


@pytest.fixture
def paths():
    """`run(attend, implementation, q, k, v)` and `assert_agree(attend, q, k, v)`, for
    attend(implementation, q, k, v) -> (out, lse)."""
    return types.SimpleNamespace(run=_run_path, assert_agree=_assert_paths_agree)
