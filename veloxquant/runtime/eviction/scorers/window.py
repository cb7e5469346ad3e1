"""SnapKV's vote: the last `window` prompt queries are kept until the prompt
ends; then each one's softmax over everything held is summed over the window
and the GQA group, max-pooled over `pool` neighbouring tokens, and the window
itself always stays.

In a batch (runtime/eviction/batch_heads.py) each row keeps its own last `window` real queries,
right-aligned ([B, Hq, window, D]; `nq` [B] of them are real, the rest zeros no weight is read from),
and its own `end`; a row that has decided lets its queries go."""

import mlx.core as mx
import numpy as np

from ..scoring import max_pool
from .base import QueryWindowScorer, scorer


@scorer("window")
class Window(QueryWindowScorer):
    def __init__(self, route):
        super().__init__(route)
        self.queries, self.end = None, 0  # the newest `window` queries; position after the last
        self.nq = None  # a batch's real queries per row (host ints); None: one sequence

    def observe(self, tier, seen):
        self.queries = self.keep_window(seen, self.route.window)
        self.end = seen.first_q + seen.queries.shape[2]

    def priority(self, tier, offset, weigh):
        if self.queries is None:
            return mx.zeros(tier.positions.shape, mx.float32)
        if self.nq is None:
            first = self.end - self.queries.shape[2]
            votes = weigh(self.queries, first)
        else:
            first = mx.array(self.end - self.route.window, dtype=mx.int32)
            votes = weigh(self.queries, first, mx.array(self.nq))
        votes = max_pool(votes, self.route.pool)
        return mx.where(tier.positions >= offset - self.route.window, mx.inf, votes)

    # --- batch rows ---------------------------------------------------------------
    def observe_rows(self, tier, seen, listening, real):
        w, q = self.route.window, seen.queries
        B, Hq, n, D = q.shape
        old = self.queries if self.queries is not None else mx.zeros((B, Hq, w, D), q.dtype)
        both = mx.concatenate([old.astype(q.dtype), q], axis=2)  # row b's newest real query at w + real_b - 1
        idx = mx.array(np.asarray(real)[:, None] + np.arange(w)[None], dtype=mx.int32)[:, None, :, None]
        new = mx.take_along_axis(both, mx.broadcast_to(idx, (B, Hq, w, D)), axis=2)
        self.queries = mx.contiguous(mx.where(mx.array(listening)[:, None, None, None], new, old.astype(q.dtype)))
        mx.async_eval(self.queries)
        self.nq = np.where(listening, np.minimum(self.nq + real, w), self.nq)
        self.end = np.where(listening, seen.first_q + real, self.end)

    def stack(self, parts, rows):
        w = self.route.window
        like = next((p.queries for p in parts if p.queries is not None), None)
        queries, nq, end = [], [], []
        for p, r in zip(parts, rows):
            held = p.queries
            if p.nq is None:  # one sequence: its queries right-aligned in the window
                nq.append(np.array([0 if held is None else held.shape[2]]))
                end.append(np.array([p.end]))
                if held is not None and held.shape[2] < w:
                    held = mx.pad(held, [(0, 0), (0, 0), (w - held.shape[2], 0), (0, 0)])
            else:
                nq.append(p.nq)
                end.append(p.end)
            if like is not None:
                queries.append(held if held is not None else mx.zeros((r, *like.shape[1:]), like.dtype))
        self.queries = mx.concatenate(queries, axis=0) if like is not None else None
        self.nq, self.end = np.concatenate(nq), np.concatenate(end)

    def keep_rows(self, rows):
        self.nq, self.end = self.nq[rows], self.end[rows]
        if self.queries is not None:
            self.queries = self.queries[mx.array(rows, dtype=mx.int32)] if len(rows) else None

    def take_row(self, batch, i):
        n = int(batch.nq[i])
        held = batch.queries
        self.queries = mx.contiguous(held[i : i + 1, :, held.shape[2] - n :]) if n and held is not None else None
        self.end = int(batch.end[i])

    def release_rows(self, rows):
        self.nq = np.where(rows, 0, self.nq)
        if self.queries is not None:
            self.queries = None if not self.nq.any() else mx.where(mx.array(rows)[:, None, None, None], 0, self.queries)
