"""`split`: mixed precision by channel; two stores side by side, not a chain.

Each group of `chunk` tokens of one head sends its `fraction` of channels with
the largest spread (`by=variance` over the chunk's tokens: Kitty; `by=range`:
max - min; `by=queries`: variance weighted by the real queries' mean square
per channel, each channel's share of the score error q.(k - k'), which the
attention hook gathers while tokens wait in the fp16 window) through the `hi` store and the rest
through `lo`; `by=list` sends the fixed `channels` ("3,17,42") through `hi` (CompositeQuantizer). A chosen
split is recorded per chunk as a bit mask (uint32 words, counted in the
bytes); a listed one costs nothing. Decoding scatters both parts back, so
q·k = q_hi·k_hi + q_lo·k_lo exactly: the two branches' scores add.
"""

from typing import Dict, Optional, Tuple

import attrs
import mlx.core as mx

from ..kernels.bitpack import pack, unpack
from .registry import choices, in_range, stage


def _fraction(instance, attribute, value):
    if not 0.0 < value < 1.0:
        raise ValueError("must be between 0 and 1 (exclusive)")


@stage("split", "store")
@attrs.frozen
class Split:
    """Channels split per chunk: the `fraction` with most spread (or listed ones) through `hi`,
    the rest through `lo`."""

    hi: object = attrs.field(default=None)
    lo: object = attrs.field(default=None)
    fraction: float = attrs.field(default=0.25, validator=_fraction)
    by: str = attrs.field(default="variance", validator=choices("variance", "range", "queries", "list"))
    channels: str = attrs.field(default="")
    chunk: int = attrs.field(default=32, validator=in_range(1, 1 << 12))

    codes = False  # its integer codes live in the branches (entropy stages do not reach them)

    @property
    def scored(self):
        return "channels" if self.by == "queries" else False  # the cache hands encode() per-channel q²

    @property
    def runtime_needs(self):
        return ("attention",) if self.by == "queries" else ()

    @property
    def token_multiple(self) -> int:
        import math

        return math.lcm(self.chunk if self.by != "list" else 1, self.hi.token_multiple, self.lo.token_multiple)

    def listed(self) -> Tuple[int, ...]:
        return tuple(sorted({int(c) for c in self.channels.replace(" ", "").split(",") if c}))

    def n_hi(self, head_dim: int) -> int:
        return len(self.listed()) if self.by == "list" else int(round(self.fraction * head_dim))

    def units(self) -> Dict[str, int]:
        out = {f"hi.{k}": v for k, v in self.hi.units().items()}
        out.update({f"lo.{k}": v for k, v in self.lo.units().items()})
        if self.by != "list":
            out["mask"] = self.token_multiple
        return out

    def bits_per_element(self, head_dim: int) -> float:
        h = self.n_hi(head_dim)
        bits = (h * self.hi.bits_per_element(h) + (head_dim - h) * self.lo.bits_per_element(head_dim - h)) / head_dim
        return bits + (32 * -(-head_dim // 32) / (head_dim * self.token_multiple) if self.by != "list" else 0)

    def check_head_dim(self, head_dim: int) -> str:
        for side in ("hi", "lo"):
            inner = getattr(self, side)
            if not hasattr(inner, "stage_name"):
                return "split needs two stores, e.g. split(hi=affine(bits=4), lo=affine(bits=2))"
            if getattr(inner, "fitted_once", False):
                return f"'{inner.stage_name}' fits arrays per tier and cannot be a branch of split"
        h = self.n_hi(head_dim)
        if self.by == "list":
            if not self.listed() or self.listed()[-1] >= head_dim or self.listed()[0] < 0:
                return f"channels must list channels 0..{head_dim - 1}, got '{self.channels}'"
        if not 0 < h < head_dim:
            return f"fraction={self.fraction} of {head_dim} channels leaves a branch empty"
        for inner, d in ((self.hi, h), (self.lo, head_dim - h)):
            problem = getattr(inner, "check_head_dim", lambda d: "")(d)
            if problem:
                return f"its '{inner.stage_name}' branch gets {d} channels: {problem}"
        return ""

    # --- which channels go where -------------------------------------------
    def _order(self, x: mx.array, q2: Optional[mx.array] = None) -> Tuple[mx.array, mx.array]:
        """(order [B, H, G, D]: hi channels then lo channels, each ascending; mask words or None).
        `q2` [B, H, D]: mean squared query per channel (by=queries; None before any query)."""
        B, H, L, D = x.shape
        if self.by == "list":
            listed = set(self.listed())
            order = mx.array(list(self.listed()) + [c for c in range(D) if c not in listed])
            return mx.broadcast_to(order, (B, H, 1, D)), None
        g = x.astype(mx.float32).reshape(B, H, L // self.token_multiple, self.token_multiple, D)
        spread = mx.max(g, axis=3) - mx.min(g, axis=3) if self.by == "range" else mx.var(g, axis=3)
        if q2 is not None:
            spread = spread * q2[:, :, None, :]
        top = mx.argpartition(-spread, kth=self.n_hi(D) - 1, axis=-1)[..., : self.n_hi(D)]
        mask = mx.put_along_axis(mx.zeros(spread.shape, dtype=mx.uint32), top, mx.array(1, dtype=mx.uint32), axis=-1)
        return self._order_of(mask), pack(mask, 1)

    @staticmethod
    def _order_of(mask: mx.array) -> mx.array:
        D = mask.shape[-1]
        return mx.argsort((1 - mask.astype(mx.int32)) * D + mx.arange(D), axis=-1)  # unique keys: deterministic

    def _per_token(self, order: mx.array, L: int) -> mx.array:
        B, H, G, D = order.shape
        return mx.broadcast_to(order[:, :, :, None, :], (B, H, G, L // G, D)).reshape(B, H, L, D)

    def encode(self, x: mx.array, scores: Optional[mx.array] = None) -> Dict[str, mx.array]:
        D = x.shape[-1]
        h = self.n_hi(D)
        order, mask = self._order(x, scores if self.by == "queries" else None)
        moved = mx.take_along_axis(x, self._per_token(order, x.shape[2]), axis=-1)
        out = {f"hi.{k}": v for k, v in self.hi.encode(moved[..., :h]).items()}
        out.update({f"lo.{k}": v for k, v in self.lo.encode(moved[..., h:]).items()})
        if mask is not None:
            out["mask"] = mask
        return out

    def decode(self, enc: Dict[str, mx.array], dtype) -> mx.array:
        hi = self.hi.decode({k[3:]: v for k, v in enc.items() if k.startswith("hi.")}, mx.float32)
        lo = self.lo.decode({k[3:]: v for k, v in enc.items() if k.startswith("lo.")}, mx.float32)
        both = mx.concatenate([hi, lo], axis=-1)
        B, H, L, D = both.shape
        if self.by == "list":
            order, _ = self._order(both[:, :, :0])
        else:
            order = self._order_of(unpack(enc["mask"], 1, D))
        return mx.put_along_axis(mx.zeros_like(both), self._per_token(order, L), both, axis=-1).astype(dtype)
