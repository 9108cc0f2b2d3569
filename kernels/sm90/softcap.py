"""Logit soft-capping in the softcap kernel variants: the softmax sees c * tanh(s * S / c)
for scores S, softmax scale s and runtime cap c.

The kernels keep applying s (in base 2) inside the softmax, so the map done here is
    S -> tanh(S * softcap_scale) / softcap_scale,   softcap_scale = s / c,
and the backward's dS carries its derivative 1 - tanh^2. Both run before masking: a
masked score must stay -inf. tanh is the hardware's approximate one (tanh.approx.f32,
relative error about 2^-11, one instruction): the exact one halved the forward's speed.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32


@cute.jit
def cap_scores(s_rc: cute.Tensor, softcap_scale: Float32):
    """The map above, in place on the (rows, cols) scores `s_rc`."""
    inv = Float32(1.0) / softcap_scale
    for r in cutlass.range_constexpr(cute.size(s_rc, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
            s_rc[r, c] = cute.math.tanh(s_rc[r, c] * softcap_scale, approx=True) * inv


@cute.jit
def cap_scores_and_slope(s_rc: cute.Tensor, slope_rc: cute.Tensor, softcap_scale: Float32):
    """cap_scores, and the map's derivative 1 - tanh^2 into `slope_rc` (same shape, in
    its own dtype: the 16-bit register tile dS will later take)."""
    inv = Float32(1.0) / softcap_scale
    for r in cutlass.range_constexpr(cute.size(s_rc, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
            t = cute.math.tanh(s_rc[r, c] * softcap_scale, approx=True)
            s_rc[r, c] = t * inv
            slope_rc[r, c] = (Float32(1.0) - t * t).to(slope_rc.element_type)
