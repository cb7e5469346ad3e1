"""The tier-kind protocol: what TieredCache asks of every tier kind, and how a kind registers itself.

`TierKind` names the calls every kind answers (the cache, trimming, saving and copying make
them and nothing else). `KindBase` is the common base of the three families (Tier, HeadTier,
SidesHeld): it declares the optional capabilities with their "not this kind" defaults, so the
cache reads a declared attribute instead of probing a kind with getattr/hasattr. A kind that
has a capability says so by overriding it.

A kind module registers its class with `@kind("name")` (a store stage's `tier_kind`) or
`@head_kind("name")` (a per-head route's `tier_kind`); runtime/kinds/__init__.py finds every
module of the package, so adding a kind is one module and its tests.

mlx-lm's batch operations (merge, filter, extend, extract, left padding) are the next calls of
this protocol (every kind will answer them); they are not part of it yet.
"""

from typing import Dict, List, Optional, Protocol, Tuple, runtime_checkable

import mlx.core as mx

KINDS: Dict[str, type] = {}  # a store stage's tier_kind -> class(plan, n_kv_heads, head_dim)
HEAD_KINDS: Dict[str, type] = {}  # a per-head route's tier_kind -> class(plan, window)


def kind(name: str):
    """Register a tier kind under the `tier_kind` its store stages name."""

    def register(cls):
        if name in KINDS:
            raise ValueError(f"tier kind {name!r} is registered twice ({KINDS[name].__name__}, {cls.__name__})")
        KINDS[name] = cls
        return cls

    return register


def head_kind(name: str):
    """Register a per-head tier kind under the `tier_kind` its route names."""

    def register(cls):
        if name in HEAD_KINDS:
            raise ValueError(f"per-head tier kind {name!r} is registered twice")
        HEAD_KINDS[name] = cls
        return cls

    return register


@runtime_checkable
class TierKind(Protocol):
    """What every tier kind implements (positions [start, end) held, `count` tokens)."""

    route: object  # the plan's route (None: unrouted), read by the cache's routing
    drops: bool  # the tier drops what reaches it (nothing is held)
    spill_after: Optional[int]  # settling calls spill() only while count > spill_after (None: never)
    start: int
    count: int

    @property
    def end(self) -> int: ...

    @property
    def granularity(self) -> int: ...  # tokens that must leave or be trimmed together

    @property
    def nbytes(self) -> int: ...

    def append(self, keys: mx.array, values: mx.array, start: int) -> None: ...  # place a block

    def spill(self, offset: int, dtype) -> Optional[Tuple[mx.array, mx.array, int]]: ...  # settle: what overflows

    def expire(self, oldest_visible: int) -> None: ...  # a sliding window forgets

    def decoded(self, dtype) -> Tuple[mx.array, mx.array]: ...

    def drop_front(self, n: int) -> None: ...

    def drop_back(self, n: int) -> None: ...  # trim

    def arrays(self) -> Dict[str, mx.array]: ...  # saving (and mlx-lm's `state`)

    def expected_names(self) -> List[str]: ...

    def restore(self, start: int, count: int, arrays: Dict[str, mx.array]) -> Optional[str]: ...

    # copying is copy.deepcopy (runtime/copying.py: a kind that shares frozen parts says so in __deepcopy__)


class KindBase:
    """Declared capabilities, each with the value of a kind that lacks it.

    Attending kinds also answer `answer(queries, scale, mask=None, hidden=0)` (a partial, or None:
    decode me; runtime/kinds/tier.py); per-head kinds are read by runtime/eviction/per_head.py."""

    per_head = False  # kv heads keep different tokens (runtime/eviction/head_tier.py)
    ends_prompt = False  # finish_prompt() acts when the prompt is over (latent tiers fit their basis)
    joins_groups = False  # join_group(link, layers): shares with other layers by itself (coordinator)
    scorer = None  # ranks its tokens (eviction)
    ragged = None  # per-head lengths, once heads keep different counts
    collecting = False  # budgets still open: holds the prompt whole until the coordinator decides
    listening = False  # its scorer is fed now
    needs: frozenset = frozenset()  # what its scorer needs gathered
    can_rewind = True  # trim can take tokens back
    spill_after = None  # settling calls spill() only while count > spill_after (None: nothing ever moves on)
    decodes_only = False  # answer() is always None (a plain 16-bit Tier): routes decode it without asking

    def spill(self, offset: int, dtype) -> Optional[Tuple[mx.array, mx.array, int]]:
        """Nothing overflows a kind whose route holds everything it gets (a layer's last tier)."""
        return None

    def settle_group(self) -> None:
        """Settle what a cross-layer partner holds for this tier (MiniCache); nothing by default."""

    def group_problem(self) -> Optional[str]:
        """Why this tier's cross-layer group cannot run; None by default."""
        return None

    def pick(self, queries: mx.array, dtype):
        """Decode-time selection of the held tokens (RocketKV); None: attend over all of them."""
        return None
