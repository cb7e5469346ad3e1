"""Positions no eviction tier drops: a vision-language model's image tokens.

mlx-vlm's generate feeds the prompt to the language model as embeddings, the image (and video)
placeholder ids replaced by the vision tower's output, with the ids alongside
(`language_model(ids, inputs_embeds=..., cache=...)`). Where the placeholder ids sit, the image
sits. The language model class's __call__ is wrapped (reversibly, as the model pass records ids:
runtime/eviction/model_pass.py) to record those positions, as runs [start, end), for the cache
list it is called with; calls without embeddings (decode steps: nothing of an image is fed) are
not read, so decoding never waits on the sampled token.

Every eviction tier of the list (runtime/eviction/head_tier.py, ragged.py) then ranks those
positions above any other, as it ranks its sinks, and keeps them on top of its budget: a head
keeps `budget` tokens of text plus every image token it can still see (on a sliding-window layer,
an image token past the window leaves, as any token does: no query sees it again). Batched rows
share the runs (a position is kept where any row has an image token there). The image tokens'
K/V are held in the tiers like any other and counted in their nbytes; the runs are host integers.
"""

from typing import List, Optional, Tuple

import mlx.core as mx
import numpy as np

from .call_watch import CallWatch

_WATCH = CallWatch()  # the language model classes whose calls are watched


class Protected:
    """The image-token runs of one cache list (shared by its layers' eviction tiers), or of one layer of a
    batch (runtime/batch.py: each row its own runs; filter and extend carry them with the rows)."""

    def __init__(self, ids: Tuple[int, ...], rows: int = 1):
        self.ids = tuple(ids)
        self.starts = np.zeros(0, dtype=np.int64)  # per run: first position,
        self.ends = np.zeros(0, dtype=np.int64)  # one past its last,
        self.row = np.zeros(0, dtype=np.int64)  # and the batch row it is in
        self.seen = np.zeros(rows, dtype=np.int64)  # per row: positions fed through the model when last recorded

    def record(self, offset, inputs) -> None:
        """Each row's positions [offset, offset + n) were fed with `inputs` (ids [B, n] or [n]; `offset` an
        int or, in a batch, [B]: a left-padded row's padding columns lie before its first position)."""
        ids = np.asarray(inputs).reshape(-1, np.asarray(inputs).shape[-1])
        first = np.broadcast_to(np.asarray(offset, dtype=np.int64).reshape(-1), (ids.shape[0],))
        live = self.starts < first[self.row]  # a rewind forgets newer runs
        self.starts, self.row = self.starts[live], self.row[live]
        self.ends = np.minimum(self.ends[live], first[self.row])
        hit = np.isin(ids, self.ids).astype(np.int8)
        pad = np.zeros((ids.shape[0], 1), dtype=np.int8)
        rows, cols = np.nonzero(np.diff(np.concatenate([pad, hit, pad], axis=1), axis=1))  # row-major: start, end
        self.starts = np.concatenate([self.starts, first[rows[::2]] + cols[::2]])
        self.ends = np.concatenate([self.ends, first[rows[1::2]] + cols[1::2]])
        self.row = np.concatenate([self.row, rows[::2]])
        self.seen = first + ids.shape[1]

    @property
    def runs(self) -> List[Tuple[int, int]]:
        """[start, end) of every run (one sequence: its image tokens' positions)."""
        return [(int(s), int(e)) for s, e in zip(self.starts, self.ends)]

    @property
    def count(self) -> int:
        return int((self.ends - self.starts).sum())

    def held_rows(self, offset=None, window: Optional[int] = None) -> np.ndarray:
        """Per row: image tokens a head still sees at `offset` (all of them without a sliding window)."""
        seen = self.seen if offset is None else np.broadcast_to(np.asarray(offset).reshape(-1), self.seen.shape)
        lo = seen[self.row] - window + 1 if window else self.starts
        kept = np.maximum(0, self.ends - np.maximum(self.starts, lo))
        return np.bincount(self.row, kept, self.seen.size).astype(np.int64)

    def held(self, offset: Optional[int] = None, window: Optional[int] = None) -> int:
        """Image tokens one sequence's head still sees at `offset`."""
        return int(self.held_rows(offset, window).max(initial=0))

    def mask(self, positions: mx.array) -> mx.array:
        """True where `positions` ([B, ...]; one sequence: any shape) fall in an image run of their row: one
        comparison per image of a row, not per token or per row."""
        out = mx.zeros(positions.shape, mx.bool_)
        rows = self.seen.size
        order = np.argsort(self.row, kind="stable")
        rank = np.arange(order.size) - np.searchsorted(self.row[order], self.row[order])  # k-th run of its row
        bounds = np.zeros((2, rows, int(rank.max(initial=-1)) + 1), dtype=np.int64)  # empty runs: [0, 0)
        bounds[:, self.row[order], rank] = self.starts[order], self.ends[order]
        shape = (rows,) + (1,) * (positions.ndim - 1) if rows > 1 else ()
        for s, e in zip(bounds[0].T, bounds[1].T):
            out = out | ((positions >= mx.array(s).reshape(shape)) & (positions < mx.array(e).reshape(shape)))
        return out

    def keep_rows(self, keep) -> "Protected":
        """The runs of rows `keep`, renumbered (a batch's filter)."""
        keep = np.asarray(keep, dtype=np.int64)
        renumbered = np.full(self.seen.size, -1, dtype=np.int64)
        renumbered[keep] = np.arange(keep.size)
        live = renumbered[self.row] >= 0
        kept = Protected(self.ids, 0)
        kept.starts, kept.ends, kept.row = self.starts[live], self.ends[live], renumbered[self.row[live]]
        kept.seen = self.seen[keep]
        return kept

    def joined(self, other: Optional["Protected"], rows: int) -> "Protected":
        """These runs and `other`'s (None: `rows` rows without images) as rows after these (a batch's extend)."""
        both = Protected(self.ids, 0)
        extra = other if other is not None else Protected(self.ids, rows)
        both.starts = np.concatenate([self.starts, extra.starts])
        both.ends = np.concatenate([self.ends, extra.ends])
        both.row = np.concatenate([self.row, extra.row + self.seen.size])
        both.seen = np.concatenate([self.seen, extra.seen])
        return both


def room(tier, budget: int, offset: Optional[int] = None) -> int:
    """`budget` plus the image tokens the tier keeps on top of it, at most the tier's sliding window."""
    extra = tier.protected.held(offset, tier.window) if tier.protected is not None else 0
    return min(budget + extra, tier.window) if tier.window and extra else budget + extra


def room_rows(tier, budget: int) -> np.ndarray:
    """room() per row of a batch (runtime/eviction/batch_heads.py): each row's own image tokens on top."""
    extra = tier.protected.held_rows(None, tier.window) if tier.protected is not None else np.zeros(1, np.int64)
    capped = np.minimum(budget + extra, tier.window) if tier.window else budget + extra
    return np.where(extra > 0, capped, budget + extra)  # as room(): a row without image tokens keeps `budget`


def protect(tier, protected: mx.array, positions: mx.array) -> mx.array:
    """`protected` (sinks, recent) and the tier's image tokens."""
    if tier.protected is None or not tier.protected.runs:
        return protected
    return protected | tier.protected.mask(positions)


def attach(model, caches: list, ids: Tuple[int, ...]) -> Optional[Protected]:
    """Protect the image tokens fed to `model` (a language model) through `caches`, in every eviction tier."""
    tiers = [t for c in caches for t in getattr(c, "tiers", ()) if getattr(t, "per_head", False)]
    if not ids or not tiers:
        return None
    shared = Protected(ids)
    for c in caches:
        if hasattr(c, "tiers"):
            c.protected = shared
    for t in tiers:
        t.protected = shared
    install(model)
    return shared


def assign(cache, runs: Optional[Protected]) -> None:
    """`runs` for one cache (a batch layer) and its eviction tiers."""
    cache.protected = runs
    for t in cache.tiers:
        if getattr(t, "per_head", False):
            t.protected = runs


def stacked(caches) -> Optional[Protected]:
    """The runs of one-sequence caches (or batches) as the rows of one batch, in order; None: none has any."""
    found = [getattr(c, "protected", None) for c in caches]
    if all(p is None for p in found):
        return None
    ids = next(p.ids for p in found if p is not None)
    out = Protected(ids, 0)
    for c, p in zip(caches, found):  # host bookkeeping of a merge, never a decode step
        out = out.joined(p, 1 if c.rows is None else c.rows.seen.size)
    return out


def of(caches) -> Optional[Protected]:
    """The image-token runs a cache list records, if any."""
    return next((c.protected for c in caches or () if getattr(c, "protected", None) is not None), None)


def _observe(arg, args, kwargs) -> None:
    """Record where image placeholder ids are fed: calls that pass image embeddings (into the list's shared
    runs, or each batch layer's own)."""
    cache = arg("cache")
    inputs = args[0] if args else kwargs.get("inputs")
    if not isinstance(cache, (list, tuple)) or inputs is None or arg("inputs_embeds") is None:
        return
    owners = {id(c.protected): c for c in cache if getattr(c, "protected", None) is not None}
    for c in owners.values():
        c.protected.record(c.offset, inputs)


def install(model) -> None:
    """Wrap the language model class's __call__ to record where image placeholder ids are fed."""
    _WATCH.install(model, _observe)


def uninstall(model=None) -> None:
    """Restore the language model class's own __call__ (of `model`, or every class wrapped)."""
    _WATCH.uninstall(model)
