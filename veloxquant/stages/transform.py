"""Transform stages: invertible maps applied to values before they are stored."""

import math
from functools import lru_cache

import attrs
import mlx.core as mx
import numpy as np

from .registry import stage


@lru_cache(maxsize=8)
def _hadamard_matrix(n: int) -> mx.array:
    h = np.ones((1, 1), dtype=np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return mx.array(h / math.sqrt(n))


@stage("hadamard", "transform")
@attrs.frozen
class Hadamard:
    """Orthonormal Hadamard rotation of head_dim: spreads outliers before quantizing."""

    def check_head_dim(self, head_dim: int) -> str:
        if head_dim & (head_dim - 1):
            return f"head_dim {head_dim} is not a power of two"
        return ""

    def forward(self, x: mx.array) -> mx.array:
        return x.astype(mx.float32) @ _hadamard_matrix(x.shape[-1])

    def inverse(self, y: mx.array) -> mx.array:
        # The normalized Sylvester matrix is symmetric and orthogonal: H^-1 == H.
        return y @ _hadamard_matrix(y.shape[-1])

    # Orthonormal: <Hq, Hk> == <q, k>, so scoring rotates the query the same way.
    query = forward
