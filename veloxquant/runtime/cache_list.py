"""The list mlx-lm is handed, laid out as the model's own make_cache() lays it out (compiler/layout.py).

The recipe's caches sit in the attention entries; a non-attention layer's state cache (ArraysCache,
MambaCache) is the model's own, passed through untouched; caches that later layers attend over are
marked as lending (runtime/shared_kv.py). For the usual layout the list is just the recipe's caches.
"""

from typing import List, Optional

from ..compiler import Plan
from ..compiler.layout import ATTENTION
from ..errors import VeloxError
from .cache import TieredCache


def assemble(plan: Plan, caches: List[TieredCache], kept: Optional[list]) -> list:
    """`caches` (one per attention cache of the plan) in the model's cache list; `kept`: the model's
    own cache list (or one restored from a file), whose non-attention entries are passed through."""
    shape = plan.shape
    if shape.trivial_layout:
        return caches
    out, attention = [], iter(caches)
    for slot, kind in enumerate(shape.slots):
        if kind == ATTENTION:
            out.append(next(attention))
            continue
        own = kept[slot] if kept is not None and slot < len(kept) else None
        if own is None or type(own).__name__ != kind:
            found = "nothing" if own is None else type(own).__name__
            raise VeloxError(
                f"layer {slot}: the plan keeps the model's own {kind} there, but the model's cache "
                f"list has {found} (the model is not the one the plan was made for)"
            )
        out.append(own)
    for cache, readers in zip(caches, shape.readers):
        cache.lends = len(readers) > 1
    return out


def recipe_caches(caches: list) -> List[TieredCache]:
    """The caches a recipe runs, out of a model's cache list (mixed for hybrid models)."""
    return [c for c in caches if isinstance(c, TieredCache)]


def kept_caches(caches: list) -> list:
    """(slot, cache) of the entries passed through as the model made them."""
    return [(i, c) for i, c in enumerate(caches) if not isinstance(c, TieredCache)]
