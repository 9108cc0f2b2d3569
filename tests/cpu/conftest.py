"""Fixtures for the CPU tests."""

import pathlib
import types

import jax
import pytest

from jax_fa4 import _registry

REPO = pathlib.Path(__file__).resolve().parents[2]


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
