"""Attention and scoring for layers whose kv heads keep different tokens.

When a layer has an eviction tier (HeadTier), keys are masked by their
per-head positions, and the tier's scorer is fed from the very attention the
model computes:
  mass / current  the weights of this step's real queries (explicit softmax);
  proxy           the new keys stand in for queries (the model's own output
                  still comes from fused SDPA);
  snap            the last `window` prompt queries are kept, and vote once,
                  at the end of the prompt (see finish_prompt).
"""
from typing import List, Optional

import mlx.core as mx

from .scoring import (attend_with_weights, attention_weights, expand_heads, max_pool, position_mask, received,
                      received_blocked)

SCORE_BLOCK = 128  # queries whose explicit softmax weights are held at once while scoring


def _positions(tier, B: int, H: int) -> mx.array:
    if getattr(tier, "per_head", False):
        return tier.positions
    return mx.broadcast_to(mx.arange(tier.start, tier.end, dtype=mx.int32), (B, H, tier.count))


def _gather(cache, held: List, dtype):
    """Keys, values and per-head positions of everything held, plus each tier's slice."""
    pairs = [t.decoded(dtype) for t in held]
    k, v = (mx.concatenate([p[i] for p in pairs], axis=2) for i in (0, 1))
    B, H = k.shape[:2]
    kpos = mx.concatenate([_positions(t, B, H) for t in held], axis=2)
    slices, at = [], 0
    for t in held:
        slices.append(slice(at, at + t.count))
        at += t.count
    return k, v, kpos, slices


def _mask(cache, held, kpos, first_q: int, Lq: int) -> Optional[mx.array]:
    """Per-kv-head mask, or None when every held key is visible to every query."""
    windows = [cache._window(t) for t in held]
    if Lq == 1 and all(w is None for w in windows):
        return None  # decode: everything held is older than the one query
    masks, at = [], 0
    for t, window in zip(held, windows):
        masks.append(position_mask(kpos[:, :, at:at + t.count], first_q, Lq, window))
        at += t.count
    return mx.concatenate(masks, axis=-1)


def _causal(cache, held: List, end: int) -> bool:
    """Every head holds the same contiguous run of positions ending at the last query
    (nothing evicted yet, no window): SDPA's "causal" is exact, no mask array needed."""
    spans = []
    for t in held:
        if cache._window(t) is not None or (getattr(t, "per_head", False) and not t.uniform):
            return False
        spans.append((t.first, t.first + t.count) if getattr(t, "per_head", False) else (t.start, t.end))
    # In the order _gather concatenates them: "causal" masks by index, not by position.
    contiguous = all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    return contiguous and spans[-1][1] == end


def attend(cache, held: List, queries: mx.array, scale: float, first_q: int, observe: bool) -> mx.array:
    Lq, Hq = queries.shape[2], queries.shape[1]
    scorers = [(t, i) for i, t in enumerate(held) if getattr(t, "per_head", False)]
    live = observe and any(t.route.score in ("mass", "current") for t, _ in scorers)
    blocked = live and Lq > SCORE_BLOCK  # prefill: fused output, weights a block of queries at a time
    k, v, kpos, slices = _gather(cache, held, mx.float32 if live and not blocked else queries.dtype)
    mask = _mask(cache, held, kpos, first_q, Lq)
    sdpa_mask = None  # what fused SDPA gets: the mask array, or "causal" while heads agree
    if mask is not None:
        sdpa_mask = "causal" if _causal(cache, held, first_q + Lq) else expand_heads(mask, Hq)
    if live:
        if blocked:
            out = mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=sdpa_mask)
            total, newest = received_blocked(queries, k, scale, mask, SCORE_BLOCK)
        else:
            out, w = attend_with_weights(queries, k, v, scale, mask)
            total, newest = received(w)
        for t, i in scorers:
            if t.route.score in ("mass", "current"):
                t.observe(total[..., slices[i]], newest[..., slices[i]])
        return out.astype(queries.dtype)
    out = mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=sdpa_mask)
    if observe:
        for t, i in scorers:
            if t.route.score == "proxy" and cache.new_keys is not None:
                _observe_proxy(cache, t, k, slices[i], mask, scale)
            elif t.route.once and not t.decided:
                keep = t.route.window
                prev = cache.observed_queries
                q = queries if prev is None else mx.concatenate([prev, queries], axis=2)
                cache.observed_queries = q[:, :, -keep:]
    return out


def _observe_proxy(cache, tier, k, where: slice, mask, scale: float) -> None:
    """Keys of the new block act as queries (one per kv head): the approximation."""
    proxy = cache.new_keys  # [B, Hkv, n, D], positions first_q..
    w = attention_weights(proxy, k, scale, mask)
    total, newest = received(w)
    tier.observe(total[..., where], newest[..., where])


def finish_prompt(cache) -> None:
    """End of the prompt: SnapKV tiers vote with the observed window queries, once."""
    pending = [t for t in cache.tiers if getattr(t, "per_head", False) and t.route.once and not t.decided]
    if not pending:
        return
    cache._settle()
    q = cache.observed_queries
    for t in pending:
        if t.count > t.route.budget and q is not None:
            held = cache.held()
            k, _, kpos, slices = _gather(cache, held, mx.float32)
            first_q = cache.offset - q.shape[2]
            w = attention_weights(q, k, cache.scale_seen, _mask(cache, held, kpos, first_q, q.shape[2]))
            votes, _ = received(w)
            votes = max_pool(votes[..., slices[held.index(t)]], t.route.pool)
            in_window = t.positions >= cache.offset - t.route.window
            t.keep(mx.where(in_window, mx.inf, votes), cache.offset)
        t.decided = True
    cache.observed_queries = None
