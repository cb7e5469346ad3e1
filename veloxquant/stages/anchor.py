"""The `anchor` store (AnchorKV): a few tokens exact, the rest as a scaled anchor plus residuals where they matter.

At the end of the prompt each kv head picks `anchors` (a share) of its tokens
and keeps them in float16, exactly. Every other token becomes (anchor index,
coefficient): its nearest anchor a by |cosine| and its projection on it,
c = <x, a> / |a|^2, so x ~ c·a. Scores come from the anchors without rebuilding
a key: q·k ~ c·(q·a), one small [queries x anchors] product and a gather.

Anchor choice: half the anchors are the tokens the prompt's real queries
attend to most (heavy hitters: an error there moves the output most, and
sinks are far from every other key, so nothing else can stand for them), the
other half are medoids of a few spherical k-means steps over the remaining
tokens, sign-invariant like the projection, so the anchors cover the
directions the keys take and the projections lose little. k-means needs only
[tokens x anchors] products (no per-token loop) and the medoid keeps an anchor
a real token, held exactly.

Residuals: `theta` is the byte budget for residuals -- the share of the
non-anchor tokens that hold one (theta=1 costs what coding every residual
costs). Which tokens get them is decided by the caller (runtime/kinds/anchor_tier.py)
from a first-order estimate of the output error on the prompt's real queries.
A residual is coded by the `affine` store (per token, `bits` wide, a float16
scale and zero per token): theta=1 is that codec on x - c·a everywhere.
Tokens arriving after the prompt keep both shares (so a cache holds the same bytes however its
tokens arrived): the ones a projection serves worst become anchors, the next worst hold a residual
(no queries rank them there: the projection error does).
"""

import math
from typing import Tuple

import attrs
import mlx.core as mx

from .registry import in_range, stage
from .store import Affine

MAX_ANCHORS = 1 << 16  # anchor indices are uint16
BLOCK = 1024  # tokens projected at once


@stage("anchor", "store")
@attrs.frozen
class Anchor:
    """AnchorKV: anchors in float16, other tokens as anchor index + coefficient, quantized residuals under theta."""

    anchors: float = attrs.field(default=0.125, validator=in_range(0.0, 1.0))
    theta: float = attrs.field(default=0.25, validator=in_range(0.0, 1.0))
    bits: int = attrs.field(default=4, validator=in_range(1, 8))
    iters: int = attrs.field(default=4, validator=in_range(0, 64))

    codes = False
    tier_kind = "anchor"  # held by runtime/kinds/anchor_tier.py
    layers = 1  # never shared across layers
    group = 1
    token_multiple = 1

    def __attrs_post_init__(self):
        if self.anchors <= 0.0:
            raise ValueError("anchors must be above 0 (the share of tokens kept exactly)")

    def check_head_dim(self, head_dim: int) -> str:
        return self.residual_codec(head_dim).check_head_dim(head_dim)

    def residual_codec(self, head_dim: int) -> Affine:
        return Affine(bits=self.bits, group=head_dim, axis="token")

    def bits_per_element(self, head_dim: int) -> float:
        """Mean bits per element at the stated shares: anchors in float16, the rest uint16 index + float16
        coefficient, theta of the rest also a residual (codes + float16 scale and zero, + int32 position)."""
        rest = 1.0 - self.anchors
        return self.anchors * 16 + rest * (32 + self.theta * (self.bits * head_dim + 64)) / head_dim

    def count(self, n: int) -> int:
        """Anchors a head keeps for n tokens (at most MAX_ANCHORS: indices are uint16)."""
        return min(n, MAX_ANCHORS, max(1, math.ceil(self.anchors * n)))

    # --- anchor choice --------------------------------------------------------------------
    def choose(self, x: mx.array, mass: mx.array) -> mx.array:
        """Anchor positions [B, H, A] (sorted) for tokens x [B, H, L, D], given each token's attention
        mass [B, H, L] from real queries (heavy hitters first, then k-means medoids)."""
        B, H, L, D = x.shape
        A = self.count(L)
        if A == L:
            return mx.broadcast_to(mx.arange(L, dtype=mx.int32), (B, H, L))
        heavy = (A + 1) // 2
        order = mx.argsort(-mass, axis=-1).astype(mx.int32)
        chosen = order[..., :heavy]
        rest = order[..., heavy:]  # [B, H, L - heavy]: the candidates for medoids
        k = A - heavy
        if k:
            u = _unit(mx.take_along_axis(x.astype(mx.float32), rest[..., None], axis=2))
            chosen = mx.concatenate([chosen, mx.take_along_axis(rest, self._medoids(u, k), axis=-1)], axis=-1)
        return mx.sort(chosen, axis=-1)

    def _medoids(self, u: mx.array, k: int) -> mx.array:
        """k medoids [B, H, k] (indices into u's tokens) of sign-invariant spherical k-means on unit rows u."""
        B, H, n, D = u.shape
        seeds = mx.array([(i * n) // k for i in range(k)], dtype=mx.int32)  # evenly over the positions
        centre = u[:, :, seeds]
        for _ in range(self.iters):
            sim = u @ centre.swapaxes(-1, -2)  # [B, H, n, k]
            best = mx.argmax(mx.abs(sim), axis=-1)
            sign = mx.sign(mx.take_along_axis(sim, best[..., None], axis=-1))  # fold antipodes together
            member = (mx.arange(k) == best[..., None]).astype(mx.float32) * sign  # [B, H, n, k]
            moved = member.swapaxes(-1, -2) @ u  # [B, H, k, D]
            empty = mx.sum(mx.abs(member), axis=2)[..., None] == 0
            centre = mx.where(empty, centre, _unit(moved))  # an empty cluster keeps its centre
            mx.eval(centre)  # one step's [tokens x centres] at a time, not the whole loop's graph
        return mx.argmax(mx.abs(u @ centre.swapaxes(-1, -2)), axis=2).astype(mx.int32)  # [B, H, k]

    # --- tokens as (anchor, coefficient) -----------------------------------------------------
    @staticmethod
    def project(x: mx.array, anchors: mx.array) -> Tuple[mx.array, mx.array]:
        """x [B, H, L, D] onto anchors [B, H, A, D]: (index [B, H, L] uint16, coefficient [B, H, L] float16),
        the anchor with the largest |projection| (smallest residual) and the projection's scale."""
        a = anchors.astype(mx.float32)
        sq = mx.maximum(mx.sum(a * a, axis=-1), 1e-30)[:, :, None]  # |a|^2 [B, H, 1, A]
        out = []
        for s in range(0, x.shape[2], BLOCK):  # [BLOCK x anchors] at a time: a long prompt's peak stays flat
            dots = x[:, :, s : s + BLOCK].astype(mx.float32) @ a.swapaxes(-1, -2)  # [B, H, b, A]
            idx = mx.argmax(mx.abs(dots) * mx.rsqrt(sq), axis=-1)  # the anchor explaining most energy
            coeff = mx.take_along_axis(dots, idx[..., None], axis=-1)[..., 0] / mx.take_along_axis(sq[:, :, 0], idx, -1)
            out.append((idx.astype(mx.uint16), coeff.astype(mx.float16)))
            mx.eval(out[-1])
        return tuple(mx.concatenate(parts, axis=2) for parts in zip(*out))

    @staticmethod
    def approx(anchors: mx.array, idx: mx.array, coeff: mx.array) -> mx.array:
        """c·a for each token [B, H, L, D] (float32): what the token is without a residual."""
        a = mx.take_along_axis(anchors.astype(mx.float32), idx.astype(mx.int32)[..., None], axis=2)
        return coeff.astype(mx.float32)[..., None] * a


def _unit(x: mx.array) -> mx.array:
    return x / mx.maximum(mx.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
