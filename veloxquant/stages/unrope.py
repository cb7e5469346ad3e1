"""`unrope`: code keys before RoPE rotated them (KVQuant's pre-RoPE keys).

RoPE rotates each pair of key channels by an angle that grows with the
position, so one channel's values swing between two channels along the
sequence and per-channel codes see a wider, mixed range. `unrope` undoes the
rotation with the cache's positions before the store codes the keys, and
re-applies it when the keys are decoded, so attention sees the model's keys.

The model's RoPE settings (traditional or not, base or explicit frequencies,
scale) are read per layer by `ModelShape.from_model` (Gemma 3 has two bases,
Llama 3 scaled frequencies) and bound into the stage by the compiler, so they
enter the plan's fingerprint and a saved cache rebuilds with them.
"""

from typing import Optional, Tuple

import attrs
import mlx.core as mx

from ..errors import VeloxError
from .registry import stage

# (dims, traditional, base, scale, freqs): base is None when explicit freqs are given.
RopeSpec = Tuple[int, bool, Optional[float], float, Optional[Tuple[float, ...]]]


def rope_spec(module) -> Tuple[Optional[RopeSpec], str]:
    """An mlx-lm RoPE module's settings, or (None, why it cannot be inverted)."""
    import mlx.nn as nn

    name = type(module).__name__
    if isinstance(module, nn.RoPE):
        return (int(module.dims), bool(module.traditional), float(module.base), float(module.scale), None), ""
    if name == "Llama3RoPE":  # scaled frequencies, rotation otherwise plain
        freqs = tuple(float(f) for f in module._freqs.tolist())
        return (int(module.dims), bool(module.traditional), None, 1.0, freqs), ""
    if module is None:
        return None, "the layer has no RoPE module"
    return None, f"its RoPE is {name}, which also rescales the keys; unrope inverts plain and Llama-3 RoPE only"


def _freeze(spec):
    """JSON (a saved plan) gives lists: back to hashable tuples."""
    if spec is None:
        return None
    dims, trad, base, scale, freqs = spec
    return (
        int(dims),
        bool(trad),
        None if base is None else float(base),
        float(scale),
        None if freqs is None else tuple(float(f) for f in freqs),
    )


def rotate(x: mx.array, spec: RopeSpec, start: int, inverse: bool = False) -> mx.array:
    """RoPE (or its inverse: the same rotation by minus the angle) of tokens at positions start, start+1, ..."""
    dims, traditional, base, scale, freqs = spec
    sign = -1.0 if inverse else 1.0
    return mx.fast.rope(
        x,
        dims,
        traditional=traditional,
        base=base,
        scale=sign * scale,
        offset=start,
        freqs=None if freqs is None else mx.array(freqs, dtype=mx.float32),
    )


@stage("unrope", "transform")
@attrs.frozen
class Unrope:
    """Keys coded before RoPE: the rotation is undone by position before the store and re-applied on decode."""

    _rope: Optional[tuple] = attrs.field(default=None, alias="_rope", converter=_freeze)

    positional = True  # encode/decode take the position of the first token
    keys_only = True

    def forward(self, x: mx.array, start: int) -> mx.array:
        return rotate(x.astype(mx.float32), self._spec(), start, inverse=True)

    def inverse(self, y: mx.array, start: int) -> mx.array:
        return rotate(y, self._spec(), start)

    @property
    def spec(self) -> RopeSpec:
        return self._spec()

    def _spec(self) -> RopeSpec:
        if self._rope is None:
            raise VeloxError(
                "unrope has no RoPE settings: make the caches with veloxquant.make_prompt_cache(model, ...)"
            )
        return self._rope
