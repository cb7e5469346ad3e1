"""Q-Filters (arXiv:2503.02812): one direction u per kv head, the top singular
vector of the real queries of its group (the first `window` the layer sees:
a calibration on the live prompt). Its sign is fixed so that the queries'
mean projection on u is positive; then <q, k> ~ <E q, k> grows with <k, u>,
and the keys with the highest <k, u> are kept."""

import mlx.core as mx

from .base import Scorer, scorer


@scorer("qfilters")
class QFilters(Scorer):
    def __init__(self, route):
        super().__init__(route)
        self.samples, self.direction = None, None

    def observe(self, tier, seen):
        if self.direction is not None:
            return
        B, Hq, Lq, D = seen.queries.shape
        Hkv = tier.positions.shape[1]
        q = seen.queries.astype(mx.float32).reshape(B, Hkv, Hq // Hkv, Lq, D)
        q = q.swapaxes(2, 3).reshape(B, Hkv, -1, D)  # every query of the group, [B, Hkv, n, D]
        self.samples = q if self.samples is None else mx.concatenate([self.samples, q], axis=2)
        if self.samples.shape[2] >= self.route.window * (Hq // Hkv):
            self.direction, self.samples = self._fit(self.samples), None

    @staticmethod
    def _fit(q: mx.array) -> mx.array:
        gram = q.swapaxes(-1, -2) @ q  # [B, Hkv, D, D]: its top eigenvector is q's top right singular vector
        _, vecs = mx.linalg.eigh(gram, stream=mx.cpu)
        u = vecs[..., -1]  # eigenvalues ascend
        sign = mx.where(mx.mean(q @ u[..., None], axis=(2, 3)) < 0, -1.0, 1.0)
        return u * sign[..., None]

    def priority(self, tier, offset, weigh):
        u = (
            self.direction
            if self.direction is not None
            else (self._fit(self.samples) if self.samples is not None else None)
        )
        k = tier.decoded(mx.float32)[0]
        if u is None:
            return mx.zeros(k.shape[:3], mx.float32)
        return (k @ u[..., None])[..., 0]

    def state(self):
        if self.direction is not None:
            return {"direction": self.direction}
        return {} if self.samples is None else {"samples": self.samples}  # calibration still under way

    def load(self, arrays):
        self.direction, self.samples = arrays.get("direction"), arrays.get("samples")

    def release(self):
        self.samples = None  # the direction (D floats per head) stays: it is all later keys would need

    @property
    def nbytes(self):
        return sum(x.nbytes for x in (self.samples, self.direction) if x is not None)
