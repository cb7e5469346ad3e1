"""Attention with its weights in hand, for scorers that rank tokens by the
attention they receive (H2O, TOVA, SnapKV) — masks by per-head positions.

mlx's fused SDPA never materialises the weights, so scoring layers compute
softmax(q k^T) explicitly, in float32, over everything the layer holds.
"""
from typing import Optional, Tuple

import mlx.core as mx


def position_mask(kpos: mx.array, first_q: int, Lq: int, window: Optional[int]) -> mx.array:
    """kpos [..., L] -> boolean [..., Lq, L]: key not after the query, inside its window."""
    qpos = mx.arange(first_q, first_q + Lq, dtype=mx.int32)[:, None]
    kpos = kpos[..., None, :]
    mask = kpos <= qpos
    if window is not None:
        mask = mask & (qpos - kpos < window)
    return mask


def expand_heads(mask: mx.array, n_q_heads: int) -> mx.array:
    """A per-kv-head mask [B, Hkv, Lq, L] repeated for the query heads of each group."""
    B, Hkv, Lq, L = mask.shape
    rep = n_q_heads // Hkv
    return mx.broadcast_to(mask[:, :, None], (B, Hkv, rep, Lq, L)).reshape(B, n_q_heads, Lq, L)


def attention_weights(queries: mx.array, keys: mx.array, scale: float, mask: Optional[mx.array]) -> mx.array:
    """softmax(q k^T * scale), GQA-aware: [B, Hkv, rep, Lq, L] in float32.

    `mask` is per kv head, [B, Hkv, Lq, L] (True = may attend)."""
    B, Hq, Lq, D = queries.shape
    Hkv = keys.shape[1]
    q = queries.astype(mx.float32).reshape(B, Hkv, Hq // Hkv, Lq, D) * scale
    scores = q @ keys.astype(mx.float32)[:, :, None].swapaxes(-1, -2)
    if mask is not None:
        scores = mx.where(mask[:, :, None], scores, -mx.inf)
    return mx.softmax(scores, axis=-1, precise=True)


def attend_with_weights(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                        mask: Optional[mx.array]) -> Tuple[mx.array, mx.array]:
    """(output [B, Hq, Lq, D] float32, weights [B, Hkv, rep, Lq, L])."""
    B, Hq, Lq, _ = queries.shape
    w = attention_weights(queries, keys, scale, mask)
    out = w @ values.astype(mx.float32)[:, :, None]
    return out.reshape(B, Hq, Lq, -1), w


def received_blocked(queries: mx.array, keys: mx.array, scale: float, mask: Optional[mx.array],
                     block: int, rows: int = 1) -> Tuple[mx.array, mx.array]:
    """`received` of attention_weights(...), computed `block` queries at a time: rows are
    independent softmaxes, so the sums are exact and only one block of weights lives at once.
    The newest `rows` rows are the last block's when it has them, else weighed on their own."""
    Lq = queries.shape[2]
    total = tail = None
    for s in range(0, Lq, block):
        part = mask[:, :, s:s + block] if mask is not None else None
        t, tail = received(attention_weights(queries[:, :, s:s + block], keys, scale, part), rows)
        total = t if total is None else total + t
    if tail.shape[2] < min(rows, Lq):
        part = mask[:, :, -rows:] if mask is not None else None
        _, tail = received(attention_weights(queries[:, :, -rows:], keys, scale, part), rows)
    return total, tail


def received(weights: mx.array, rows: int = 1) -> Tuple[mx.array, mx.array]:
    """Attention each key received, summed over the query heads sharing its kv head:
    (from all queries [B, Hkv, L], from each of the newest `rows` queries [B, Hkv, rows, L])."""
    return mx.sum(weights, axis=(2, 3)), mx.sum(weights[:, :, :, -rows:], axis=2)


def max_pool(x: mx.array, size: int) -> mx.array:
    """Max over `size` neighbouring tokens (axis -1), same length (SnapKV's pooling)."""
    if size <= 1:
        return x
    left = size // 2
    pad = mx.full((*x.shape[:-1], left), -mx.inf, x.dtype)
    pad_r = mx.full((*x.shape[:-1], size - 1 - left), -mx.inf, x.dtype)
    padded = mx.concatenate([pad, x, pad_r], axis=-1)
    L = x.shape[-1]
    out = padded[..., :L]
    for i in range(1, size):  # a loop over the kernel width, not over tokens
        out = mx.maximum(out, padded[..., i:i + L])
    return out
