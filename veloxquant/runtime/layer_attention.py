"""How a layer answers attention: one route per cache, chosen once from what its tiers declare.

`TieredCache.attend` calls its route and nothing else. A route takes (cache, queries, scale,
mask, observe) and returns the attention output for the newest queries over everything held:
- `tier_partials`: every tier answers its own partial (codes, kernels, latents) or asks to be
  decoded (`Tier.answer` returns None); the cache only merges. The general route.
- `plain`: the fp16 recipe's one 16-bit tier (KVCache's work, runtime/kinds/plain.py): SDPA
  over the buffer where no query needs a mask, else the general route.
- `per_head`: tiers whose kv heads keep different tokens (eviction, `KindBase.per_head`);
  runtime/eviction/per_head.py masks by per-head positions and feeds the scorers.
- `salient`: a score-routed tier (runtime/eviction/saliency.py) that routes tokens by the
  attention they receive: attention in query blocks, observed.
A batch of sequences has its own route (runtime/batch.py sets it with the rows).
"""

from typing import Callable

import mlx.core as mx

from ..kernels.partials import merge_partials
from . import decoded_attention, fused
from .eviction import per_head as per_head_eviction

Route = Callable[..., mx.array]


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
        k, v = cache._plain.fetch(queries.dtype)
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask="causal" if Lq > 1 else None)
    return tier_partials(cache, queries, scale, mask, observe)


def per_head(cache, queries: mx.array, scale: float, mask, observe: bool) -> mx.array:
    cache.scale_seen = scale
    first_q = cache.offset - queries.shape[2]
    return per_head_eviction.attend(cache, cache.held(), queries, scale, first_q, observe)


def salient(cache, queries: mx.array, scale: float, mask, observe: bool) -> mx.array:
    return cache.saliency.attend(cache.held_in_order(), queries, scale, cache.offset - queries.shape[2], observe)


def tier_partials(cache, queries: mx.array, scale: float, mask, observe: bool) -> mx.array:
    Lq = queries.shape[2]
    first_q = cache.offset - Lq
    held = cache.held_in_order()
    # One query and no windows (every decode step of kivi & co): each held token is visible to it.
    seen = Lq == 1 and cache._unwindowed
    needs = [False] * len(held) if seen else [cache._needs_mask(t, first_q, Lq) for t in held]
    if len(held) == 1 and not needs[0]:
        answer = held[0].answer(queries, scale)
        if answer is None:  # one tier, every token visible, decoded (fp16): straight to SDPA
            k, v = held[0].decoded(queries.dtype)
            return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale)
        return merge_partials([answer()]).astype(queries.dtype)
    answered = [
        masked_answer(cache, t, queries, scale, first_q, Lq) if n else t.answer(queries, scale)
        for t, n in zip(held, needs)
    ]
    rest = [t for t, a in zip(held, answered) if a is None]
    if len(rest) == len(held):
        return decoded_attention.dense(cache, held, queries, scale, first_q, needs)
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
        parts.append(decoded_attention.partial(cache, rest, queries, scale, first_q))
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
