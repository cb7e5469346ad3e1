"""The `amc` store (AMC): tokens routed by saliency into three latent tiers of different rank and precision.

At the end of the prompt a basis ordered by variance (the eigenvectors of the
prompt's second moment, per group of `heads` kv heads; `center=true`: PCA) is
fitted, as for `latent`. Each token gets a saliency, the L1 norm of its vector
(mean over the batch and heads), and the two thresholds that put the prompt's
top `k_high` tokens in High and the next `k_mid` in Mid are frozen with the
basis; later tokens are routed by them. A token in tier c keeps its first
rank_c latent components (the rank mask), coded at bits_c: 16 = float16, else
affine min/max codes with a float16 scale and zero per token and head group.
No token is ever dropped. The runtime is runtime/kinds/amc_side.py (a side of the
latent tier, attending in latent space); this module is the arithmetic.
"""

import math
from typing import Dict, Tuple

import attrs
import mlx.core as mx
import numpy as np

from ..kernels.bitpack import pack, unpack
from .latent import FLOAT, latent_width
from .principal import principal_axes
from .registry import in_range, stage

TIERS = ("high", "mid", "low")


@stage("amc", "store")
@attrs.frozen
class Amc:
    """AMC: tokens routed by L1 saliency to High/Mid/Low latent tiers of falling rank and precision; no eviction."""

    k_high: float = attrs.field(default=0.2, validator=in_range(0.0, 1.0))
    k_mid: float = attrs.field(default=0.3, validator=in_range(0.0, 1.0))
    high_rank: float = attrs.field(default=1.0, validator=in_range(0.0, 1.0))
    mid_rank: float = attrs.field(default=0.34, validator=in_range(0.0, 1.0))
    low_rank: float = attrs.field(default=0.0625, validator=in_range(0.0, 1.0))
    high_bits: int = attrs.field(default=16, validator=latent_width)
    mid_bits: int = attrs.field(default=8, validator=latent_width)
    low_bits: int = attrs.field(default=4, validator=latent_width)
    heads: int = attrs.field(default=1, validator=in_range(0, 1 << 10))
    center: bool = False

    codes = False
    tier_kind = "latent"  # a side of runtime/kinds/latent_tier.py ...
    side = "amc"  # ... held by runtime/kinds/amc_side.py
    layers = 1  # never shared across layers
    group = 1  # tokens are routed and coded one at a time
    token_multiple = 1

    def __attrs_post_init__(self):
        if self.k_high + self.k_mid > 1.0:
            raise ValueError(f"k_high + k_mid = {self.k_high + self.k_mid:g} exceeds 1 (the shares of High and Mid)")

    def check_head_dim(self, head_dim: int) -> str:
        return ""

    def check_heads(self, n_kv_heads: int, head_dim: int) -> str:
        return (
            f"heads={self.heads} does not divide the {n_kv_heads} kv heads"
            if self.heads and n_kv_heads % self.heads
            else ""
        )

    def heads_per_group(self, n_kv_heads: int) -> int:
        return self.heads or n_kv_heads

    # --- tiers ---------------------------------------------------------------------------
    def tiers(self, width: int) -> Tuple[Tuple[str, int, int], ...]:
        """(name, rank, bits) per tier for a group `width` channels wide; a coded rank fills whole words."""
        out = []
        for name in TIERS:
            bits, share = getattr(self, f"{name}_bits"), getattr(self, f"{name}_rank")
            step = 1 if bits == FLOAT else 32 // math.gcd(32, bits)
            out.append((name, min(width, max(step, math.ceil(share * width / step) * step)), bits))
        return tuple(out)

    def bits_per_element(self, head_dim: int) -> float:
        """Mean bits per element at the routing shares, one head per basis (NaN otherwise)."""
        if self.heads != 1:
            return float("nan")
        shares = (self.k_high, self.k_mid, 1.0 - self.k_high - self.k_mid)
        return (
            sum(p * (r * b if b == FLOAT else r * b + 32) for p, (_, r, b) in zip(shares, self.tiers(head_dim)))
            / head_dim
        )

    # --- the basis and the routing --------------------------------------------------------
    def fit(self, x: mx.array) -> Dict[str, mx.array]:
        """{"basis" [G, hg*D, hg*D] (all components, by variance), "mean" [G, hg*D], "widths"} from x [B, H, L, D]."""
        B, H, L, D = x.shape
        hg = self.heads_per_group(H)
        mean, _, evecs = principal_axes(x, hg, self.center)
        basis = np.ascontiguousarray(evecs, dtype=np.float16)  # descending variance
        return {
            "basis": mx.array(basis),
            "mean": mx.array(mean.astype(np.float16)),
            "widths": mx.array(np.full(hg * D, FLOAT, np.uint8)),
        }

    @staticmethod
    def saliency(x: mx.array) -> mx.array:
        """x [B, H, L, D] -> the L1 norm of each token's vector, mean over batch and heads [L]."""
        return mx.mean(mx.sum(mx.abs(x.astype(mx.float32)), axis=-1), axis=(0, 1))

    def thresholds(self, x: mx.array) -> mx.array:
        """The saliencies from which a token goes to High, and to Mid: the prompt's tokens x [B, H, L, D]
        split k_high / k_mid / the rest (+inf: a tier the shares leave empty)."""
        s = np.sort(np.array(self.saliency(x)))[::-1]
        tops = [int(round(k * len(s))) for k in (self.k_high, self.k_high + self.k_mid)]
        return mx.array(np.array([s[n - 1] if n else np.inf for n in tops], np.float32))

    def route(self, x: mx.array, thresholds: mx.array) -> mx.array:
        """Each token's tier, 0 High, 1 Mid, 2 Low [L] (uint8)."""
        s = self.saliency(x)
        return (2 - (s >= thresholds[1]).astype(mx.uint8) - (s >= thresholds[0]).astype(mx.uint8)).astype(mx.uint8)

    # --- latents <-> codes ----------------------------------------------------------------
    def encode(self, z: mx.array, bits: int) -> Dict[str, mx.array]:
        """One tier's latents z [B, G, n, r] -> its arrays (axis 2 counts tokens)."""
        if bits == FLOAT:
            return {"f16": z.astype(mx.float16)}
        lo, hi = mx.min(z, axis=-1, keepdims=True), mx.max(z, axis=-1, keepdims=True)
        levels = (1 << bits) - 1
        scale, zero = ((hi - lo) / levels).astype(mx.float16), lo.astype(mx.float16)
        q = mx.clip(mx.round((z - zero.astype(mx.float32)) / mx.maximum(scale.astype(mx.float32), 1e-12)), 0, levels)
        return {"codes": pack(q, bits), "scales": scale, "zeros": zero}

    def decode(self, enc: Dict[str, mx.array], rank: int, bits: int) -> mx.array:
        if bits == FLOAT:
            return enc["f16"].astype(mx.float32)
        q = unpack(enc["codes"], bits, rank).astype(mx.float32)
        return q * enc["scales"].astype(mx.float32) + enc["zeros"].astype(mx.float32)

    @staticmethod
    def names(bits: int) -> Tuple[str, ...]:
        return ("f16",) if bits == FLOAT else ("codes", "scales", "zeros")
