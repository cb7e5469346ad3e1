"""A model's cache layout, read from its own make_cache() and layer wiring.

mlx-lm models hand layer i the i-th entry of make_cache()'s list. Three kinds of entry are read:
KVCache (full attention), RotatingKVCache(keep=0) (a sliding window), and the state caches of
non-attention layers (ArraysCache, MambaCache: linear attention, SSMs), which veloxquant passes
through untouched. A list shorter than the model's layers is read only where the model says which
cache each later layer attends over (`previous_kvs`, Gemma 4's KV sharing). Anything else is
refused, naming the layer and what was found: a cache list that does not match the model's own
runs with wrong attention and no error.

Cache classes are matched by name and module, so reading a layout does not import mlx-lm; mlx-vlm's
classes of the same names (mlx_vlm.models.cache, used by its language models) are read the same way.
"""

import threading
from typing import List, Optional, Tuple

import attrs

from ..errors import VeloxError

ATTENTION = "attention"
_MLX = ("mlx_lm.models.cache", "mlx_vlm.models.cache")
KEPT = ("ArraysCache", "MambaCache")  # non-attention state: passed through as mlx-lm made it
_reading = threading.local()  # ids of models whose make_cache() is being read (a replaced one may re-enter)


@attrs.frozen
class Layout:
    slots: Tuple[str, ...]  # per entry of make_cache(): ATTENTION or the class kept as is
    windows: Tuple[Optional[int], ...]  # per attention slot: sliding window, None = full attention
    readers: Tuple[Tuple[int, ...], ...]  # per attention slot: the model layers attending over it (owner first)

    @property
    def trivial(self) -> bool:
        """One attention cache per model layer, each read by its own layer (Llama, Gemma 3)."""
        return all(s == ATTENTION for s in self.slots) and all(r == (i,) for i, r in enumerate(self.readers))


def _mlx_class(cache) -> Optional[str]:
    """The mlx-lm cache class `cache` is exactly, or the kept class it derives from; None otherwise."""
    cls = type(cache)
    if cls.__module__ in _MLX and cls.__name__ in ("KVCache", "RotatingKVCache", *KEPT):
        return cls.__name__
    kept = [k.__name__ for k in cls.__mro__ if k.__module__ in _MLX and k.__name__ in KEPT]
    return kept[0] if kept else None


def _where(fn) -> str:
    code = getattr(fn, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else repr(fn)


def own_caches(model) -> Optional[list]:
    """The cache list the model itself makes, or None where it has no make_cache (one KVCache per layer).

    A make_cache replaced on the instance (`model.make_cache = lambda: veloxquant.make_prompt_cache(...)`)
    is not called: the class's own make_cache is read instead, so the replacement can call veloxquant."""
    replaced = "make_cache" in vars(model)
    fn = getattr(type(model), "make_cache", None)
    if fn is None:
        return None
    if id(model) in _active():
        raise VeloxError(
            f"{type(model).__name__}.make_cache ({_where(fn)}) calls veloxquant.make_prompt_cache, "
            "which reads the model's layout from that same make_cache: replace it on the model "
            "instance (model.make_cache = lambda: ...), not on its class, so the class's own "
            "make_cache still says which layers hold which cache"
        )
    _active().add(id(model))
    try:
        caches = list(fn(model))
    finally:
        _active().discard(id(model))
    made = [c for c in caches if type(c).__module__.startswith("veloxquant.")]
    if made:
        raise VeloxError(
            f"{type(model).__name__}.make_cache ({_where(fn)}) returns veloxquant caches, so it cannot "
            "say what the model's own layout is"
            + ("" if replaced else "; replace make_cache on the model instance instead of its class")
        )
    return caches


def _active() -> set:
    if not hasattr(_reading, "ids"):
        _reading.ids = set()
    return _reading.ids


def read(model, name: str = "model") -> Layout:
    """The model's layout (see the module docstring); a VeloxError for one veloxquant cannot read."""
    layers = list(model.layers)
    caches = own_caches(model)
    if caches is None:
        return Layout((ATTENTION,) * len(layers), (None,) * len(layers), tuple((i,) for i in range(len(layers))))
    if len(caches) > len(layers):
        raise VeloxError(
            f"{name}: make_cache() returns {len(caches)} caches for {len(layers)} layers; "
            "veloxquant reads one cache per layer"
        )
    slots, windows, owner_of_slot = [], [], {}
    for i, c in enumerate(caches):
        kind = _mlx_class(c)
        if kind == "RotatingKVCache" and getattr(c, "keep", 0):
            raise VeloxError(
                f"layer {i} of {name} uses RotatingKVCache(keep={c.keep}) (a window that keeps its "
                "first tokens); veloxquant reads sliding windows with keep=0 only"
            )
        if kind is None:
            raise VeloxError(
                f"layer {i} of {name} uses {type(c).__module__}.{type(c).__name__}, a cache veloxquant "
                "cannot read (it reads mlx-lm's and mlx-vlm's KVCache, RotatingKVCache(keep=0), "
                "and passes "
                f"{' and '.join(KEPT)} of non-attention layers through)"
            )
        if kind in KEPT:
            slots.append(kind)
            continue
        owner_of_slot[i] = len(windows)
        slots.append(ATTENTION)
        windows.append(int(c.max_size) if kind == "RotatingKVCache" else None)
    if not windows:
        raise VeloxError(
            f"{name}: no layer of make_cache() holds an attention cache (found "
            f"{', '.join(sorted(set(slots)))}): there is nothing for a recipe to compress"
        )
    readers: List[List[int]] = [[i] for i, s in enumerate(slots) if s == ATTENTION]
    for j, slot in _shared_layers(model, layers, len(caches), name):
        if slot not in owner_of_slot:
            raise VeloxError(
                f"layer {j} of {name} attends over layer {slot}'s cache, which is "
                f"{slots[slot] if slot < len(slots) else 'missing'}, not an attention cache"
            )
        mine, theirs = getattr(layers[j], "layer_type", None), getattr(layers[slot], "layer_type", None)
        if mine != theirs:
            raise VeloxError(
                f"layer {j} of {name} ({mine}) attends over layer {slot}'s cache ({theirs}): "
                "veloxquant reads shared caches of the same attention type only"
            )
        readers[owner_of_slot[slot]].append(j)
    return Layout(tuple(slots), tuple(windows), tuple(tuple(r) for r in readers))


def _shared_layers(model, layers, n_caches: int, name: str):
    """(layer, cache it attends over) for the layers past the cache list (Gemma 4's KV-shared layers)."""
    if n_caches == len(layers):
        return []
    wiring = next(
        (
            m.previous_kvs
            for _, m in model.named_modules()
            if isinstance(getattr(m, "previous_kvs", None), list) and len(m.previous_kvs) == len(layers)
        ),
        None,
    )
    if wiring is None:
        rest = f"layer {n_caches}" if n_caches == len(layers) - 1 else f"layers {n_caches}-{len(layers) - 1}"
        raise VeloxError(
            f"{name}: make_cache() returns {n_caches} caches for {len(layers)} layers, and veloxquant "
            f"cannot read which cache {rest} attend over (it reads Gemma 4's `previous_kvs`)"
        )
    for i in range(n_caches):
        if wiring[i] != i:
            raise VeloxError(
                f"layer {i} of {name} has its own cache but attends over layer {wiring[i]}'s "
                "(previous_kvs); veloxquant cannot read that wiring"
            )
    return [(j, int(wiring[j])) for j in range(n_caches, len(layers))]
