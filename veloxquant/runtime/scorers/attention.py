"""Scores from the attention this step's real queries paid each token.

mass     H2O: accumulated, every query adds what it paid (favours old tokens,
         which more queries could see)
mean     kvpress's ObservedAttention: the same sum divided by the number of
         queries that could see the token, so early tokens are not favoured
current  TOVA: the newest query's weights only; nothing carries over
"""
import mlx.core as mx

from . import Scorer, observers, scorer


@scorer("mass")
class Mass(Scorer):
    needs = frozenset({"weights"})

    def observe(self, tier, seen):
        tier.set_scores(tier.scores + seen.received)


@scorer("mean")
class Mean(Mass):
    def priority(self, tier, offset, weigh):
        return tier.scores / mx.maximum(observers(tier, offset), 1.0)


@scorer("current")
class Current(Scorer):
    needs = frozenset({"weights"})

    def observe(self, tier, seen):
        tier.set_scores(seen.rows[:, :, -1])
