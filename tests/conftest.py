"""Markers shared by tests/cpu and tests/gpu.

gpu: needs a CUDA GPU and the built native module; skipped elsewhere.
native: needs the built native module jax_fa4._ffi (no GPU); skipped in a source
    checkout that was not built.
"""

import jax
import pytest

# The kernels and the reference are 32-bit; keep 64-bit types out of every test.
jax.config.update("jax_enable_x64", False)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and the built native module")
    config.addinivalue_line("markers", "native: needs the built native module jax_fa4._ffi")
    # Registered by pytest-xdist when installed; declared here so plain runs know it.
    config.addinivalue_line("markers", "xdist_group: cases --dist loadgroup keeps on one worker")


def pytest_collection_modifyitems(config, items):
    from jax_fa4 import _registry

    backend = jax.default_backend()
    not_built = _registry.native_reason()
    for item in items:
        if "gpu" in item.keywords and backend != "gpu":
            item.add_marker(pytest.mark.skip(
                reason=f"needs a GPU; jax.default_backend() is {backend!r}"))
        elif ("gpu" in item.keywords or "native" in item.keywords) and not_built:
            item.add_marker(pytest.mark.skip(reason=not_built))
