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
    """The image-token runs of one cache list (shared by its layers' eviction tiers)."""

    def __init__(self, ids: Tuple[int, ...]):
        self.ids = tuple(ids)
        self.runs: List[Tuple[int, int]] = []
        self.seen = 0  # positions fed through the model when last recorded

    def record(self, offset: int, inputs) -> None:
        """Positions [offset, offset + n) were fed with `inputs` (ids [B, n] or [n])."""
        ids = np.asarray(inputs).reshape(-1, np.asarray(inputs).shape[-1])
        self.runs = [(s, min(e, offset)) for s, e in self.runs if s < offset]  # a rewind forgets newer runs
        hit = np.isin(ids, self.ids).any(axis=0).astype(np.int8)
        edges = np.flatnonzero(np.diff(np.concatenate([[0], hit, [0]])))
        self.runs += [(offset + int(s), offset + int(e)) for s, e in zip(edges[::2], edges[1::2])]
        self.seen = offset + ids.shape[1]

    @property
    def count(self) -> int:
        return sum(e - s for s, e in self.runs)

    def held(self, offset: Optional[int] = None, window: Optional[int] = None) -> int:
        """Image tokens a head still sees at `offset` (all of them without a sliding window)."""
        if not window:
            return self.count
        lo = (self.seen if offset is None else offset) - window + 1
        return sum(max(0, e - max(s, lo)) for s, e in self.runs)

    def mask(self, positions: mx.array) -> mx.array:
        """True where `positions` (any shape) fall in an image run (one comparison per image, not per token)."""
        out = mx.zeros(positions.shape, mx.bool_)
        for s, e in self.runs:
            out = out | ((positions >= s) & (positions < e))
        return out


def room(tier, budget: int, offset: Optional[int] = None) -> int:
    """`budget` plus the image tokens the tier keeps on top of it, at most the tier's sliding window."""
    extra = tier.protected.held(offset, tier.window) if tier.protected is not None else 0
    return min(budget + extra, tier.window) if tier.window and extra else budget + extra


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


def of(caches) -> Optional[Protected]:
    """The image-token runs a cache list records, if any."""
    return next((c.protected for c in caches or () if getattr(c, "protected", None) is not None), None)


def _observe(arg, args, kwargs) -> None:
    """Record where image placeholder ids are fed: calls that pass image embeddings."""
    cache = arg("cache")
    runs = of(cache) if isinstance(cache, (list, tuple)) else None
    inputs = args[0] if args else kwargs.get("inputs")
    if runs is not None and inputs is not None and arg("inputs_embeds") is not None:
        first = next(c for c in cache if getattr(c, "protected", None) is runs)
        runs.record(first.offset, inputs)


def install(model) -> None:
    """Wrap the language model class's __call__ to record where image placeholder ids are fed."""
    _WATCH.install(model, _observe)


def uninstall(model=None) -> None:
    """Restore the language model class's own __call__ (of `model`, or every class wrapped)."""
    _WATCH.uninstall(model)
