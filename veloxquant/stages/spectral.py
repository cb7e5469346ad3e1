"""`spectral`: a calibrated PCA basis per kv head, bits per component by water-filling.

Calibration (veloxquant calibrate) fits, per layer and kv head, the mean and
eigenbasis of the model's own keys (or values) and gives each component a
width b_i (0..8 bits) by greedy reverse water-filling on the Lloyd-Max
distortions sigma_i^2 * d(b_i), for `bits` * head_dim bits per vector in all.
Stored per token: the components' Lloyd-Max codes of (x - mean) B / sigma, as
one packed bit stream (no per-token metadata). Scores rotate the query once
(q B * sigma) and read the codes' levels; keys are never rotated back.
"""

from functools import lru_cache
from typing import Dict

import attrs
import mlx.core as mx
import numpy as np

from ..artifacts import CalibrationError, slot_arrays
from ..kernels.bitpack import pack, unpack
from .codebook import lloyd_max
from .registry import in_range, stage

MAX_BITS = 8


@lru_cache(maxsize=1)
def _tables():
    """Levels and decision edges of Lloyd-Max codebooks of 0..MAX_BITS bits, padded to 256 columns."""
    levels = np.zeros((MAX_BITS + 1, 256), np.float32)
    edges = np.full((MAX_BITS + 1, 256), np.inf, np.float32)
    dist = np.zeros(MAX_BITS + 1)
    grid = np.linspace(-8, 8, 40001)
    pdf = np.exp(-(grid**2) / 2)
    pdf /= pdf.sum()
    dist[0] = 1.0
    for b in range(1, MAX_BITS + 1):
        lv = lloyd_max(b, "gaussian")
        levels[b, : lv.size] = lv
        edges[b, : lv.size - 1] = (lv[1:] + lv[:-1]) / 2
        dist[b] = float(np.sum(pdf * (grid - lv[np.searchsorted(edges[b, : lv.size - 1], grid)]) ** 2))
    return levels, edges, dist


def water_fill(variances: np.ndarray, total: int) -> np.ndarray:
    """Integer bits per component (0..MAX_BITS) summing to `total`, greedily minimising sum var_i * d(b_i)."""
    _, _, dist = _tables()
    bits = np.zeros(variances.shape, np.int64)
    gain = variances * (dist[0] - dist[1])
    for _ in range(total):
        i = int(np.argmax(gain))
        bits[i] += 1
        gain[i] = variances[i] * (dist[bits[i]] - dist[bits[i] + 1]) if bits[i] < MAX_BITS else -np.inf
    return bits


@stage("spectral", "store")
@attrs.frozen
class Spectral:
    """Calibrated per-head PCA basis + Lloyd-Max codes per component, widths by water-filling (bits on average)."""

    bits: int = attrs.field(default=3, validator=in_range(1, MAX_BITS))
    corpus: str = "austen:emma"
    tokens: int = attrs.field(default=4096, validator=in_range(64, 1 << 20))
    scale: bool = True  # a float16 RMS per token: outlier tokens (attention sinks) are scaled, not clipped
    _artifact: str = ""  # set when bound: the content hash of the calibration artifact
    _slot: str = ""  # set when bound: this stage's arrays in it, "layer.tier.side"

    calibrated = True
    codes = False  # variable widths in one stream: no entropy stage applies
    token_multiple = 1

    def units(self) -> Dict[str, int]:
        return {"codes": 1, "scale": 1} if self.scale else {"codes": 1}

    def bits_per_element(self, head_dim: int) -> float:
        return self.bits + (16 / head_dim if self.scale else 0)

    def check_head_dim(self, head_dim: int) -> str:
        return "" if head_dim * self.bits % 32 == 0 else f"{head_dim} x {self.bits} bits do not fill 32-bit words"

    # --- calibration ------------------------------------------------------
    def fit(self, samples: np.ndarray, queries: np.ndarray = None) -> Dict[str, np.ndarray]:
        """samples [H, N, D] -> mean, basis (columns by falling variance), sigma, bits per component.

        With the real queries [Hq, M, D] (keys), widths are water-filled on the error attention
        sees, E[(q.b_i)^2] * sigma_i^2 per component b_i, not on sigma_i^2 alone: a direction keys
        barely vary along can carry large query components (measured: MSE-only widths lost
        +127% PPL on SmolLM2 at 2.75 bits)."""
        H, N, D = samples.shape
        x = samples.astype(np.float64)
        mean = x.mean(axis=1)
        xc = x - mean[:, None]
        cov = np.einsum("hnd,hne->hde", xc, xc) / max(N - 1, 1)
        var, basis = np.linalg.eigh(cov)
        var, basis = var[:, ::-1], basis[:, :, ::-1]
        var = np.maximum(var, 1e-6 * var[:, :1])  # components silent in calibration: not divided by ~0
        weight = np.ones_like(var)
        if queries is not None:
            q = queries.astype(np.float64).reshape(H, -1, D)  # a kv head's query heads, rows together
            weight = np.mean(np.einsum("hmd,hde->hme", q, basis) ** 2, axis=1)
            weight = np.maximum(weight / weight.mean(axis=1, keepdims=True), 1e-6)
        bits = np.stack([water_fill(v, self.bits * D) for v in var * weight])
        return {
            "mean": mean.astype(np.float32),
            "basis": basis.astype(np.float32),
            "sigma": np.sqrt(var).astype(np.float32),
            "bits": bits.astype(np.int32),
        }

    # --- runtime ------------------------------------------------------------
    def _t(self) -> Dict[str, mx.array]:
        if not self._artifact:
            raise CalibrationError(
                "stage 'spectral' is not bound to a calibration artifact: run `veloxquant "
                "calibrate RECIPE` and make caches with veloxquant.make_prompt_cache"
            )
        t = slot_arrays(self._artifact, self._slot)
        if "pick" not in t:  # derived once: where each component's bits sit in the packed stream
            t.update(_layout(np.array(t["bits"])))
            t["energy"] = mx.sum(t["sigma"] * t["sigma"], axis=-1, keepdims=True)  # [H, 1]
        return t

    def encode(self, x: mx.array) -> Dict[str, mx.array]:
        t = self._t()
        y = (x.astype(mx.float32) - t["mean"][:, None]) @ t["basis"]
        z = y / t["sigma"][:, None]
        out = {}
        if self.scale:
            # The token's energy relative to the calibrated one (not an RMS of z, which one
            # component that was quiet in calibration could dominate).
            rel = mx.sqrt(mx.sum(y * y, axis=-1, keepdims=True) / t["energy"][:, None])
            rel = mx.clip(rel, 1e-4, 6e4).astype(mx.float16)
            z = z / rel.astype(mx.float32)
            out["scale"] = rel
        code = _quantize(z, t["bits"][:, None], t["count"][:, None], t["edges_flat"])
        planes = ((code[..., None] >> mx.arange(MAX_BITS, dtype=mx.uint32)) & 1).reshape(*code.shape[:-1], -1)
        pick = mx.broadcast_to(t["pick"][:, None], (*planes.shape[:-1], t["pick"].shape[-1]))
        stream = mx.take_along_axis(planes, pick, -1)
        return {"codes": pack(stream, 1), **out}

    def _unit(self, enc) -> mx.array:
        """Each component's Lloyd-Max level (unit variance), from the packed stream."""
        t = self._t()
        S = t["pick"].shape[-1]
        stream = unpack(enc["codes"], 1, S)
        stream = mx.concatenate([stream, mx.zeros((*stream.shape[:-1], 1), stream.dtype)], axis=-1)
        where = t["place"][:, None]  # [H, 1, D*8]: stream position of bit j of component i (S = none)
        bits = mx.take_along_axis(stream, mx.broadcast_to(where, (*stream.shape[:-1], where.shape[-1])), -1)
        D = t["bits"].shape[-1]
        code = mx.sum(bits.reshape(*bits.shape[:-1], D, MAX_BITS) << mx.arange(MAX_BITS, dtype=mx.uint32), -1)
        unit = t["levels_flat"][t["bits"][:, None] * 256 + code.astype(mx.int32)]
        return unit * enc["scale"].astype(mx.float32) if self.scale else unit

    def decode(self, enc: Dict[str, mx.array], dtype) -> mx.array:
        t = self._t()
        y = self._unit(enc) * t["sigma"][:, None]
        return (y @ t["basis"].swapaxes(-1, -2) + t["mean"][:, None]).astype(dtype)

    def scores(self, q: mx.array, enc: Dict[str, mx.array]) -> mx.array:
        """<q, mean> + <(q B) sigma, level(code)>: the query is rotated and scaled once."""
        t = self._t()
        qr = (q @ t["basis"]) * t["sigma"][:, None]
        return qr @ self._unit(enc).swapaxes(-1, -2) + q @ t["mean"][:, :, None]


def _layout(bits: np.ndarray) -> Dict[str, mx.array]:
    H, D = bits.shape
    levels, edges, _ = _tables()
    pick, place = [], np.zeros((H, D * MAX_BITS), np.int32)
    for h in range(H):
        own = np.array([i * MAX_BITS + j for i in range(D) for j in range(bits[h, i])], np.int32)
        pick.append(own)
        place[h] = own.size  # the padding column: bits a component does not have read as 0
        place[h, own] = np.arange(own.size)
    if len({p.size for p in pick}) != 1:
        raise CalibrationError("calibrated bit widths differ in total between heads (damaged artifact)")
    return {
        "pick": mx.array(np.stack(pick)),
        "place": mx.array(place),
        "count": mx.array(2 ** bits.astype(np.int32)),
        "levels_flat": mx.array(levels.ravel()),
        "edges_flat": mx.array(edges.ravel()),
    }


def _quantize(z: mx.array, bits: mx.array, count: mx.array, edges_flat: mx.array) -> mx.array:
    """Index of each component's Lloyd-Max cell (edges passed), by binary search over its own codebook."""
    code = mx.zeros(z.shape, mx.int32)
    base = bits * 256
    for step in (128, 64, 32, 16, 8, 4, 2, 1):
        probe = code + step
        ok = (probe < count) & (z > edges_flat[base + mx.minimum(probe, 255) - 1])
        code = mx.where(ok, probe, code)
    return code.astype(mx.uint32)
