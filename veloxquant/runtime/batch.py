"""A batch of sequences in one TieredCache per layer: mlx-lm's batch protocol, routed to the tiers.

mlx-lm's BatchGenerator (and its server) merge per-sequence caches that may already hold a prompt, pad new prompts
on the right while they are processed (prepare/finalize turns that into left padding), filter out finished
sequences, extend the batch with joining ones and extract a sequence's cache when it leaves. Each batch layout
(`Layout`, picked by compiler/batching.py) does that its own way: plain 16-bit rows here, as BatchKVCache does (rows
left-padded to a common end, `Rows.left`; each row's position offset in `cache.offset`, an array RoPE reads; padding
columns are zeros the mask hides, never a sequence's tokens), tier chains in runtime/batch_chain.py and eviction
rows in runtime/eviction/batch_heads.py. mlx-vlm's BatchGenerator instead left-pads its prompts and asks each cache
for `to_batch(left_padding)` (runtime/batch_left.py). A refused plan raises here, never computes a batch that would
change a sequence's output.
"""

from typing import Callable, List, NamedTuple, Optional

import mlx.core as mx

from ..compiler.batching import layer_layout, refusal
from ..errors import VeloxError
from . import batch_chain as chain
from . import batch_left
from .eviction import batch_heads as heads


class Rows:
    """The batch's per-row facts a cache keeps besides its tiers."""

    def __init__(self, left: mx.array, end: int):
        self.left = left  # [B] int32: first real column of each row
        self.end = end  # columns written: the next token goes to column `end`
        self.right: Optional[mx.array] = None  # right padding of the prompt being processed (prepare)
        self.refresh()

    def refresh(self) -> None:
        self.pad_end = int(self.left.max().item()) if self.left.size else 0  # no row has padding at or after it


class BatchRefused(VeloxError, AttributeError):
    """A cache whose plan does not batch has no `merge`: mlx-lm's own test (hasattr(cache, "merge"), its
    server's load-time check) then serves it one sequence at a time; asked directly, it says why."""


def why_not(cache) -> Optional[str]:
    """Why this cache cannot join a batch (compiler/batching.py's declared refusal), or None."""
    plan = getattr(cache, "plan_root", None)
    why = refusal(plan) if plan is not None else None
    if why is None and cache._plain is None and layer_layout(cache.plan) not in ("chain", "heads"):
        why = f"layer {cache.plan.index}'s cache is not one plain 16-bit tier"
    return why


def check(cache) -> None:
    why = why_not(cache)
    if why is not None:
        raise BatchRefused(f"{why}; serve it one sequence at a time (veloxquant serve does)")


def _blank(like):
    """An empty cache of like's layer, sharing its compiled plan."""
    fresh = type(like)(like.plan)
    for name in ("fingerprint", "plan_root"):
        if hasattr(like, name):
            setattr(fresh, name, getattr(like, name))
    fresh.lends = like.lends  # Gemma 4's KV-shared layers attend over this batch's tiers too
    return fresh


def merge(caches: List) -> "object":
    """One batch cache from per-sequence caches (each may hold a prompt), right-aligned."""
    for c in caches:
        check(c)
    return LAYOUTS[layer_layout(caches[0].plan)].merge(caches, _blank)


def _merge_plain(caches: List, blank):
    for c in caches:
        if c.rows is not None:
            raise VeloxError("merge takes one-sequence caches; a batch joins another with extend()")
        c._settle()  # a window's pending expiry
    tiers = [c.tiers[0] for c in caches]
    width = max(t.count for t in tiers)
    like = next((t.held_arrays() for t in tiers if t.count), {})
    batch = blank(caches[0])
    batch.dtype = next((c.dtype for c in caches if c.tiers[0].count), caches[0].dtype)
    parts = [t.rows_padded_front(width - t.count, 1, like) for t in tiers]
    arrays = {k: mx.concatenate([p[k] for p in parts], axis=0) for k in like}
    batch.tiers[0].set_rows(arrays, 0, width)
    batch.rows = Rows(mx.array([width - t.count for t in tiers], dtype=mx.int32), width)
    batch.offset = mx.array([c.offset for c in caches], dtype=mx.int32)
    return batch


def extend(cache, other) -> None:
    """`other`'s rows appended to `cache`'s, both right-aligned to the later end."""
    a, b = cache.rows, other.rows
    end = max(a.end, b.end)
    ta, tb = cache.tiers[0], other.tiers[0]
    starts = []
    for c, t in ((a, ta), (b, tb)):
        shift = end - c.end
        c.left, c.end = c.left + shift, end
        t.start += shift
        if t.count:
            starts.append(t.start)
    start = min(starts, default=end)
    like = ta.held_arrays() or tb.held_arrays()
    parts = [
        t.rows_padded_front((t.start - start) if t.count else end - start, c.left.size, like)
        for c, t in ((a, ta), (b, tb))
    ]
    ta.set_rows({k: mx.concatenate([p[k] for p in parts], axis=0) for k in like}, start, end - start)
    a.left = mx.concatenate([a.left, b.left])
    a.right = None
    a.refresh()
    cache.offset = mx.concatenate([cache.offset, other.offset])
    cache.dtype = cache.dtype if ta.count else other.dtype


def filter(cache, keep: List[int]) -> None:
    """Keep the given rows; columns that are padding in every kept row are let go."""
    rows, tier = cache.rows, cache.tiers[0]
    idx = mx.array(keep, dtype=mx.int32)
    if tier.count:
        tier.keep_rows(idx)
    rows.left, cache.offset = rows.left[idx], cache.offset[idx]
    lowest = int(rows.left.min().item()) if len(keep) else rows.end
    if tier.count and lowest > tier.start:
        tier.drop_front(min(lowest, tier.end) - tier.start)
    rows.refresh()


def extract(cache, i: int, blank):
    """Row i as a one-sequence cache (its real tokens only), as if it had run alone."""
    rows, tier = cache.rows, cache.tiers[0]
    alone = blank(cache)
    alone.dtype = cache.dtype
    offset = int(cache.offset[i].item())
    first = max(int(rows.left[i].item()), tier.start) if tier.count else rows.end
    n = rows.end - first
    alone.tiers[0].set_rows(tier.row(i, first) if n else {}, offset - n, n)
    alone.offset = offset
    return alone


def prepare(cache, left_padding=None, lengths=None, right_padding=None) -> None:
    rows = cache.rows
    if left_padding is not None:
        if cache.tiers[0].count:
            raise ValueError("left padding can only be added to an empty batch cache")
        pad = mx.array(left_padding, dtype=mx.int32)
        rows.left = rows.left + pad
        cache.offset = cache.offset - pad
        rows.refresh()
    if right_padding is not None and max(right_padding) > 0:
        rows.right = mx.array(right_padding, dtype=mx.int32)


def finalize(cache) -> None:
    """The processed prompt's right padding moved to the left of each row."""
    rows, tier = cache.rows, cache.tiers[0]
    if rows.right is None:
        return
    pad, rows.right = rows.right, None
    if tier.count:
        tier.roll_rows(pad)
    rows.left = mx.maximum(rows.left, tier.start) + pad
    cache.offset = cache.offset - pad
    rows.refresh()


def _start(cache, window: Optional[int]) -> int:
    """The first column held once this step's expiry has run (update_and_fetch)."""
    rows, tier = cache.rows, cache.tiers[0]
    if not tier.count:
        return rows.end
    if window is None or rows.right is not None:  # a prompt in flight keeps all: its rows end unevenly
        return tier.start
    return min(rows.end, max(tier.start, rows.end - window + 1))


def settle(cache) -> None:
    """TieredCache._settle of a batch: an eviction batch cuts (the chains settle in their own updates)."""
    cache._layout().settle(cache)


def make_mask(cache, N: int, window_size: Optional[int] = None):
    return cache._layout().make_mask(cache, N, window_size)


def update_and_fetch(cache, keys: mx.array, values: mx.array):
    return cache._layout().update_and_fetch(cache, keys, values)


def attend(cache, queries: mx.array, scale: float, mask, observe: bool = True):
    """A batch's route (runtime/layer_attention.py): the rows' attention over their tiers."""
    return cache._layout().attend(cache, queries, scale, mask)


def _mask_plain(cache, N: int, window_size: Optional[int] = None):
    rows = cache.rows
    window = window_size or cache.plan.window
    start = _start(cache, cache.plan.window)
    if N == 1 and rows.pad_end <= start and (window is None or rows.end - start < window):
        return None  # one query per row, and every held column is that row's and in its window
    q = mx.arange(rows.end, rows.end + N)[:, None]
    k = mx.arange(start, rows.end + N)[None]
    mask = (k <= q) & (k >= rows.left[:, None, None, None])
    if window is not None:
        mask = mask & (q - k < window)
    return mask


def _update_plain(cache, keys: mx.array, values: mx.array):
    rows, plain = cache.rows, cache._plain
    if cache.plan.window and rows.right is None:
        plain.expire(rows.end - cache.plan.window + 1)
    cache.dtype = keys.dtype
    plain.append(keys, values, rows.end)
    n = keys.shape[2]
    rows.end += n
    cache.offset = cache.offset + n
    return plain.decoded(keys.dtype)


def _attend_plain(cache, queries: mx.array, scale: float, mask):
    k, v = cache._plain.decoded(queries.dtype)
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)


def _settled(cache) -> None:
    """Nothing is left to settle between steps."""


class Layout(NamedTuple):
    """A batch layout's operations (compiler/batching.py's layer_layout names the one a plan takes)."""

    merge: Callable  # (caches, blank) -> a batch cache
    extend: Callable
    filter: Callable
    extract: Callable  # (cache, row, blank) -> a one-sequence cache
    prepare: Callable
    finalize: Callable
    update_and_fetch: Callable
    attend: Callable  # (cache, queries, scale, mask): the tier layouts build their own masks
    make_mask: Callable
    settle: Callable = _settled  # TieredCache._settle's work (plain rows and chains settle as they update)


PLAIN = Layout(_merge_plain, extend, filter, extract, prepare, finalize, _update_plain, _attend_plain, _mask_plain)


def _tiers_layout(module, settle=_settled) -> Layout:
    """A layout of tier rows whose module has the operations by name (its attention builds its own masks)."""
    ops = (module.merge, module.extend, module.filter, module.extract, module.prepare, module.finalize)
    attend = lambda cache, queries, scale, mask: module.attend(cache, queries, scale)
    return Layout(*ops, module.update_and_fetch, attend, module.make_mask, settle)


CHAIN = batch_left.padded(_tiers_layout(chain))
HEADS = batch_left.padded(_tiers_layout(heads, heads.settle))
LAYOUTS = {"plain": PLAIN, "chain": CHAIN, "heads": HEADS}
