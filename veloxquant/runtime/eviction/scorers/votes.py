"""SnapKV's window votes beside any `once` score: a share of each head's budget.

Accumulated scores (`mean`, kvpress's ObservedAttention) keep what the whole
prompt read, which is best for the continuation's perplexity, but a needle
read only by the prompt's last queries (the question at its end) carries
little of that mass and is lost. SnapKV's vote (`window.py`: the last
`vote_window` queries' softmax, max-pooled over `vote_pool` tokens) finds it.
With `votes=s` on a `once` evict route, each head first keeps the round(s x
budget) tokens the window votes for most (the window itself among them: its
votes are infinite), then fills the rest of its budget by its own score:
the union of two shares of the budget, ranked once, at the end of the prompt
(as kvpress composes presses, and as SnapKV keeps its window).

votes=0 is the plain score (the route is not wrapped at all); votes=1 keeps
the top of the votes alone, SnapKV's ranking (`snap`), bit for bit.
"""

from types import SimpleNamespace

import mlx.core as mx

from .base import Scorer
from .window import Window


class Voted(Scorer):
    """`base` ranks, except that each head's top round(votes x budget) window votes rank first."""

    def __init__(self, route, base: Scorer):
        super().__init__(route)
        self.base = base
        self.window = Window(SimpleNamespace(window=route.vote_window, pool=route.vote_pool))
        self.name = base.name
        self.alone = route.votes >= 1  # the whole budget by vote: the score is neither fed nor read
        self.needs = frozenset({"queries"}) if self.alone else base.needs | {"queries"}
        self.rows = base.rows
        self.token_state = base.token_state

    def initial(self, keys):
        return self.base.initial(keys)

    def observe(self, tier, seen):
        if not self.alone:
            self.base.observe(tier, seen)
        self.window.observe(tier, seen)

    def priority(self, tier, offset, weigh):
        if weigh is None or self.window.queries is None:  # no vote to take (a head allocation asking early)
            return self.base.priority(tier, offset, weigh)
        votes = self.window.priority(tier, offset, weigh)
        if self.alone:
            return votes
        return union(self.base.priority(tier, offset, weigh), votes, self.shares(tier))

    def shares(self, tier) -> mx.array:
        """[H] tokens each head keeps by vote: round(votes x its budget)."""
        budgets = mx.array(tier.head_budgets(), mx.float32)
        return mx.round(budgets * self.route.votes).astype(mx.int32)

    def state(self):
        out = dict(self.base.state())
        out.update({f"votes.{k}": v for k, v in self.window.state().items()})
        return out

    def load(self, arrays):
        self.base.load({k: v for k, v in arrays.items() if not k.startswith("votes.")})
        self.window.load({k[len("votes.") :]: v for k, v in arrays.items() if k.startswith("votes.")})

    def release(self):
        self.base.release()
        self.window.release()

    def rewind(self, n):
        self.base.rewind(n)
        self.window.rewind(n)

    @property
    def nbytes(self):
        return self.base.nbytes + self.window.nbytes


def ranks(x: mx.array) -> mx.array:
    """Each token's rank within its head, 0 = lowest, as float32 (exact below 2^24 tokens)."""
    return mx.argsort(mx.argsort(x, axis=-1), axis=-1).astype(mx.float32)


def union(score: mx.array, votes: mx.array, shares: mx.array) -> mx.array:
    """[B, H, L]: the `shares[h]` highest votes of head h outrank every other token (in vote order);
    the rest keep their order by `score`. Ranks, not values, so the two scales never mix."""
    L = score.shape[-1]
    vote_rank = ranks(votes)  # L - 1 = the highest vote
    chosen = vote_rank >= (L - shares)[None, :, None].astype(mx.float32)
    return mx.where(chosen, L + vote_rank, ranks(score))
