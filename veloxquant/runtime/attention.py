"""Attention by tiers: each tier answers a partial (output, log-sum-exp) and the
partials merge exactly, flash-decoding style.
"""
from typing import List, Optional, Tuple

import mlx.core as mx

Partial = Tuple[mx.array, mx.array]  # out [B, Hq, Lq, D] (normalized, f32), lse [B, Hq, Lq]


def partial_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                      mask: Optional[mx.array] = None) -> Partial:
    """softmax(q k^T * scale) v over one tier, GQA-aware, accumulated in float32.

    `mask` is boolean, broadcastable to [Lq, Lk] (True = may attend).
    """
    B, Hq, Lq, D = queries.shape
    Hkv = keys.shape[1]
    rep = Hq // Hkv
    q = queries.astype(mx.float32).reshape(B, Hkv, rep, Lq, D) * scale
    k = keys.astype(mx.float32)[:, :, None]
    v = values.astype(mx.float32)[:, :, None]
    scores = q @ k.swapaxes(-1, -2)  # [B, Hkv, rep, Lq, Lk]
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf)
    peak = mx.stop_gradient(mx.max(scores, axis=-1, keepdims=True))
    # A row that may attend to nothing here gets lse=-inf and weight 0 in the merge.
    peak = mx.where(mx.isinf(peak), 0.0, peak)
    weights = mx.exp(scores - peak)
    total = mx.sum(weights, axis=-1, keepdims=True)
    out = (weights @ v) / mx.maximum(total, 1e-30)
    lse = (mx.log(total) + peak).squeeze(-1)
    return out.reshape(B, Hq, Lq, -1), lse.reshape(B, Hq, Lq)


def merge_partials(parts: List[Partial]) -> mx.array:
    """Exact softmax over the union of the tiers' tokens from their partials."""
    if len(parts) == 1:
        return parts[0][0]
    lses = mx.stack([lse for _, lse in parts])
    peak = mx.max(lses, axis=0)
    peak = mx.where(mx.isinf(peak), 0.0, peak)
    weights = mx.exp(lses - peak)  # [T, B, Hq, Lq]
    out = sum(w[..., None] * o for w, (o, _) in zip(weights, parts))
    return out / mx.maximum(mx.sum(weights, axis=0), 1e-30)[..., None]
