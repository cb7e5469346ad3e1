"""Which runtime class holds a tier: the tier kinds behind one protocol.

A store stage that needs its own kind of tier names it (`tier_kind = "latent"`);
TieredCache asks `build` and never branches on kinds itself. A new kind is a
module plus one line in KINDS (or HEAD_KINDS, for a per-head route's
`tier_kind`: RocketKV's decode-time selection).
"""
from ..compiler.plan import LayerPlan, TierPlan
from ..errors import VeloxError
from .head_tier import HeadTier
from .latent_tier import LatentTier
from .merged_tier import MergedTier
from .query_aware_tier import QueryAwareTier
from .sparse_tier import SparseDecodeTier
from .tier import Tier

KINDS = {"latent": LatentTier, "merged": MergedTier, "query_aware": QueryAwareTier}  # tier_kind -> class(plan, n_kv_heads, head_dim)
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
