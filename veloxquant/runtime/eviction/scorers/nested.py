"""NestedKV (Chen et al., arXiv:2605.26678, a preprint): keys only, once at the end of the prompt.

Each key k^ = k/|k| is scored by how anomalous it is at three scales: against the
mean of all held keys (stable, a_s), of its block of b = clip(N // 32, 128, 256)
positions (episodic, a_e), and of the trailing `window` keys ending at it
(current, a_c); anomaly = -cos(k^, mean). Per head each is min-max normalised.
Head-adaptive blend: w = softmax(log(0.4, 0.4, 0.2) + beta * Delta), Delta a
scale's mean top-10% minus mean bottom-10%, so the scale that separates tokens
best weighs most. Surprise gate: where the scales disagree (their per-token
std, min-max normalised per head and mean-centred, above `tau`, sharpness
`kappa`), the score moves to the strongest scale: a* = (1-g) blend + g max.
a* lies in [0, 1] in every head, so heads compete for the layer's budget on it
(heads=score: runtime/eviction/allocation.py). Decode tokens are appended, never rescored.
"""

import mlx.core as mx

from .base import Scorer, scorer

PRIOR = (0.4, 0.4, 0.2)  # stable, episodic, current (the paper's Appendix A)


def _unit(k: mx.array) -> mx.array:
    return k / mx.maximum(mx.linalg.norm(k, axis=-1, keepdims=True), 1e-12)


def _anomaly(k: mx.array, mean: mx.array) -> mx.array:
    return -mx.sum(k * _unit(mean), axis=-1)


def _minmax(a: mx.array) -> mx.array:
    lo, hi = mx.min(a, axis=-1, keepdims=True), mx.max(a, axis=-1, keepdims=True)
    return (a - lo) / mx.maximum(hi - lo, 1e-12)


def scales(k: mx.array, window: int) -> mx.array:
    """Keys [B, H, N, D] in position order -> normalised anomalies [3, B, H, N]."""
    B, H, N, D = k.shape
    k = _unit(k.astype(mx.float32))
    stable = mx.mean(k, axis=2, keepdims=True)
    b = min(max(N // 32, 128), 256)
    nb = -(-N // b)
    padded = mx.concatenate([k, mx.zeros((B, H, nb * b - N, D), k.dtype)], axis=2).reshape(B, H, nb, b, D)
    counts = mx.minimum(b, N - mx.arange(nb) * b).astype(mx.float32)[:, None]
    episodic = mx.repeat(mx.sum(padded, axis=3) / counts, b, axis=2)[:, :, :N]
    csum = mx.cumsum(k, axis=2)
    behind = (
        mx.concatenate([mx.zeros((B, H, window, D), k.dtype), csum[:, :, :-window]], axis=2)[:, :, :N]
        if window < N
        else mx.zeros_like(csum)
    )
    current = csum - behind  # the trailing `window` keys, the token's own included
    return mx.stack([_minmax(_anomaly(k, m)) for m in (stable, episodic, current)])


def route(a: mx.array, beta: float, tau: float, kappa: float) -> mx.array:
    """Normalised anomalies [3, B, H, N] -> a* [B, H, N]: head-adaptive blend, surprise-gated."""
    N = a.shape[-1]
    tenth = max(1, N // 10)
    ranked = mx.sort(a, axis=-1)
    delta = mx.mean(ranked[..., -tenth:], axis=-1) - mx.mean(ranked[..., :tenth], axis=-1)  # [3, B, H]
    w = mx.softmax(mx.log(mx.array(PRIOR))[:, None, None] + beta * delta, axis=0)
    blend = mx.sum(w[..., None] * a, axis=0)
    surprise = _minmax(mx.sqrt(mx.var(a, axis=0)))
    surprise = surprise - mx.mean(surprise, axis=-1, keepdims=True)
    gate = mx.sigmoid(kappa * (surprise - tau))
    return (1 - gate) * blend + gate * mx.max(a, axis=0)


@scorer("nested")
class Nested(Scorer):
    """Needs nothing from attention: it ranks the keys the tier holds when it decides."""

    def priority(self, tier, offset, weigh):
        keys, _ = tier.decoded(mx.float32)
        r = self.route
        return route(scales(keys, r.window), r.beta, r.tau, r.kappa)
