"""`commvq`: CommVQ's additive quantization of pre-RoPE keys with RoPE-commutative codewords.

Li et al., CommVQ (ICML 2025, arXiv:2506.18879). A key (after `unrope`) is
stored as its L2 norm and R additive codes: k ~ |k| * sum_r w_r. Each code is a
pair (A, B) of `half_bits`-bit indices into one table of 2^half_bits complex
vectors c_{r,0..}, one complex number per RoPE pair, and the codeword is

    w_r(A, B) = c_{r,A} + i * c_{r,B}       (pairwise complex arithmetic)

i.e. per RoPE pair the 2x2 block [[a, -b], [b, a]] of a complex scalar applied
to a one-hot (e_A, e_B) - a matrix that commutes with every 2x2 rotation, so
R(pos) w = c_A e^{i theta pos} + i c_B e^{i theta pos}: RoPE passes through the
codebook onto the codes. Training is EM over the (A, B) grid (hard assignments:
the paper's soft E-step at its final, near-zero temperature), whose M-step is
the paper's commutativity-constrained least squares: one complex linear system
G c = b shared by all pairs, with G = diag(count_A) + diag(count_B) + i (N - N^T)
over the assignment counts N[A, B]. Residual stages are trained one after
another on what the earlier ones leave, and codes are assigned greedily the same
way. Codes and the float16 norm share one bit stream; `bits` is the budget per
element that R is chosen to fill (R 12-bit codes + 16 norm bits, whole words).

Scores (`scores_at`) apply RoPE exactly at each key's own position: the codes
are summed per stage into the complex pairs, rotated by e^{i theta n} (one
complex multiply per pair) and dotted with the post-RoPE query.
"""

import math
from typing import Dict, Optional

import attrs
import mlx.core as mx
import numpy as np

from ..kernels.bitpack import pack, unpack
from . import rope_pairs as rp
from .registry import in_range, stage
from .unrope import _freeze

NORM_BITS = 16


def _grid_codes(a: mx.array, b: mx.array, re: mx.array, im: mx.array, sq: mx.array) -> mx.array:
    """Nearest codeword w(A, B) = c_A + i c_B of each row (pairs a + i b, [..., N, P]) -> A * C + B.

    |x - w|^2 = |x|^2 - 2 (u[A] + v[B]) + |w(A, B)|^2 with u = Re<c, x>, v = Re<i c, x>: the two
    projections are matmuls; the C x C grid is one broadcast add per row."""
    re_t, im_t = re.swapaxes(-1, -2), im.swapaxes(-1, -2)
    u = a @ re_t + b @ im_t  # [..., N, C]
    v = b @ re_t - a @ im_t
    cost = sq[..., None, :, :] - 2 * (u[..., :, None] + v[..., None, :])  # [..., N, C, C]
    return mx.argmin(cost.reshape(*cost.shape[:-2], -1), axis=-1)


def _norms2(re: mx.array, im: mx.array) -> mx.array:
    """|c_A + i c_B|^2 for every (A, B): [..., C, C] (Re(conj(c_A) i c_B) = <im_A, re_B> - <re_A, im_B>)."""
    n = mx.sum(re * re + im * im, axis=-1)
    return n[..., :, None] + n[..., None, :] + 2 * (im @ re.swapaxes(-1, -2) - re @ im.swapaxes(-1, -2))


def _m_step(x: np.ndarray, A: np.ndarray, B: np.ndarray, C: int, old: np.ndarray) -> np.ndarray:
    """The commutative codebook minimising sum |x_n - (c_{A_n} + i c_{B_n})|^2 (complex [C, P])."""
    counts = np.bincount(A * C + B, minlength=C * C).reshape(C, C).astype(np.float64)
    G = np.diag(counts.sum(1) + counts.sum(0)) + 1j * (counts - counts.T)
    rhs = np.zeros((C, x.shape[1]), np.complex128)
    np.add.at(rhs, A, x)
    np.add.at(rhs, B, -1j * x)
    used = np.diag(G).real > 0
    ridge = 1e-6 * max(float(np.diag(G).real.max()), 1.0)
    c = np.linalg.solve(G + ridge * np.eye(C), rhs)
    return np.where(used[:, None], c, old)  # an index nothing chose keeps its codeword


@stage("commvq", "store")
@attrs.frozen
class CommVQ(rp.BoundPreRope):
    """Additive VQ of pre-RoPE keys with RoPE-commutative codewords (EM-trained); RoPE re-applied exactly
    in the scores."""

    bits: int = attrs.field(default=2, validator=in_range(1, 8))
    half_bits: int = attrs.field(default=6, validator=in_range(2, 8))
    iters: int = attrs.field(default=6, validator=in_range(1, 200))
    corpus: str = "austen:emma"
    tokens: int = attrs.field(default=4096, validator=in_range(64, 1 << 20))
    _artifact: str = ""
    _slot: str = ""
    _rope: Optional[tuple] = attrs.field(default=None, alias="_rope", converter=_freeze)

    calibrated = True
    positional = True  # bound to its layer's RoPE (the pairs its codewords commute with)
    keys_only = True
    codes = False
    token_multiple = 1

    def stages(self, head_dim: int) -> int:
        """Additive codes per key: as many 2*half_bits-bit codes as fit the budget with the norm."""
        return (self.bits * head_dim - NORM_BITS) // (2 * self.half_bits)

    def _stream_bits(self, head_dim: int) -> int:
        return 32 * math.ceil((2 * self.half_bits * self.stages(head_dim) + NORM_BITS) / 32)

    def units(self) -> Dict[str, int]:
        return {"codes": 1}

    def bits_per_element(self, head_dim: int) -> float:
        return self._stream_bits(head_dim) / head_dim

    def check_head_dim(self, head_dim: int) -> str:
        if head_dim % 2 or self.stages(head_dim) < 1:
            return f"{self.bits} bits x {head_dim} channels hold no {2 * self.half_bits}-bit code beside the norm"
        return ""

    # --- calibration ------------------------------------------------------
    def fit(self, samples: np.ndarray, queries: np.ndarray = None) -> Dict[str, np.ndarray]:
        H, N, D = samples.shape
        R, C = self.stages(D), 1 << self.half_bits
        spec = self._spec()
        books = np.zeros((H, R, C, D // 2), np.complex64)
        for h in range(H):
            k = mx.array(samples[h])
            a, b = rp.pairs(k / mx.maximum(mx.linalg.norm(k, axis=-1, keepdims=True), 1e-12), spec)
            resid = np.array(a).astype(np.float64) + 1j * np.array(b).astype(np.float64)  # [N, P]
            rng = np.random.default_rng(h)
            for r in range(R):
                book = resid[rng.choice(N, C, replace=N < C)] / 2  # codewords start as (x_A + i x_B) / 2
                for _ in range(self.iters):
                    AB = np.array(self._assign(resid, book))
                    book = _m_step(resid, AB // C, AB % C, C, book)
                AB = np.array(self._assign(resid, book))
                resid = resid - (book[AB // C] + 1j * book[AB % C])
                books[h, r] = book
        return {"re": books.real.astype(np.float32), "im": books.imag.astype(np.float32)}

    @staticmethod
    def _assign(resid: np.ndarray, book: np.ndarray) -> mx.array:
        re, im = mx.array(book.real.astype(np.float32)), mx.array(book.imag.astype(np.float32))
        x = resid.astype(np.complex64)
        return _grid_codes(mx.array(x.real), mx.array(x.imag), re, im, _norms2(re, im))

    # --- codes ------------------------------------------------------------
    def encode(self, x: mx.array) -> Dict[str, mx.array]:
        t, spec = self._t(), self._spec()
        x = x.astype(mx.float32)
        D = x.shape[-1]
        norm = mx.linalg.norm(x, axis=-1, keepdims=True)
        a, b = rp.pairs(x / mx.maximum(norm, 1e-12), spec)  # [B, H, L, P]
        a, b = a.swapaxes(0, 1), b.swapaxes(0, 1)  # heads first: each head has its own books
        re, im = t["re"], t["im"]  # [H, R, C, P]
        C, codes = re.shape[2], []
        for r in range(re.shape[1]):  # stages are sequential: each codes what the last left
            rr, ii = re[:, r][:, None], im[:, r][:, None]  # [H, 1, C, P]
            sq = _norms2(rr, ii)
            AB = _grid_codes(a, b, rr, ii, sq)  # [H, B, L]
            A, Bc = AB // C, AB % C
            a = a - (_take(rr, A) - _take(ii, Bc))
            b = b - (_take(ii, A) + _take(rr, Bc))
            codes += [A, Bc]
        halves = mx.stack(codes, axis=-1).swapaxes(0, 1).astype(mx.uint32)  # [B, H, L, 2R]
        bits = (halves[..., None] >> mx.arange(self.half_bits, dtype=mx.uint32)) & 1
        n16 = norm.astype(mx.float16).view(mx.uint16).astype(mx.uint32)
        nbits = (n16 >> mx.arange(NORM_BITS, dtype=mx.uint32)) & 1
        stream = mx.concatenate([bits.reshape(*bits.shape[:-2], -1), nbits], axis=-1)
        pad = self._stream_bits(D) - stream.shape[-1]
        if pad:
            stream = mx.concatenate([stream, mx.zeros((*stream.shape[:-1], pad), mx.uint32)], axis=-1)
        return {"codes": pack(stream, 1)}

    def _unpacked(self, enc, D: int):
        """(codes [B, H, L, 2R] int32: A0, B0, A1, B1, ..., norms [B, H, L, 1] float32)."""
        R, h = self.stages(D), self.half_bits
        stream = unpack(enc["codes"], 1, self._stream_bits(D))
        halves = stream[..., : 2 * R * h].reshape(*stream.shape[:-1], 2 * R, h)
        codes = mx.sum(halves << mx.arange(h, dtype=mx.uint32), axis=-1).astype(mx.int32)
        n16 = mx.sum(stream[..., 2 * R * h : 2 * R * h + NORM_BITS] << mx.arange(NORM_BITS, dtype=mx.uint32), axis=-1)
        return codes, n16.astype(mx.uint16).view(mx.float16).astype(mx.float32)[..., None]

    def _pairs(self, enc, D: int):
        """The stored keys as RoPE pairs (a + i b) [B, H, L, P], summed stage by stage (never [.., R, P])."""
        t = self._t()
        codes, norms = self._unpacked(enc, D)
        re, im = t["re"], t["im"]
        H, R, C, P = re.shape
        flat_re, flat_im = re.reshape(H * R * C, P), im.reshape(H * R * C, P)
        base = (mx.arange(H, dtype=mx.int32) * (R * C))[:, None]  # [H, 1]: each head reads its own books
        a = b = mx.zeros((*codes.shape[:-1], P), mx.float32)
        for r in range(R):
            A, Bc = codes[..., 2 * r] + base + r * C, codes[..., 2 * r + 1] + base + r * C
            a = a + flat_re[A] - flat_im[Bc]
            b = b + flat_im[A] + flat_re[Bc]
        return a * norms, b * norms

    def decode(self, enc: Dict[str, mx.array], dtype) -> mx.array:
        D = self._stream_D(enc)
        a, b = self._pairs(enc, D)
        return rp.unpairs(a, b, self._spec()).astype(dtype)

    def _stream_D(self, enc) -> int:
        return 2 * self._t()["re"].shape[-1]

    def scores_at(
        self, q: mx.array, enc: Dict[str, mx.array], spec, key_start: int, query_pos: mx.array = None
    ) -> mx.array:
        """q (post-RoPE) . R(n) k_n for keys at positions key_start.. : the codewords commute with
        RoPE, so each key's summed pairs take one complex rotation e^{i theta n} before the dot."""
        D = q.shape[-1]
        rp.check_full(spec, D)
        a, b = self._pairs(enc, D)
        c, s = rp.cos_sin(spec, mx.arange(key_start, key_start + a.shape[2]))
        qa, qb = rp.pairs(q, spec)
        return qa @ (a * c - b * s).swapaxes(-1, -2) + qb @ (a * s + b * c).swapaxes(-1, -2)


def _take(book: mx.array, idx: mx.array) -> mx.array:
    """book [H, 1, C, P], idx [H, B, L] -> [H, B, L, P]."""
    H, _, C, P = book.shape
    own = idx + (mx.arange(H, dtype=mx.int32) * C)[:, None, None]
    return book.reshape(H * C, P)[own]
