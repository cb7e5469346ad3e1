"""Index and mask arrays built from a batch's host counts, built once and shared by every layer.

Every layer of a batch holds the same per-row counts, so a decode step would otherwise build the
same column indices and masks once per layer (and per held array); a few recent ones are kept,
keyed by the counts' bytes. They depend on host numbers alone, never on a layer's arrays.
"""

from collections import OrderedDict
from typing import Callable, Hashable

import mlx.core as mx

_KEPT: "OrderedDict[Hashable, object]" = OrderedDict()
_KEEP = 64  # a step asks for a handful (per tier kind and unit size); a few steps' worth


def shared(key: Hashable, build: Callable[[], object]):
    """build()'s result, built once for `key` while it is among the recent ones."""
    found = _KEPT.get(key)
    if found is None:
        found = _KEPT[key] = build()
        if len(_KEPT) > _KEEP:
            _KEPT.popitem(last=False)
    else:
        _KEPT.move_to_end(key)
    return found


def widen(cond: mx.array, ndim: int) -> mx.array:
    """[B, W] -> [B, 1, W, 1, ...] against [B, H, W, ...] arrays."""
    return cond.reshape(cond.shape[0], 1, cond.shape[1], *([1] * (ndim - 3)))
