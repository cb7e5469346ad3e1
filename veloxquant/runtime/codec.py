"""A codec: transform stages then a store stage, for one tensor of one tier."""

import copy
import re
from functools import lru_cache
from typing import Dict, Optional

import mlx.core as mx

from ..compiler.plan import CodecPlan
from ..kernels import dispatch

_RESIDUAL = re.compile(r"r\d+\.")  # names of residual stages' arrays


# Decode appends one token (or one spilled group) per step, always the same shapes:
# those encodes run as one compiled graph (elementwise chains fused), shared by all
# layers with the same codec. Longer blocks (prefill) vary in length: plain ops.
COMPILED_BLOCK = 64


@lru_cache(maxsize=None)
def _compiled_encode(plan: CodecPlan):
    return mx.compile(Codec(plan).encode_ops)


def _corrected(inner, approx: mx.array, part: Dict[str, mx.array]) -> mx.array:
    """approx plus what a residual stage holds: its own correct() (sparse scatters), else its decode added."""
    if hasattr(inner, "correct"):
        return inner.correct(approx, part)
    return approx + inner.decode(part, mx.float32)


class Codec:
    """encode: transforms, store, then each residual stage codes what is left;
    residual arrays are named r0.codes, r1.norms, ..."""

    def __init__(self, plan: CodecPlan):
        self.plan = plan
        self.store = plan.store
        self.transforms = plan.transforms
        self.residuals = [r.inner for r in plan.residuals]
        # fp16 / identity with nothing around them: encode is at most a cast, nothing to fuse
        self.trivial = not self.transforms and not self.residuals and self.store.stage_name in ("fp16", "identity")
        # Positional transforms (unrope) take the first token's position; fitted stores (nuq)
        # fit arrays on the first block they code and hold them for the tier's life.
        self.positional = any(getattr(t, "positional", False) for t in self.transforms)
        self.fits = getattr(self.store, "fitted_once", False)
        self.scored = getattr(self.store, "scored", False)  # salient: routes tokens by scores the cache gives
        self.fitted: Dict[str, mx.array] = {}
        self.compilable = not (self.trivial or self.positional or self.fits or self.scored) and all(
            getattr(r, "compilable", True) for r in self.residuals
        )
        # A verified CUDA kernel that codes a block in one launch (Lloyd-Max stores): decode steps
        # append a token per layer, and the ops of an encode cost more host time than the launch.
        self.kernel_encode = None if self.trivial else dispatch.encode_kernel(self)

    def __deepcopy__(self, memo):
        # The plan's stages are frozen and shared; only what a fitted store learned is the tier's own.
        new = copy.copy(self)
        new.fitted = dict(self.fitted)
        memo[id(self)] = new
        return new

    def encode(self, x: mx.array, start: int = 0, scores: Optional[mx.array] = None) -> Dict[str, mx.array]:
        if self.trivial:  # fp16 / identity: at most a cast (every decode step of every layer)
            return self.store.encode(x)
        if self.kernel_encode is not None:
            return self.kernel_encode(self, x)
        if x.shape[2] <= COMPILED_BLOCK and self.compilable:
            return _compiled_encode(self.plan)(x)
        return self.encode_ops(x, start, scores)

    def _store_encode(self, x: mx.array, scores: Optional[mx.array] = None) -> Dict[str, mx.array]:
        if self.fits:
            if not self.fitted:  # headbits allocates from per-head scores; nuq fits on the block alone
                self.fitted = self.store.fit(x, scores) if self.scored else self.store.fit(x)
            return self.store.encode(x, self.fitted, scores) if self.scored else self.store.encode(x, self.fitted)
        return self.store.encode(x, scores) if self.scored else self.store.encode(x)

    def _store_decode(self, enc: Dict[str, mx.array], dtype) -> mx.array:
        return self.store.decode(enc, dtype, self.fitted) if self.fits else self.store.decode(enc, dtype)

    def _forward(self, t, x, start):
        return t.forward(x, start) if getattr(t, "positional", False) else t.forward(x)

    def _inverse(self, t, x, start):
        return t.inverse(x, start) if getattr(t, "positional", False) else t.inverse(x)

    def encode_ops(self, x: mx.array, start: int = 0, scores: Optional[mx.array] = None) -> Dict[str, mx.array]:
        for t in self.transforms:
            x = self._forward(t, x, start)
        enc = self._store_encode(x, scores)
        if self.residuals:
            x = x.astype(mx.float32)
            approx = self._store_decode(enc, mx.float32)
            for i, inner in enumerate(self.residuals):
                part = inner.encode(x - approx)
                enc.update({f"r{i}.{k}": v for k, v in part.items()})
                approx = _corrected(inner, approx, part)
        return enc

    def decode(self, enc: Dict[str, mx.array], dtype, start: int = 0) -> mx.array:
        if not self.transforms and not self.residuals:
            return self._store_decode(enc, dtype)
        x = self._store_decode({k: v for k, v in enc.items() if not _RESIDUAL.match(k)}, mx.float32)
        for i, inner in enumerate(self.residuals):
            prefix = f"r{i}."
            x = _corrected(inner, x, {k[len(prefix) :]: v for k, v in enc.items() if k.startswith(prefix)})
        for t in reversed(self.transforms):
            x = self._inverse(t, x, start)
        return x.astype(dtype)

    # --- scoring from codes ---------------------------------------------
    @property
    def scores_from_codes(self) -> bool:
        """Every transform is orthogonal (has `query`) and every store can score its codes; or keys
        kept before RoPE (`unrope` alone) in a store that re-applies RoPE in its scores (`scores_at`)."""
        if self.positional:
            return len(self.transforms) == 1 and not self.residuals and hasattr(self.store, "scores_at")
        return (
            all(hasattr(t, "query") for t in self.transforms)
            and hasattr(self.store, "scores")
            and all(hasattr(r, "scores") for r in self.residuals)
        )

    @property
    def linear_transforms(self) -> bool:
        """The transforms are orthogonal maps: a weighted sum may be un-transformed once, after summing."""
        return all(hasattr(t, "query") for t in self.transforms)

    def scores(
        self, q: mx.array, enc: Dict[str, mx.array], key_start: int = 0, query_pos: Optional[mx.array] = None
    ) -> mx.array:
        """<q, decoded key> for q [B, H, M, D] -> [B, H, M, L] (float32), from the codes: the
        query is transformed once, then each stage (store, residuals) adds its own estimate.
        Pre-RoPE stores get the keys' first position and each query row's position [M]."""
        q = q.astype(mx.float32)
        if self.positional:
            return self.store.scores_at(q, enc, self.transforms[0].spec, key_start, query_pos)
        for t in self.transforms:
            q = t.query(q)
        parts = self._split(enc)
        s = self.store.scores(q, parts[0])
        for inner, part in zip(self.residuals, parts[1:]):
            s = s + inner.scores(q, part)
        return s

    def decode_transformed(self, enc: Dict[str, mx.array]) -> mx.array:
        """Values in the transformed domain (float32): decode() without the inverse transforms."""
        parts = self._split(enc)
        x = self.store.decode(parts[0], mx.float32)
        for inner, part in zip(self.residuals, parts[1:]):
            x = x + inner.decode(part, mx.float32)
        return x

    def untransform(self, y: mx.array) -> mx.array:
        for t in reversed(self.transforms):
            y = t.inverse(y)
        return y

    def _split(self, enc: Dict[str, mx.array]):
        """The store's arrays, then each residual stage's (prefix r0., r1., ... removed)."""
        if not self.residuals:
            return [enc]
        parts = [{k: v for k, v in enc.items() if not _RESIDUAL.match(k)}]
        for i in range(len(self.residuals)):
            prefix = f"r{i}."
            parts.append({k[len(prefix) :]: v for k, v in enc.items() if k.startswith(prefix)})
        return parts

    def units(self) -> Dict[str, int]:
        units = dict(self.store.units())
        for i, inner in enumerate(self.residuals):
            units.update({f"r{i}.{k}": v for k, v in inner.units().items()})
        return units

    @property
    def lossless(self) -> bool:
        return not self.transforms and self.store.stage_name == "identity"
