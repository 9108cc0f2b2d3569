"""The FLOP convention of the FlashAttention papers and ../shared/anchors.

forward  = 2 * B * H * (visible (query, key) pairs) * (D + Dv)
           (4 * B * H * S * S * D for square non-causal; half of it for square causal)
backward = 2.5 * forward

The backward's five GEMMs are 2 * pairs * (3 D + 2 Dv) (S = Q K^T and dP = dO V^T
again, dV, dK, dQ): 2.5 * forward where D == Dv; with D 192 / Dv 128 the convention
counts 3.8% fewer FLOPs than are done, for every backend alike (ratios stand).
"""

# The standard cells' shapes (../shared/anchors): 16k tokens a batch (batch = TOKENS /
# seqlen), hidden HIDDEN (heads = HIDDEN / head_dim).
TOKENS, HIDDEN = 16384, 2048


def visible_pairs(seqlen_q: int, seqlen_k: int, causal: bool, window_left=None) -> int:
    """Pairs (i, j) with j < Sk, and j <= i + Sk - Sq when causal (bottom-right), and
    j >= i + Sk - Sq - window_left with a (causal) sliding window.

    Square causal counts S * S / 2, the papers' convention, not S * (S + 1) / 2; a
    window counts its pairs exactly."""
    if window_left is not None:
        if not causal:
            raise ValueError("window_left counts a causal sliding window: pass causal=True")
        offset = seqlen_k - seqlen_q
        return sum(max(0, min(seqlen_k, i + offset + 1) - max(0, i + offset - window_left))
                   for i in range(seqlen_q))
    if not causal:
        return seqlen_q * seqlen_k
    if seqlen_q == seqlen_k:
        return seqlen_q * seqlen_k // 2
    offset = seqlen_k - seqlen_q
    return sum(min(seqlen_k, max(0, i + offset + 1)) for i in range(seqlen_q))


def attention_flops(b, h, seqlen_q, seqlen_k, d, causal, mode, dv=None, window_left=None,
                    documents=1):
    """`documents`: square rows packed with that many equal documents (segment ids), each
    attending within itself."""
    pairs = documents * visible_pairs(seqlen_q // documents, seqlen_k // documents, causal,
                                      window_left)
    if mode not in ("fwd", "bwd", "bwd_det"):
        raise ValueError(f"mode must be fwd, bwd or bwd_det; got {mode!r}")
    fwd = 2 * b * h * pairs * (d + (dv or d))
    return fwd * (1.0 if mode == "fwd" else 2.5)
