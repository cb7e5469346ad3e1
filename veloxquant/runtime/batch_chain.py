"""A batch of sequences in a chain of tiers (sink? >> recent >> codes): each row at its own positions.

A coded tier groups tokens from each sequence's own first spilled token and spills when *that*
sequence's window fills, so the plain layout (runtime/batch.py: rows left-padded to one column
axis) would put padding into code groups and move every row at once. Here every tier's arrays hold
B rows each starting at column 0 of the tier: the sink's column c is position c, the codes' column
c is position `sink + c`, the recent window's column c is position `sink + coded_i + c`. Rows differ
only in how many columns they fill (`counts`, on the host: they follow from token counts alone);
what a row has not filled is zeros the mask hides and no code group ever holds. New tokens are
written at each row's own column, a window spills each row's own whole chunks (one batched encode
of the widest spill; a row's columns past its own spill are written again when it spills them),
and right-padded prompt tokens (mlx-lm's prompt batches) are never written at all: no padding is
kept, coded or scored, and prepare/finalize only count. Each sequence so holds, codes and sees what
it would alone (compiler/batching.py declares which chains these are). The array work is the
tiers' (runtime/kinds/tier_rows.py, "ragged rows"); this module keeps the counts and routes.
"""

from typing import List, Optional

import mlx.core as mx
import numpy as np

from ..errors import VeloxError
from . import row_index
from .chain_attention import attend, fetch, mask

__all__ = ["attend"]  # mlx-lm's batch methods and the layer's attention (runtime/batch.py routes by name)


class ChainRows:
    """Per-row counts of a chain batch (host arrays: [tier, row] tokens held and the position of each
    tier's column 0, [row] positions seen)."""

    def __init__(self, counts: np.ndarray, starts: np.ndarray, offset: np.ndarray):
        self.counts = counts
        self.starts = starts
        self.seen = offset
        self.pending: Optional[np.ndarray] = None  # real tokens left in a right-padded prompt (prepare)
        # the last block's first position per row, its real tokens per row and its length (attend's mask)
        self.queries = (offset.copy(), np.zeros_like(offset), 0)
        self.unsettled = True
        self.roles = None  # roles(cache), once: a chain's tiers do not change

    @property
    def end(self) -> int:
        """Positions the longest row has seen (0: the batch holds nothing; TieredCache.empty)."""
        return int(self.seen.max(initial=0))


def roles(cache):
    """(sink index or None, recent index or None, the rest's index) of the cache's chain."""
    if cache.rows.roles is None:
        names = [t.route.stage_name if t.route is not None else None for t in cache.tiers]
        sink = names.index("sink") if "sink" in names else None
        recent = names.index("recent") if "recent" in names else None
        cache.rows.roles = (sink, recent, len(names) - 1)
    return cache.rows.roles


def _sink_n(cache) -> int:
    sink, _, _ = roles(cache)
    return cache.tiers[sink].route.n if sink is not None else 0


def is_chain(cache) -> bool:
    return isinstance(cache.rows, ChainRows)


def _spill(route, chunk: int, held: np.ndarray) -> np.ndarray:
    """Recent.spill, per row."""
    over = held - route.n
    whole = -(-over // chunk) * chunk
    return np.where(over <= 0, 0, np.where(whole <= held, whole, held // chunk * chunk))


def settle(cache) -> None:
    rows = cache.rows
    if not rows.unsettled:
        return
    rows.unsettled = False
    _, recent, rest = roles(cache)
    if recent is not None:
        _spill_rows(cache, cache.tiers[recent], recent, rest)
    if cache.plan.window:  # a sliding-window layer forgets, per row, what no later query sees
        oldest = rows.seen - cache.plan.window + 1
        for t, tier in enumerate(cache.tiers):
            gone = np.clip(oldest - rows.starts[t], 0, rows.counts[t]) // tier.granularity * tier.granularity
            if gone.max(initial=0) > 0:
                tier.ragged_drop_front(rows.counts[t], gone)
                rows.starts[t] = rows.starts[t] + gone
                rows.counts[t] = rows.counts[t] - gone


def _spill_rows(cache, tier, recent: int, rest: int) -> None:
    rows = cache.rows
    held = rows.counts[recent]
    moved = row_index.shared(
        ("spill", held.tobytes(), tier.route.n, tier.plan.chunk), lambda: _spill(tier.route, tier.plan.chunk, held)
    )
    widest = int(moved.max()) if moved.size else 0
    if not widest:
        return
    if cache.tiers[rest].drops:  # streaming_llm: the spill is let go
        tier.ragged_drop_front(rows.counts[recent], moved)
        rows.counts[recent] = rows.counts[recent] - moved
        rows.starts[recent] = rows.starts[recent] + moved
        return
    keys, values = tier.rows_front(widest, cache.dtype)
    cache.tiers[rest].ragged_encode_append(keys, values, rows.counts[rest], moved)
    tier.ragged_drop_front(rows.counts[recent], moved)
    rows.starts[rest] = np.where(rows.counts[rest] == 0, rows.starts[recent], rows.starts[rest])
    rows.counts[rest] = rows.counts[rest] + moved
    rows.counts[recent] = rows.counts[recent] - moved
    rows.starts[recent] = rows.starts[recent] + moved


def _placement(cache, real: np.ndarray):
    """[(tier index, tokens each row's tier takes, the block column they start at)] for a block whose
    first `real` [B] columns are real tokens: the sink takes the positions below its n, the next tier the rest."""
    rows = cache.rows
    sink, recent, rest = roles(cache)
    taken = np.clip(_sink_n(cache) - rows.seen, 0, real) if sink is not None else np.zeros_like(real)
    out = [(sink, taken, np.zeros_like(real))] if sink is not None else []
    return out + [(recent if recent is not None else rest, real - taken, taken)]


def _place(cache, keys: mx.array, values: mx.array, real: np.ndarray) -> None:
    """A block's real tokens written at each row's own columns; the columns past them (padding) never."""
    rows = cache.rows
    for t, take, source in _placement(cache, real):
        if take.max(initial=0) > 0:
            cache.tiers[t].ragged_encode_append(keys, values, rows.counts[t], take, source)
    rows.counts, rows.starts = _placed(cache, real)
    rows.seen = rows.seen + real
    rows.unsettled = True


def _placed(cache, real: np.ndarray):
    """The counts and starts once a block's real tokens are placed (no array touched)."""
    rows = cache.rows
    counts, starts = rows.counts.copy(), rows.starts.copy()
    for t, take, source in _placement(cache, real):
        starts[t] = np.where((counts[t] == 0) & (take > 0), rows.seen + source, starts[t])
        counts[t] = counts[t] + take
    return counts, starts


def _real(cache, n: int, consume: bool = True) -> np.ndarray:
    """How many of an n-token block's columns are each row's real tokens (a right-padded prompt: fewer)."""
    rows = cache.rows
    if rows.pending is None:
        return np.full(rows.seen.shape, n, dtype=np.int64)
    real = np.minimum(rows.pending, n)
    if consume:
        rows.pending = rows.pending - real
    return real


def update_and_fetch(cache, keys: mx.array, values: mx.array):
    settle(cache)
    cache.dtype = keys.dtype
    rows = cache.rows
    real = _real(cache, keys.shape[2])
    rows.queries = (rows.seen.copy(), real, keys.shape[2])
    _place(cache, keys, values, real)
    cache.offset = mx.array(rows.seen, dtype=mx.int32)
    if cache.hook_answers():
        return keys, values  # the hook answered the last step: attend() reads the tiers
    return fetch(cache, keys.dtype)


def make_mask(cache, n: int, window_size: Optional[int] = None):
    """The mask attend() uses for an n-token block, for mlx-lm's own attention; None where the hook
    answered the last step (attend() masks by the rows' own counts: the mask would never be read)."""
    if cache.hook_answers():
        return None
    settle(cache)
    real = _real(cache, n, consume=False)
    counts, starts = _placed(cache, real)
    return mask(cache, counts, starts, cache.rows.seen, real, n, window_size or cache.plan.window)


# --- mlx-lm's batch methods -------------------------------------------------
def merge(caches: list, blank):
    for c in caches:
        if c.rows is not None:
            raise VeloxError("merge takes one-sequence caches; a batch joins another with extend()")
        c._settle()
    first = caches[0]
    batch = blank(first)
    batch.dtype = next((c.dtype for c in caches if c.size()), first.dtype)
    counts = np.array([[t.count for t in c.tiers] for c in caches], dtype=np.int64).T
    starts = np.array([[t.start for t in c.tiers] for c in caches], dtype=np.int64).T
    for i, tier in enumerate(batch.tiers):
        tier.ragged_stack([c.tiers[i] for c in caches])
    batch.rows = ChainRows(counts, starts, np.array([c.offset for c in caches], dtype=np.int64))
    batch.rows.unsettled = False
    batch.offset = mx.array(batch.rows.seen, dtype=mx.int32)
    return batch


def extend(cache, other) -> None:
    settle(cache)
    settle(other)
    rows, more = cache.rows, other.rows
    for a, b in zip(cache.tiers, other.tiers):
        a.ragged_concat(b, rows.seen.size, more.seen.size)
    rows.counts = np.concatenate([rows.counts, more.counts], axis=1)
    rows.starts = np.concatenate([rows.starts, more.starts], axis=1)
    rows.seen = np.concatenate([rows.seen, more.seen])
    rows.pending = None
    cache.offset = mx.array(rows.seen, dtype=mx.int32)
    cache.dtype = cache.dtype if cache.size() else other.dtype


def filter(cache, keep: List[int]) -> None:
    rows = cache.rows
    idx = np.array(keep, dtype=np.int64)
    rows.counts, rows.starts, rows.seen = rows.counts[:, idx], rows.starts[:, idx], rows.seen[idx]
    for tier, counts in zip(cache.tiers, rows.counts):
        tier.ragged_keep(mx.array(idx, dtype=mx.int32), int(counts.max(initial=0)))
    cache.offset = mx.array(rows.seen, dtype=mx.int32)


def extract(cache, i: int, blank):
    settle(cache)
    rows = cache.rows
    alone = blank(cache)
    alone.dtype = cache.dtype
    for t, (src, dst) in enumerate(zip(cache.tiers, alone.tiers)):
        n = int(rows.counts[t][i])
        dst.set_rows(src.ragged_row(i, n) if n else {}, int(rows.starts[t][i]), n)
    alone.offset = int(rows.seen[i])
    return alone


def prepare(cache, left_padding=None, lengths=None, right_padding=None) -> None:
    """A chain or eviction batch (runtime/eviction/batch_heads.py takes these two as they are): a
    right-padded prompt's real lengths, to count only real tokens while it is fed."""
    if left_padding is not None and max(left_padding) > 0:
        raise VeloxError(
            "a coded tier chain's or eviction batch is never left-padded: each row starts at column 0 "
            "(mlx-vlm's left-padded batches go through runtime/batch_left.py)"
        )
    if right_padding is not None and max(right_padding) > 0:
        cache.rows.pending = np.array(lengths, dtype=np.int64)


def finalize(cache) -> None:
    cache.rows.pending = None
