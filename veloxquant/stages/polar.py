"""`polar`: PolarQuant's recursive polar transform of (rotated) vectors.

Level 1 pairs the coordinates, (x_2i, x_2i+1) -> (radius, angle in [0, 2pi));
each further level pairs the radii of the level below, (r_2i, r_2i+1) ->
(radius, angle in [0, pi/2]). After `levels` levels the D / 2^levels radii are
kept in float16 and every angle is quantized with its level's codebook: level 1
uniform with `first_bits` (a rotated vector's level-1 angles are uniform),
levels >= 2 Lloyd-Max on their density, proportional to sin(2 theta)^(2^(l-1) - 1),
with `bits` each -- the paper's split is 4 levels, 4 bits then 2 bits
(Han et al., PolarQuant, AISTATS 2026). The angle codes of all levels form one
packed bit stream, padded to whole 32-bit words (the padding is held and counted).
Scores go through decode (angles multiply along the tree: no per-code table).
"""

import math
from functools import lru_cache
from typing import Dict, List

import attrs
import mlx.core as mx
import numpy as np

from ..kernels.bitpack import pack, unpack
from .codebook import lloyd_levels
from .registry import in_range, stage


@lru_cache(maxsize=16)
def angle_levels(level: int, bits: int) -> np.ndarray:
    """Lloyd-Max levels for the level-`level` angle density on [0, pi/2] (level >= 2)."""
    grid = np.linspace(0, math.pi / 2, 20001)
    return lloyd_levels(grid, np.sin(2 * grid) ** (2 ** (level - 1) - 1), bits, 200)


@stage("polar", "store")
@attrs.frozen
class Polar:
    """Recursive polar transform: level-1 angles at first_bits, deeper angles at bits (Lloyd-Max),
    last radii float16."""

    levels: int = attrs.field(default=4, validator=in_range(1, 8))
    first_bits: int = attrs.field(default=4, validator=in_range(1, 8))
    bits: int = attrs.field(default=2, validator=in_range(1, 8))

    codes = False  # mixed widths in one stream
    token_multiple = 1

    def _widths(self, D: int) -> List[tuple]:
        """(angles, bits) per level."""
        return [(D >> l, self.first_bits if l == 1 else self.bits) for l in range(1, self.levels + 1)]

    def _stream_bits(self, D: int) -> int:
        used = sum(n * b for n, b in self._widths(D))
        return -(-used // 32) * 32

    def units(self) -> Dict[str, int]:
        return {"angles": 1, "radii": 1}

    def bits_per_element(self, head_dim: int) -> float:
        return (self._stream_bits(head_dim) + 16 * (head_dim >> self.levels)) / head_dim

    def check_head_dim(self, head_dim: int) -> str:
        if head_dim % (1 << self.levels):
            return (
                f"{self.levels} levels halve head_dim {self.levels} times; "
                f"{head_dim} is not divisible by {1 << self.levels}"
            )
        return ""

    def encode(self, x: mx.array) -> Dict[str, mx.array]:
        r = x.astype(mx.float32)
        D = r.shape[-1]
        planes = []
        for level, (n, b) in enumerate(self._widths(D), start=1):
            a, c = r[..., 0::2], r[..., 1::2]
            theta = mx.arctan2(c, a)
            if level == 1:
                theta = mx.where(theta < 0, theta + 2 * math.pi, theta)
                code = mx.floor(theta / (2 * math.pi) * (1 << b)).astype(mx.uint32) % (1 << b)
            else:
                lv = angle_levels(level, b)
                edges = mx.array((lv[1:] + lv[:-1]) / 2)
                code = mx.sum(theta[..., None] > edges, axis=-1).astype(mx.uint32)
            planes.append(((code[..., None] >> mx.arange(b, dtype=mx.uint32)) & 1).reshape(*code.shape[:-1], n * b))
            r = mx.sqrt(a * a + c * c)
        stream = mx.concatenate(planes, axis=-1)
        pad = self._stream_bits(D) - stream.shape[-1]
        if pad:
            stream = mx.concatenate([stream, mx.zeros((*stream.shape[:-1], pad), stream.dtype)], axis=-1)
        return {"angles": pack(stream, 1), "radii": r.astype(mx.float16)}

    def decode(self, enc: Dict[str, mx.array], dtype) -> mx.array:
        r = enc["radii"].astype(mx.float32)
        D = r.shape[-1] << self.levels
        stream = unpack(enc["angles"], 1, enc["angles"].shape[-1] * 32)
        widths = self._widths(D)
        starts = np.cumsum([0] + [n * b for n, b in widths])
        for level in range(self.levels, 0, -1):
            n, b = widths[level - 1]
            bits = stream[..., int(starts[level - 1]) : int(starts[level])].reshape(*stream.shape[:-1], n, b)
            code = mx.sum(bits << mx.arange(b, dtype=mx.uint32), axis=-1)
            if level == 1:
                theta = (code.astype(mx.float32) + 0.5) * (2 * math.pi / (1 << b))
            else:
                theta = mx.array(angle_levels(level, b))[code]
            r = mx.stack([r * mx.cos(theta), r * mx.sin(theta)], axis=-1).reshape(*r.shape[:-1], 2 * n)
        return r.astype(dtype)
