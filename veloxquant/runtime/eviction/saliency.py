"""ZipCache's normalized attention score (and AdaKV's per-head entropy), gathered for a scored tier.

Tokens wait in the tier before the salient one (an fp16 window) until they
spill into it. While they wait, every real query attends to them: a token's
score is the attention probability it received, summed over the query heads
of its kv head and over queries, divided by the number of queries that could
see it (ZipCache, arXiv:2405.14256: early tokens are seen by more queries and
would win on raw sums). When a chunk spills, the salient store gets those
scores and routes the chunk's tokens by them. A `headbits` store instead gets
each kv head's mean attention entropy over the waiting tokens, once.

The running sums are held by the salient tier (`state.*` arrays: counted in
its bytes and saved with the cache, so a loaded cache continues identically).
Layers with a salient tier attend through explicit float32 partials, a block
of queries at a time (the probabilities need the softmax normaliser over
everything held), never [heads x queries x keys] for a whole long prompt.
"""

import weakref
from typing import List, Optional

import mlx.core as mx

from ...errors import VeloxError
from .. import layer_attention
from ..copying import copy_owned
from .scoring import position_mask

QUERY_BLOCK = 128


class Saliency:
    def __init__(self, cache, index: int):
        self._cache = weakref.ref(cache)  # the cache owns its saliency (copying.copy_owned)
        self.index = index  # the salient tier; index - 1 feeds it

    def __deepcopy__(self, memo):
        return copy_owned(self, memo, "_cache")

    @property
    def cache(self):
        return self._cache()

    @classmethod
    def attach(cls, cache) -> Optional["Saliency"]:
        for i, t in enumerate(cache.plan.tiers):
            if i and not t.drops and any(getattr(c.store, "scored", False) for c in (t.keys, t.values)):
                return cls(cache, i)
        return None

    @property
    def _state(self):
        return self.cache.tiers[self.index].side_state

    def attend(self, held: List, queries: mx.array, scale: float, first_q: int, observe: bool) -> mx.array:
        cache, Lq = self.cache, queries.shape[2]
        outs = []
        for s in range(0, Lq, QUERY_BLOCK):
            q = queries[:, :, s : s + QUERY_BLOCK]
            out, lse = layer_attention.partial(cache, held, q, scale, first_q + s)
            outs.append(out)
            if observe:
                self._observe(q, lse, scale, first_q + s)
        return mx.concatenate(outs, axis=2).astype(queries.dtype) if len(outs) > 1 else outs[0].astype(queries.dtype)

    def _observe(self, q: mx.array, lse: mx.array, scale: float, first_q: int) -> None:
        feeder = self.cache.tiers[self.index - 1]
        if not feeder.count:
            return
        k = feeder.decoded(mx.float32)[0]  # [B, Hkv, n, D]: the waiting tokens (an fp16 window)
        B, Hkv, n, D = k.shape
        Hq, Lq = q.shape[1], q.shape[2]
        rep = Hq // Hkv
        mask = position_mask(mx.arange(feeder.start, feeder.end), first_q, Lq, self.cache._window(feeder))
        logits = (q.astype(mx.float32).reshape(B, Hkv, rep, Lq, D) * scale) @ k[:, :, None].swapaxes(-1, -2)
        p = mx.where(mask, mx.exp(logits - lse.reshape(B, Hkv, rep, Lq)[..., None]), 0.0)
        self._add(feeder.start, p.sum(axis=(2, 3)), mask.sum(axis=0).astype(mx.float32))
        # Per kv head: the entropy the window's tokens contribute to each query's attention (headbits)
        entropy = -mx.sum(p * mx.log(mx.maximum(p, 1e-30)), axis=(2, 3, 4))
        st = self._state
        st["entropy"] = entropy + st["entropy"] if "entropy" in st else entropy
        st["queries"] = st.get("queries", mx.zeros((1,))) + rep * Lq
        # Per kv head and channel: the sum of squared queries (skvq weighs its clip search by it)
        q2 = mx.sum(q.astype(mx.float32).reshape(B, Hkv, rep * Lq, D) ** 2, axis=2)
        st["q2"] = q2 + st["q2"] if "q2" in st else q2

    def _add(self, start: int, received: mx.array, seen: mx.array) -> None:
        """Fold sums for positions start.. into the running sums (extended with zeros, aligned)."""
        st = self._state
        n = received.shape[-1]
        if "received" not in st or int(st["start"][0]) + st["received"].shape[-1] <= start:
            st.update(received=received, seen=seen, start=mx.array([start], dtype=mx.int32))
            return
        old_start = int(st["start"][0])
        keep = start - old_start  # positions before `start` have spilled already or wait unseen now
        old_r, old_s = st["received"][..., keep:], st["seen"][keep:]
        m = old_r.shape[-1]
        pad = n - m
        r = received + mx.concatenate([old_r, mx.zeros((*old_r.shape[:-1], pad))], axis=-1) if pad >= 0 else None
        s = seen + mx.concatenate([old_s, mx.zeros((pad,))]) if pad >= 0 else None
        if r is None:  # the window shrank (a trim): keep only what it holds
            r, s = received + old_r[..., :n], seen + old_s[:n]
        st.update(received=r, seen=s, start=mx.array([start], dtype=mx.int32))

    def scores_for(self, start: int, n: int) -> mx.array:
        """What the salient tier's store routes by: per-token scores, or per-head entropy (headbits)."""
        stores = [c.store for c in (self.cache.plan.tiers[self.index].keys, self.cache.plan.tiers[self.index].values)]
        kinds = [getattr(s, "scored", None) for s in stores]
        if "channels" in kinds:  # the same for keys and values: a tier scores one way
            return self._state["q2"] / self._state["queries"] if "q2" in self._state else None
        if "heads" in kinds:
            st = self._state
            if "entropy" not in st:
                raise VeloxError("headbits allocates bits before any attention was observed (is the hook installed?)")
            return st["entropy"] / st["queries"]
        return self.take(start, n)

    def take(self, start: int, n: int) -> mx.array:
        """Normalized scores [B, Hkv, n] of positions start.., which leave the window now."""
        st = self._state
        if "received" not in st:
            raise VeloxError("salient tokens arrived before any attention was observed (is the hook installed?)")
        at = start - int(st["start"][0])
        if at < 0 or at + n > st["received"].shape[-1]:
            raise VeloxError(f"no saliency gathered for positions {start}..{start + n}")
        scores = st["received"][..., at : at + n] / mx.maximum(st["seen"][at : at + n], 1.0)
        st.update(
            received=st["received"][..., at + n :],
            seen=st["seen"][at + n :],
            start=mx.array([start + n], dtype=mx.int32),
        )
        return scores
