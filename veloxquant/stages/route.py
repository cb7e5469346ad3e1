"""Routing stages: which tokens a tier holds and when they move on.

Tiers are listed newest first. A new block of tokens is offered to each tier
in order; what a tier declines or spills continues to the next.

A route declares what the runtime compiles into its tier once, when the cache is built:
`takes_below` (the tier takes only positions below it; None: every token offered) and, for a
route that `spills`, `holds` (nothing moves on while the tier holds at most that many). `spill`
is asked only past `holds`: a decode step calls no route.
"""

import attrs

from .registry import in_range, stage


@stage("sink", "route")
@attrs.frozen
class Sink:
    """The first `n` positions of the sequence, kept forever (attention sinks)."""

    n: int = attrs.field(default=4, validator=in_range(0, 1 << 20))

    bounded = True
    spills = False

    @property
    def takes_below(self) -> int:
        return self.n

    def spill(self, held: int, chunk: int) -> int:
        return 0


@stage("recent", "route")
@attrs.frozen
class Recent:
    """A window of the newest `n` tokens; older ones spill to the next tier in chunks."""

    n: int = attrs.field(default=128, validator=in_range(0, 1 << 24))

    bounded = True
    spills = True
    takes_below = None

    @property
    def holds(self) -> int:
        return self.n

    def spill(self, held: int, chunk: int) -> int:
        # Spill whole chunks so the next tier's groups are complete: enough to keep
        # <= n when whole chunks allow it; a window smaller than a chunk waits for one.
        over = held - self.n
        if over <= 0:
            return 0
        whole = -(-over // chunk) * chunk
        return whole if whole <= held else held // chunk * chunk


@stage("drop", "route")
@attrs.frozen
class Drop:
    """Discards every token that reaches it (structural eviction)."""

    bounded = False
    spills = False
    takes_below = None

    def spill(self, held: int, chunk: int) -> int:
        return 0
