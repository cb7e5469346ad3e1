"""`skvq`: per-token group codes over channels reordered by range, with a clip searched per group (SKVQ).

Channels of similar range share a group when each head's channels are sorted
by their range; the order is taken from the first `chunk` tokens the tier
codes (so a prefill and token-by-token decode freeze the same order) and held
(`order`, uint16 per channel). Each group of `group` reordered channels of one
token is coded min/max like `affine`, after shrinking its range by the clip
factor α from `clips` that gives the least error. With `weight=queries` the
error is weighted per channel by the mean squared query of that channel (real
queries, gathered by runtime/eviction/saliency.py): the expected error of q·k, i.e.
the attention-score error, rather than key MSE. Decoding un-permutes.
"""

from typing import Dict, Optional, Tuple

import attrs
import mlx.core as mx

from ..kernels.bitpack import pack, unpack
from .registry import choices, in_range, stage


def _clips(instance, attribute, value):
    try:
        grid = [float(c) for c in value.split(",")]
    except ValueError:
        raise ValueError(f"must be comma-separated numbers, got '{value}'") from None
    if not grid or not all(0 < c <= 1 for c in grid):
        raise ValueError("must list clip factors in (0, 1]")


@stage("skvq", "store", needs=("attention",))
@attrs.frozen
class Skvq:
    """Per-token group codes over range-sorted channels (order frozen from the first chunk), clip searched per group."""

    bits: int = attrs.field(default=2, validator=in_range(1, 8))
    group: int = attrs.field(default=32, validator=in_range(1, 1 << 16))
    clips: str = attrs.field(default="1.0,0.95,0.9,0.85,0.8,0.75", validator=_clips)
    reorder: bool = attrs.field(default=True)
    weight: str = attrs.field(default="none", validator=choices("none", "queries"))
    chunk: int = attrs.field(default=32, validator=in_range(1, 1 << 12))

    codes = True
    fitted_once = True

    @property
    def scored(self):
        return "channels" if self.weight == "queries" else False

    @property
    def token_multiple(self) -> int:
        return self.chunk

    def units(self) -> Dict[str, int]:
        return {"codes": 1, "scales": 1, "zeros": 1}

    def bits_per_element(self, head_dim: int) -> float:
        return self.bits + 32 / self.group

    def check_head_dim(self, head_dim: int) -> str:
        if head_dim % self.group:
            return f"group={self.group} does not divide head_dim {head_dim}"
        return "" if (head_dim * self.bits) % 32 == 0 else f"{head_dim} channels of {self.bits} bits do not fill words"

    def fit(self, x: mx.array, scores: Optional[mx.array] = None) -> Dict[str, mx.array]:
        first = x[:, :, : self.chunk].astype(mx.float32)
        spread = mx.max(first, axis=2) - mx.min(first, axis=2)  # [B, H, D]
        D = x.shape[-1]
        order = mx.argsort(spread, axis=-1) if self.reorder else mx.broadcast_to(mx.arange(D), spread.shape)
        return {"order": order.astype(mx.uint16)}

    def _minmax(self, g: mx.array, alpha: mx.array, levels: int) -> Tuple[mx.array, mx.array]:
        lo, hi = mx.min(g, axis=-1, keepdims=True), mx.max(g, axis=-1, keepdims=True)
        width = hi - lo
        # The clipped range, centred like the group's own; alpha=1 is affine's (lo, (hi-lo)/levels) exactly.
        return (width * alpha / levels).astype(mx.float16), (lo + width * (1 - alpha) / 2).astype(mx.float16)

    def encode(self, x: mx.array, fitted: Dict[str, mx.array], scores: Optional[mx.array] = None):
        B, H, L, D = x.shape
        order = fitted["order"].astype(mx.int32)[:, :, None, :]
        moved = mx.take_along_axis(x.astype(mx.float32), mx.broadcast_to(order, x.shape), axis=-1)
        g = moved.reshape(B, H, L, D // self.group, self.group)
        levels = (1 << self.bits) - 1
        grid = mx.array([float(c) for c in self.clips.split(",")]).reshape(-1, 1, 1, 1, 1, 1)
        scale, zero = self._minmax(g[None], grid, levels)  # one (scale, zero) per clip candidate
        s32, z32 = mx.maximum(scale.astype(mx.float32), 1e-12), zero.astype(mx.float32)
        q = mx.clip(mx.round((g[None] - z32) / s32), 0, levels)
        err = (q * scale.astype(mx.float32) + z32 - g[None]) ** 2
        if scores is not None:  # mean q^2 per channel: the expected error of q.k
            w = mx.take_along_axis(scores.astype(mx.float32), order[:, :, 0], axis=-1)
            err = err * w.reshape(B, H, 1, D // self.group, self.group)
        best = mx.argmin(err.sum(axis=-1, keepdims=True), axis=0)  # [B, H, L, G, 1]
        pick = lambda a: mx.take_along_axis(a, best[None], axis=0)[0]
        codes = pick(q).astype(mx.uint32).reshape(B, H, L, D)
        return {"codes": pack(codes, self.bits), "scales": pick(scale)[..., 0], "zeros": pick(zero)[..., 0]}

    def decode(self, enc: Dict[str, mx.array], dtype, fitted: Dict[str, mx.array]) -> mx.array:
        codes = enc["codes"]
        B, H, L, W = codes.shape
        D = W * 32 // self.bits
        q = unpack(codes, self.bits, D).astype(mx.float32).reshape(B, H, L, D // self.group, self.group)
        moved = q * enc["scales"].astype(mx.float32)[..., None] + enc["zeros"].astype(mx.float32)[..., None]
        order = mx.broadcast_to(fitted["order"].astype(mx.int32)[:, :, None, :], (B, H, L, D))
        out = mx.put_along_axis(mx.zeros((B, H, L, D)), order, moved.reshape(B, H, L, D), axis=-1)
        return out.astype(dtype)
