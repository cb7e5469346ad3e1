"""XQuant's store: affine codes shared by a group of adjacent layers.

In the group's anchor layer `xquant` is exactly `affine` (its codes are the
ones shared). In the other ("reuse") layers it holds no codes: only its own
per-group scale and zero, least-squares fitted to the anchor's codes, plus an
optional 1-bit residual (sign, with one magnitude per group) for the drift.
Which role a layer plays is decided by the compiler (LayerPlan.share).
"""

from typing import Dict

import attrs
import mlx.core as mx

from ..kernels.bitpack import pack, unpack
from .registry import in_range, stage
from .store import Affine


@stage("xquant", "store")
@attrs.frozen
class XQuant(Affine):
    """Affine codes that `layers` adjacent layers share: the first quantizes, the rest fit their own scale/zero."""

    layers: int = attrs.field(default=2, validator=in_range(1, 8))
    residual_bits: int = attrs.field(default=0, validator=in_range(0, 1))

    # --- the reuse role -----------------------------------------------------
    def reuse_units(self) -> Dict[str, int]:
        meta = self.group if self.axis == "channel" else 1
        units = {"scales": meta, "zeros": meta}
        if self.residual_bits:
            units.update({"rcodes": 1, "rscales": meta})
        return units

    def reuse_bits_per_element(self, head_dim: int) -> float:
        residual = self.residual_bits + 16 / self.group if self.residual_bits else 0.0
        return 2 * 16 / self.group + residual

    def _axis(self) -> int:
        return -1 if self.axis == "token" else -2

    def fit(self, x: mx.array, q: mx.array) -> Dict[str, mx.array]:
        """Per quantization group, the (scale, zero) that best maps the anchor's codes q onto x."""
        B, H, L, D = x.shape
        axis = self._axis()
        g, gq = self._grouped(x.astype(mx.float32)), self._grouped(q)
        mean_x, mean_q = mx.mean(g, axis=axis, keepdims=True), mx.mean(gq, axis=axis, keepdims=True)
        dq = gq - mean_q
        var = mx.mean(dq * dq, axis=axis, keepdims=True)
        cov = mx.mean(dq * (g - mean_x), axis=axis, keepdims=True)
        # All codes equal (var 0): the codes say nothing, the group's mean is the best guess.
        scale = mx.where(var > 0, cov / mx.maximum(var, 1e-12), 0.0).astype(mx.float16)
        # The zero is fitted after rounding the scale, so it absorbs the rounding.
        zero = (mean_x - scale.astype(mx.float32) * mean_q).astype(mx.float16)
        enc = {"scales": scale.squeeze(axis), "zeros": zero.squeeze(axis)}
        if self.residual_bits:
            err = g - (gq * scale.astype(mx.float32) + zero.astype(mx.float32))
            # Signs plus the group's mean |error|: the least-squares 1-bit code of the drift.
            enc["rcodes"] = pack((err >= 0).astype(mx.uint32).reshape(B, H, L, D), 1)
            enc["rscales"] = mx.mean(mx.abs(err), axis=axis).astype(mx.float16)
        return enc

    def rebuild(self, enc: Dict[str, mx.array], q: mx.array, dtype) -> mx.array:
        """x from the anchor's codes q (float32 [B, H, L, D]) and this layer's own params."""
        B, H, L, D = q.shape
        axis = self._axis()
        scale = mx.expand_dims(enc["scales"].astype(mx.float32), axis)
        zero = mx.expand_dims(enc["zeros"].astype(mx.float32), axis)
        x = self._grouped(q) * scale + zero
        if self.residual_bits:
            signs = self._grouped(unpack(enc["rcodes"], 1, D).astype(mx.float32) * 2 - 1)
            x = x + signs * mx.expand_dims(enc["rscales"].astype(mx.float32), axis)
        return x.reshape(B, H, L, D).astype(dtype)
