"""Saving and restoring the state caches a hybrid model's non-attention layers keep (ArraysCache,
MambaCache), which veloxquant passes through untouched: their arrays go in the cache file beside the
recipe's (named `s{layer}.{entry}`, covered by the same checksums), rebuilt as the same mlx-lm class."""

from typing import Dict, List, Tuple

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from ..compiler.layout import KEPT
from ..errors import VeloxError

_BATCH = ("left_padding", "lengths")  # set only while mlx-lm's BatchGenerator runs the cache


def save(kept: List[Tuple[int, object]], arrays: Dict[str, mx.array]) -> List[Dict]:
    """Add each kept cache's arrays to `arrays`; returns what the file's metadata records of them."""
    out = []
    for slot, c in kept:
        if any(getattr(c, name, None) is not None for name in _BATCH):
            raise VeloxError(
                f"layer {slot}: its {type(c).__name__} is in the middle of a batch (left padding or "
                "lengths set); save a cache of one sequence"
            )
        held = [j for j, a in enumerate(c.cache) if a is not None]
        for j in held:
            arrays[f"s{slot}.{j}"] = c.cache[j]
        out.append({"layer": slot, "class": type(c).__name__, "size": len(c.cache), "held": held})
    return out


def load(records: List[Dict], arrays: Dict[str, mx.array], n_slots: int) -> List[object]:
    """The model's cache list with the kept caches restored in their layers (None in the others)."""
    kept: List[object] = [None] * n_slots
    for r in records:
        cls = getattr(mlx_cache, r["class"], None) if r["class"] in KEPT else None
        if cls is None or not 0 <= r["layer"] < n_slots:
            raise ValueError(
                f"layer {r['layer']}: {r['class']} is not a state cache veloxquant keeps "
                "(or this mlx-lm has no such class)"
            )
        c = cls(int(r["size"]))
        for j in r["held"]:
            c.cache[j] = arrays[f"s{r['layer']}.{j}"]
        kept[r["layer"]] = c
    return kept
