"""exp2 on the FMA units (FlashAttention-4's emulated exponential), as a PTX block.

2^x = 2^j * 2^f with j = floor(x) and f = x - j in [0, 1); 2^f comes from a cubic, and
j is added to the cubic's exponent bits. Adding 1.5 * 2^23 rounding down leaves j in
the low mantissa bits of t (two's complement), so t's bits shifted up by 23 are j in
the exponent field. x is clamped at -127 first: there j = -127 and f = 0, the cubic is
exactly 1 and the sum of the bits exactly +0, so a masked (-inf) score gives p = 0 as
MUFU's ex2 does. Valid for x <= 127 (the softmax passes x <= its rescale threshold).

Plain Python: tests/cpu/test_exp2_poly.py replays the same steps in numpy.
"""

import struct

# 2^f ~ 1 + f (c1 + f (c2 + f c3)) on [0, 1): fp32 coefficients of least max relative
# error, fitted by Lawson's reweighted least squares; 8.6e-5, far below the 2^-9 of
# bf16's rounding of P. The constant term is exactly 1 (see above).
COEFFS = (0.6951169371604919, 0.2276444286108017, 0.0770675539970398)
CLAMP = -127.0
SHIFTER = 1.5 * 2.0**23


def _f32(x: float) -> str:
    """A PTX fp32 literal, exact for fp32-representable x."""
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", x))[0]


C1, C2, C3 = (_f32(c) for c in COEFFS)
# $0: the result's bits (b32), $1: x (f32).
PTX = f"""{{
.reg .f32 x, t, j, f, p;
.reg .b32 e, b;
max.f32 x, $1, {_f32(CLAMP)};
add.rm.f32 t, x, {_f32(SHIFTER)};
sub.f32 j, t, {_f32(SHIFTER)};
sub.f32 f, x, j;
fma.rn.f32 p, f, {C3}, {C2};
fma.rn.f32 p, p, f, {C1};
fma.rn.f32 p, p, f, 0f3F800000;
mov.b32 e, t;
shl.b32 e, e, 23;
mov.b32 b, p;
add.s32 $0, b, e;
}}"""
