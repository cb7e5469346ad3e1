"""Which plans batch: the declared capability `explain` prints and the runtime's batch methods obey.

A batch of B sequences is one cache per layer whose tiers hold B rows on one column axis, rows
left-padded to a common end (mlx-lm's BatchKVCache layout, runtime/batch.py). That keeps each
sequence's meaning exactly when a layer is one 16-bit tier holding every token it is given (fp16,
sliding windows included: a window is a column distance, the same for every row). A tier that
routes tokens on (recent(n) >> codes), drops, scores or codes them acts at each sequence's own
positions (a spill when *its* window fills, key groups from *its* first token): on a shared column
axis those boundaries differ per row, so batching would change what a sequence keeps or how it is
coded. Such plans refuse, with the reason, and are served one sequence at a time.
"""
from typing import Optional

from .plan import LayerPlan, Plan, TierPlan

SIXTEEN_BIT_STORES = ("fp16", "identity")


def _plain(tier: TierPlan) -> bool:
    return not tier.drops and tier.route is None and all(
        c.store.stage_name in SIXTEEN_BIT_STORES and not c.transforms and not c.residuals
        and getattr(c.store, "tier_kind", None) is None for c in (tier.keys, tier.values))


def layer_refusal(layer: LayerPlan) -> Optional[str]:
    """Why this layer's cache cannot hold a batch (None: it can)."""
    if layer.share is not None:
        return "its layers share codes across layers (a cross-layer group is not batched yet)"
    if layer.needs:
        return f"it scores tokens ({', '.join(sorted(layer.needs))}), per sequence and head, which is not batched yet"
    if len(layer.tiers) != 1 or not _plain(layer.tiers[0]):
        text = " >> ".join(t.name for t in layer.tiers)
        return (f"its tiers ({text}) route, drop or code tokens at each sequence's own positions (a spill when "
                "that sequence's window fills, code groups from its first token); batched tiers share one "
                "column axis, so batching would change what a sequence keeps or how it is coded. "
                "Per-row tier boundaries are not built yet")
    return None


def refusal(plan: Plan) -> Optional[str]:
    """Why `plan`'s caches cannot be merged into a batch, naming the first such layer; None if they can."""
    for layer in plan.layers:
        why = layer_refusal(layer)
        if why is not None:
            return f"recipe '{plan.recipe}' does not batch: layer {layer.index}: {why}"
    return None
