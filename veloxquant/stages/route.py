"""Routing stages: which tokens a tier holds and when they move on.

Tiers are listed newest first. A new block of tokens is offered to each tier
in order; what a tier declines or spills continues to the next.
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

    def take(self, start: int, count: int, held: int) -> int:
        """How many of the tokens at positions start.. this tier takes."""
        return max(0, min(count, self.n - start))

    def spill(self, held: int, chunk: int) -> int:
        return 0


@stage("recent", "route")
@attrs.frozen
class Recent:
    """A window of the newest `n` tokens; older ones spill to the next tier in chunks."""

    n: int = attrs.field(default=128, validator=in_range(0, 1 << 24))

    bounded = True
    spills = True

    def take(self, start: int, count: int, held: int) -> int:
        return count

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

    def take(self, start: int, count: int, held: int) -> int:
        return count

    def spill(self, held: int, chunk: int) -> int:
        return 0
