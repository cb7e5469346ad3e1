"""Which runtime class holds a tier: the tier kinds behind one protocol (runtime/kinds/protocol.py).

A store stage that needs its own kind of tier names it (`tier_kind = "latent"`), and so may a
route (`duo`: "heads");
TieredCache asks `build` and never branches on kinds itself. A kind registers itself
(`@kind("latent")`, or `@head_kind(...)` for a per-head route's `tier_kind`: RocketKV's
decode-time selection); every module of this package is imported here, so a new kind
is one module.
"""

import importlib
import pkgutil
from typing import Optional

from ...compiler.plan import LayerPlan, TierPlan
from ...errors import VeloxError
from ..eviction.head_tier import HeadTier
from .protocol import HEAD_KINDS, KINDS, TierKind
from .protocol import KindBase as KindBase  # re-exported, with kind and head_kind: what a kind registers with
from .protocol import head_kind as head_kind
from .protocol import kind as kind
from .tier import EXACT_MIN_CHUNK, Tier, fusable

for _info in pkgutil.iter_modules(__path__, prefix=__name__ + "."):
    importlib.import_module(_info.name)  # each kind module registers itself


def kind_of(plan: TierPlan):
    """The tier kind a tier's stores ask for, or None (an ordinary Tier)."""
    if plan.drops:
        return None
    asked = {getattr(c.store, "tier_kind", None) for c in (plan.keys, plan.values)} - {None}
    if not getattr(plan.route, "per_head", False) and getattr(plan.route, "tier_kind", None):
        asked.add(plan.route.tier_kind)  # a route that holds its tokens its own way (duo: some heads only)
    if len(asked) > 1:
        raise VeloxError(f"one tier cannot be held by two tier kinds ({', '.join(sorted(asked))})")
    return asked.pop() if asked else None


def build(plan: TierPlan, layer: LayerPlan, exact: bool) -> TierKind:
    if getattr(plan.route, "per_head", False):
        return HEAD_KINDS.get(getattr(plan.route, "tier_kind", None), HeadTier)(plan, layer.window)
    name = kind_of(plan)
    if name is None:
        return Tier(plan, exact)
    return KINDS[name](plan, layer.n_kv_heads, layer.head_dim)


def plain_tier(tiers) -> Optional[Tier]:
    """A layer's one tier when it is plain 16-bit storage and nothing else: unrouted, read by
    SDPA (the fp16 recipe); the cache then does KVCache's work with it (append, decoded). The
    cache asks only for a layer nothing scores, and then skips its routing (a sliding-window
    layer: at decode, where no query needs a mask)."""
    if len(tiers) != 1:
        return None
    tier = tiers[0]
    plain = (
        type(tier) is Tier
        and tier.route is None
        and tier.sixteen_bit
        and not tier.codes_attend
        and all(c.trivial for c in tier.codecs.values())
    )
    return tier if plain else None


def fed_in_chunks(layer: LayerPlan, i: int) -> bool:
    """Tier i receives only whole spills of >= EXACT_MIN_CHUNK tokens and a kernel reads it."""
    before = layer.tiers[i - 1] if i else None
    return (
        before is not None
        and getattr(before.route, "spills", False)
        and before.chunk >= EXACT_MIN_CHUNK
        and fusable(layer.tiers[i])
    )


def horizon(layer: LayerPlan, i: int) -> Optional[int]:
    """A recent(n) tier whose overflow is dropped sees n+1 keys back (n settled + the newest)."""
    route, rest = layer.tiers[i].route, layer.tiers[i + 1 :]
    if route is not None and route.stage_name == "recent" and rest and rest[0].drops:
        return route.n + 1
    return None
