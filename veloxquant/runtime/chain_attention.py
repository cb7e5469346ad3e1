"""Attention of a batch of tier chains (runtime/batch_chain.py): each row over its own filled columns.

A decode step (one query per row, no window) attends each coded tier from its codes, every row in one
kernel launch with the row's visible span as an input (runtime/fused.py `rows_answer`), and the 16-bit
window and sinks as decoded arrays under a column mask; the partials merge exactly. Other blocks
(prefill chunks, sliding windows) decode every tier and run one SDPA under a mask built on the device.
"""

from typing import Optional

import mlx.core as mx
import numpy as np

from ..kernels.partials import MASKED, biased_partial, blend_two, merge_partials
from . import fused, row_index

FAR = 2**31 - 1  # the position of a column its row has not filled: no query reaches it


def mask(cache, counts, starts, first_q: np.ndarray, real: np.ndarray, n: int, window: Optional[int] = None):
    """[B, 1, n, keys] over the held tiers in tier order (a tier's width is its longest row): a key is
    seen by the queries at or after its position (and within the window); a column its row has not
    filled, by none. Built on the device from the [B] counts (a prefill chunk's mask over a long
    tier is large). `window`: mlx-lm's for the layer; each tier's own (TieredCache.windows: a
    recent(n) whose spill is dropped sees n+1 keys back) narrows it. Rows alike with no window
    (one sequence prefilled alone, or rows that started together): "causal" or None, as KVCache's."""
    if _rows_alike(cache, counts, first_q, real, n, window):
        return "causal" if n > 1 else None
    q = (mx.array(first_q.astype(np.int32))[:, None] + mx.arange(n, dtype=mx.int32)[None])[:, :, None]  # [B, n, 1]
    parts = []
    for held, start, own in zip(counts, starts, cache.windows):
        cols = mx.arange(int(held.max(initial=0)), dtype=mx.int32)[None]
        filled = cols < mx.array(held.astype(np.int32))[:, None]
        k = mx.where(filled, mx.array(start.astype(np.int32))[:, None] + cols, FAR)[:, None, :]  # [B, 1, W]
        seen = k <= q
        reach = min(w for w in (window, own) if w) if (window or own) else None
        if reach:
            seen = seen & (q - k < reach)
        parts.append(seen)
    return mx.concatenate(parts, axis=2)[:, None]


def _rows_alike(cache, counts, first_q: np.ndarray, real: np.ndarray, n: int, window: Optional[int]) -> bool:
    """Every row holds the same positions and no window narrows: the held keys in tier order are in
    position order, the block's tokens (all real) the last of them."""
    return (
        window is None
        and cache._unwindowed
        and bool((first_q == first_q[0]).all())
        and bool((real == n).all())
        and bool((counts == counts[:, :1]).all())
    )


def fetch(cache, dtype):
    """Every held tier decoded, in tier order: [B, H, keys, D] each of K and V."""
    return _decoded([t for t in cache.tiers if t.ragged_width()], dtype)


def _decoded(tiers, dtype):
    """K and V of `tiers` decoded and joined along the key axis, in the order given."""
    pairs = [t.decoded(dtype) for t in tiers]
    if len(pairs) == 1:
        return pairs[0]
    return tuple(mx.concatenate([p[s] for p in pairs], axis=2) for s in (0, 1))


def attend(cache, queries: mx.array, scale: float):
    if queries.shape[2] == 1 and cache._unwindowed:
        out = _by_tiers(cache, queries, scale)
        if out is not None:
            return out
    rows = cache.rows
    seen = mask(cache, rows.counts, rows.starts, *rows.queries, cache.plan.window)
    k, v = fetch(cache, queries.dtype)
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=seen)


def _by_tiers(cache, queries: mx.array, scale: float) -> Optional[mx.array]:
    """One decode query per row and no window: each row sees its own filled columns of every tier.
    A tier a fused kernel reads answers from its codes for every row in one launch (runtime/fused.py);
    the others are decoded and attended together, their unfilled columns masked; the partials merge.
    None where no tier has a kernel (the caller decodes all: one SDPA)."""
    answers, rest = [], []
    for tier, counts in zip(cache.tiers, cache.rows.counts):
        if tier.ragged_width():
            found = fused.rows_answer(tier, queries, scale, counts) if tier.fusable else None
            (rest.append((tier, counts)) if found is None else answers.append(found))
    if not answers:
        return None
    parts = [a() for a in answers]
    if rest:
        k, v = _decoded([t for t, _ in rest], queries.dtype)
        widths = tuple(t.ragged_width() for t, _ in rest)
        key = ("seen", widths, *(c.tobytes() for _, c in rest))
        bias = row_index.shared(key, lambda: _unfilled_bias(widths, [c for _, c in rest]))
        parts.append(biased_partial(queries, k, v, scale, bias))
    out = blend_two(*parts) if len(parts) == 2 else merge_partials(parts)  # the window holds each row's query
    return out.astype(queries.dtype)


def _unfilled_bias(widths, counts) -> mx.array:
    """[B, 1, 1, keys] float32: 0 on the columns of the tiers (these widths, in order) each row has
    filled, MASKED on the others."""
    seen = np.concatenate([np.arange(w)[None] < c[:, None] for w, c in zip(widths, counts)], axis=1)
    return mx.array(np.where(seen, 0.0, MASKED).astype(np.float32)[:, None, None, :])
