"""ExpectedAttention (kvpress): the attention future queries are expected to
pay each key, from the statistics of the last `window` real queries of each
query head: with q ~ N(mu, S), E[exp(q.k s)] = exp(s mu.k + s^2 k'Sk / 2);
normalised over the keys (a softmax), averaged over the GQA group, and
weighted by the value's norm (what the token can move the output by).
Deviation: kvpress rotates the query statistics to future positions with
RoPE; the cache only sees rotated queries, so the recent statistics stand
in for the next positions' (docs/eviction.md)."""

import mlx.core as mx

from .base import QueryWindowScorer, scorer


@scorer("expected")
class Expected(QueryWindowScorer):
    def __init__(self, route):
        super().__init__(route)
        self.queries, self.scale = None, 1.0

    def observe(self, tier, seen):
        self.queries = self.keep_window(seen, self.route.window).astype(mx.float32)

    def priority(self, tier, offset, weigh):
        k, v = tier.decoded(mx.float32)
        if self.queries is None:
            return mx.zeros(k.shape[:3], mx.float32)
        B, Hq, W, D = self.queries.shape
        Hkv = k.shape[1]
        s = D**-0.5
        q = self.queries.reshape(B, Hkv, Hq // Hkv, W, D)
        mu = mx.mean(q, axis=3)  # [B, Hkv, rep, D]
        c = q - mu[:, :, :, None]
        cov = c.swapaxes(-1, -2) @ c / max(W - 1, 1)  # [B, Hkv, rep, D, D]
        kk = k[:, :, None]  # [B, Hkv, 1, L, D]
        logits = s * (kk @ mu[..., None])[..., 0] + 0.5 * s * s * mx.sum((kk @ cov) * kk, axis=-1)
        expected = mx.mean(mx.softmax(logits, axis=-1, precise=True), axis=2)  # [B, Hkv, L]
        return expected * mx.linalg.norm(v, axis=-1)
