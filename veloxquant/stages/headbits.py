"""`headbits`: affine codes with a code width per kv head (AdaKV-style bit allocation).

Heads whose real attention is more spread out (higher entropy over the
tokens waiting in the fp16 window, gathered by runtime/eviction/saliency.py from the
model's queries) get more bits: the widths lo/mid/hi are handed out greedily,
highest entropy first, so the mean over heads meets `target` without
exceeding it. The allocation is made once, on the first block the tier codes,
and held (`bits`, one uint8 per head). Tied heads, or a target outside
(lo, hi), give every head one width: the widest of lo/mid/hi not above the
target, so codes, scales and zeros are those of `affine` at that width, bit
for bit. Codes are packed per width ("lo.codes" holds the heads at lo bits,
and so on; a width no head got holds an empty array); scales and zeros are
float16 per group, as `affine`'s.
"""

from typing import Dict, List, Optional

import attrs
import mlx.core as mx
import numpy as np

from ..kernels.bitpack import pack, unpack
from .registry import choices, in_range, stage

ROLES = ("lo", "mid", "hi")


def allocate(entropy: np.ndarray, widths: List[int], target: float) -> np.ndarray:
    """Bits per head: greedy by entropy (highest first), mean <= target; uniform when tied or out of range."""
    lo, hi = widths[0], widths[-1]
    n = entropy.shape[-1]
    uniform = max([w for w in widths if w <= target] or [lo])
    if not lo < target < hi or np.allclose(entropy, entropy.flat[0], rtol=1e-5, atol=1e-7):
        return np.full(n, uniform, dtype=np.uint8)
    budget = target * n - lo * n + 1e-9
    bits = np.full(n, lo, dtype=np.uint8)
    for h in np.argsort(-entropy.reshape(-1, n).mean(axis=0), kind="stable"):  # a loop over heads, once per tier
        for w in reversed(widths[1:]):
            if budget >= w - lo:
                bits[h], budget = w, budget - (w - lo)
                break
    return bits


@stage("headbits", "store", needs=("attention",))
@attrs.frozen
class HeadBits:
    """Affine codes at lo/mid/hi bits per kv head, allocated once from the entropy of real attention
    to meet `target`."""

    lo: int = attrs.field(default=2, validator=in_range(1, 8))
    mid: int = attrs.field(default=3, validator=in_range(1, 8))
    hi: int = attrs.field(default=4, validator=in_range(1, 8))
    target: float = attrs.field(default=3.0)
    group: int = attrs.field(default=32, validator=in_range(1, 1 << 16))
    axis: str = attrs.field(default="channel", validator=choices("token", "channel"))

    codes = False
    fitted_once = True
    scored = "heads"  # fit() takes per-head scores (attention entropy) from the cache

    @property
    def token_multiple(self) -> int:
        return self.group if self.axis == "channel" else 1

    @property
    def widths(self) -> List[int]:
        return [self.lo, self.mid, self.hi]

    def units(self) -> Dict[str, int]:
        meta = self.token_multiple
        return {**{f"{r}.codes": 1 for r in ROLES}, "scales": meta, "zeros": meta}

    def bits_per_element(self, head_dim: int) -> float:
        return min(max(self.target, self.lo), self.hi) + 32 / self.group  # the allocated mean is at most this

    def check_head_dim(self, head_dim: int) -> str:
        if not self.lo <= self.mid <= self.hi:
            return f"widths must rise: lo={self.lo}, mid={self.mid}, hi={self.hi}"
        if self.axis == "token" and head_dim % self.group:
            return f"group={self.group} does not divide head_dim {head_dim}"
        bad = [w for w in self.widths if (head_dim * w) % 32]
        return f"{head_dim} channels of {bad[0]} bits do not fill whole 32-bit words" if bad else ""

    def fit(self, x: mx.array, head_scores: Optional[mx.array] = None) -> Dict[str, mx.array]:
        H = x.shape[1]
        entropy = np.zeros(H) if head_scores is None else np.array(head_scores.astype(mx.float32))
        return {"bits": mx.array(allocate(entropy, self.widths, self.target))}

    def _grouped(self, x: mx.array) -> mx.array:
        B, H, L, D = x.shape
        if self.axis == "token":
            return x.reshape(B, H, L, D // self.group, self.group)
        return x.reshape(B, H, L // self.group, self.group, D)

    def _heads(self, bits: mx.array, role: str) -> mx.array:
        """The heads coded in `role`'s array: the first role whose width is theirs (widths may repeat)."""
        first = np.array([self.widths.index(int(b)) for b in np.array(bits)])
        return mx.array(np.nonzero(first == ROLES.index(role))[0].astype(np.int32))

    def encode(self, x: mx.array, fitted: Dict[str, mx.array], scores=None) -> Dict[str, mx.array]:
        B, H, L, D = x.shape
        bits = fitted["bits"]
        levels = (mx.power(2, bits.astype(mx.float32)) - 1).reshape(1, H, 1, 1, 1)
        g = self._grouped(x.astype(mx.float32))
        axis = -1 if self.axis == "token" else -2
        lo, hi = mx.min(g, axis=axis, keepdims=True), mx.max(g, axis=axis, keepdims=True)
        scale, zero = ((hi - lo) / levels).astype(mx.float16), lo.astype(mx.float16)  # as affine rounds them
        q = mx.clip(mx.round((g - zero.astype(mx.float32)) / mx.maximum(scale.astype(mx.float32), 1e-12)), 0, levels)
        q = q.astype(mx.uint32).reshape(B, H, L, D)
        out = {"scales": scale.squeeze(axis), "zeros": zero.squeeze(axis)}
        for role in ROLES:  # up to three widths, not a loop over heads
            out[f"{role}.codes"] = pack(mx.take(q, self._heads(bits, role), axis=1), getattr(self, role))
        return out

    def decode(self, enc: Dict[str, mx.array], dtype, fitted: Dict[str, mx.array]) -> mx.array:
        bits = fitted["bits"]
        B, H = enc["scales"].shape[:2]
        L = enc["lo.codes"].shape[2]
        D = next(enc[f"{r}.codes"].shape[-1] * 32 // getattr(self, r) for r in ROLES if enc[f"{r}.codes"].shape[1])
        parts = [unpack(enc[f"{r}.codes"], getattr(self, r), D) for r in ROLES]
        order = np.concatenate([np.array(self._heads(bits, r)) for r in ROLES])
        q = mx.take(mx.concatenate(parts, axis=1), mx.array(np.argsort(order).astype(np.int32)), axis=1)
        q = self._grouped(q.astype(mx.float32))
        axis = -1 if self.axis == "token" else -2
        scale = mx.expand_dims(enc["scales"].astype(mx.float32), axis)
        zero = mx.expand_dims(enc["zeros"].astype(mx.float32), axis)
        return (q * scale + zero).reshape(B, H, L, D).astype(dtype)
