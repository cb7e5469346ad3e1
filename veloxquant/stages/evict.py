"""Eviction stages: a tier that keeps a budget of tokens per head, chosen by score.

Each kv head keeps its own token set, so these tiers store positions per
(batch, head). Scores come from the attention the model really computes
(`attend` sees the real queries); `score=proxy` uses keys as queries instead,
the approximation other libraries ship, so the two can be compared.
"""
import attrs

from .registry import choices, in_range, stage


def _sinks_below_budget(instance, attribute, value):
    if value >= instance.budget:
        raise ValueError(f"sinks={value} must be smaller than budget={instance.budget}")


class _PerHeadRoute:
    """Takes every token offered; the tier itself decides what leaves (nothing spills on)."""
    bounded = False
    spills = False
    per_head = True

    def take(self, start: int, count: int, held: int) -> int:
        return count

    def spill(self, held: int, chunk: int) -> int:
        return 0


@stage("evict", "route", needs=("attention",))
@attrs.frozen
class Evict(_PerHeadRoute):
    """Keeps `budget` tokens per head; evicts the lowest-scoring ones every step.

    score=mass: attention received so far, accumulated (H2O);
    score=current: attention from the newest query only (TOVA, memoryless);
    score=proxy: accumulated attention with the new keys standing in for queries.
    The first `sinks` positions and the newest `recent` are never evicted
    (H2O's paper splits its budget between heavy hitters and recent tokens).
    """
    budget: int = attrs.field(default=256, validator=in_range(1, 1 << 24))
    sinks: int = attrs.field(default=4, validator=[in_range(0, 1 << 20), _sinks_below_budget])
    score: str = attrs.field(default="mass", validator=choices("mass", "current", "proxy"))
    recent: int = attrs.field(default=0, validator=in_range(0, 1 << 24))

    def __attrs_post_init__(self):
        if self.sinks + self.recent >= self.budget:
            raise ValueError(f"sinks={self.sinks} plus recent={self.recent} leave no room in budget={self.budget}")

    once = False


@stage("snap", "route", needs=("attention",))
@attrs.frozen
class Snap(_PerHeadRoute):
    """SnapKV: once, at the end of the prompt, keeps `budget` tokens per head.

    The last `window` prompt queries vote (their attention, max-pooled over
    `pool` neighbouring tokens); the window itself and the first `sinks`
    positions are always kept; later tokens are appended and never evicted.
    """
    budget: int = attrs.field(default=256, validator=in_range(1, 1 << 24))
    window: int = attrs.field(default=32, validator=in_range(1, 1 << 16))
    pool: int = attrs.field(default=7, validator=in_range(1, 1 << 10))
    sinks: int = attrs.field(default=0, validator=[in_range(0, 1 << 20), _sinks_below_budget])

    once = True
    score = "window"

    def __attrs_post_init__(self):
        if self.window + self.sinks > self.budget:
            raise ValueError(f"window={self.window} plus sinks={self.sinks} exceed budget={self.budget}")
