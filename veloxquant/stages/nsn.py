"""`nsn`: NSNQuant's normalize-shift-normalize, Hadamard and one universal codebook.

Per group of `group` tokens (the chunk an fp16 window flushes): each token is
scaled to norm sqrt(D) (its norm n1 kept), the group's per-channel mean m is
subtracted (the shift), and the result is scaled to norm sqrt(D) again (n2
kept). After a Hadamard rotation its components are close to i.i.d. N(0, 1)
whatever the model, so one codebook made once from synthetic Gaussians (no
calibration) codes every layer: `piece`-dim pieces, 256 centroids.
  bits=1: one uint8 index per 8-dim piece (k-means on N(0, I));
  bits=2: the piece's sign mask (8 bits) + a uint8 index into a codebook of
          magnitudes (k-means on |N(0, I)|).
Stored: codes (+ signs), n1 and n2 per token (float16), m per group (float16).
Scores from codes, with q in the store's domain: <q, x> = n1/sqrt(D) * (<q, m> +
n2/sqrt(D) * <H q, y>) -- the query is rotated once, no key is rotated back.
(Son, Choi, Yoo, NSNQuant, NeurIPS 2025, arXiv:2505.18231.)
"""

import math
from functools import lru_cache
from typing import Dict

import attrs
import mlx.core as mx
import numpy as np

from ..kernels.bitpack import pack, unpack
from .productvq import kmeans
from .registry import choices, in_range, stage
from .transform import _hadamard_matrix

CENTROIDS = 256
SAMPLES = 200  # synthetic pieces per centroid


@lru_cache(maxsize=8)
def universal_codebook(piece: int, bits: int, seed: int) -> mx.array:
    """256 centroids of `piece`-dim standard Gaussians (bits=1) or of their magnitudes (bits=2)."""
    g = np.random.default_rng(seed).standard_normal((CENTROIDS * SAMPLES, piece))
    return mx.array(kmeans(np.abs(g) if bits == 2 else g, CENTROIDS, seed).astype(np.float32))


def _norm(x: mx.array) -> mx.array:
    return mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True))


@stage("nsn", "store")
@attrs.frozen
class NSN:
    """Normalize-shift-normalize per token group, Hadamard, one universal 8-dim codebook (1 or 2 bits/element)."""

    bits: int = attrs.field(default=2, validator=choices(1, 2))
    group: int = attrs.field(default=64, validator=in_range(2, 4096))
    piece: int = attrs.field(default=8, validator=choices(8))
    seed: int = attrs.field(default=1234, validator=in_range(0, 2**31 - 1))

    codes = False  # codebook indices (and sign masks), not scalar levels: no entropy stage applies

    @property
    def token_multiple(self) -> int:
        return self.group

    def units(self) -> Dict[str, int]:
        u = {"codes": 1, "n1": 1, "n2": 1, "mean": self.group}
        return {**u, "signs": 1} if self.bits == 2 else u

    def bits_per_element(self, head_dim: int) -> float:
        return self.bits + 32 / head_dim + 16 / self.group

    def check_head_dim(self, head_dim: int) -> str:
        if head_dim & (head_dim - 1) or head_dim < 32:
            return f"head_dim {head_dim} is not a power of two >= 32 (Hadamard; whole words of codes)"
        return ""

    def _book(self) -> mx.array:
        return universal_codebook(self.piece, self.bits, self.seed)

    def encode(self, x: mx.array) -> Dict[str, mx.array]:
        B, H, L, D = x.shape
        x = x.astype(mx.float32)
        n1 = _norm(x)
        u = x * (math.sqrt(D) / mx.maximum(n1, 1e-12))
        m = mx.mean(u.reshape(B, H, L // self.group, self.group, D), axis=3)
        r = u - mx.repeat(m, self.group, axis=2)
        n2 = _norm(r)
        y = (r * (math.sqrt(D) / mx.maximum(n2, 1e-12))) @ _hadamard_matrix(D)
        pieces = y.reshape(B, H, L, D // self.piece, self.piece)
        book = self._book()
        target = mx.abs(pieces) if self.bits == 2 else pieces
        dist = mx.sum(book * book, -1) - 2 * (target @ book.T)  # [B, H, L, P, C]
        enc = {
            "codes": pack(mx.argmin(dist, axis=-1).astype(mx.uint32), 8),
            "n1": n1.astype(mx.float16),
            "n2": n2.astype(mx.float16),
            "mean": m.astype(mx.float16),
        }
        if self.bits == 2:
            enc["signs"] = pack(y > 0, 1)
        return enc

    def _rotated(self, enc: Dict[str, mx.array]) -> mx.array:
        """y^ [B, H, L, D]: the codebook pieces (with their signs), in the Hadamard domain."""
        D = enc["codes"].shape[-1] * 32 // 8 * self.piece
        codes = unpack(enc["codes"], 8, D // self.piece).astype(mx.int32)
        y = self._book()[codes].reshape(*codes.shape[:-1], D)
        if self.bits == 2:
            y = y * (unpack(enc["signs"], 1, D).astype(mx.float32) * 2 - 1)
        return y

    def decode(self, enc: Dict[str, mx.array], dtype) -> mx.array:
        y = self._rotated(enc)
        D = y.shape[-1]
        r = (y @ _hadamard_matrix(D)) * (enc["n2"].astype(mx.float32) / math.sqrt(D))
        u = r + mx.repeat(enc["mean"].astype(mx.float32), self.group, axis=2)
        return (u * (enc["n1"].astype(mx.float32) / math.sqrt(D))).astype(dtype)

    def scores(self, q: mx.array, enc: Dict[str, mx.array]) -> mx.array:
        D = q.shape[-1]
        y = self._rotated(enc)
        shaped = (
            (q @ _hadamard_matrix(D))
            @ y.swapaxes(-1, -2)
            * (enc["n2"].astype(mx.float32).swapaxes(-1, -2) / math.sqrt(D))
        )
        shift = mx.repeat(q @ enc["mean"].astype(mx.float32).swapaxes(-1, -2), self.group, axis=-1)
        return (shaped + shift) * (enc["n1"].astype(mx.float32).swapaxes(-1, -2) / math.sqrt(D))
