"""Scores from the attention this step's real queries paid each token.

mass     H2O: accumulated, every query adds what it paid (favours old tokens,
         which more queries could see)
mean     kvpress's ObservedAttention: the same sum divided by the number of
         queries that could see the token, so early tokens are not favoured
         (optionally max-pooled over `pool` neighbours, as SnapKV pools)
current  TOVA: the newest query's weights only; nothing carries over
"""

import mlx.core as mx

from ..scoring import max_pool
from .base import Scorer, observers, scorer


@scorer("mass")
class Mass(Scorer):
    def observe(self, tier, seen):
        tier.set_scores(tier.scores + seen.received)


@scorer("mean")
class Mean(Mass):
    def priority(self, tier, offset, weigh):
        mean = tier.scores / mx.maximum(observers(tier, offset), 1.0)
        return max_pool(mean, self.route.pool) if self.route.pool > 1 else mean


@scorer("current")
class Current(Scorer):
    def observe(self, tier, seen):
        tier.set_scores(seen.rows[:, :, -1])
