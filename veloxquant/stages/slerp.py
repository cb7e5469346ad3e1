"""The `slerp` store (MiniCache): pairs of adjacent layers share one direction per token.

Each token's K (or V) vector in a layer is split into its norm (magnitude) and
its unit direction. The layers of a group (`layers`, 2 in MiniCache) keep one
direction for both, SLERP(dir_anchor, dir_reuse, t), and each its own
magnitude; a layer's vector is rebuilt as magnitude x shared direction, and
attention scores it as mag·(q·dir) without rebuilding it.

Tokens whose two directions are too far apart to share one -- the mean angular
distance θ/π over the kv heads above `threshold` -- stay unmerged: the shared
direction is the anchor's own there (the anchor stays exact) and the reuse
layer keeps its own float16 vector for that token, counted in its bytes.

`start` is MiniCache's depth: layers before start x n_layers are never grouped
and hold their tokens in float16 as they came (a lone slerp layer is a lossless
passthrough). The runtime is runtime/kinds/merged_tier.py; this module is the arithmetic.
"""

from typing import Tuple

import attrs
import mlx.core as mx

from .registry import in_range, stage

PARALLEL = 1e-4  # radians; closer than this, SLERP is the plain average of the two directions


@stage("slerp", "store")
@attrs.frozen
class Slerp:
    """MiniCache: a group of adjacent layers shares one SLERP-merged direction per token, each keeps its magnitudes."""

    layers: int = attrs.field(default=2, validator=in_range(1, 8))
    start: float = attrs.field(default=0.5, validator=in_range(0.0, 1.0))
    t: float = attrs.field(default=0.5, validator=in_range(0.0, 1.0))
    threshold: float = attrs.field(default=1.0, validator=in_range(0.0, 1.0))

    codes = False
    token_multiple = 1
    tier_kind = "merged"  # held by runtime/kinds/merged_tier.py
    expires_together = True  # sliding-window pairs (same window) drop the same oldest tokens in both layers

    def __attrs_post_init__(self):
        if self.layers > 2:
            raise ValueError(f"layers={self.layers}: MiniCache merges pairs of layers (layers=2), or none (1)")

    def check_head_dim(self, head_dim: int) -> str:
        return ""

    def first_layer(self, n_layers: int) -> int:
        """The first layer that may join a group."""
        return int(round(self.start * n_layers))

    def bits_per_element(self, head_dim: int) -> float:
        """A lone layer (outside any pair): its vectors in float16."""
        return 16.0

    def anchor_bits_per_element(self, head_dim: int) -> float:
        """A pair's anchor: the shared direction at float16 plus its own magnitude."""
        return 16.0 + 16.0 / head_dim

    def reuse_bits_per_element(self, head_dim: int) -> float:
        """A reuse layer's merged tokens: one float16 magnitude per head (unmerged tokens add 16 each)."""
        return 16.0 / head_dim

    # --- the arithmetic -----------------------------------------------------------------
    def merge(self, a: mx.array, b: mx.array) -> Tuple[mx.array, mx.array, mx.array, mx.array]:
        """Two layers' vectors [B, H, L, D] of the same tokens -> (direction, |a|, |b| [B, H, L, 1],
        distance [L]: the mean angular distance θ/π over batch and heads). Float32."""
        a, b = a.astype(mx.float32), b.astype(mx.float32)
        ma = mx.sqrt(mx.sum(a * a, axis=-1, keepdims=True))
        mb = mx.sqrt(mx.sum(b * b, axis=-1, keepdims=True))
        ua, ub = a / mx.maximum(ma, 1e-12), b / mx.maximum(mb, 1e-12)
        omega = mx.arccos(mx.clip(mx.sum(ua * ub, axis=-1, keepdims=True), -1.0, 1.0))
        sin = mx.sin(omega)
        wide = omega > PARALLEL
        wa = mx.where(wide, mx.sin((1 - self.t) * omega) / mx.where(wide, sin, 1.0), 1 - self.t)
        wb = mx.where(wide, mx.sin(self.t * omega) / mx.where(wide, sin, 1.0), self.t)
        e = wa * ua + wb * ub
        e = e / mx.maximum(mx.sqrt(mx.sum(e * e, axis=-1, keepdims=True)), 1e-12)  # unit (the lerp fallback too)
        distance = mx.mean(omega[..., 0], axis=(0, 1)) / mx.pi
        return e, ma, mb, distance
