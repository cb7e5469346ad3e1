"""`pvq`: VecInfer's calibrated product VQ of keys, scored through a per-query look-up table.

Calibration fits, per layer and kv head, a per-channel smoothing factor
lambda_i = sqrt(max |k_i|) and a k-means codebook of `centroids` centroids for
`piece`-dim pieces of the smoothed, Hadamard-rotated keys H(k / lambda) (one
codebook shared by all pieces of the head). Stored per token: one index per
piece (log2(centroids) bits each; 1 bit per element at 8-dim pieces and 256
centroids). The query takes the dual transform H(q * lambda), which keeps
q.k, and scores read a table of piece-centroid products: table[p, c] =
<q'_p, centroid_c>, score = sum over pieces of table[p, code_p].
"""

import math
from typing import Dict

import attrs
import mlx.core as mx
import numpy as np

from ..artifacts import CalibrationError, slot_arrays
from ..kernels.bitpack import pack, unpack
from .registry import in_range, stage
from .transform import _hadamard_matrix

KMEANS_ITERS = 20


def kmeans(x: np.ndarray, k: int, seed: int = 0) -> np.ndarray:
    """Lloyd's k-means (k-means++ start on a sample): centroids [k, d]."""
    rng = np.random.default_rng(seed)
    sample = x[rng.choice(len(x), min(len(x), 20 * k), replace=False)]
    cent = [sample[rng.integers(len(sample))]]
    d2 = np.sum((sample - cent[0]) ** 2, axis=1)
    for _ in range(1, k):
        cent.append(sample[rng.choice(len(sample), p=d2 / d2.sum()) if d2.sum() > 0 else rng.integers(len(sample))])
        d2 = np.minimum(d2, np.sum((sample - cent[-1]) ** 2, axis=1))
    cent = np.stack(cent)
    for _ in range(KMEANS_ITERS):
        assign = np.argmin((x**2).sum(1)[:, None] - 2 * x @ cent.T + (cent**2).sum(1)[None], axis=1)
        sums = np.zeros_like(cent)
        np.add.at(sums, assign, x)
        counts = np.bincount(assign, minlength=k)[:, None]
        cent = np.where(counts > 0, sums / np.maximum(counts, 1), cent)
    return cent


class PieceCodes:
    """One index of ceil(log2 centroids) bits per `piece` channels, packed in 32-bit words:
    what product-VQ key stores share (pvq, qavq)."""

    @property
    def code_bits(self) -> int:
        return max(1, math.ceil(math.log2(self.centroids)))

    def units(self) -> Dict[str, int]:
        return {"codes": 1}

    def bits_per_element(self, head_dim: int) -> float:
        return self.code_bits / self.piece

    def words_problem(self, head_dim: int) -> str:
        if (head_dim // self.piece * self.code_bits) % 32:
            return f"{head_dim // self.piece} indices of {self.code_bits} bits do not fill 32-bit words"
        return ""


@stage("pvq", "store")
@attrs.frozen
class ProductVQ(PieceCodes):
    """Calibrated smoothing + Hadamard + product VQ (one index per piece); scores through a piece-centroid table."""

    piece: int = attrs.field(default=8, validator=in_range(2, 64))
    centroids: int = attrs.field(default=256, validator=in_range(2, 256))
    corpus: str = "austen:emma"
    tokens: int = attrs.field(default=4096, validator=in_range(64, 1 << 20))
    _artifact: str = ""
    _slot: str = ""

    calibrated = True
    codes = False
    token_multiple = 1

    def check_head_dim(self, head_dim: int) -> str:
        if head_dim % self.piece or head_dim & (head_dim - 1):
            return f"head_dim {head_dim} must be a power of two split into pieces of {self.piece}"
        return self.words_problem(head_dim)

    def fit(self, samples: np.ndarray, queries: np.ndarray = None) -> Dict[str, np.ndarray]:
        H, N, D = samples.shape
        smooth = np.sqrt(np.maximum(np.abs(samples).max(axis=1), 1e-6))  # [H, D]
        R = np.array(_hadamard_matrix(D))
        books = []
        for h in range(H):
            y = (samples[h] / smooth[h]) @ R
            books.append(kmeans(y.reshape(-1, self.piece).astype(np.float64), self.centroids, seed=h))
        return {"smooth": smooth.astype(np.float32), "codebook": np.stack(books).astype(np.float32)}

    def _t(self) -> Dict[str, mx.array]:
        if not self._artifact:
            raise CalibrationError(
                "stage 'pvq' is not bound to a calibration artifact: run `veloxquant calibrate "
                "RECIPE` and make caches with veloxquant.make_prompt_cache"
            )
        return slot_arrays(self._artifact, self._slot)

    def encode(self, x: mx.array) -> Dict[str, mx.array]:
        t = self._t()
        D = x.shape[-1]
        y = (x.astype(mx.float32) / t["smooth"][:, None]) @ _hadamard_matrix(D)
        pieces = y.reshape(*y.shape[:-1], D // self.piece, self.piece)  # [B, H, L, P, d]
        book = t["codebook"][:, None]  # [H, 1, C, d]: batch dims (H, 1) meet the pieces' (H, L)
        dist = mx.sum(book * book, -1)[:, :, None, :] - 2 * (pieces @ book.swapaxes(-1, -2))  # [B, H, L, P, C]
        return {"codes": pack(mx.argmin(dist, axis=-1).astype(mx.uint32), self.code_bits)}

    def _codes(self, enc, D: int) -> mx.array:
        return unpack(enc["codes"], self.code_bits, D // self.piece).astype(mx.int32)

    def decode(self, enc: Dict[str, mx.array], dtype) -> mx.array:
        t = self._t()
        D = t["smooth"].shape[-1]
        codes = self._codes(enc, D)  # [B, H, L, P]
        H, C = t["codebook"].shape[:2]
        own = codes + (mx.arange(H, dtype=mx.int32) * C)[:, None, None]  # each kv head reads its own book
        y = t["codebook"].reshape(H * C, -1)[own].reshape(*codes.shape[:-1], D)
        return ((y @ _hadamard_matrix(D)) * t["smooth"][:, None]).astype(dtype)

    def scores(self, q: mx.array, enc: Dict[str, mx.array]) -> mx.array:
        """Dual-transformed query, a [P, C] table per query row, then one look-up per piece."""
        t = self._t()
        B, H, M, D = q.shape
        qd = (q * t["smooth"][:, None]) @ _hadamard_matrix(D)
        P = D // self.piece
        table = qd.reshape(B, H, M, P, 1, self.piece) @ t["codebook"][:, None, None].swapaxes(-1, -2)
        table = table.reshape(B, H, M, P * self.centroids)  # [B, H, M, P*C]
        codes = self._codes(enc, D)
        L = codes.shape[2]
        where = (codes + mx.arange(P, dtype=mx.int32) * self.centroids).reshape(B, H, 1, L * P)
        picked = mx.take_along_axis(table, mx.broadcast_to(where, (B, H, M, L * P)), axis=-1)
        return mx.sum(picked.reshape(B, H, M, L, P), axis=-1)
