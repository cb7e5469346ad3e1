"""Ragged per-head storage: kv heads that keep different numbers of tokens.

Ada-KV and NestedKV give each kv head its own budget. Padding every head to the
longest would hold (and count) memory no token uses, so a ragged tier holds each
array flat: head h's tokens are the run [off[h], off[h] + lens[h]) of one token
axis ([B, 1, N, ...] with N = sum(lens); axis 2 still counts tokens, so the
generic Buffer holds it). Attention needs a [B, H, W, ...] view: `pad` gathers
one for the step (a transient, never held) whose unused slots repeat a head's
last token and carry position PAD, which every query's position mask hides.
Tokens appended after the layout was fixed (decode steps) go to a uniform tail
that every head shares, so an append is not a re-gather.
"""

from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np

from ..buffer import UNBOUNDED_STEP, Buffer
from .protected import protect
from .protected import room as protected_room

PAD = 1 << 30  # position of an unused slot: after every query, so masked out
# Tokens: an eviction dropping at least this many (a prefill step's, the prompt's decision) evaluates
# what it kept at once, so the dropped tokens' arrays are freed before the next layer queues its own.
FREE_AFTER = 256


class Ragged:
    """Per-head lengths, held as the int32 array that is saved (`ragged.lens`), and the index arrays
    that pad and flatten by them. All are held and count in nbytes (9 bytes per token and head, with
    the padded slots): rebuilt at each use they cost ~3x the gather of every padded view."""

    def __init__(self, lens: List[int]):
        if min(lens) < 1:
            raise ValueError(f"every kv head must hold a token, got lengths {lens}")
        self.lens = [int(n) for n in lens]
        self.width = max(self.lens)
        self.array = mx.array(self.lens, mx.int32)
        lens_np = np.array(self.lens)
        off = np.concatenate([[0], np.cumsum(lens_np)[:-1]])
        j = np.arange(self.width)
        self.valid = mx.array(j[None, :] < lens_np[:, None])  # [H, W]
        self.pad_idx = mx.array(
            (off[:, None] + np.minimum(j[None, :], lens_np[:, None] - 1)).reshape(-1).astype(np.int32)
        )
        self.sel = mx.array(
            (np.repeat(np.arange(len(lens_np)) * self.width - off, lens_np) + np.arange(int(lens_np.sum()))).astype(
                np.int32
            )
        )  # [N]: each flat index's padded slot

    @property
    def nbytes(self) -> int:
        return self.array.nbytes + self.valid.nbytes + self.pad_idx.nbytes + self.sel.nbytes

    @property
    def total(self) -> int:
        return int(sum(self.lens))

    def pad(self, flat: mx.array, fill=None) -> mx.array:
        """[B, 1, N, ...] -> [B, H, W, ...]; unused slots hold `fill` where given (positions: PAD)."""
        B, H = flat.shape[0], len(self.lens)
        out = mx.take(flat, self.pad_idx, axis=2).reshape(B, H, self.width, *flat.shape[3:])
        if fill is None:
            return out
        valid = self.valid.reshape(1, H, self.width, *([1] * (flat.ndim - 3)))
        return mx.where(valid, out, mx.array(fill, out.dtype))

    def flatten(self, padded: mx.array) -> mx.array:
        """[B, H, W, ...] -> [B, 1, N, ...]: the used slots, head after head."""
        B, H, W = padded.shape[:3]
        return mx.take(padded.reshape(B, 1, H * W, *padded.shape[3:]), self.sel, axis=2)


class RaggedBuffer:
    """One array of a ragged tier: the flat ragged part plus the shared uniform tail.
    Speaks Buffer's protocol (view / append / set / nbytes) in padded terms."""

    def __init__(self, layout: Ragged, flat: mx.array, step: Optional[int], fill=None):
        self.layout, self.flat, self.fill = layout, flat, fill
        self.tail = Buffer(step)

    @property
    def used(self) -> int:
        return self.layout.width + self.tail.used

    def view(self) -> mx.array:
        padded = self.layout.pad(self.flat, self.fill)
        tail = self.tail.view()
        return padded if tail is None else mx.concatenate([padded, tail], axis=2)

    def append(self, x: mx.array) -> None:
        self.tail.append(x)

    def set(self, padded: mx.array) -> None:
        """A padded view with changed values (scores) goes back into the flat part and the tail."""
        W = self.layout.width
        self.flat = self.layout.flatten(padded[:, :, :W])
        self.tail.set(padded[:, :, W:] if padded.shape[2] > W else None)

    def drop_back(self, n: int) -> None:
        raise ValueError("a ragged tier has evicted tokens: it cannot be trimmed")

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes + self.tail.nbytes


def choose(priority: mx.array, budgets: List[int]):
    """Each head h keeps its `budgets[h]` highest-priority slots of a padded view [B, H, W], in
    slot order: (the new layout, indices [B, N] into the view flattened to [B, H*W])."""
    B, H, W = priority.shape
    most = max(budgets)
    order = mx.argsort(-priority, axis=2)[:, :, :most].astype(mx.int32)
    j = mx.arange(most, dtype=mx.int32)
    chosen = j[None, :] < mx.array(budgets, dtype=mx.int32)[:, None]  # [H, most]
    order = mx.sort(mx.where(chosen, order, W + j), axis=2)  # the chosen first, older first
    layout = Ragged(budgets)
    src = mx.arange(H, dtype=mx.int32)[:, None] * W + order
    return layout, layout.flatten(src)[:, 0]


def gather(padded: mx.array, idx: mx.array) -> mx.array:
    """The slots `idx` [B, N] of a padded array [B, H, W, ...], flat: [B, 1, N, ...]."""
    B, H, W = padded.shape[:3]
    rest = padded.shape[3:]
    flat = padded.reshape(B, H * W, *rest)
    out = mx.take_along_axis(flat, idx.reshape(B, -1, *([1] * len(rest))), axis=1)
    return out.reshape(B, 1, idx.shape[1], *rest)


def keep_ragged(tier, priority: mx.array, offset: int, cap: Optional[int] = None) -> None:
    """Head h of an eviction tier (runtime/eviction/head_tier.py) keeps its own budget: the tier's
    arrays become ragged (flat, no padding held)."""
    pos = tier.positions
    valid = pos < PAD
    recent = getattr(tier.route, "recent", 0)
    protected = valid & protect(tier, (pos < tier.route.sinks) | (pos >= offset - recent), pos)
    priority = mx.where(protected, mx.inf, priority)
    if tier.window:  # expired tokens rank below every visible one (unused slots lower still)
        priority = mx.where(pos < offset - tier.window + 1, -1e30, priority)
    priority = mx.where(valid, priority, -mx.inf)
    rooms = [protected_room(tier, b, offset) for b in tier.head_budgets()]  # image tokens on top of the budget
    budgets = [min(r, n, cap or r) for r, n in zip(rooms, tier.lengths())]
    dropped = sum(tier.lengths()) - sum(budgets)
    layout, idx = choose(priority, budgets)
    step = UNBOUNDED_STEP if tier.route.once else None
    for bufs in (*tier.buffers.values(), tier.meta):
        for name, buf in bufs.items():
            fill = PAD if bufs is tier.meta and name == "pos" else None
            bufs[name] = RaggedBuffer(layout, gather(buf.view(), idx), step, fill)
    tier.ragged, tier.count, tier.uniform = layout, layout.width, False
    if dropped >= FREE_AFTER:
        mx.eval([b.flat for bufs in (*tier.buffers.values(), tier.meta) for b in bufs.values()])


def restore_ragged(tier, arrays: Dict[str, mx.array]) -> Optional[str]:
    """A saved ragged tier (runtime/eviction/head_tier.py: arrays()) back into `tier`; an error text, or None."""
    lens = arrays["ragged.lens"].tolist()
    if not lens or min(lens) < 1:
        return f"ragged.lens {lens} gives a kv head no tokens"
    layout = Ragged(lens)
    step = UNBOUNDED_STEP if tier.route.once else None
    for key in tier.expected_names():
        side, _, name = key.partition(".") if key.split(".")[0] in tier.buffers else ("", "", key)
        bufs = tier.buffers[side] if side else tier.meta
        arr = arrays.get(key)
        if arr is None:
            return f"missing array {key}"
        if arr.ndim < 3 or arr.shape[1] != 1 or arr.shape[2] != layout.total:
            return (
                f"array {key} has shape {tuple(arr.shape)}, which does not hold the {layout.total} tokens "
                "of ragged.lens"
            )
        bufs[name] = RaggedBuffer(layout, arr, step, PAD if not side and name == "pos" else None)
        tail = arrays.get(f"tail.{key}")
        if tail is not None:
            bufs[name].tail.append(tail)
    tails = {b.tail.used for bufs in (*tier.buffers.values(), tier.meta) for b in bufs.values()}
    if len(tails) != 1:
        return f"the tail arrays hold different token counts ({sorted(tails)})"
    tier.ragged, tier.count = layout, layout.width + tails.pop()
    pos = tier.positions
    valid = pos < PAD
    before = mx.cummax(mx.where(valid, pos, -1), axis=-1)  # the newest valid position so far
    ordered = (pos[..., 1:] > before[..., :-1]) | ~valid[..., 1:]
    if pos.dtype != mx.int32 or not bool(mx.all(ordered).item()):
        return "positions are not increasing int32 per head"
    return None
