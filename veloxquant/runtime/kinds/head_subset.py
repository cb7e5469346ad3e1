"""The head-subset tier kind: a tier that holds some kv heads only (DuoAttention's retrieval heads).

What reaches the tier is held for the kept heads ([B, kept, L, D] through the tier's codec); the
other heads' tokens are let go, so its bytes are the kept heads' alone. Attention takes the kept
heads' query heads (one gather), answers their partial as an ordinary tier would, and gives the
other query heads an empty partial (lse = -inf: weight 0 in the exact merge with the tiers
before it), scattered back by one precomputed index: no per-head loop. Without the attention
hook (the route needs it) `decoded` would need a per-head mask, so the plan refuses that mode.
"""

from typing import Dict, Optional, Tuple

import mlx.core as mx
import numpy as np

from ...compiler.plan import TierPlan
from ...kernels.partials import partial_attention
from .protocol import kind
from .tier import Tier, front_mask


@kind("heads")
class HeadSubsetTier(Tier):
    def __init__(self, plan: TierPlan, n_kv_heads: int, head_dim: int):
        super().__init__(plan)
        self.kept = tuple(int(h) for h in plan.route.kept_heads(n_kv_heads))
        self.n_kv_heads = n_kv_heads
        self.whole = len(self.kept) == n_kv_heads  # every head kept: an ordinary tier
        self.kept_index: Optional[mx.array] = None  # made with the first tokens: a fresh cache holds nothing
        self._maps: Dict[int, Tuple[mx.array, mx.array]] = {}  # query heads -> (kept query heads, scatter index)

    def append(self, keys: mx.array, values: mx.array, start: int, scores: Optional[mx.array] = None) -> None:
        if not self.kept:
            return  # every head of this layer streams: nothing held here
        if not self.whole:
            if self.kept_index is None:
                self.kept_index = mx.array(self.kept, mx.int32)
            keys, values = mx.take(keys, self.kept_index, axis=1), mx.take(values, self.kept_index, axis=1)
        super().append(keys, values, start, scores)

    def _query_maps(self, n_query_heads: int) -> Tuple[mx.array, mx.array]:
        """(the kept kv heads' query heads, for each query head its row in the kept answer or the empty row)."""
        if n_query_heads not in self._maps:
            rep = n_query_heads // self.n_kv_heads
            picked = (np.array(self.kept)[:, None] * rep + np.arange(rep)[None, :]).reshape(-1)
            back = np.full(n_query_heads, picked.size, np.int32)
            back[picked] = np.arange(picked.size)
            self._maps[n_query_heads] = (mx.array(picked.astype(np.int32)), mx.array(back))
        return self._maps[n_query_heads]

    def answer(self, queries: mx.array, scale: float, mask: Optional[mx.array] = None, hidden: int = 0):
        if self.whole:
            return super().answer(queries, scale, mask, hidden)
        picked, back = self._query_maps(queries.shape[1])
        mine = mx.take(queries, picked, axis=1)
        inner = super().answer(mine, scale, mask, hidden)

        def scattered():
            out, lse = inner() if inner is not None else self._own(mine, scale, mask, hidden)
            B, _, Lq, D = out.shape
            out = mx.concatenate([out, mx.zeros((B, 1, Lq, D), out.dtype)], axis=1)
            lse = mx.concatenate([lse, mx.full((B, 1, Lq), -mx.inf, lse.dtype)], axis=1)
            return mx.take(out, back, axis=1), mx.take(lse, back, axis=1)

        return scattered

    @property
    def nbytes(self) -> int:
        """The kept heads' arrays, and the head index arrays held beside them."""
        index = (self.kept_index.nbytes if self.kept_index is not None else 0) + sum(
            a.nbytes for pair in self._maps.values() for a in pair
        )
        return super().nbytes + index

    def _own(self, queries: mx.array, scale: float, mask, hidden: int):
        if hidden:
            mask = front_mask(self.count, hidden)
        k, v = super().decoded(self.buffers["k"]["x"].view().dtype if self.sixteen_bit else mx.float32)
        return partial_attention(queries, k, v, scale, mask)

    def decoded(self, dtype) -> Tuple[mx.array, mx.array]:
        """All heads' K/V (the streaming heads' rows zero): the shape the cache's lazy fetch concatenates;
        never attended to (the route needs the hook, whose attention takes the partial above)."""
        k, v = super().decoded(dtype)
        if self.whole:
            return k, v
        back = np.full(self.n_kv_heads, len(self.kept), np.int32)
        back[list(self.kept)] = np.arange(len(self.kept))
        index = mx.array(back)
        pad = lambda x: mx.take(mx.concatenate([x, mx.zeros_like(x[:, :1])], axis=1), index, axis=1)  # noqa: E731
        return pad(k), pad(v)
