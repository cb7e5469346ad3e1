"""The slots of a batched eviction tier (runtime/eviction/batch_heads.py): the array work.

A batch's eviction tier holds [B, H, W, ...] arrays; a slot a row does not use holds position PAD and
zeros. These gather, widen, stack and cut rows of every per-token array the tier holds (the codec's and
its positions, scores and scorer state), and give one row back as a one-sequence tier holds it.
"""

from typing import List, Optional

import mlx.core as mx

from .ragged import PAD


def each(tier):
    """(store, name, fill of an unused slot) for every per-token array the tier holds."""
    for side, bufs in tier.buffers.items():
        for name in bufs:
            yield side, bufs, name, 0
    for name in tier.meta:
        yield "meta", tier.meta, name, PAD if name == "pos" else 0


def gather(tier, idx: mx.array, width: int) -> None:
    """Each row and head keeps the slots idx [B, H, width], in that order."""
    for _, bufs, name, _ in each(tier):
        arr = bufs[name].view()
        bufs[name].set(mx.take_along_axis(arr, idx.reshape(*idx.shape, *([1] * (arr.ndim - 3))), axis=2))
    tier.count, tier.uniform = width, False


def release(tier, unused: mx.array) -> None:
    """The slots where `unused` [B, 1 or H, W] holds become unused: position PAD, zeros."""
    for _, bufs, name, fill in each(tier):
        arr = bufs[name].view()
        bufs[name].set(mx.where(unused.reshape(*unused.shape, *([1] * (arr.ndim - 3))), fill, arr))


def by_position(tier, idx: mx.array) -> mx.array:
    """idx reordered so each row's kept slots run in position order (unused slots last)."""
    pos = mx.take_along_axis(tier.positions, idx, axis=2)
    return mx.take_along_axis(idx, mx.argsort(pos, axis=2), axis=2)


def compact(tier, width: int) -> None:
    """Unused slots past the fullest row let go (rows left the batch)."""
    if tier.count > width:
        if width == 0:
            return empty(tier)
        gather(tier, mx.argsort(tier.positions, axis=2)[:, :, :width], width)


def empty(tier) -> None:
    for _, bufs, name, _ in each(tier):
        bufs[name].set(None)
    tier.count = 0


def _widened(arr: Optional[mx.array], like: mx.array, width: int, rows: int, fill) -> mx.array:
    """arr with unused slots appended up to `width` (None: `rows` rows of unused slots)."""
    if arr is None:
        return mx.full((rows, like.shape[1], width, *like.shape[3:]), fill, like.dtype)
    more = width - arr.shape[2]
    return (
        arr if not more else mx.pad(arr, [(0, 0), (0, 0), (0, more)] + [(0, 0)] * (arr.ndim - 3), constant_values=fill)
    )


def stack(dst, parts: List, rows: List[int]) -> None:
    """dst's arrays: each part tier's rows, widened to the widest, one after the other."""
    width = max(t.count for t in parts)
    if not width:
        return empty(dst)
    for side, bufs, name, fill in each(dst):
        arrays = [(t.buffers[side] if side != "meta" else t.meta)[name].view() if t.count else None for t in parts]
        like = next(a for a in arrays if a is not None)
        bufs[name].set(mx.concatenate([_widened(a, like, width, n, fill) for a, n in zip(arrays, rows)], axis=0))
    dst.count, dst.uniform = width, False


def keep_rows(tier, rows: mx.array, width: int) -> None:
    """Only the given rows stay; slots past the fullest of them (`width` tokens) are let go."""
    for _, bufs, name, _ in each(tier):
        bufs[name].set(bufs[name].view()[rows])
    compact(tier, width)


def exact(tier) -> bool:
    """A one-sequence tier's arrays are exactly as long as its tokens (a cut was its last change)."""
    buf = tier.meta["pos"]
    return buf.data is None or buf.data.shape[2] == buf.used


def take_row(dst, src, i: int, n: int, cut_last: bool) -> None:
    """dst (a one-sequence tier) holds src's row i: its n tokens, in position order, in arrays as long as
    they are alone: exactly n after a cut, else as a growing buffer appends them."""
    if n:
        order = mx.argsort(src.positions[i : i + 1], axis=2)[:, :, :n]
        held = {(side, name): bufs for side, bufs, name, _ in each(dst)}
        for side, bufs, name, _ in each(src):
            arr = bufs[name].view()[i : i + 1]
            kept = mx.take_along_axis(arr, order.reshape(*order.shape, *([1] * (arr.ndim - 3))), axis=2)
            buf = held[(side, name)][name]
            if cut_last:
                buf.set(mx.contiguous(kept))
            else:
                buf.append(mx.contiguous(kept))
    dst.count = n
