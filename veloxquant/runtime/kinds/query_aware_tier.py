"""The query-aware tier kind: a Tier whose key store assigns codes by the queries it answered.

A2ATS's query-aware VQ (stages/qavq.py) weighs each key channel's error by how
much energy real queries put in its RoPE pair. The tier measures that from the
queries it answers (an exponential average over attention calls, per kv head)
and hands it to the key store when the next block arrives, so a key is
assigned by the recent real queries, never by itself standing in for a query.
Before the first query (the prompt's first block) the store falls back to the
calibration text's queries. The running energies are held as `state.energy`:
counted in the tier's bytes and saved with the cache.
"""

from typing import Optional

import mlx.core as mx

from ...compiler.plan import TierPlan
from ...stages.rope_pairs import pairs, unpairs
from .protocol import kind
from .tier import Tier

DECAY = 0.9  # weight of the energies so far at each attention call (~10 recent calls)


@kind("query_aware")
class QueryAwareTier(Tier):
    # Trimming would rewind the tokens but not the queries' running energies (an average, not a
    # log): refused, so a trimmed cache never continues from state it did not have at that point.
    can_rewind = False

    def __init__(self, plan: TierPlan, n_kv_heads: int, head_dim: int):
        super().__init__(plan)
        self.n_kv_heads = n_kv_heads

    def answer(self, queries: mx.array, scale: float, mask: Optional[mx.array] = None, hidden: int = 0):
        self._observe(queries)
        return super().answer(queries, scale, mask, hidden)

    def _observe(self, queries: mx.array) -> None:
        B, Hq, Lq, D = queries.shape
        q = queries.astype(mx.float32).reshape(B, self.n_kv_heads, Hq // self.n_kv_heads * Lq, D)
        energy = mx.mean(q * q, axis=(0, 2))  # [H, D]
        spec = self.codecs["k"].store._spec()
        a, b = pairs(energy, spec)
        energy = unpairs((a + b) / 2, (a + b) / 2, spec)  # a pair's energy is the same at every position
        energy = energy / mx.maximum(mx.mean(energy, axis=-1, keepdims=True), 1e-30)
        old = self.side_state.get("energy")
        self.side_state["energy"] = energy if old is None else DECAY * old + (1 - DECAY) * energy

    def append(self, keys: mx.array, values: mx.array, start: int, scores: Optional[mx.array] = None) -> None:
        if self.count == 0:
            self.start = start
        self._views = {}
        codec = self.codecs["k"]
        x = keys
        for t in codec.transforms:  # unrope: the store codes pre-RoPE keys
            x = codec._forward(t, x, start)
        for name, arr in codec.store.encode(x, self.side_state.get("energy")).items():
            self.buffers["k"][name].append(arr)
        for name, arr in self.codecs["v"].encode(values, start).items():
            self.buffers["v"][name].append(arr)
        self.count += keys.shape[2]
