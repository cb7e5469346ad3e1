"""`nuq`: per-channel non-uniform levels (KVQuant's NUQ), fitted once and frozen.

Each (head, channel) gets 2^bits levels by a 1-D Lloyd-Max (k-means) fit on
the first block the tier codes, the prefill's first spill, and keeps them for
the tier's life: later tokens are coded against the same levels, so codes
never need re-coding. The levels are float16 arrays the tier really holds
(counted in its bytes, saved with the cache). Pre-RoPE keys (`unrope` before
it) have stable per-channel distributions, which is what makes frozen
per-channel levels work (KVQuant, arXiv:2401.18079).
"""

from typing import Dict

import attrs
import mlx.core as mx

from ..kernels.bitpack import pack, unpack
from .registry import in_range, stage


@stage("nuq", "store")
@attrs.frozen
class Nuq:
    """Per-channel non-uniform (Lloyd-Max) levels fitted on the first block coded, then frozen; b-bit codes."""

    bits: int = attrs.field(default=3, validator=in_range(1, 8))
    iters: int = attrs.field(default=12, validator=in_range(0, 100))

    codes = True
    token_multiple = 1
    fitted_once = True  # the codec calls fit() on the first block and keeps its arrays (runtime/codec.py)

    def units(self) -> Dict[str, int]:
        return {"codes": 1}

    def bits_per_element(self, head_dim: int) -> float:
        return float(self.bits)  # + the levels: 2^bits float16 per channel, once per tier

    def check_head_dim(self, head_dim: int) -> str:
        return "" if (head_dim * self.bits) % 32 == 0 else f"{head_dim} channels of {self.bits} bits do not fill words"

    def fit(self, x: mx.array) -> Dict[str, mx.array]:
        """levels [B, H, D, 2^bits] (float16) by 1-D Lloyd-Max per channel over the block's tokens."""
        k = 1 << self.bits
        xs = mx.sort(x.astype(mx.float32).transpose(0, 1, 3, 2), axis=-1)  # [B, H, D, L]
        L = xs.shape[-1]
        start = mx.array([min(L - 1, int((i + 0.5) * L / k)) for i in range(k)])
        levels = xs[..., start]  # quantiles: a good start, and exact when L <= k
        for _ in range(self.iters):
            codes = self._assign(xs, levels)
            onehot = (codes[..., None] == mx.arange(k)).astype(mx.float32)  # [B, H, D, L, k]
            count = onehot.sum(axis=-2)
            total = (onehot * xs[..., None]).sum(axis=-2)
            levels = mx.where(count > 0, total / mx.maximum(count, 1), levels)
        return {"levels": mx.sort(levels, axis=-1).astype(mx.float16)}

    @staticmethod
    def _assign(xs: mx.array, levels: mx.array) -> mx.array:
        """Nearest level of each value: xs [..., L] against levels [..., k] (sorted)."""
        edges = (levels[..., 1:] + levels[..., :-1]) / 2
        return mx.sum(xs[..., None] > edges[..., None, :], axis=-1)

    def encode(self, x: mx.array, fitted: Dict[str, mx.array]) -> Dict[str, mx.array]:
        levels = fitted["levels"].astype(mx.float32)  # [B, H, D, k]
        codes = self._assign(x.astype(mx.float32).transpose(0, 1, 3, 2), levels).transpose(0, 1, 3, 2)
        return {"codes": pack(codes.astype(mx.uint32), self.bits)}

    def decode(self, enc: Dict[str, mx.array], dtype, fitted: Dict[str, mx.array]) -> mx.array:
        codes = enc["codes"]
        B, H, L, W = codes.shape
        D = W * 32 // self.bits
        k = 1 << self.bits
        q = unpack(codes, self.bits, D).astype(mx.int32)  # [B, H, L, D]
        flat = (q + mx.arange(D, dtype=mx.int32) * k).reshape(B, H, L * D)  # index into levels[b, h].ravel()
        table = fitted["levels"].reshape(B, H, D * k)
        return mx.take_along_axis(table, flat, axis=-1).reshape(B, H, L, D).astype(dtype)
