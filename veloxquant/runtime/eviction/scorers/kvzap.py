"""KVzap (arXiv:2601.07891; kvpress's KVzapPress): each token's score is predicted once, as it
arrives, from the hidden state its layer's attention is called with (runtime/eviction/hidden.py),
by the layer's calibrated model (stages/kvzap.py): KVzip's log-score per kv head, with no model
pass and no attention weights. The hidden states are used at once and not kept; the model's
weights are the artifact's, shared by the process and read by slot, not held by the cache.

keep=threshold: each head's budget is the count of its tokens predicted at or above the
threshold, plus its protected tokens (runtime/eviction/allocation.py asks `head_budgets`).
"""

from typing import List

import mlx.core as mx

from ....errors import VeloxError
from ....stages.kvzap import predict
from .base import Scorer, scorer


@scorer("kvzap")
class KVzap(Scorer):
    heard = None  # [B, n, D]: the hidden states of the block about to arrive

    def hear(self, hidden: mx.array) -> None:
        self.heard = hidden

    def initial(self, keys: mx.array) -> mx.array:
        hidden, self.heard = self.heard, None
        B, H, n, _ = keys.shape
        if hidden is None or hidden.shape[:2] != (B, n):
            got = "no hidden states" if hidden is None else f"hidden states of shape {tuple(hidden.shape)}"
            raise VeloxError(
                f"kvzap scores each token from the hidden state its layer's attention is called with, but a "
                f"block of {n} tokens arrived with {got}: feed the model through caches from "
                "veloxquant.make_prompt_cache(model, ...) (or load_prompt_cache(..., model=model)), and keep "
                "kvzap in the tier that takes new tokens"
            )
        scores = predict(self.route.params(), hidden)  # [B, n, H]
        if scores.shape[-1] != H:
            raise VeloxError(f"kvzap's model predicts {scores.shape[-1]} kv heads, this layer holds {H}")
        return mx.transpose(scores, (0, 2, 1))

    def head_budgets(self, tier, offset: int) -> List[int]:
        """keep=threshold: per head, the tokens predicted >= threshold and the protected ones."""
        route, pos = self.route, tier.positions
        kept = (tier.scores >= route.threshold) | (pos < route.sinks) | (pos >= offset - route.recent)
        counts = mx.max(mx.sum(kept, axis=-1), axis=0)  # [H]: the fullest row of a batch
        return [max(route.floor, int(n)) for n in counts.tolist()]
