"""The `latent` store: K or V as low-rank latents on a basis fitted at the end of the prompt.

For each group of `heads` kv heads, an eigendecomposition of the prompt's
vectors (uncentred: SVD, as SVDq/PALU; `center=true`: PCA, as KVTC) gives
orthonormal components ordered by energy. Each component gets a width:

  rank/energy mode -- the first `rank` components (or as many as reach `energy`
                      of the energy), the top `hi_fraction` of them at `hi_bits`,
                      the rest at `lo_bits` (16 = float16 latents);
  budget mode      -- widths from the KVTC allocator under `budget` bits per token
                      and kv head (a group of h heads shares h*budget; bit_alloc.py);
                      width 0 drops a component.

With `layers=N` (xKV) N adjacent layers share one basis, fitted on all their
vectors at once; each layer holds its own latents (compiler/groups.py).
With `calibrated=true` (KVTC's global basis) the components come from `veloxquant
calibrate` (PCA over `corpus`): the prompt gives only its mean and the variances along
them (the widths), and a saved cache names the artifact's axes instead of a basis.

Latents of width b < 16 are coded per component, packed along the tokens (a
component's `group` tokens of b bits fill whole 32-bit words, for any b):
quant=minmax -- affine codes, a float16 scale and zero per component and group;
quant=gauss  -- Lloyd-Max levels of a unit gaussian on the latent standardised by its
                prompt mean and deviation: no metadata per token, the budget is codes.
runtime/kinds/latent_tier.py holds them and attends in latent space; this is the basis and the
widths, latent_codes.py the coding of latents.
"""

import math
from functools import lru_cache
from typing import Dict

import attrs
import mlx.core as mx
import numpy as np

from ..artifacts import CalibrationError, slot_arrays
from .bit_alloc import allocate, parse_choices
from .latent_codes import FLOAT, LatentCoding
from .principal import centred, principal_axes
from .registry import choices as one_of
from .registry import in_range, stage
from .spectral import _tables


def _choices(instance, attribute, value):
    parse_choices(value)


@lru_cache(maxsize=1)
def lloyd_distortions() -> np.ndarray:
    """Mean squared error of the Lloyd-Max codes of a unit gaussian, by width 0..8 (the spectral stage's)."""
    return _tables()[2]


def latent_width(instance, attribute, value):
    if not (1 <= value <= 8 or value == FLOAT):
        raise ValueError("must be between 1 and 8, or 16 (float16 latents)")


@stage("latent", "store")
@attrs.frozen
class Latent(LatentCoding):
    """Low-rank latents on a basis fitted at the end of the prompt; attention runs in latent space."""

    rank: int = attrs.field(default=0, validator=in_range(0, 1 << 16))
    energy: float = attrs.field(default=0.0, validator=in_range(0.0, 1.0))
    heads: int = attrs.field(default=1, validator=in_range(0, 1 << 10))
    hi_bits: int = attrs.field(default=4, validator=latent_width)
    lo_bits: int = attrs.field(default=2, validator=latent_width)
    hi_fraction: float = attrs.field(default=0.25, validator=in_range(0.0, 1.0))
    budget: int = attrs.field(default=0, validator=in_range(0, 1 << 16))
    choices: str = attrs.field(default="0,1,2,3,4,6,8", validator=_choices)
    beta: float = attrs.field(default=4.0, validator=in_range(1.0001, 1e6))
    rule: str = attrs.field(default="beta", validator=one_of("beta", "lloyd"))  # budget: distortion per width
    group: int = attrs.field(default=32, validator=in_range(32, 1 << 16))
    center: bool = False
    quant: str = attrs.field(default="minmax", validator=one_of("minmax", "gauss"))
    layers: int = attrs.field(default=1, validator=in_range(1, 8))
    queries: bool = False  # budget mode, keys: weigh each component by the prompt's queries along it
    calibrated: bool = False  # components from `veloxquant calibrate`, not fitted per prompt (not saved)
    corpus: str = "austen:emma"  # calibrated=true: the text the components are fitted on
    tokens: int = attrs.field(default=4096, validator=in_range(64, 1 << 20))
    _artifact: str = ""  # set when bound: the content hash of the calibration artifact
    _slot: str = ""  # set when bound: this stage's arrays in it, "layer.tier.side"

    codes = True  # integer codes an entropy stage may code (the c<b>.codes arrays)
    tier_kind = "latent"  # held by runtime/kinds/latent_tier.py

    def __attrs_post_init__(self):
        if self.group % 32:
            raise ValueError(f"group={self.group} must be a multiple of 32 (codes are packed along tokens)")
        if not (self.rank or self.energy or self.budget):
            raise ValueError("give rank=, energy= or budget= (how many components to keep)")
        if self.rank and self.energy:
            raise ValueError("give rank= or energy=, not both")
        if self.calibrated and self.layers > 1:
            raise ValueError(
                "calibrated=true takes one basis per layer from the artifact: it cannot be shared "
                "across layers (layers=1)"
            )

    @property
    def token_multiple(self) -> int:
        return self.group

    def check_head_dim(self, head_dim: int) -> str:
        return ""

    def check_heads(self, n_kv_heads: int, head_dim: int) -> str:
        if self.heads and n_kv_heads % self.heads:
            return f"heads={self.heads} does not divide the {n_kv_heads} kv heads"
        if self.rank > self.group_width(n_kv_heads, head_dim):
            return f"rank={self.rank} exceeds the {self.group_width(n_kv_heads, head_dim)} channels of a head group"
        return ""

    def heads_per_group(self, n_kv_heads: int) -> int:
        return self.heads or n_kv_heads

    def group_width(self, n_kv_heads: int, head_dim: int) -> int:
        return self.heads_per_group(n_kv_heads) * head_dim

    def bits_per_element(self, head_dim: int) -> float:
        """Latent bits per K/V element (a budget of Lloyd-Max codes, or rank mode with one head per
        basis); NaN where the data decides (energy, or how many components get scales)."""
        if (self.budget and self.quant != "gauss") or not (self.rank or self.budget):
            return float("nan")
        if self.budget:
            return min(self.budget, 8 * head_dim) / head_dim
        if self.heads != 1:
            return float("nan")
        hi = math.ceil(self.hi_fraction * self.rank)
        meta = 32 / self.group if self.quant == "minmax" else 0.0
        return (
            sum(n * (b if b == FLOAT else b + meta) for n, b in ((hi, self.hi_bits), (self.rank - hi, self.lo_bits)))
            / head_dim
        )

    # --- the basis ----------------------------------------------------------------
    def widths(self, spectra: np.ndarray, weights=None, heads: int = 1) -> np.ndarray:
        """Width of each component from the energies [groups, channels] (descending per group) of `heads`
        kv heads per group; `weights` [groups, channels]: what an error along each costs (queries)."""
        n = spectra.shape[1]
        if self.budget:
            variances = (spectra if weights is None else spectra * weights).mean(axis=0)
            if self.rank:
                variances = variances[: self.rank]
            table = lloyd_distortions() if self.rule == "lloyd" else None
            w = allocate(variances, self.budget * heads, parse_choices(self.choices), self.beta, table)
            return np.concatenate([w, np.zeros(n - len(w), np.int64)])
        if self.rank:
            r = min(self.rank, n)
        else:  # the smallest rank reaching `energy` in every head group
            share = np.cumsum(spectra, axis=1) / np.maximum(spectra.sum(axis=1, keepdims=True), 1e-30)
            r = int(max(np.searchsorted(s, self.energy - 1e-12) + 1 for s in share))
            r = min(r, n)
        hi = math.ceil(self.hi_fraction * r)
        return np.array([self.hi_bits] * hi + [self.lo_bits] * (r - hi) + [0] * (n - r), np.int64)

    def fit(self, x: mx.array, query_moment=None) -> Dict[str, mx.array]:
        """{"basis" [G, hg*D, r], "mean" [G, hg*D], "widths" [r] uint8} from vectors x [B, H, L, D]
        (calibrated=true: also "keep" [r], which calibrated components the basis holds).

        `query_moment` [H, D, D] (keys, with queries=true): the second moment of the queries that
        attended during the prompt. A key error e along component p costs (q·e)² in the logits, so
        the allocator weighs component i by E[(q·p_i)²] (SpectralQuant's calibrated weighting)."""
        B, H, L, D = x.shape
        hg = self.heads_per_group(H)
        if self.calibrated:  # the calibrated components, the prompt's variance along each (not sorted)
            evecs = np.array(self.axes(), dtype=np.float64)
            Xc, mean = centred(x, hg, self.center)
            evals = np.mean((Xc @ evecs) ** 2, axis=1)
        else:
            mean, evals, evecs = principal_axes(x, hg, self.center)
        weights = None
        if self.queries and query_moment is not None:
            Sq = np.array(query_moment, dtype=np.float64).reshape(H // hg, hg, D, D)
            P = evecs.reshape(H // hg, hg, D, hg * D)  # each head's rows of a group's components
            weights = np.einsum("ghdc,ghde,ghec->gc", P, Sq, P)
            weights = np.maximum(weights / np.maximum(weights.mean(axis=1, keepdims=True), 1e-30), 1e-6)
        w = self.widths(evals, weights, hg)
        keep = np.flatnonzero(w)
        out = {
            "basis": mx.array(np.ascontiguousarray(evecs[:, :, keep], dtype=np.float16)),
            "mean": mx.array(mean.astype(np.float16)),
            "widths": mx.array(w[keep].astype(np.uint8)),
        }
        return {**out, "keep": mx.array(keep.astype(np.uint16))} if self.calibrated else out

    # --- a calibrated basis (veloxquant calibrate) --------------------------------------
    def calibration_fit(self, samples: np.ndarray, queries=None) -> Dict[str, np.ndarray]:
        """samples [H, N, D] of calibration text -> {"axes" [G, hg*D, hg*D]}: every component, by
        falling variance (float16, as a fitted basis is held). Widths stay per prompt: the prompt's
        own variance (and queries) along these axes decide them at the end of the prompt."""
        _, _, evecs = principal_axes(samples[None], self.heads_per_group(samples.shape[0]), self.center)
        return {"axes": np.ascontiguousarray(evecs, dtype=np.float16)}

    def for_calibration(self):
        """The stage as the artifact's key sees it: what the axes depend on (budgets may change freely)."""
        return Latent(
            budget=1, heads=self.heads, center=self.center, calibrated=True, corpus=self.corpus, tokens=self.tokens
        )

    def axes(self) -> mx.array:
        if not self._artifact:
            raise CalibrationError(
                "stage 'latent' with calibrated=true is not bound to a calibration artifact: "
                "run `veloxquant calibrate RECIPE` and make caches with "
                "veloxquant.make_prompt_cache"
            )
        return slot_arrays(self._artifact, self._slot)["axes"]
