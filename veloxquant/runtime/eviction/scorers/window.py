"""SnapKV's vote: the last `window` prompt queries are kept until the prompt
ends; then each one's softmax over everything held is summed over the window
and the GQA group, max-pooled over `pool` neighbouring tokens, and the window
itself always stays."""

import mlx.core as mx

from ..scoring import max_pool
from .base import QueryWindowScorer, scorer


@scorer("window")
class Window(QueryWindowScorer):
    def __init__(self, route):
        super().__init__(route)
        self.queries, self.end = None, 0  # the newest `window` queries; position after the last

    def observe(self, tier, seen):
        self.queries = self.keep_window(seen, self.route.window)
        self.end = seen.first_q + seen.queries.shape[2]

    def priority(self, tier, offset, weigh):
        if self.queries is None:
            return mx.zeros(tier.positions.shape, mx.float32)
        votes = max_pool(weigh(self.queries, self.end - self.queries.shape[2]), self.route.pool)
        return mx.where(tier.positions >= offset - self.route.window, mx.inf, votes)
