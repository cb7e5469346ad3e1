"""Reading a `latent` store's codes back as latents in a fixed, small number of MLX ops.

`Latent.decode` unpacks each width class on its own (a bit-stream expansion for 3, 5,
6 and 7 bits), scales it, and puts the components back in order: ~15-20 primitives
per class, up to six classes per side under `kvtc`'s allocator, rebuilt at every
decode step of every layer. On a GPU each primitive is a launch and host work, so
the step was host-bound (palu: 351 primitives per layer per step against fp16's 148).

Here every component's codes are read at once from the class arrays laid side by
side: component c of width w_c starts at word o_c of a token group, and its code j
sits at stream bit j·w_c, so one gather takes the two 32-bit words that hold it (seen
as one uint64), one shift and one mask give the code, and the gather's indices
already put the components in their original order. The index tables depend only on
the widths and the group size, so layers with the same widths share them (cached per
process, like the Lloyd-Max levels). The values are the same arithmetic as `decode`
(levels·std + loc, or q·scale + zero, in float32): equal bit for bit
(tests/test_latent_reader.py).
"""

from functools import lru_cache, partial
from typing import Dict, Tuple

import mlx.core as mx
import numpy as np

from .codebook import lloyd_max

FLOAT = 16


@lru_cache(maxsize=256)
def _tables(widths: Tuple[int, ...], group: int, gauss: bool):
    """(first words, next words [r*group] int32, shifts [r, group] uint32, masks [r, 1] uint32, scale order
    or None, levels [r*K] float32 and row offsets [r, 1] uint32 or None) for components of `widths`
    (original order), codes as `Latent.encode` packs them."""
    w = np.array(widths, np.int64)
    start, offset = 0, np.zeros(len(w), np.int64)
    order = []  # components in class order (the scales' and zeros' order)
    for b in sorted(set(widths), reverse=True):  # Latent.classes: widest first
        idx = np.flatnonzero(w == b)
        offset[idx] = start + np.arange(len(idx)) * (group * b // 32)
        start += len(idx) * group * b // 32
        order.extend(idx.tolist())
    bit = np.arange(group)[None, :] * w[:, None]  # [r, group]: each code's first bit in its component
    lo = offset[:, None] + bit // 32
    out = [
        mx.array(lo.reshape(-1).astype(np.int32)),
        mx.array(np.minimum(lo + 1, start - 1).reshape(-1).astype(np.int32)),
        mx.array((bit % 32).astype(np.uint32)),
        mx.array(((1 << w) - 1).astype(np.uint32)[:, None]),
    ]
    inverse = np.argsort(np.array(order))
    out.append(None if (inverse == np.arange(len(w))).all() else mx.array(inverse.astype(np.int32)))
    if gauss:  # one row of Lloyd-Max levels per component, padded to the widest
        K = 1 << max(widths)
        levels = np.zeros((len(w), K), np.float32)
        for c, b in enumerate(widths):
            levels[c, : 1 << b] = lloyd_max(int(b), "gaussian")
        out += [mx.array(levels.reshape(-1)), mx.array((np.arange(len(w)) * K).astype(np.uint32)[:, None])]
    else:
        out += [None, None]
    mx.eval([a for a in out if a is not None])
    return tuple(out)


@partial(mx.compile, shapeless=True)
def _codes(lo, hi, shifts, masks):
    """A code from the word holding its first bit and the next (hi << 32 - s, written so s = 0 gives 0)."""
    return ((lo >> shifts) | ((hi << 1) << (31 - shifts))) & masks


@partial(mx.compile, shapeless=True)
def _level_index(lo, hi, shifts, masks, rows):
    return _codes(lo, hi, shifts, masks) + rows


def readable(widths: np.ndarray) -> bool:
    """Whether the one-gather read applies: every kept width is coded (no float16 latents)."""
    return len(widths) > 0 and bool((widths < FLOAT).all()) and bool((widths >= 1).all())


class LatentReader:
    """Reads one side's codes for fixed widths (built once per fit; nothing per step but MLX ops).
    It holds the key to its index tables, not the tables: they are the process's (shared by every
    layer and cache with these widths, alive as long as the memo keeps them), so no cache owns them."""

    def __init__(self, store, widths: np.ndarray):
        self.group, self.gauss = store.group, store.quant == "gauss"
        self.classes = [b for b, _ in store.classes(widths)]
        self.names = {k: [f"c{b}.{k}" for b in self.classes] for k in ("codes", "scales", "zeros")}
        self.key = (tuple(int(b) for b in widths), store.group, self.gauss)
        self.straddles = any(32 % b for b in self.classes)

    def __call__(self, enc: Dict[str, mx.array], stats: Dict[str, mx.array]) -> mx.array:
        """Latents [B, G, L, r] float32 from the arrays `store.encode` made, equal to `store.decode`'s."""
        first, next_, shifts, masks, inverse, levels, rows = _tables(*self.key)
        words = _joined(enc, self.names["codes"])
        B, G, n_groups, _ = words.shape
        r, group = shifts.shape
        lo = mx.take(words, first, axis=-1).reshape(B, G, n_groups, r, group)
        # Widths dividing 32 never straddle two words: the next word's bits would land above the mask.
        hi = mx.take(words, next_, axis=-1).reshape(B, G, n_groups, r, group) if self.straddles else lo
        if self.gauss:
            loc, std = (stats[k].astype(mx.float32)[None, :, None, :, None] for k in ("loc", "std"))
            z = mx.take(levels, _level_index(lo, hi, shifts, masks, rows)) * std + loc
        else:
            scale, zero = _joined(enc, self.names["scales"]), _joined(enc, self.names["zeros"])
            if inverse is not None:
                scale, zero = mx.take(scale, inverse, axis=-1), mx.take(zero, inverse, axis=-1)
            q = _codes(lo, hi, shifts, masks)
            z = q.astype(mx.float32) * scale.astype(mx.float32)[..., None] + zero.astype(mx.float32)[..., None]
        return z.swapaxes(-1, -2).reshape(B, G, n_groups * group, r)


def _joined(enc: Dict[str, mx.array], names) -> mx.array:
    return mx.concatenate([enc[n] for n in names], axis=-1) if len(names) > 1 else enc[names[0]]


def read(store, enc: Dict[str, mx.array], widths: np.ndarray, stats: Dict[str, mx.array]) -> mx.array:
    """One call (tests, one-offs): LatentReader(store, widths)(enc, stats)."""
    return LatentReader(store, widths)(enc, stats)
