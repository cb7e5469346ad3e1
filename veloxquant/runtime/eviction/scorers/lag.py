"""LagKV (Liang et al., 2025; kvpress's LagKVPress): attention-free, lag-relative scores.

The held tokens after the first `sinks` are cut into partitions of `chunk` tokens
(kvpress's lag_size). A token of partition i is min-max normalised per channel with
the range of partition i+1 (its lag reference), and its score is the standard
deviation of the normalised vector, softmaxed over the partition, for keys and for
values; their mean is ranked inside the partition (rank / chunk), so every full
partition keeps the same share. The last partition and the remainder, which have no
reference, score 1 (kept, as the sinks); a head holding fewer than sinks + 2 chunks
ranks by position (the newest kept). A zero range is taken as 1e-6.
"""

import mlx.core as mx

from .base import Scorer, scorer

EPS = 1e-6


def lag_scores(x: mx.array, lag: int) -> mx.array:
    """x [B, H, n*lag, D] -> [B, H, (n-1)*lag]: each partition's spread on the next one's range."""
    B, H, L, D = x.shape
    parts = x.reshape(B, H, L // lag, lag, D)
    ref = parts[:, :, 1:]
    lo, hi = mx.min(ref, axis=3, keepdims=True), mx.max(ref, axis=3, keepdims=True)
    norm = (parts[:, :, :-1] - lo) / mx.maximum(hi - lo, EPS)
    return mx.softmax(mx.std(norm, axis=-1, ddof=1), axis=-1).reshape(B, H, -1)


@scorer("lagkv")
class LagKV(Scorer):
    def priority(self, tier, offset, weigh):
        keys, values = tier.decoded(mx.float32)
        B, H, L, _ = keys.shape
        sinks, lag = min(self.route.sinks, L), self.route.chunk
        if L < sinks + 2 * lag:  # no partition has a reference yet: keep the newest
            ramp = mx.arange(L - sinks, dtype=mx.float32) / max(L - sinks, 1)
            return mx.broadcast_to(mx.concatenate([mx.ones((sinks,)), ramp]), (B, H, L))
        end = sinks + (L - sinks) // lag * lag
        score = (lag_scores(keys[:, :, sinks:end], lag) + lag_scores(values[:, :, sinks:end], lag)) / 2
        n = score.shape[-1] // lag
        ranks = mx.argsort(mx.argsort(score.reshape(B, H, n, lag), axis=-1), axis=-1)
        ranked = ranks.astype(mx.float32).reshape(B, H, -1) / lag
        ones = mx.ones((B, H, L - sinks - ranked.shape[-1]), mx.float32)
        return mx.concatenate([mx.ones((B, H, sinks), mx.float32), ranked, ones], axis=-1)
