"""Scalar codebooks (Lloyd-Max) on unit-norm vectors, and residual composition.

`lloydmax(bits, dist)` stores each token vector as its L2 norm (float16) plus
b-bit indices into the Lloyd-Max codebook of the distribution its scaled
components follow after a Hadamard rotation (gaussian), or of a residual's
(laplace). `residual(inner)` codes what the stages before it left over.
"""

from functools import lru_cache
from typing import Dict

import attrs
import mlx.core as mx
import numpy as np

from ..kernels.bitpack import pack, unpack
from .registry import choices, in_range, stage


def lloyd_levels(grid: np.ndarray, pdf: np.ndarray, bits: int, iters: int) -> np.ndarray:
    """MSE-optimal levels for a density sampled on `grid` (Lloyd's algorithm, started at its quantiles)."""
    pdf = pdf / pdf.sum()
    levels = np.interp((np.arange(2**bits) + 0.5) / 2**bits, np.cumsum(pdf), grid)
    for _ in range(iters):
        edges = (levels[1:] + levels[:-1]) / 2
        cell = np.searchsorted(edges, grid)
        mass = np.bincount(cell, pdf, minlength=levels.size)
        levels = np.bincount(cell, pdf * grid, minlength=levels.size) / np.maximum(mass, 1e-300)
    return levels.astype(np.float32)


@lru_cache(maxsize=32)
def lloyd_max(bits: int, dist: str) -> np.ndarray:
    """MSE-optimal levels for a unit-variance gaussian or laplace source (Lloyd's algorithm)."""
    grid = np.linspace(-8, 8, 200001)
    pdf = np.exp(-(grid**2) / 2) if dist == "gaussian" else np.exp(-np.sqrt(2) * np.abs(grid))
    return lloyd_levels(grid, pdf, bits, 300)


@stage("lloydmax", "store")
@attrs.frozen
class LloydMax:
    """Per-vector L2 norm (float16) + b-bit Lloyd-Max codes of the normalised components."""

    bits: int = attrs.field(default=2, validator=in_range(1, 8))
    dist: str = attrs.field(default="gaussian", validator=choices("gaussian", "laplace"))

    codes = True
    token_multiple = 1

    def units(self) -> Dict[str, int]:
        return {"codes": 1, "norms": 1}

    def bits_per_element(self, head_dim: int) -> float:
        return self.bits + 16 / head_dim

    def check_head_dim(self, head_dim: int) -> str:
        return "" if (head_dim * self.bits) % 32 == 0 else f"{head_dim} channels of {self.bits} bits do not fill words"

    def levels(self) -> np.ndarray:
        """The codebook's levels (the Lloyd-Max kernels read them)."""
        return lloyd_max(self.bits, self.dist)

    def _levels(self) -> mx.array:
        return mx.array(self.levels())

    def encode(self, x: mx.array) -> Dict[str, mx.array]:
        x = x.astype(mx.float32)
        D = x.shape[-1]
        norms = mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True)).astype(mx.float16)
        unit = x * (D**0.5) / mx.maximum(norms.astype(mx.float32), 1e-12)  # unit-variance components
        levels = self._levels()
        edges = (levels[1:] + levels[:-1]) / 2
        codes = mx.sum(unit[..., None] > edges, axis=-1).astype(mx.uint32)
        return {"codes": pack(codes, self.bits), "norms": norms}

    def decode(self, enc: Dict[str, mx.array], dtype) -> mx.array:
        codes = enc["codes"]
        D = codes.shape[-1] * 32 // self.bits
        unit = self._levels()[unpack(codes, self.bits, D)]
        return (unit * enc["norms"].astype(mx.float32) / D**0.5).astype(dtype)

    def scores(self, q: mx.array, enc: Dict[str, mx.array]) -> mx.array:
        """<q, decoded key> for q [B, H, M, D] (float32, in this store's domain) -> [B, H, M, L].

        The codes index the level table in place (the look-up), the product runs
        on unit-scale codes, and each key's norm scales its score afterwards: no
        key is rebuilt at full scale or rotated back."""
        D = q.shape[-1]
        unit = self._levels()[unpack(enc["codes"], self.bits, D)]
        scale = enc["norms"].astype(mx.float32).swapaxes(-1, -2) / D**0.5  # [B, H, 1, L]
        return (q @ unit.swapaxes(-1, -2)) * scale


@stage("residual", "residual")
@attrs.frozen
class Residual:
    """Codes the error left by the store before it with another store stage."""

    inner: object = attrs.field(default=None)

    def check_head_dim(self, head_dim: int) -> str:
        if self.inner is None or not hasattr(self.inner, "encode"):
            return "residual(...) takes a store stage, e.g. residual(lloydmax(bits=1, dist=laplace))"
        return getattr(self.inner, "check_head_dim", lambda d: "")(head_dim)
