"""RoPE in pair coordinates, at arbitrary positions: what stores that keep keys
before RoPE (commvq, a2ats) need to re-apply it exactly inside their scores.

RoPE rotates channel pair j of a head by the angle pos * theta_j; a pair is
(x_j, x_{j + dims/2}) in mlx-lm's default layout and (x_{2j}, x_{2j+1}) in the
"traditional" one. `pairs` splits a vector into the pairs' first and second
coordinates (the real and imaginary parts of one complex number per pair), so
RoPE is one complex multiplication per pair. `unrope.rotate` (mx.fast.rope) is
the reference these are pinned to (tests/test_commvq.py); unlike it, they take
one position per row rather than a contiguous run.
"""

from typing import Dict, Tuple

import mlx.core as mx

from ..artifacts import CalibrationError, slot_arrays
from ..errors import VeloxError
from .unrope import RopeSpec


def check_full(spec: RopeSpec, head_dim: int) -> None:
    if spec[0] != head_dim:
        raise VeloxError(f"RoPE covers {spec[0]} of {head_dim} channels; pre-RoPE code stores need full-width RoPE")


def inverse_wavelengths(spec: RopeSpec) -> mx.array:
    """theta_j (radians per position) of each pair, [dims/2], scale included."""
    dims, _, base, scale, freqs = spec
    if freqs is not None:
        return scale / mx.array(freqs, dtype=mx.float32)
    return scale * mx.power(mx.array(base, dtype=mx.float32), -mx.arange(0, dims, 2, dtype=mx.float32) / dims)


def pairs(x: mx.array, spec: RopeSpec) -> Tuple[mx.array, mx.array]:
    """x [..., D] -> (first, second) coordinates of each RoPE pair, [..., D/2] each."""
    if spec[1]:
        return x[..., 0::2], x[..., 1::2]
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def unpairs(a: mx.array, b: mx.array, spec: RopeSpec) -> mx.array:
    if spec[1]:
        return mx.stack([a, b], axis=-1).reshape(*a.shape[:-1], 2 * a.shape[-1])
    return mx.concatenate([a, b], axis=-1)


def cos_sin(spec: RopeSpec, positions: mx.array) -> Tuple[mx.array, mx.array]:
    """cos and sin of each position's angle per pair: [N, D/2] each (positions [N], any ints)."""
    angle = positions.astype(mx.float32)[:, None] * inverse_wavelengths(spec)[None]
    return mx.cos(angle), mx.sin(angle)


def rotate_at(x: mx.array, spec: RopeSpec, positions: mx.array, inverse: bool = False) -> mx.array:
    """RoPE of x [..., N, D] with row i at positions[i] (or its inverse)."""
    check_full(spec, x.shape[-1])
    c, s = cos_sin(spec, positions)
    if inverse:
        s = -s
    a, b = pairs(x.astype(mx.float32), spec)
    return unpairs(a * c - b * s, a * s + b * c, spec)


class BoundPreRope:
    """A calibrated pre-RoPE store's two bindings (commvq, qavq): the arrays of its
    calibration artifact and its layer's RoPE settings, each with the error that
    says how to get it (the compiler binds both through make_prompt_cache)."""

    def _t(self) -> Dict[str, mx.array]:
        if not self._artifact:
            raise CalibrationError(
                f"stage '{self.stage_name}' is not bound to a calibration artifact: run "
                "`veloxquant calibrate RECIPE` and make caches with veloxquant.make_prompt_cache"
            )
        return slot_arrays(self._artifact, self._slot)

    def _spec(self) -> RopeSpec:
        if self._rope is None:
            raise VeloxError(
                f"{self.stage_name} has no RoPE settings: make the caches with veloxquant.make_prompt_cache(model, ...)"
            )
        return self._rope
