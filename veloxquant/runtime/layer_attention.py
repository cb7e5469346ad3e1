"""How a layer answers attention: one route per cache, chosen once from what its tiers declare,
and the attention over the tiers it decodes.

`TieredCache.attend` calls its route and nothing else. A route takes (cache, queries, scale,
mask, observe) and returns the attention output for the newest queries over everything held:
- `tier_partials`: every tier answers its own partial (codes, kernels, latents) or asks to be
  decoded (`Tier.answer` returns None; a tier that `decodes_only` is not asked); the cache only
  merges. The general route.
- `plain`: the fp16 recipe's one 16-bit tier (KVCache's work): SDPA over the buffer where no
  query needs a mask, else the general route.
- `per_head`: tiers whose kv heads keep different tokens (eviction, `KindBase.per_head`);
  runtime/eviction/per_head.py masks by per-head positions and feeds the scorers.
- `salient`: a score-routed tier (runtime/eviction/saliency.py) that routes tokens by the
  attention they receive: attention in query blocks, observed.
A batch of sequences has its own route (runtime/batch.py sets it with the rows).

The tiers that answer None are decoded here (`dense`, `partial`, `decoded_run`), masked by
position where a tier holds tokens some query must not see (TieredCache._needs_mask). A route
reads the cache's fields and never calls back into it on the decode path.
"""

from operator import attrgetter
from typing import Callable, List, Tuple

import mlx.core as mx

from ..kernels.partials import merge_partials, partial_attention
from . import fused
from .eviction import per_head as per_head_eviction
from .eviction.scoring import additive
from .kinds.tier import Tier

Route = Callable[..., mx.array]
_start = attrgetter("start")


def held(tiers: List) -> List:
    """The tiers holding tokens (a dropping tier holds none)."""
    return [t for t in tiers if t.count and not t.drops]


def held_in_order(tiers: List) -> List:
    """The tiers holding tokens, by position (the order decoded keys are laid out in)."""
    out = held(tiers)
    if len(out) > 1:
        out.sort(key=_start)
    return out


def route_for(cache) -> Route:
    """The route a single-sequence cache answers by (declared by its tiers at construction)."""
    if cache.per_head:
        return per_head
    if cache.saliency is not None:
        return salient
    if cache._plain is not None:
        return plain
    return tier_partials


def plain(cache, queries: mx.array, scale: float, mask, observe: bool) -> mx.array:
    Lq = queries.shape[2]
    if cache._unwindowed or Lq == 1:
        # holds every position up to the last query (a window's: those it sees): causal or no mask
        k, v = cache._plain.decoded(queries.dtype)
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask="causal" if Lq > 1 else None)
    return tier_partials(cache, queries, scale, mask, observe)


def per_head(cache, queries: mx.array, scale: float, mask, observe: bool) -> mx.array:
    cache.scale_seen = scale
    first_q = cache.offset - queries.shape[2]
    return per_head_eviction.attend(cache, held(cache.tiers), queries, scale, first_q, observe)


def salient(cache, queries: mx.array, scale: float, mask, observe: bool) -> mx.array:
    return cache.saliency.attend(held_in_order(cache.tiers), queries, scale, cache.offset - queries.shape[2], observe)


def tier_partials(cache, queries: mx.array, scale: float, mask, observe: bool) -> mx.array:
    Lq = queries.shape[2]
    first_q = cache.offset - Lq
    tiers = held_in_order(cache.tiers)
    # One query and no windows (every decode step of kivi & co): each held token is visible to it.
    seen = Lq == 1 and cache._unwindowed
    needs = [False] * len(tiers) if seen else [cache._needs_mask(t, first_q, Lq) for t in tiers]
    if len(tiers) == 1 and not needs[0]:
        answer = None if tiers[0].decodes_only else tiers[0].answer(queries, scale)
        if answer is None:  # one tier, every token visible, decoded (fp16): straight to SDPA
            k, v = tiers[0].decoded(queries.dtype)
            return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale)
        return merge_partials([answer()]).astype(queries.dtype)
    answered = []
    for t, n in zip(tiers, needs):
        if t.decodes_only:
            answered.append(None)
        else:
            answered.append(masked_answer(cache, t, queries, scale, first_q, Lq) if n else t.answer(queries, scale))
    rest = [t for t, a in zip(tiers, answered) if a is None]
    if len(rest) == len(tiers):  # every tier decoded: one SDPA over them all
        return dense(cache, tiers, queries, scale, first_q, needs)
    answers = [a for a in answered if a is not None]
    if (
        len(answers) == 1
        and rest
        and getattr(answers[0], "folds_tail", False)
        and (seen or not any(n for n, a in zip(needs, answered) if a is None))
    ):
        tail = fused.tail(rest, queries, cache.dtype, cache._tail_layouts)
        if tail:
            return answers[0](tail)  # the kernel's reduce also attends over the 16-bit tiers
    parts = [a() for a in answers]
    if rest:  # decoded together: one partial
        parts.append(partial(cache, rest, queries, scale, first_q))
    return merge_partials(parts).astype(queries.dtype)


def masked_answer(cache, tier, queries: mx.array, scale: float, first_q: int, Lq: int):
    """A tier's answer where some of its tokens are masked. One decode query and a window
    that has passed the tier's first tokens (a sliding layer: expiry drops whole key groups,
    so up to a group of expired tokens stays): the hidden tokens are a prefix, which the
    fused kernel leaves out by count (`hidden`), with no mask array built."""
    window = cache._window(tier)
    if Lq == 1 and window is not None and tier.end - 1 <= first_q:
        hidden = first_q - window + 1 - tier.start
        if 0 < hidden < tier.count:
            return tier.answer(queries, scale, hidden=hidden)
    return tier.answer(queries, scale, cache._tier_mask(tier, first_q, Lq))


def dense(cache, tiers: List[Tier], queries, scale, first_q: int, needs: List[bool]):
    """All tiers decoded, in position order, through mlx's fused SDPA (no scores in memory).
    `needs`: which tiers a mask must cover."""
    Lq = queries.shape[2]
    k, v = decoded_run(tiers, queries.dtype)
    if not any(needs):
        mask = None
    elif causal_ok(cache, tiers, first_q + Lq):
        mask = "causal"  # one contiguous run ending at the last query: bottom-right aligned
    else:
        mask = additive(mx.concatenate([cache._tier_mask(t, first_q, Lq) for t in tiers], axis=1), queries.dtype)
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)


def causal_ok(cache, tiers: List[Tier], end: int) -> bool:
    """The string mask "causal" (fused SDPA, no mask array) is exact for these keys."""
    contiguous = sum(t.count for t in tiers) == tiers[-1].end - tiers[0].start
    return contiguous and tiers[-1].end == end and all(cache._window(t) is None for t in tiers)


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
