"""MorphKV (Ghadia et al., ICML 2025): a token's relevance is the mean
attention it got from the last `window` real queries, recomputed every step
and never accumulated, so old heavy hitters cannot crowd out the current
topic. Each held token keeps its rows from those queries (a ring of `window`
floats, gathered with it on eviction). window=1 is TOVA, bit for bit."""

import mlx.core as mx

from .base import Scorer, scorer


@scorer("morph")
class Morph(Scorer):
    def __init__(self, route):
        super().__init__(route)
        self.rows = route.window

    def observe(self, tier, seen):
        new = seen.rows.swapaxes(-1, -2)  # [B, H, L, r], oldest query first
        old = tier.meta["rows"].view()
        keep = self.route.window - new.shape[-1]
        tier.meta["rows"].set(mx.concatenate([old[..., -keep:], new], axis=-1) if keep > 0 else new)

    def priority(self, tier, offset, weigh):
        return mx.sum(tier.meta["rows"].view(), axis=-1) / self.route.window
