"""Position only: the newest tokens rank highest (with `sinks`, StreamingLLM's
choice). With once=true it is kvpress's StreamingLLMPress: sinks plus the
last prompt tokens are kept at the end of the prompt, then tokens append."""

import mlx.core as mx

from .base import Scorer, scorer


@scorer("newest")
class Newest(Scorer):
    def priority(self, tier, offset, weigh):
        return tier.positions.astype(mx.float32)
