"""`salient`: tokens routed by saliency to one of two codecs (ZipCache).

Each chunk of `chunk` tokens of one head sends its round(fraction x chunk)
most salient tokens through the `hi` store and the rest through `lo`. The
score is ZipCache's normalized attention: the attention a token received from
the model's real queries while it waited in the fp16 window, divided by the
number of queries that could see it (runtime/eviction/saliency.py gathers it; hence
the hook). Both branches live in one tier, in position order once decoded,
so attention over them is exact like any tier's. The choice is held per chunk
as a bit mask (uint32 words, counted). Branch arrays are stored one row per
chunk (their rows of that chunk side by side), so every array counts chunks.
"""

from typing import Dict, Optional

import attrs
import mlx.core as mx

from ..kernels.bitpack import pack, unpack
from .registry import in_range, stage


def _fraction(instance, attribute, value):
    if not 0.0 < value < 1.0:
        raise ValueError("must be between 0 and 1 (exclusive)")


@stage("salient", "store", needs=("attention",))
@attrs.frozen
class Salient:
    """Per chunk and head, the `fraction` of tokens with most normalized attention through `hi`, the rest `lo`."""

    hi: object = attrs.field(default=None)
    lo: object = attrs.field(default=None)
    fraction: float = attrs.field(default=0.25, validator=_fraction)
    chunk: int = attrs.field(default=64, validator=in_range(32, 1 << 12))

    codes = False
    scored = True  # encode takes per-token scores from the cache

    @property
    def token_multiple(self) -> int:
        return self.chunk

    @property
    def n_hi(self) -> int:
        return int(round(self.fraction * self.chunk))

    def _branches(self):
        return (("hi", self.hi, self.n_hi), ("lo", self.lo, self.chunk - self.n_hi))

    def units(self) -> Dict[str, int]:
        out = {f"{side}.{k}": self.chunk for side, inner, _ in self._branches() for k in inner.units()}
        out["mask"] = self.chunk
        return out

    def bits_per_element(self, head_dim: int) -> float:
        return sum(
            n * inner.bits_per_element(head_dim) for _, inner, n in self._branches()
        ) / self.chunk + self.chunk / (head_dim * self.chunk)

    def check_head_dim(self, head_dim: int) -> str:
        if self.chunk % 32:
            return f"chunk={self.chunk} is not a multiple of 32 (the token mask fills 32-bit words)"
        for side, inner, n in self._branches():
            if not hasattr(inner, "stage_name"):
                return "salient needs two stores, e.g. salient(hi=affine(bits=4), lo=affine(bits=2))"
            if getattr(inner, "fitted_once", False) or getattr(inner, "scored", False):
                return f"'{inner.stage_name}' cannot be a branch of salient"
            if n == 0 or n % inner.token_multiple:
                return f"its {side} branch gets {n} tokens of each chunk, not whole groups of {inner.token_multiple}"
            problem = getattr(inner, "check_head_dim", lambda d: "")(head_dim)
            if problem:
                return problem
        return ""

    def _order(self, mask: mx.array) -> mx.array:
        """[B, H, G, chunk]: the chunk's hi tokens then its lo tokens, each in position order."""
        C = mask.shape[-1]
        return mx.argsort((1 - mask.astype(mx.int32)) * C + mx.arange(C), axis=-1)

    def encode(self, x: mx.array, scores: Optional[mx.array] = None) -> Dict[str, mx.array]:
        if scores is None:
            raise ValueError("salient codes tokens by their attention scores, which the cache supplies")
        B, H, L, D = x.shape
        G, C = L // self.chunk, self.chunk
        s = scores.astype(mx.float32).reshape(B, H, G, C)
        top = mx.argpartition(-s, kth=self.n_hi - 1, axis=-1)[..., : self.n_hi]
        mask = mx.put_along_axis(mx.zeros((B, H, G, C), dtype=mx.uint32), top, mx.array(1, dtype=mx.uint32), axis=-1)
        order = self._order(mask)
        moved = mx.take_along_axis(x.reshape(B, H, G, C, D), order[..., None], axis=3)
        out, at = {"mask": pack(mask, 1)}, 0
        for side, inner, n in self._branches():
            part = moved[:, :, :, at : at + n].reshape(B, H, G * n, D)
            for k, v in inner.encode(part).items():  # rows of one chunk side by side: axis 2 counts chunks
                out[f"{side}.{k}"] = v.reshape(B, H, G, -1)
            at += n
        return out

    def decode(self, enc: Dict[str, mx.array], dtype) -> mx.array:
        mask = unpack(enc["mask"], 1, self.chunk)
        B, H, G, C = mask.shape
        parts = []
        for side, inner, n in self._branches():
            mine = {}
            for k, units in inner.units().items():
                arr = enc[f"{side}.{k}"]
                mine[k] = arr.reshape(B, H, G * (n // units), -1)
            parts.append(inner.decode(mine, mx.float32).reshape(B, H, G, n, -1))
        both = mx.concatenate(parts, axis=3)
        idx = mx.broadcast_to(self._order(mask)[..., None], both.shape)
        return mx.put_along_axis(mx.zeros_like(both), idx, both, axis=3).reshape(B, H, G * C, -1).astype(dtype)
