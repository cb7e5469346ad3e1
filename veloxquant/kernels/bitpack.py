"""Bit-packing of b-bit codes (1..8) along the last axis into uint32 words.

Layout (the kernels' contract): the codes form one little-endian bit stream;
code j occupies stream bits [j*b, (j+1)*b), stream bit k is bit k%32 of word
k//32. For b in {1, 2, 4, 8} this is the usual "32/b codes per word, code i at
shift i*b" layout, so kernels read a code with one shift and mask.
"""

from functools import lru_cache

import mlx.core as mx


def packed_width(n: int, bits: int) -> int:
    if (n * bits) % 32:
        raise ValueError(f"{n} codes of {bits} bits do not fill whole 32-bit words")
    return n * bits // 32


def pack(codes: mx.array, bits: int) -> mx.array:
    codes = codes.astype(mx.uint32)
    *lead, n = codes.shape
    width = packed_width(n, bits)
    if 32 % bits == 0:
        per_word = 32 // bits
        shifts = mx.arange(per_word, dtype=mx.uint32) * bits
        return mx.sum(codes.reshape(*lead, width, per_word) << shifts, axis=-1).astype(mx.uint32)
    # 3, 5, 6, 7 bits: codes straddle words; go through the bit stream.
    stream = (codes[..., None] >> mx.arange(bits, dtype=mx.uint32)) & 1
    stream = stream.reshape(*lead, width, 32)
    return mx.sum(stream << mx.arange(32, dtype=mx.uint32), axis=-1).astype(mx.uint32)


def unpack(words: mx.array, bits: int, n: int) -> mx.array:
    *lead, width = words.shape
    if width != packed_width(n, bits):
        raise ValueError(f"{width} words do not hold {n} codes of {bits} bits")
    return _compiled_unpack(tuple(words.shape), words.dtype, bits, n)(words)


# A decode step unpacks a whole coded tier where no kernel reads it; its length changes only when
# a group arrives. One compiled graph per shape (the shifts and masks fused: integer ops, exact),
# shared by the layers; the least recent shapes are let go, with their traces.
@lru_cache(maxsize=64)
def _compiled_unpack(shape: tuple, dtype, bits: int, n: int):
    return mx.compile(lambda words: _unpack_ops(words, bits, n))


def _unpack_ops(words: mx.array, bits: int, n: int) -> mx.array:
    *lead, width = words.shape
    mask = (1 << bits) - 1
    if 32 % bits == 0:
        shifts = mx.arange(32 // bits, dtype=mx.uint32) * bits
        return ((words[..., None] >> shifts) & mask).reshape(*lead, n)
    stream = (words[..., None] >> mx.arange(32, dtype=mx.uint32)) & 1
    stream = stream.reshape(*lead, n, bits)
    return mx.sum(stream << mx.arange(bits, dtype=mx.uint32), axis=-1).astype(mx.uint32)
