"""Scores from the keys alone, no attention needed (the layer keeps fused SDPA).

knorm    L2Norm (Devoto et al. 2024): keys with a low L2 norm draw the most
         attention in trained LMs; a token's score is -|k|, set when it arrives
         and never changed, so without a recent window one-block and
         token-by-token arrival keep the same set
keydiff  KeyDiff (kvpress): keep the keys least similar to the head's mean
         direction (the anchor: the mean of the unit keys held), ranked when
         the tier evicts
"""

import mlx.core as mx

from .base import Scorer, scorer


def _unit(x: mx.array) -> mx.array:
    return x / mx.maximum(mx.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


@scorer("knorm")
class KeyNorm(Scorer):
    def initial(self, keys):
        return -mx.linalg.norm(keys.astype(mx.float32), axis=-1)


@scorer("keydiff")
class KeyDiff(Scorer):
    def priority(self, tier, offset, weigh):
        k = _unit(tier.decoded(mx.float32)[0])
        anchor = _unit(mx.mean(k, axis=2, keepdims=True))
        return -mx.sum(k * anchor, axis=-1)
