"""Which runtime class holds a tier: the tier kinds behind one protocol.

A store stage that needs its own kind of tier names it (`tier_kind = "latent"`);
TieredCache asks `build` and never branches on kinds itself. A new kind is a
module plus one line in KINDS (or HEAD_KINDS, for a per-head route's
`tier_kind`: RocketKV's decode-time selection).
"""
from typing import Optional

from ...compiler.plan import LayerPlan, TierPlan
from ...errors import VeloxError
from .anchor_tier import AnchorTier
from ..eviction.head_tier import HeadTier
from .latent_tier import LatentTier
from .merged_tier import MergedTier
from .plain import PlainRun
from .query_aware_tier import QueryAwareTier
from .sparse_tier import SparseDecodeTier
from .tier import EXACT_MIN_CHUNK, Tier, fusable

# tier_kind -> class(plan, n_kv_heads, head_dim)
KINDS = {"latent": LatentTier, "merged": MergedTier, "anchor": AnchorTier, "query_aware": QueryAwareTier}
HEAD_KINDS = {"sparse_decode": SparseDecodeTier}  # a per-head route's tier_kind -> class(plan, window)


def kind_of(plan: TierPlan):
    """The tier kind a tier's stores ask for, or None (an ordinary Tier)."""
    if plan.drops:
        return None
    asked = {getattr(c.store, "tier_kind", None) for c in (plan.keys, plan.values)} - {None}
    if len(asked) > 1:
        raise VeloxError(f"one tier cannot be held by two tier kinds ({', '.join(sorted(asked))})")
    return asked.pop() if asked else None


def build(plan: TierPlan, layer: LayerPlan, exact: bool):
    if getattr(plan.route, "per_head", False):
        return HEAD_KINDS.get(getattr(plan.route, "tier_kind", None), HeadTier)(plan, layer.window)
    kind = kind_of(plan)
    if kind is None:
        return Tier(plan, exact)
    return KINDS[kind](plan, layer.n_kv_heads, layer.head_dim)


def plain_tier(cache) -> Optional[PlainRun]:
    """The cache's one tier, wrapped for KVCache's work (runtime/kinds/plain.py), when the layer is plain
    16-bit storage and nothing else: unrouted, unscored, read by SDPA (the fp16 recipe). The cache
    then skips its routing (a sliding-window layer: at decode, where no query needs a mask)."""
    tiers = cache.tiers
    if len(tiers) != 1 or cache.scored or cache.per_head or cache._prompt_tiers or cache.saliency is not None:
        return None
    tier = tiers[0]
    plain = type(tier) is Tier and tier.route is None and tier.sixteen_bit and not tier.codes_attend \
        and all(c.trivial for c in tier.codecs.values())
    return tier.plain if plain else None


def fed_in_chunks(layer: LayerPlan, i: int) -> bool:
    """Tier i receives only whole spills of >= EXACT_MIN_CHUNK tokens and a kernel reads it."""
    before = layer.tiers[i - 1] if i else None
    return (before is not None and getattr(before.route, "spills", False)
            and before.chunk >= EXACT_MIN_CHUNK and fusable(layer.tiers[i]))


def horizon(layer: LayerPlan, i: int) -> Optional[int]:
    """A recent(n) tier whose overflow is dropped sees n+1 keys back (n settled + the newest)."""
    route, rest = layer.tiers[i].route, layer.tiers[i + 1:]
    if route is not None and route.stage_name == "recent" and rest and rest[0].drops:
        return route.n + 1
    return None
