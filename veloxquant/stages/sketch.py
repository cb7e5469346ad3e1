"""One-bit sketches of key vectors scored straight against the real query.

`qjl`: sign(S k) for a seeded Gaussian S (m x D) plus ||k||; the estimator
    <q, k> ~ sqrt(pi/2)/m * ||k|| * <S q, sign(S k)>
is unbiased (Zandieh et al., QJL). `rabitq`: the sign of each coordinate of
the (rotated) vector plus one scale; RaBitQ's bias-corrected estimator
    <q, k> ~ ||k|| * <q, xbar> / <xbar, u>,   u = k/||k||, xbar = sign(u)/sqrt(D)
divides out the expected shrinkage <xbar, u> (about 0.8) of the 1-bit code.

Both estimators are linear in q, so `decode` returns the vector that gives
exactly that estimate (the reference decode-then-attend path) and `scores`
evaluates it from the sign bits without forming that vector at full width.
"""

import math
from functools import lru_cache
from typing import Dict

import attrs
import mlx.core as mx
import numpy as np

from ..kernels.bitpack import pack, unpack
from .registry import in_range, stage


@lru_cache(maxsize=16)
def jl_matrix(m: int, d: int, seed: int) -> mx.array:
    return mx.array(np.random.default_rng(seed).standard_normal((m, d)).astype(np.float32))


def _norms(x: mx.array) -> mx.array:
    return mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True))


def _signs(codes: mx.array, n: int) -> mx.array:
    """Packed sign bits -> +-1 float32."""
    return unpack(codes, 1, n).astype(mx.float32) * 2 - 1


@stage("qjl", "store")
@attrs.frozen
class QJL:
    """1-bit JL sketch sign(S k) of m = factor * head_dim rows + ||k|| (float16); unbiased scores from the bits."""

    factor: float = attrs.field(default=1.0, validator=in_range(0.25, 8.0))
    seed: int = attrs.field(default=7, validator=in_range(0, 2**31 - 1))

    codes = False  # sign bits, not quantizer indices: no entropy stage applies
    token_multiple = 1

    def rows(self, head_dim: int) -> int:
        return int(round(self.factor * head_dim))

    def units(self) -> Dict[str, int]:
        return {"signs": 1, "norms": 1}

    def bits_per_element(self, head_dim: int) -> float:
        return (self.rows(head_dim) + 16) / head_dim

    def check_head_dim(self, head_dim: int) -> str:
        m = self.rows(head_dim)
        return "" if m % 32 == 0 else f"factor={self.factor} gives {m} sketch bits per vector, not whole 32-bit words"

    def constant_bytes(self, head_dim: int) -> int:
        return self.rows(head_dim) * head_dim * 4

    def _matrix(self, d: int) -> mx.array:
        return jl_matrix(self.rows(d), d, self.seed)

    def encode(self, x: mx.array) -> Dict[str, mx.array]:
        x = x.astype(mx.float32)
        bits = (x @ self._matrix(x.shape[-1]).T) > 0
        return {"signs": pack(bits, 1), "norms": _norms(x).astype(mx.float16)}

    def _coef(self, enc, d: int) -> mx.array:
        return enc["norms"].astype(mx.float32) * (math.sqrt(math.pi / 2) / self.rows(d))

    def _dim(self, enc) -> int:
        return int(round(enc["signs"].shape[-1] * 32 / self.factor))

    def decode(self, enc: Dict[str, mx.array], dtype) -> mx.array:
        d = self._dim(enc)
        S = self._matrix(d)
        return ((_signs(enc["signs"], S.shape[0]) @ S) * self._coef(enc, d)).astype(dtype)

    def scores(self, q: mx.array, enc: Dict[str, mx.array]) -> mx.array:
        """sqrt(pi/2)/m * ||k|| * <S q, sign(S k)>: q is projected once, then sign products."""
        d = q.shape[-1]
        S = self._matrix(d)
        products = (q @ S.T) @ _signs(enc["signs"], S.shape[0]).swapaxes(-1, -2)
        return products * self._coef(enc, d).swapaxes(-1, -2)


@stage("rabitq", "store")
@attrs.frozen
class RaBitQ:
    """1 sign bit per coordinate + one float16 scale ||k|| / (sqrt(D) <xbar, u>): RaBitQ's bias-corrected estimator."""

    codes = False
    token_multiple = 1

    def units(self) -> Dict[str, int]:
        return {"signs": 1, "scale": 1}

    def bits_per_element(self, head_dim: int) -> float:
        return 1 + 16 / head_dim

    def check_head_dim(self, head_dim: int) -> str:
        return "" if head_dim % 32 == 0 else f"{head_dim} sign bits do not fill 32-bit words"

    def encode(self, x: mx.array) -> Dict[str, mx.array]:
        x = x.astype(mx.float32)
        norm = _norms(x)
        # <xbar, u> = sum|x| / (sqrt(D) ||x||); the scale folds it with ||x|| and xbar's 1/sqrt(D).
        l1 = mx.sum(mx.abs(x), axis=-1, keepdims=True)
        scale = norm * norm / mx.maximum(l1, 1e-30)
        return {"signs": pack(x > 0, 1), "scale": scale.astype(mx.float16)}

    def decode(self, enc: Dict[str, mx.array], dtype) -> mx.array:
        D = enc["signs"].shape[-1] * 32
        return (_signs(enc["signs"], D) * enc["scale"].astype(mx.float32)).astype(dtype)

    def scores(self, q: mx.array, enc: Dict[str, mx.array]) -> mx.array:
        D = q.shape[-1]
        return (q @ _signs(enc["signs"], D).swapaxes(-1, -2)) * enc["scale"].astype(mx.float32).swapaxes(-1, -2)
