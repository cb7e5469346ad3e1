"""Eviction stages: a tier that keeps a budget of tokens per head, chosen by score.

Each kv head keeps its own token set, so these tiers store positions per
(batch, head). Scores come from the attention the model really computes
(`attend` sees the real queries); `score=proxy` uses keys as queries instead,
the approximation other libraries ship, so the two can be compared.
"""

import attrs

from .registry import choices, in_range, stage
from .scorers import check_params, selectable

# Budgets the per-model coordinator allocates once, at the end of the prompt, from the
# attention each token received (runtime/eviction/allocation.py); the same four fields on evict and snap.
LAYER_RULES = ("fixed", "squeeze")
HEAD_RULES = ("equal", "adakv", "score")


def _sinks_below_budget(instance, attribute, value):
    if value >= instance.budget:
        raise ValueError(f"sinks={value} must be smaller than budget={instance.budget}")


class _PerHeadRoute:
    """Takes every token offered; the tier itself decides what leaves (nothing spills on)."""

    bounded = False
    spills = False
    takes_below = None
    per_head = True
    slack = 0  # tokens past the budget before a cut; `evict` makes it a field (the others cut exactly)

    def spill(self, held: int, chunk: int) -> int:
        return 0


def _room_after_protected(route) -> None:
    """The first `sinks` and newest `recent` tokens are never evicted: the budget must hold one more."""
    if route.sinks + route.recent >= route.budget:
        raise ValueError(f"sinks={route.sinks} plus recent={route.recent} leave no room in budget={route.budget}")


def _known_scorer(instance, attribute, value):
    # declared in stages/scorers.py; SnapKV's vote is the `snap` stage, KVzip's model pass `reconstruct`
    allowed = selectable()
    if value not in allowed:
        raise ValueError(f"must be one of {', '.join(allowed)}")


@stage("evict", "route", needs=("attention",))
@attrs.frozen
class Evict(_PerHeadRoute):
    """Keeps `budget` tokens per head, the highest by `score`; every step, or once at the end of the prompt.

    score (declared with its parameters in stages/scorers.py, run by runtime/eviction/scorers/): mass (H2O, accumulated
    attention), mean (mass / queries that saw the token: kvpress's
    ObservedAttention), current (TOVA), proxy (keys as queries), knorm,
    keydiff, lagkv (LagKV: lag-relative, chunk = its lag), qfilters,
    expected (ExpectedAttention), keyformer, morph
    (MorphKV), chunk (ChunkKV), curd (CurDKV).
    once=true: rank once, when the prompt ends, then append (kvpress's
    protocol); false: keep the budget every step (the papers' decode loop).
    The first `sinks` positions and the newest `recent` are never evicted.
    slack (every-step routes): a head may grow to budget + slack tokens before
    it is cut back to budget, so ranking and gathering run once per `slack`
    decode steps instead of every step (held tokens, and bytes, range from
    budget to budget + slack; 0 = the papers' one token per step).
    window: queries a scorer looks back on (morph rows, expected/qfilters
    statistics); tau: keyformer's noise temperature; chunk: chunkkv's chunk
    size; rank: curdkv's rank cap; pool: max-pool `mean` scores over that
    many neighbouring tokens (SnapKV's smoothing).
    shared_heads=true: rank by the score averaged over the layer's kv heads,
    so every head keeps the same tokens (kvpress's TOVA averages over heads).
    votes (once routes): share of each head's budget that goes first to the
    tokens SnapKV's vote picks (the last `vote_window` prompt queries,
    max-pooled over `vote_pool`); the rest by `score` (runtime/eviction/scorers/votes.py).
    """

    budget: int = attrs.field(default=256, validator=in_range(1, 1 << 24))
    sinks: int = attrs.field(default=4, validator=[in_range(0, 1 << 20), _sinks_below_budget])
    score: str = attrs.field(default="mass", validator=_known_scorer)
    recent: int = attrs.field(default=0, validator=in_range(0, 1 << 24))
    once: bool = False
    slack: int = attrs.field(default=0, validator=in_range(0, 1 << 20))
    shared_heads: bool = False
    window: int = attrs.field(default=8, validator=in_range(1, 1 << 16))
    tau: float = attrs.field(default=1.0, validator=in_range(0.0, 1e6))
    chunk: int = attrs.field(default=8, validator=in_range(1, 1 << 16))
    rank: int = attrs.field(default=16, validator=in_range(1, 1 << 16))
    pool: int = attrs.field(default=1, validator=in_range(1, 1 << 10))
    layers: str = attrs.field(default="fixed", validator=choices(*LAYER_RULES))
    strength: float = attrs.field(default=0.0, validator=in_range(0.0, 16.0))
    heads: str = attrs.field(default="equal", validator=choices(*HEAD_RULES))
    alpha: float = attrs.field(default=0.2, validator=in_range(0.0, 1.0))
    beta: float = attrs.field(default=3.0, validator=in_range(0.0, 1e3))
    kappa: float = attrs.field(default=10.0, validator=in_range(0.0, 1e3))
    merge: str = attrs.field(default="drop", validator=choices("drop", "prominence", "sample"))
    targets: int = attrs.field(default=4, validator=in_range(1, 1 << 10))
    votes: float = attrs.field(default=0.0, validator=in_range(0.0, 1.0))
    vote_window: int = attrs.field(default=32, validator=in_range(1, 1 << 16))
    vote_pool: int = attrs.field(default=7, validator=in_range(1, 1 << 10))

    @property
    def floor(self) -> int:
        """The smallest budget an allocation may give a head: its protected tokens and one more."""
        return self.sinks + self.recent + 1

    def __attrs_post_init__(self):
        _room_after_protected(self)
        check_params(self, {f.name: f.default for f in attrs.fields(type(self))})
        if self.slack and self.once:
            raise ValueError(f"slack={self.slack} needs once=false (a `once` route cuts a single time)")
        if self.votes > 0 and not self.once:
            raise ValueError(f"votes={self.votes} needs once=true (the window votes once, when the prompt ends)")
        if self.merge != "drop" and self.heads != "equal":
            raise ValueError(f"merge={self.merge} needs heads=equal (merging into ragged heads is not built)")


@stage("snap", "route", needs=("attention",))
@attrs.frozen
class Snap(_PerHeadRoute):
    """SnapKV: once, at the end of the prompt, keeps `budget` tokens per head.

    The last `window` prompt queries vote (their attention, max-pooled over
    `pool` neighbouring tokens); the window itself and the first `sinks`
    positions are always kept; later tokens are appended and never evicted.
    layers, strength, heads, alpha: budget allocation, as for `evict`.
    """

    budget: int = attrs.field(default=256, validator=in_range(1, 1 << 24))
    window: int = attrs.field(default=32, validator=in_range(1, 1 << 16))
    pool: int = attrs.field(default=7, validator=in_range(1, 1 << 10))
    sinks: int = attrs.field(default=0, validator=[in_range(0, 1 << 20), _sinks_below_budget])
    layers: str = attrs.field(default="fixed", validator=choices(*LAYER_RULES))
    strength: float = attrs.field(default=0.0, validator=in_range(0.0, 16.0))
    heads: str = attrs.field(default="equal", validator=choices(*HEAD_RULES))
    alpha: float = attrs.field(default=0.2, validator=in_range(0.0, 1.0))

    once = True
    score = "window"

    @property
    def floor(self) -> int:
        return max(self.window + self.sinks, 1)

    def __attrs_post_init__(self):
        if self.window + self.sinks > self.budget:
            raise ValueError(f"window={self.window} plus sinks={self.sinks} exceed budget={self.budget}")
