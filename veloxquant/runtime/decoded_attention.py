"""Attention over the tiers a cache decodes (those whose `answer` was None), masked by
position where a tier holds tokens some query must not see (TieredCache._needs_mask)."""

from typing import List, Tuple

import mlx.core as mx

from ..kernels.partials import partial_attention
from .eviction.scoring import additive
from .kinds.tier import Tier


def dense(cache, held: List[Tier], queries, scale, first_q: int, needs: List[bool]):
    """All tiers decoded, in position order, through mlx's fused SDPA (no scores in memory).
    `needs`: which tiers a mask must cover."""
    Lq = queries.shape[2]
    k, v = decoded_run(held, queries.dtype)
    if not any(needs):
        mask = None
    elif causal_ok(cache, held, first_q + Lq):
        mask = "causal"  # one contiguous run ending at the last query: bottom-right aligned
    else:
        mask = additive(mx.concatenate([cache._tier_mask(t, first_q, Lq) for t in held], axis=1), queries.dtype)
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)


def causal_ok(cache, held: List[Tier], end: int) -> bool:
    """The string mask "causal" (fused SDPA, no mask array) is exact for these keys."""
    contiguous = sum(t.count for t in held) == held[-1].end - held[0].start
    return contiguous and held[-1].end == end and all(cache._window(t) is None for t in held)


def partial(cache, tiers: List[Tier], queries, scale, first_q: int):
    """One partial over the decoded tokens of `tiers` (any order: masks go by position)."""
    Lq = queries.shape[2]
    mask = None
    if any(cache._needs_mask(t, first_q, Lq) for t in tiers):
        mask = mx.concatenate([cache._tier_mask(t, first_q, Lq) for t in tiers], axis=1)
    # 16-bit stores decode exactly in their own dtype; partial_attention accumulates in float32.
    pairs = [t.decoded(cache.dtype if t.sixteen_bit else mx.float32) for t in tiers]
    if len(pairs) == 1:
        k, v = pairs[0]
    else:
        k, v = (mx.concatenate([p[i] for p in pairs], axis=2) for i in (0, 1))
    return partial_attention(queries, k, v, scale, mask)


def decoded_run(tiers: List[Tier], dtype) -> Tuple[mx.array, mx.array]:
    """K and V of `tiers` (in position order) as one buffer each, for SDPA.

    A tier the dequant kernel takes is decoded straight into its place in the
    buffer and the others are written around it in place: one 16-bit copy of the
    layer's tokens instead of a decoded copy plus a concatenated one (prefill's peak)."""
    if len(tiers) == 1:
        return tiers[0].decoded(dtype)
    lead = None
    for i, t in enumerate(tiers):  # a loop, not a generator: every decode step of every layer
        if isinstance(t, Tier) and t.dequant_kernel is not None and t.placeable(dtype):
            lead = i
            break
    pairs = {}
    for i, t in enumerate(tiers):
        if i != lead:
            pairs[i] = t.decoded(dtype)
    if lead is None:
        keys, values = zip(*pairs.values())
        return mx.concatenate(keys, axis=2), mx.concatenate(values, axis=2)
    starts = [sum(t.count for t in tiers[:i]) for i in range(len(tiers) + 1)]
    out = []
    for s, side in enumerate(("k", "v")):
        buf = tiers[lead].decoded_side(side, dtype, starts[-1], starts[lead])
        for i, pair in pairs.items():  # in place: nothing else holds the buffer (MLX donates it)
            buf[:, :, starts[i] : starts[i + 1], :] = pair[s]
        out.append(buf)
    return tuple(out)
