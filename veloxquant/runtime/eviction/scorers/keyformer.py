"""Keyformer (Adnan et al., MLSys 2024): H2O's accumulated mass, ranked with
Gumbel noise so a token that is low before its queries arrive is not doomed.
The noise is redrawn at every eviction, keyed on the position counter (so a
run is reproducible), scaled by the head's mean score (scale-free), and its
temperature anneals from `tau` towards 0 as the context outgrows the budget:
tau_t = tau * budget / max(offset, budget). tau=0 is H2O, bit for bit."""

import mlx.core as mx

from .attention import Mass
from .base import scorer


@scorer("keyformer")
class Keyformer(Mass):
    def priority(self, tier, offset, weigh):
        if self.route.tau == 0:
            return tier.scores
        tau = self.route.tau * self.route.budget / max(offset, self.route.budget)
        scores = tier.scores
        noise = mx.random.gumbel(scores.shape, key=mx.random.key(offset))
        return scores + tau * noise * mx.mean(scores, axis=-1, keepdims=True)
