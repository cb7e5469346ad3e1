"""Attention and scoring of a batched eviction tier (runtime/eviction/batch_heads.py): each row's own.

Every query sees the slots of its own row at or before its position (and within the layer's sliding
window); unused slots (position PAD) are seen by none. Attention goes through an explicit softmax while
some row's scorer listens, a block of queries at a time (runtime/eviction/scoring.py); the weights of a
right-padded prompt's padding queries are zeroed before any sum, and TOVA's newest row is each row's
newest real query. Once no row listens (SnapKV after every row decided), one fused SDPA with the mask.
"""

from typing import Optional

import mlx.core as mx

from .per_head import SCORE_BLOCK, SCORE_BYTES, SYNC_BYTES
from .scorers import Seen
from .scoring import additive, attend_blocked, attention_weights, block_size, expand_heads, received


def _mask(kpos: mx.array, first_q: mx.array, n: int, window: Optional[int]) -> mx.array:
    """[B, H, n, W]: a slot is seen by the queries at or after its position and within the sliding window,
    if any (PAD: by none)."""
    qpos = (first_q[:, None] + mx.arange(n, dtype=mx.int32)[None])[:, None, :, None]
    kpos = kpos[:, :, None, :]
    seen = kpos <= qpos
    return seen & (qpos - kpos < window) if window else seen


def weigher(cache, k: mx.array, kpos: mx.array):
    """weigh(queries [B, Hq, n, D], first_q [B], real [B] or None) -> attention received [B, H, W] from
    each row's queries (those a row does not have, zero rows of `queries`, dropped)."""
    tier = cache.tiers[0]

    def weigh(queries: mx.array, first_q: mx.array, real: Optional[mx.array] = None) -> mx.array:
        n = queries.shape[2]
        real_for = None if real is None else lambda s, m: _real_rows(real, n, s, m)
        _, total, _ = attend_blocked(
            queries,
            k,
            None,
            cache.scale_seen,
            lambda s, m: _mask(kpos, first_q + s, m, tier.window),
            block_size(queries.shape[0] * queries.shape[1], k.shape[2], SCORE_BLOCK, SCORE_BYTES),
            sync_bytes=SYNC_BYTES,
            real_for=real_for,
        )
        return total

    return weigh


def _real_rows(real: mx.array, n: int, s: int, m: int) -> mx.array:
    """[B, 1, 1, m, 1]: which of query rows s .. s + m are a row's real queries (the last `real` of n)."""
    j = mx.arange(s, s + m)[None]
    return (j >= n - real[:, None]).reshape(real.shape[0], 1, 1, m, 1)


def attend(cache, queries: mx.array, scale: float) -> mx.array:
    cache._awaiting_attend = False
    cache.scale_seen = scale
    rows, tier = cache.rows, cache.tiers[0]
    B, Hq, n, _ = queries.shape
    first = mx.array(rows.first_q, dtype=mx.int32)
    listening = ~rows.decided & (rows.real > 0) if tier.route.once else rows.real > 0
    if not listening.any():
        k, v = tier.decoded(queries.dtype)
        mask = additive(expand_heads(_mask(tier.positions, first, n, tier.window), Hq), queries.dtype)
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)
    k, v = tier.decoded(mx.float32)
    kpos = tier.positions
    real = mx.array(rows.real)
    padded = bool((rows.real < n).any())
    weights = "weights" in tier.needs  # SnapKV's window keeps queries, and reads no weights until it decides
    out, total, tail = attend_blocked(
        queries,
        k,
        v,
        scale,
        lambda s, m: _mask(kpos, first + s, m, tier.window),
        block_size(B * Hq, k.shape[2], SCORE_BLOCK, SCORE_BYTES),  # one block's weights, all rows: bounded
        tier.scorer.rows,
        weigh=weights,
        sync_bytes=SYNC_BYTES,
        real_for=(lambda s, m: (mx.arange(s, s + m)[None] < real[:, None]).reshape(B, 1, 1, m, 1)) if padded else None,
    )
    if padded and weights:  # each row's newest real query, not the block's last column
        last = mx.broadcast_to(mx.array(rows.real - 1)[:, None, None, None], (B, Hq, 1, queries.shape[3]))
        q = mx.take_along_axis(queries, last, axis=2)
        _, tail = received(attention_weights(q, k, scale, _mask(kpos, first + real - 1, 1, tier.window)), 1)
    seen = Seen(first_q=rows.first_q, received=total, rows=tail, queries=queries if "queries" in tier.needs else None)
    tier.scorer.observe_rows(tier, seen, listening, rows.real)
    return out.astype(queries.dtype)
