"""Trimming a layer's cache: all or nothing, as mlx-lm's trim_prompt_cache needs.

mlx-lm asks every layer's is_trimmable(), then calls trim(n) on each and ignores
what they return (LRUPromptCache continues from the position it asked for). So
trim(n) rewinds exactly min(n, offset) positions, or, where the layer cannot,
is_trimmable() is False and trim changes nothing and returns 0. Which recipe
trims when: docs/architecture.md, "Trimming and deep copies".
"""

from ..compiler.groups import shared_tiers
from .eviction import deferred


def trimmable(cache) -> bool:
    """The layer holds every position it has seen (nothing dropped, evicted or expired:
    mlx-lm's RotatingKVCache refuses likewise once it has wrapped) and no cross-layer
    group shares its codes yet (a reuse layer's tokens decode from its anchor's codes,
    so a cut group could not be re-held)."""
    cache._settle()
    if cache.size() != cache.offset:
        return False
    # A tier that cannot hand its tokens back (latent tiers: the fp16 values are gone and
    # a cut group could not be re-held) says so; the layer is untrimmable once it holds any.
    if any(not t.can_rewind for t in cache.held()):
        return False
    shared = getattr(cache, "coordinator", None) and cache.plan.share
    return not (shared and any(cache.tiers[t].count for t in shared_tiers(cache.plan)))


def trim(cache, n: int) -> int:
    """Rewind the newest min(n, offset) positions, or nothing (returns 0). A quantized
    group cut in two is decoded, and its older part goes back to the tier new tokens
    enter (the fp16 window), so every position before the cut is still held."""
    if n <= 0 or not trimmable(cache):
        return 0
    n = min(n, cache.offset)
    left, refill = n, None
    while left:
        newest = max(cache.held(), key=lambda t: t.end)
        take = min(left, newest.count)
        whole = -(-take // newest.granularity) * newest.granularity
        if whole == take:
            newest.drop_back(take)
        else:  # granular tiers hold whole groups: trimmable() checked nothing is missing before them
            k, v, start = newest.take_back(whole, cache.dtype)
            refill = (k[:, :, : whole - take], v[:, :, : whole - take], start)
        left -= take
    cache.offset -= n
    deferred.rewind(cache, n)  # decode queries held unscored (evict(slack)): the newest n are gone
    for tier in cache.tiers:  # SnapKV's pending query window: its newest queries are gone too
        if tier.scorer is not None:
            tier.scorer.rewind(n)
    if refill is not None:
        cache._place(0, *refill)
        cache._unsettled = True
    return n
