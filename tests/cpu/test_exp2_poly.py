"""The emulated exp2 of the forward softmax (kernels/sm90/exp2_poly.py), replayed step
by step in numpy with the kernel's fp32 constants: the bit trick and the clamp are
checked here, the PTX itself by the GPU forward tests."""

import numpy as np
import pytest

from kernels.sm90 import exp2_poly

F32 = np.float32


def _replay(x: np.ndarray) -> np.ndarray:
    """The PTX block on fp32 inputs: clamp, floor by the rounding-down shifter add,
    cubic, exponent add in the integer unit."""
    x = np.maximum(x.astype(F32), F32(exp2_poly.CLAMP))
    shifter = F32(exp2_poly.SHIFTER)
    # add.rm: the exact sum rounded down to an fp32 (its spacing is 1 near 1.5 * 2^23).
    t = np.floor(x.astype(np.float64) + float(shifter)).astype(F32)
    j = t - shifter
    f = x - j
    c1, c2, c3 = (F32(c) for c in exp2_poly.COEFFS)
    p = f * c3 + c2
    p = p * f + c1
    p = p * f + F32(1.0)
    bits = p.view(np.int32) + (t.view(np.int32) << 23)
    return bits.view(F32)


def test_coefficients_are_fp32():
    for c in exp2_poly.COEFFS:
        assert float(F32(c)) == c


def test_relative_error_over_the_softmax_range():
    # The softmax passes x = s * scale_log2 - max <= its rescale threshold (8).
    x = np.concatenate([np.linspace(-126, 8, 2_000_001, dtype=F32),
                        -np.logspace(-30, 0, 1001, dtype=F32), [F32(0.0)]])
    got = _replay(x).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    assert np.max(np.abs(got / want - 1)) < 1e-4


@pytest.mark.parametrize("x", [-np.inf, -1e30, -1000.0, -127.5, -127.0])
def test_masked_and_tiny_give_exact_zero(x):
    assert _replay(np.array([x], F32))[0] == 0.0


def test_integers_are_exact():
    x = np.arange(-126, 9, dtype=F32)
    np.testing.assert_array_equal(_replay(x), np.exp2(x))


def test_monotone_across_integer_steps():
    x = np.linspace(-20, 8, 1_000_001, dtype=F32)
    # p(1) lands 8.6e-5 below 2: monotone up to that relative step.
    assert np.all(np.diff(_replay(x).astype(np.float64)) >= -1e-4 * np.exp2(x[1:]))
