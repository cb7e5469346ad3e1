"""Store stages: how a tier's values are held (16-bit, as computed, affine codes).

A store encodes x [B, H, L, D] into named arrays whose axis 2 counts token
units (one token, or a group of tokens), and decodes them back.
"""

from functools import lru_cache, partial
from typing import Callable, Dict, Optional, Tuple

import attrs
import mlx.core as mx

from ..kernels.bitpack import pack, unpack
from .registry import choices, in_range, stage

SIXTEEN_BIT = (mx.float16, mx.bfloat16)


@stage("fp16", "store")
@attrs.frozen
class Fp16:
    """Uncompressed 16-bit storage (float32 activations are rounded to float16)."""

    codes = False
    token_multiple = 1
    # What wider activations (float32) are held as; 16-bit ones are held as they come. A 16-bit tier
    # reads this once and casts itself (runtime/kinds/tier.py): its decode steps call no store.
    narrows_to = mx.float16

    def units(self) -> Dict[str, int]:
        return {"x": 1}

    def bits_per_element(self, head_dim: int) -> float:
        return 16.0

    def encode(self, x: mx.array) -> Dict[str, mx.array]:
        return {"x": x if self.narrows_to is None or x.dtype in SIXTEEN_BIT else x.astype(self.narrows_to)}

    def decode(self, enc: Dict[str, mx.array], dtype) -> mx.array:
        return enc["x"].astype(dtype)


@stage("identity", "store")
@attrs.frozen
class Identity(Fp16):
    """Uncompressed storage in the dtype the model computes in (bit-exact)."""

    narrows_to = None

    def bits_per_element(self, head_dim: int) -> float:
        return float("nan")  # depends on the model's dtype; measured at run time


@stage("affine", "store")
@attrs.frozen
class Affine:
    """Asymmetric min/max group quantization to b-bit codes, bit-packed in uint32.

    axis=token groups `group` channels of one token; axis=channel groups
    `group` tokens of one channel (KIVI's keys). Scales and zeros are float16.
    """

    bits: int = attrs.field(default=4, validator=in_range(1, 8))
    group: int = attrs.field(default=32, validator=in_range(1, 1 << 16))
    axis: str = attrs.field(default="token", validator=choices("token", "channel"))

    codes = True

    @property
    def token_multiple(self) -> int:
        return self.group if self.axis == "channel" else 1

    def units(self) -> Dict[str, int]:
        meta = self.group if self.axis == "channel" else 1
        return {"codes": 1, "scales": meta, "zeros": meta}

    def bits_per_element(self, head_dim: int) -> float:
        return self.bits + 2 * 16 / self.group

    def check_head_dim(self, head_dim: int) -> str:
        if self.axis == "token" and head_dim % self.group:
            return f"group={self.group} does not divide head_dim {head_dim}"
        if (head_dim * self.bits) % 32:
            return f"{head_dim} channels of {self.bits} bits do not fill whole 32-bit words"
        return ""

    def _grouped(self, x: mx.array) -> mx.array:
        B, H, L, D = x.shape
        if self.axis == "token":
            return x.reshape(B, H, L, D // self.group, self.group)
        return x.reshape(B, H, L // self.group, self.group, D)

    def encode(self, x: mx.array) -> Dict[str, mx.array]:
        B, H, L, D = x.shape
        g = self._grouped(x.astype(mx.float32))
        reduce_axis = -1 if self.axis == "token" else -2
        lo = mx.min(g, axis=reduce_axis, keepdims=True)
        hi = mx.max(g, axis=reduce_axis, keepdims=True)
        levels = (1 << self.bits) - 1
        # Round scale and zero to float16 first so encode and decode agree exactly.
        scale = ((hi - lo) / levels).astype(mx.float16)
        zero = lo.astype(mx.float16)
        safe = mx.maximum(scale.astype(mx.float32), 1e-12)
        q = mx.clip(mx.round((g - zero.astype(mx.float32)) / safe), 0, levels)
        codes = pack(q.astype(mx.uint32).reshape(B, H, L, D), self.bits)
        return {"codes": codes, "scales": scale.squeeze(reduce_axis), "zeros": zero.squeeze(reduce_axis)}

    def decode(self, enc: Dict[str, mx.array], dtype) -> mx.array:
        prepared = self.prepared_decode(enc, dtype)
        if prepared is not None:
            run, shape = prepared
            return run().reshape(shape)
        codes = enc["codes"]
        B, H, L, W = codes.shape
        D = W * 32 // self.bits
        q = unpack(codes, self.bits, D).astype(mx.float32)
        q = self._grouped(q)
        axis = -1 if self.axis == "token" else -2
        scale = mx.expand_dims(enc["scales"].astype(mx.float32), axis)
        zero = mx.expand_dims(enc["zeros"].astype(mx.float32), axis)
        return (q * scale + zero).reshape(B, H, L, D).astype(dtype)

    def laid_out(self, enc: Dict[str, mx.array]) -> Optional[Tuple[mx.array, ...]]:
        """codes, scales and zeros reshaped (views, no copy where contiguous) so that the decode
        is one broadcast elementwise kernel: the words' codes along one axis, their groups along
        another. None where groups and words do not nest (3, 5, 6, 7 bits; uneven groups), and off the
        CPU (GPUs decode through their kernels; there a compiled multiply-add may round once, not twice)."""
        if mx.default_device() != mx.cpu:
            return None
        codes, scales, zeros, g = enc["codes"], enc["scales"], enc["zeros"], self.group
        B, H, L, W = codes.shape
        per_word = 32 // self.bits if 32 % self.bits == 0 else 0
        if not per_word:
            return None
        if self.axis == "channel":  # token l = t*g + j, channel d = w*per_word + i
            if L % g:
                return None
            words, meta = (B, H, L // g, g, W, 1), (B, H, L // g, 1, W, per_word)
        elif g % per_word == 0:  # channel d = (group*(g/per_word) + word)*per_word + i
            words, meta = (B, H, L, W * per_word // g, g // per_word, 1), (B, H, L, W * per_word // g, 1, 1)
        elif per_word % g == 0:  # channel d = w*per_word + a*g + b
            words, meta = (B, H, L, W, 1, 1), (B, H, L, W, per_word // g, 1)
        else:
            return None
        return codes.reshape(words), scales.reshape(meta), zeros.reshape(meta)

    def prepared_decode(self, enc: Dict[str, mx.array], dtype) -> Optional[Tuple[Callable[[], mx.array], tuple]]:
        """decode(enc, dtype) prepared once for arrays that change only when a chunk arrives (a tier
        keeps it with its views, so its decode steps call no store): `run()` is one compiled kernel
        over `laid_out`'s arrays (unpack, cast, scale, zero and the cast to `dtype`: the same float32
        multiply and add per element), and its output reshaped to `shape` is the decode. None where
        `laid_out` is."""
        laid = self.laid_out(enc)
        if laid is None:
            return None
        codes, scales, _ = laid
        per_word = 32 // self.bits
        split = self.axis == "token" and scales.shape[4] > 1  # a word holds several groups
        lanes = (scales.shape[4], per_word // scales.shape[4]) if split else (per_word,)
        B, H, L = codes.shape[:3]
        shape = (B, H, L * codes.shape[3] if self.axis == "channel" else L, -1)
        return partial(_dequantize(self.bits, lanes, dtype), *laid, _shifts(self.bits, lanes)), shape


@lru_cache(maxsize=None)
def _shifts(bits: int, lanes: tuple) -> mx.array:
    """Each code's shift in its word, shaped as the last axes of `laid_out`'s words."""
    shifts = (mx.arange(32 // bits, dtype=mx.uint32) * bits).reshape(lanes)
    mx.eval(shifts)
    return shifts


@lru_cache(maxsize=None)
def _dequantize(bits: int, lanes: tuple, dtype):
    mask = (1 << bits) - 1

    def dequantize(codes, scales, zeros, shifts):
        q = ((codes >> shifts) & mask).astype(mx.float32)
        return (q * scales.astype(mx.float32) + zeros.astype(mx.float32)).astype(dtype)

    return mx.compile(dequantize)
