"""The approximation other libraries ship: the new block's keys stand in for
queries (one per kv head), and what they pay is accumulated like H2O's mass.
Kept so the two can be compared (docs/eviction.md)."""

from .base import Scorer, scorer


@scorer("proxy")
class Proxy(Scorer):
    def observe(self, tier, seen):
        if seen.new_keys is not None:
            tier.set_scores(tier.scores + seen.weigh(seen.new_keys, seen.first_q))
