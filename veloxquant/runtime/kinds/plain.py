"""The fp16 recipe's layer at decode: mlx-lm KVCache's work and nothing else.

A layer whose plan is one unrouted 16-bit tier (nothing scored or settled,
`kinds.plain_tier`) appends to the tier's two buffers and reads them back here
(a sliding-window layer also forgets its oldest token here, at decode), without the codec calls of
`Tier.append` (two store encodes, a dict each) or `Tier.decoded`. Per decode step that leaves KVCache's MLX ops (two
slice updates, two slices, one SDPA) and 4 short Python calls per layer
(docs/kernels.md, "The fp16 path at KVCache's op count").
"""

import weakref
from typing import Tuple

import mlx.core as mx

from ...stages.store import SIXTEEN_BIT
from ..copying import copy_owned


class PlainRun:
    """Appends to and reads a plain 16-bit tier's buffers; the tier's own count/start stay true."""

    def __init__(self, tier):
        self._tier = weakref.ref(tier)  # the tier owns this run (Tier.plain): copying.copy_owned
        self.keys, self.values = tier.buffers["k"]["x"], tier.buffers["v"]["x"]
        self.stores = (tier.codecs["k"].store, tier.codecs["v"].store)

    def __deepcopy__(self, memo):
        return copy_owned(self, memo, "_tier")

    def append(self, keys: mx.array, values: mx.array, start: int) -> int:
        """Tier.append for this tier (same arrays held); returns the tokens added."""
        tier = self._tier()
        if not tier.count:
            tier.start = start
        if tier._views:
            tier._views = {}
        if keys.dtype not in SIXTEEN_BIT:  # float32 models: what the stores keep (fp16 rounds, identity not)
            keys, values = self.stores[0].encode(keys)["x"], self.stores[1].encode(values)["x"]
        self.keys.append(keys)
        self.values.append(values)
        n = keys.shape[2]
        tier.count += n
        return n

    def expire(self, oldest_visible: int) -> None:
        """Tier.expire for this tier (granularity 1): forget what no later query of the window sees."""
        tier = self._tier()
        n = min(tier.count, oldest_visible - tier.start)
        if n > 0:
            tier.drop_front(n)

    def fetch(self, dtype) -> Tuple[mx.array, mx.array]:
        """Tier.decoded: the held K and V as views of the buffers (a cast only if dtypes differ)."""
        k, v = self.keys.view(), self.values.view()
        return (k, v) if k.dtype == dtype else (k.astype(dtype), v.astype(dtype))
