"""`qavq`: A2ATS's query-aware product VQ of pre-RoPE keys, scored with windowed RoPE.

He et al., A2ATS (ACL 2025 Findings, arXiv:2502.12665). Keys (after `unrope`)
are cut into `piece`-dim pieces, each coded by the index of one of `centroids`
centroids of that piece's own codebook (calibrated k-means, per kv head).

Query-aware assignment: a key's error matters through q.(k - k^). Averaged
over the relative positions at which RoPE turns queries against a key, the
query second moment E[q q^T] keeps, per RoPE pair, only the pair's mean energy
(cross terms between pairs of other frequencies, and the antisymmetric part
within a pair, average out). So the expected score error is a weighted squared
error with one weight per channel: w_c = the mean energy of real queries in
c's RoPE pair (normalised to mean 1). Assignment and codebook training use
beta * |e|^2 + (1 - beta) * sum_c w_c e_c^2: beta = 1 is plain VQ. The
weights come from the real queries the model attends with - the calibration
text's (artifact `energy`), then the queries each tier has answered recently
(runtime/kinds/query_aware_tier.py passes them in) - never from the keys themselves.

Windowed RoPE (scores_at): a key within `window` positions of the query gets
exact RoPE, R(n); an older one is scored as if it were exactly `window` back,
so q . R(m - w) k = (R(m - w)^-1 q) . k - one un-rotated query per row, then a
per-query piece-centroid look-up table for every older key. window <= 0: all
keys take the approximation (at relative distance 0); window >= the length:
every key exact RoPE.
"""

from typing import Dict, Optional

import attrs
import mlx.core as mx
import numpy as np

from ..artifacts import CalibrationError
from ..kernels.bitpack import pack, unpack
from . import rope_pairs as rp
from .productvq import PieceCodes, kmeans
from .registry import in_range, stage
from .unrope import _freeze


def pair_energy(queries: np.ndarray, n_kv_heads: int, spec) -> np.ndarray:
    """Real queries [Hq, N, D] -> per-channel weight [H, D]: each RoPE pair's mean energy, mean 1."""
    Hq, N, D = queries.shape
    e = (queries.astype(np.float64) ** 2).reshape(n_kv_heads, Hq // n_kv_heads * N, D).mean(1)
    a, b = rp.pairs(mx.array(e.astype(np.float32)), spec)
    pair = (a + b) / 2
    w = np.array(rp.unpairs(pair, pair, spec))
    return (w / np.maximum(w.mean(-1, keepdims=True), 1e-30)).astype(np.float32)


@stage("qavq", "store")
@attrs.frozen
class QueryAwareVQ(PieceCodes, rp.BoundPreRope):
    """Product VQ of pre-RoPE keys, assigned by real queries' pair energies (beta blend); windowed-RoPE scores."""

    piece: int = attrs.field(default=8, validator=in_range(2, 64))
    centroids: int = attrs.field(default=256, validator=in_range(2, 256))
    beta: float = attrs.field(default=0.5, converter=float, validator=in_range(0.0, 1.0))
    window: int = attrs.field(default=128, validator=in_range(-(1 << 30), 1 << 30))
    corpus: str = "austen:emma"
    tokens: int = attrs.field(default=4096, validator=in_range(64, 1 << 20))
    _artifact: str = ""
    _slot: str = ""
    _rope: Optional[tuple] = attrs.field(default=None, alias="_rope", converter=_freeze)

    calibrated = True
    positional = True  # bound to its layer's RoPE: the pairs the query energies are averaged over
    keys_only = True
    tier_kind = "query_aware"  # its tier feeds it the energies of the queries it answered
    runtime_params = ("window",)  # scoring only: the same artifact serves every window
    codes = False
    token_multiple = 1

    def check_head_dim(self, head_dim: int) -> str:
        if head_dim % self.piece or head_dim % 2:
            return f"head_dim {head_dim} does not split into pieces of {self.piece}"
        return self.words_problem(head_dim)

    def weights(self, energy: mx.array) -> mx.array:
        """The assignment metric per channel [H, D]: beta + (1 - beta) * query energy."""
        return self.beta + (1 - self.beta) * energy

    # --- calibration ------------------------------------------------------
    def fit(self, samples: np.ndarray, queries: np.ndarray = None) -> Dict[str, np.ndarray]:
        H, N, D = samples.shape
        if queries is None:
            raise CalibrationError("qavq is fitted with the model's real queries; none were collected")
        energy = pair_energy(queries, H, self._spec())
        w = np.sqrt(np.array(self.weights(mx.array(energy))))  # k-means in the weighted metric's coordinates
        P, d = D // self.piece, self.piece
        books = np.zeros((H, P, self.centroids, d), np.float32)
        for h in range(H):
            pieces = (samples[h] * w[h]).reshape(N, P, d).astype(np.float64)
            for p in range(P):  # a diagonal metric: centroids are means, scaled back exactly
                books[h, p] = kmeans(pieces[:, p], self.centroids, seed=h * P + p) / w[h].reshape(P, d)[p]
        return {"codebook": books, "energy": energy}

    # --- codes ------------------------------------------------------------
    def encode(self, x: mx.array, energy: Optional[mx.array] = None) -> Dict[str, mx.array]:
        """`energy` [H, D]: recent real queries' pair energies (mean 1); the calibrated ones without it."""
        t = self._t()
        B, H, L, D = x.shape
        P, d = D // self.piece, self.piece
        w = self.weights(t["energy"] if energy is None else energy).reshape(H, P, 1, d)
        book = t["codebook"]  # [H, P, C, d]
        pieces = x.astype(mx.float32).reshape(B, H, L, P, d).transpose(0, 1, 3, 2, 4)  # [B, H, P, L, d]
        cross = (pieces * w) @ book.swapaxes(-1, -2)  # [B, H, P, L, C]
        csq = mx.sum(book * book * w, axis=-1)[:, :, None, :]  # [H, P, 1, C]
        codes = mx.argmin(csq - 2 * cross, axis=-1).transpose(0, 1, 3, 2)  # [B, H, L, P]
        return {"codes": pack(codes.astype(mx.uint32), self.code_bits)}

    def _codes(self, enc, D: int) -> mx.array:
        return unpack(enc["codes"], self.code_bits, D // self.piece).astype(mx.int32)

    def decode(self, enc: Dict[str, mx.array], dtype) -> mx.array:
        book = self._t()["codebook"]
        H, P, C, d = book.shape
        codes = self._codes(enc, P * d)  # [B, H, L, P]
        own = codes + (mx.arange(H * P, dtype=mx.int32) * C).reshape(H, 1, P)  # each head, piece: its own book
        return book.reshape(H * P * C, d)[own].reshape(*codes.shape[:-1], P * d).astype(dtype)

    def scores_at(self, q: mx.array, enc: Dict[str, mx.array], spec, key_start: int, query_pos: mx.array) -> mx.array:
        """Windowed RoPE: exact for keys within `window` of each query row, else the fixed offset."""
        B, H, M, D = q.shape
        codes = self._codes(enc, D)
        L = codes.shape[2]
        far = rp.rotate_at(q, spec, query_pos - max(self.window, 0), inverse=True)
        scores = self._table_scores(far, codes)
        lo = max(key_start, int(mx.min(query_pos).item()) - self.window + 1) if self.window > 0 else key_start + L
        n = key_start + L - lo
        if n <= 0:
            return scores
        keys = rp.rotate_at(
            self.decode({"codes": enc["codes"][:, :, L - n :]}, mx.float32), spec, mx.arange(lo, lo + n)
        )
        exact = q @ keys.swapaxes(-1, -2)  # [B, H, M, n]
        near = (query_pos[:, None] - mx.arange(lo, lo + n)[None]) < self.window
        return mx.concatenate([scores[..., : L - n], mx.where(near, exact, scores[..., L - n :])], axis=-1)

    def _table_scores(self, q: mx.array, codes: mx.array) -> mx.array:
        """<q, decoded key> through a [P, C] table per query row: one look-up per piece."""
        book = self._t()["codebook"]
        H, P, C, d = book.shape
        B, _, M, _ = q.shape
        table = q.reshape(B, H, M, P, 1, d) @ book[:, None].swapaxes(-1, -2)  # [B, H, M, P, 1, C]
        table = table.reshape(B, H, M, P * C)
        L = codes.shape[2]
        where = (codes + mx.arange(P, dtype=mx.int32) * C).reshape(B, H, 1, L * P)
        picked = mx.take_along_axis(table, mx.broadcast_to(where, (B, H, M, L * P)), axis=-1)
        return mx.sum(picked.reshape(B, H, M, L, P), axis=-1)
