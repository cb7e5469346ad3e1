"""`sparse`: the largest errors left by the store, held exactly as (index, value) lists.

KVQuant keeps the top outlier fraction of elements in a sparse fp16 list so
they neither widen the dense codes' range nor lose their value. Here each
token's vector in each head keeps its round(fraction x head_dim) largest
errors: a channel index (uint8, or uint16 past 256 channels) and the error in
float16, so the decoded element is the original to float16 precision. A fixed
count per vector keeps the arrays rectangular: the bytes are exactly what is
held. `fraction=0` holds nothing: the codec is its store alone, bit for bit.
"""

from typing import Dict

import attrs
import mlx.core as mx

from .registry import stage


def _fraction(instance, attribute, value):
    if not 0.0 <= value <= 0.5:
        raise ValueError("must be between 0 and 0.5")


@stage("sparse", "residual")
@attrs.frozen
class Sparse:
    """Per token and head, the round(fraction x head_dim) largest errors of the store, kept as (index, float16)."""

    fraction: float = attrs.field(default=0.01, validator=_fraction)

    codes = False
    token_multiple = 1

    @property
    def inner(self):
        return self  # a residual stage that codes the error itself (no inner store)

    def count(self, head_dim: int) -> int:
        return int(round(self.fraction * head_dim))

    def units(self) -> Dict[str, int]:
        return {"idx": 1, "vals": 1} if self.fraction > 0 else {}

    def bits_per_element(self, head_dim: int) -> float:
        n = self.count(head_dim)
        return n * ((8 if head_dim <= 256 else 16) + 16) / head_dim

    def check_head_dim(self, head_dim: int) -> str:
        return "" if head_dim <= 1 << 16 else f"head_dim {head_dim} does not fit uint16 indices"

    def encode(self, err: mx.array) -> Dict[str, mx.array]:
        D = err.shape[-1]
        n = self.count(D)
        if n == 0:
            return {}
        err = err.astype(mx.float32)
        idx = mx.argpartition(-mx.abs(err), kth=n - 1, axis=-1)[..., :n]
        vals = mx.take_along_axis(err, idx, axis=-1)
        return {"idx": idx.astype(mx.uint8 if D <= 256 else mx.uint16), "vals": vals.astype(mx.float16)}

    def correct(self, approx: mx.array, enc: Dict[str, mx.array]) -> mx.array:
        """approx with the held errors added at their indices (a scatter, no dense error array)."""
        if "idx" not in enc:
            return approx  # nothing held
        idx = enc["idx"].astype(mx.int32)
        held = mx.take_along_axis(approx, idx, axis=-1)
        return mx.put_along_axis(approx, idx, held + enc["vals"].astype(approx.dtype), axis=-1)
