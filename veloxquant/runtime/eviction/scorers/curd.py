"""CurDKV (Sengupta et al., NeurIPS 2025): value-guided. Each held token is a
row of the attention-weighted value block M (row i = a_i v_i, a_i the
attention it received per observing query); rows are scored by their
energy-weighted leverage over M's top `rank` singular directions,
sum_j (sigma_j^2 / sum sigma^2) U_ij^2 = sum_j (M_i . e_j)^2 / sum sigma^2,
read from the eigenvectors e_j of M'M (D x D per head, not L x L)."""

import mlx.core as mx

from .attention import Mass
from .base import observers, scorer


@scorer("curd")
class CurD(Mass):
    def priority(self, tier, offset, weigh):
        a = tier.scores / mx.maximum(observers(tier, offset), 1.0)
        m = a[..., None] * tier.decoded(mx.float32)[1]  # [B, H, L, D]
        vals, vecs = mx.linalg.eigh(m.swapaxes(-1, -2) @ m, stream=mx.cpu)  # ascending
        top = vecs[..., -self.route.rank :]  # [B, H, D, r]
        energy = mx.maximum(mx.sum(vals, axis=-1), 1e-30)[..., None]
        return mx.sum(mx.square(m @ top), axis=-1) / energy
