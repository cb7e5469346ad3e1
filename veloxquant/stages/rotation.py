"""Random orthogonal rotation of head_dim (TurboQuant's rotation).

A Hadamard matrix is a fixed rotation: a key dominated by one channel comes out
as +-c in every coordinate (two spikes), which a Gaussian codebook codes badly.
A Haar-random orthogonal matrix maps any fixed vector to a uniform point on the
sphere, whose coordinates are near i.i.d. N(0, 1/D): what the Lloyd-Max
codebooks (and QJL/RaBitQ's estimators) are designed for.

The matrix is a constant regenerated from `seed` (QR of a seeded Gaussian),
shared by every layer and cache: it is not held by a cache, so it is not in a
cache's bytes; `explain` lists it with the other constants.
"""

from functools import lru_cache

import attrs
import mlx.core as mx
import numpy as np

from .registry import in_range, stage


@lru_cache(maxsize=16)
def orthogonal_matrix(n: int, seed: int) -> mx.array:
    g = np.random.default_rng(seed).standard_normal((n, n))
    q, r = np.linalg.qr(g)
    q = q * np.sign(np.diag(r))  # sign fix: Haar-distributed, not biased by QR's convention
    return mx.array(q.astype(np.float32))


@stage("rotation", "transform")
@attrs.frozen
class Rotation:
    """Seeded Haar-random orthogonal rotation of head_dim (a constant, regenerated from the seed)."""

    seed: int = attrs.field(default=42, validator=in_range(0, 2**31 - 1))

    def check_head_dim(self, head_dim: int) -> str:
        return ""

    def constant_bytes(self, head_dim: int) -> int:
        return head_dim * head_dim * 4

    def forward(self, x: mx.array) -> mx.array:
        return x.astype(mx.float32) @ orthogonal_matrix(x.shape[-1], self.seed)

    def inverse(self, y: mx.array) -> mx.array:
        return y @ orthogonal_matrix(y.shape[-1], self.seed).T

    # Orthogonal: <forward(q), forward(k)> == <q, k>, so a query is rotated the same way.
    query = forward
