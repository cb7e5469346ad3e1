"""A batch of sequences in one per-head eviction tier (h2o, tova, pyramidkv, snapkv, ...): each row its own.

An eviction tier (runtime/eviction/head_tier.py) holds [B, H, L] arrays with every token's position
beside it; a batch is B rows of it. Rows hold different numbers of tokens, so the tier is as wide as
its fullest row, and a slot a row does not use holds position PAD and zeros: every query's position
mask hides it, every cut ranks it below any token, `extract` leaves it behind. Per row:
- a block's columns take the row's own positions; the columns of a right-padded prompt (mlx-lm's
  prompt batches) past the row's real tokens become PAD slots, their keys and values zeroed: padding
  is never seen, kept or scored, and the padded queries' weights are dropped before any sum;
- a cut keeps the row's `budget` highest-priority tokens (sinks and the recent window protected at
  its own positions), or all it holds when that is fewer; the tier then is as wide as the fullest row.
  Every-step routes cut once the tier is wider than the budget (a row under it keeps all its tokens,
  so a cut that reaches only padding changes nothing a sequence holds); `once` routes (SnapKV) cut
  each row at its own prompt's end, which in mlx-lm's batches is the step that feeds its last token;
- scorers see each row's real queries only (TOVA: each row's newest real query; SnapKV: each row's
  own last `window` queries, runtime/eviction/scorers/window.py);
- on a sliding-window layer the window is in every mask and a row's expired tokens rank last.
Rows are host counts (tokens held per head, positions seen), so masks and cuts are batched array ops:
nothing loops over sequences. compiler/batching.py declares which layers batch this way.
"""

from typing import List, Optional

import mlx.core as mx
import numpy as np

from ...errors import VeloxError
from .. import batch_chain, hook
from . import batch_attention, protected, slots
from .protected import protect
from .ragged import PAD

ROW_FIELDS = ("counts", "seen", "decided", "exact", "first_q", "real")


class HeadRows:
    """Per-row host facts of an eviction batch: tokens each row holds per head, positions it has seen,
    whether its `once` route decided, whether a cut was its last change (alone, a cut leaves its arrays
    exactly as long as its tokens, a growing buffer's append rounds them up to UNBOUNDED_STEP: `extract`
    gives it the same), and the last block's first query position and real column count."""

    def __init__(self, counts: np.ndarray, seen: np.ndarray, decided: np.ndarray):
        self.counts, self.seen, self.decided = counts, seen, decided
        self.exact = np.zeros(seen.shape, dtype=bool)
        self.pending: Optional[np.ndarray] = None  # real tokens left in a right-padded prompt (prepare)
        self.first_q, self.real = seen.copy(), np.zeros_like(seen)

    def cut(self, rows: np.ndarray, counts: np.ndarray) -> None:
        """The rows `rows` [B] were cut (alone they would have been), leaving `counts` tokens per row."""
        self.counts, self.exact = counts, self.exact | rows

    @property
    def end(self) -> int:
        """Positions the longest row has seen (0: the batch holds nothing; TieredCache.empty)."""
        return int(self.seen.max(initial=0))


def is_heads(cache) -> bool:
    return isinstance(cache.rows, HeadRows)


def _offset(rows: HeadRows) -> mx.array:
    return mx.array(rows.seen, dtype=mx.int32)[:, None, None]


# --- cuts ---------------------------------------------------------------------
def _keep(tier, rows, priority: mx.array, offset: mx.array, keep: np.ndarray, cutting=None) -> None:
    """Each row keeps its `keep` [B] highest-priority slots (HeadTier.keep, per row); `cutting` [B] False:
    that row keeps every token it holds."""
    width = int(keep.max())
    pos = tier.positions
    protected = pos < tier.route.sinks
    recent = getattr(tier.route, "recent", 0)
    if recent:
        protected = protected | (pos >= offset - recent)
    protected = protect(tier, protected, pos)
    priority = mx.where(protected, mx.inf, priority)
    if tier.window:  # expired tokens leave first, sinks included (alone: -inf; here above the unused slots)
        priority = mx.where(pos < offset - tier.window + 1, -1e30, priority)
    if cutting is not None:
        priority = mx.where(cutting[:, None, None], priority, mx.inf)
    priority = mx.where(pos >= PAD, -mx.inf, priority)
    if not ((keep < width) & (rows.counts > keep)).any():  # rows under `width` hold only what they keep
        order = mx.argpartition(-priority, kth=width - 1, axis=2)[:, :, :width]
        return slots.gather(tier, slots.by_position(tier, order), width)
    # rows keep different numbers (their own image tokens on top of the budget): ranked, the rest let go
    slots.gather(tier, mx.argsort(-priority, axis=2)[:, :, :width], width)
    slots.release(tier, mx.arange(width)[None, None] >= mx.array(keep)[:, None, None])
    slots.gather(tier, mx.argsort(tier.positions, axis=2), width)


def settle(cache) -> None:
    """Every-step routes: rows over their budget cut back to it (the step after a block, as alone). On a
    sliding-window layer, `once` routes' rows over the window drop what no query sees (HeadTier._cut)."""
    tier, rows = cache.tiers[0], cache.rows
    if tier.route.once:
        over = rows.counts > (tier.window or PAD)
        if over.any():
            keep = np.where(over, tier.window, rows.counts)
            _keep(tier, rows, mx.zeros(tier.positions.shape, mx.float32), _offset(rows), keep, mx.array(over))
            rows.cut(over, keep)
        return
    budget = protected.room_rows(tier, tier.budget)
    if (tier.count <= budget).all():
        return
    keep = np.minimum(rows.counts, budget)
    offset = _offset(rows)
    if getattr(tier.route, "pool", 1) > 1:  # scores max-pooled over neighbours: each row in position order
        slots.gather(tier, mx.argsort(tier.positions, axis=2), tier.count)
    _keep(tier, rows, tier.scorer.priority(tier, offset, None), offset, keep)
    rows.cut(rows.counts > budget, keep)


def _finish(cache, ending: np.ndarray) -> None:
    """`once` routes: the rows whose prompt ends now decide (per_head.finish_prompt, per row)."""
    tier, rows = cache.tiers[0], cache.rows
    budget = protected.room_rows(tier, tier.budget)
    cutting = ending & (rows.counts > budget)
    if cutting.any():
        offset = _offset(rows)
        # each row's tokens in position order, unused slots last: votes are max-pooled over neighbours
        slots.gather(tier, mx.argsort(tier.positions, axis=2), tier.count)
        k = tier.decoded(mx.float32)[0]
        weigh = batch_attention.weigher(cache, k, tier.positions)
        keep = np.where(cutting, np.minimum(rows.counts, budget), rows.counts)
        priority = tier.scorer.priority(tier, offset, weigh)
        _keep(tier, rows, priority, offset, keep, mx.array(cutting))
        rows.cut(cutting, keep)
    rows.decided = rows.decided | ending
    tier.scorer.release_rows(ending)


# --- mlx-lm's batch methods -----------------------------------------------------
def update_and_fetch(cache, keys: mx.array, values: mx.array):
    if cache._awaiting_attend or not hook.any_installed():
        raise VeloxError(hook.NOT_ROUTED.format(recipe=getattr(getattr(cache, "plan_root", None), "recipe", "?")))
    rows, tier = cache.rows, cache.tiers[0]
    n = keys.shape[2]
    real = _real(rows, n)
    if tier.route.once:  # a row fed its prompt's last token alone has ended its prompt; more tokens open a turn
        ending = ~rows.decided & (real == 1)
        if ending.any():
            _finish(cache, ending)
        rows.decided = rows.decided & ~(real > 1)
    cache._settle()
    cache.dtype = keys.dtype
    j = np.arange(n)[None]
    pos = np.where(j < real[:, None], rows.seen[:, None] + j, PAD).astype(np.int32)
    if (real < n).any():  # a right-padded prompt: its padding columns become unused slots
        live = mx.array(j < real[:, None])[:, None, :, None]
        keys, values = (mx.where(live, x, mx.zeros((), x.dtype)) for x in (keys, values))
    tier.append(keys, values, 0, mx.broadcast_to(mx.array(pos)[:, None], (keys.shape[0], keys.shape[1], n)))
    rows.first_q, rows.real = rows.seen, real
    rows.seen, rows.counts = rows.seen + real, rows.counts + real
    rows.exact = rows.exact & (real == 0)
    cache.offset = mx.array(rows.seen, dtype=mx.int32)
    cache._unsettled = cache._awaiting_attend = True
    return keys, values


def _real(rows: HeadRows, n: int) -> np.ndarray:
    if rows.pending is None:
        return np.full(rows.seen.shape, n, dtype=np.int64)
    real = np.minimum(rows.pending, n)
    rows.pending = rows.pending - real
    return real


def merge(caches: list, blank):
    for c in caches:
        if c.rows is not None:
            raise VeloxError("merge takes one-sequence caches; a batch joins another with extend()")
        c._settle()
    batch = blank(caches[0])
    batch.dtype = next((c.dtype for c in caches if c.tiers[0].count), caches[0].dtype)
    tiers = [c.tiers[0] for c in caches]
    slots.stack(batch.tiers[0], tiers, [1] * len(tiers))
    batch.tiers[0].scorer.stack([t.scorer for t in tiers], [1] * len(tiers))
    decided = np.array([t.decided for t in tiers], dtype=bool)
    batch.rows = HeadRows(np.array([t.count for t in tiers]), np.array([c.offset for c in caches]), decided)
    batch.rows.exact = np.array([slots.exact(t) for t in tiers], dtype=bool)
    batch.offset = mx.array(batch.rows.seen, dtype=mx.int32)
    protected.assign(batch, protected.stacked(caches))  # each row's image tokens, at its own positions
    return batch


def extend(cache, other) -> None:
    cache._settle()
    other._settle()
    protected.assign(cache, protected.stacked([cache, other]))  # before the rows are joined: it counts them
    a, b = cache.rows, other.rows
    ta, tb = cache.tiers[0], other.tiers[0]
    ta.scorer.stack([ta.scorer, tb.scorer], [a.seen.size, b.seen.size])
    slots.stack(ta, [ta, tb], [a.seen.size, b.seen.size])
    for name in ROW_FIELDS:
        setattr(a, name, np.concatenate([getattr(a, name), getattr(b, name)]))
    a.pending = None
    cache.offset = mx.array(a.seen, dtype=mx.int32)
    cache.dtype = cache.dtype if ta.count else other.dtype


def filter(cache, keep: List[int]) -> None:
    cache._settle()
    rows, tier = cache.rows, cache.tiers[0]
    idx = np.array(keep, dtype=np.int64)
    for name in ROW_FIELDS:
        setattr(rows, name, getattr(rows, name)[idx])
    if rows.pending is not None:
        rows.pending = rows.pending[idx]
    tier.scorer.keep_rows(idx)
    if cache.protected is not None:
        protected.assign(cache, cache.protected.keep_rows(idx))
    if tier.count:
        slots.keep_rows(tier, mx.array(idx, dtype=mx.int32), int(rows.counts.max(initial=0)))
    cache.offset = mx.array(rows.seen, dtype=mx.int32)


def extract(cache, i: int, blank):
    """Row i as a one-sequence cache: its own tokens in position order, as it holds them alone."""
    cache._settle()
    rows, tier = cache.rows, cache.tiers[0]
    alone = blank(cache)
    alone.dtype = cache.dtype
    dst, n = alone.tiers[0], int(rows.counts[i])
    slots.take_row(dst, tier, i, n, bool(rows.exact[i]))
    dst.uniform = n == int(rows.seen[i])  # nothing cut yet: its positions run from 0, as alone
    dst.first = 0
    dst.decided = bool(rows.decided[i])
    dst.scorer.take_row(tier.scorer, i)
    alone.offset = int(rows.seen[i])
    return alone


prepare, finalize = batch_chain.prepare, batch_chain.finalize  # right padding counted the same way


attend = batch_attention.attend


def make_mask(cache, n: int, window_size=None):
    return None  # attention comes through attend (the hook), which masks by each row's positions
