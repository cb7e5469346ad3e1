"""Attention by tiers: each tier answers a partial (output, log-sum-exp) and the
partials merge exactly, flash-decoding style.

Decode runs this once per layer per token, so op count is host time (and a
kernel launch each on the GPU): the unmasked path skips the guards a mask
needs, and merging is one compiled elementwise kernel per extra tier.
"""

from functools import partial
from typing import Callable, List, Optional, Tuple

import mlx.core as mx

Partial = Tuple[mx.array, mx.array]  # out [B, Hq, Lq, D] (normalized, f32), lse [B, Hq, Lq]

# float32 scores one block of query positions may hold (64 MiB): a long prefill chunk over a long
# tier attends in blocks of queries, never as one [batch x heads x queries x keys] array.
SCORE_ELEMENTS = 1 << 24


def hides_tokens(hidden) -> bool:
    """`hidden` (a front count, or an int32 [B, 2] array of each batch row's visible span) leaves
    some token out: the launches that take it then need a kernel that reads it."""
    return isinstance(hidden, mx.array) or hidden > 0


def hide(scores: mx.array, hidden) -> mx.array:
    """scores [B, H, R, L] with the tokens `hidden` leaves out at -inf: an int hides the first
    `hidden` tokens of every row (a sliding window's expired front); an int32 [B, 2] array leaves
    batch row b only the tokens [hidden[b, 0], hidden[b, 1]) (a ragged batch's rows)."""
    at = mx.arange(scores.shape[-1])
    if isinstance(hidden, mx.array):
        return mx.where((at >= hidden[:, :1, None, None]) & (at < hidden[:, 1:, None, None]), scores, -mx.inf)
    return mx.where(at < hidden, -mx.inf, scores) if hidden else scores


def query_rows(mask: Optional[mx.array], Lq: int, start: int, n: int) -> Optional[mx.array]:
    """The rows [start, start + n) of a mask broadcastable to [..., Lq, Lk] (one without a query axis as is)."""
    if mask is None or mask.ndim < 2 or mask.shape[-2] != Lq:
        return mask
    return mask[..., start : start + n, :]


def partial_attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Optional[mx.array] = None
) -> Partial:
    """softmax(q k^T * scale) v over one tier, GQA-aware, accumulated in float32.

    `mask` is boolean, broadcastable to [Lq, Lk] (True = may attend).
    """
    B, Hq, Lq, D = queries.shape
    Hkv, Lk = keys.shape[1], keys.shape[2]
    keys, values = keys.astype(mx.float32), values.astype(mx.float32)
    block = max(1, SCORE_ELEMENTS // max(1, B * Hq * Lk))
    if Lq <= block:
        return _partial(queries, keys, values, scale, mask, Hkv)
    parts = [
        _partial(queries[:, :, s : s + block], keys, values, scale, query_rows(mask, Lq, s, block), Hkv)
        for s in range(0, Lq, block)
    ]
    return mx.concatenate([o for o, _ in parts], axis=2), mx.concatenate([l for _, l in parts], axis=2)


# An additive mask's value for a key no query of the row may see: far below any score, finite so that a
# row seeing nothing gets a finite partial whose lse (about MASKED) weighs nothing in the merge.
MASKED = -1e30


def biased_partial(queries: mx.array, keys: mx.array, values: mx.array, scale: float, bias: mx.array) -> Partial:
    """partial_attention for a short tier under an additive float32 mask `bias` (0 seen, MASKED not),
    broadcastable to [B, 1, 1, Lk]: one LogSumExp instead of the guarded max/sum/log of a boolean
    mask, about half the primitives (a batch's decode step runs it for every layer)."""
    B, Hq, Lq, D = queries.shape
    Hkv = keys.shape[1]
    q = queries.reshape(B, Hkv, (Hq // Hkv) * Lq, D).astype(mx.float32) * scale
    scores = q @ keys.astype(mx.float32).swapaxes(-1, -2) + bias
    lse = mx.logsumexp(scores, axis=-1, keepdims=True)
    out = mx.exp(scores - lse) @ values.astype(mx.float32)
    return out.reshape(B, Hq, Lq, -1), lse.reshape(B, Hq, Lq)


def _partial(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask, Hkv: int) -> Partial:
    B, Hq, Lq, D = queries.shape
    # The rep query heads of a kv head become rows of one matmul (no broadcast K/V).
    q = queries.reshape(B, Hkv, (Hq // Hkv) * Lq, D).astype(mx.float32) * scale
    scores = q @ keys.swapaxes(-1, -2)  # [B, Hkv, rep*Lq, Lk]
    return partial_from_scores(scores, mask, Lq, lambda weights: weights @ values)


def partial_from_scores(
    scores: mx.array, mask: Optional[mx.array], Lq: int, combine: Callable[[mx.array], mx.array]
) -> Partial:
    """The partial of one tier from its scores [B, Hkv, rep*Lq, Lk] (scaled, float32).

    `combine(weights)` returns sum_k weights·v [B, Hkv, rep*Lq, D]: plain values, or a
    tier's own way to that sum (latents: (Σ a·z)·Pᵀ). Output as [B, Hkv*rep, Lq, D]."""
    B, Hkv, R, Lk = scores.shape
    rep = R // Lq
    if mask is not None:
        scores = mx.where(mask, scores.reshape(B, Hkv, rep, Lq, Lk), -mx.inf).reshape(B, Hkv, R, Lk)
    peak = mx.max(scores, axis=-1, keepdims=True)
    if mask is not None:
        # A row that may attend to nothing here gets lse=-inf and weight 0 in the merge.
        peak = mx.where(mx.isinf(peak), 0.0, peak)
    weights = mx.exp(scores - peak)
    total = mx.sum(weights, axis=-1, keepdims=True)
    if mask is not None:
        total = mx.maximum(total, 1e-30)
    out = combine(weights) / total
    lse = mx.log(total) + peak
    return out.reshape(B, Hkv * rep, Lq, -1), lse.reshape(B, Hkv * rep, Lq)


@partial(mx.compile, shapeless=True)
def _merge2(o1: mx.array, l1: mx.array, o2: mx.array, l2: mx.array):
    """Two partials -> one (exact); a row empty in both stays empty (out 0, lse -inf)."""
    peak = mx.maximum(l1, l2)
    peak = mx.where(mx.isinf(peak), 0.0, peak)
    w1, w2 = mx.exp(l1 - peak), mx.exp(l2 - peak)
    total = w1 + w2
    out = (w1[..., None] * o1 + w2[..., None] * o2) / mx.maximum(total, 1e-30)[..., None]
    return out, mx.log(total) + peak


@partial(mx.compile, shapeless=True)
def _blend(o1: mx.array, l1: mx.array, o2: mx.array, l2: mx.array) -> mx.array:
    # softmax weights of two partials: w1 / (w1 + w2) = sigmoid(l1 - l2)
    return o2 + mx.sigmoid(l1 - l2)[..., None] * (o1 - o2)


def blend_two(first: Partial, second: Partial) -> mx.array:
    """The output of exactly two partials (no lse): fewer primitives than merge_partials, for a
    batch's decode step. Every row must see some token in one of them (a row seeing nothing in
    both gives NaN where merge_partials gives 0; a decode query always sees itself)."""
    return _blend(*first, *second)


def merge_partials(parts: List[Partial]) -> mx.array:
    """Exact softmax over the union of the tiers' tokens from their partials."""
    out, lse = parts[0]
    for o, l in parts[1:]:
        out, lse = _merge2(out, lse, o, l)
    return out
