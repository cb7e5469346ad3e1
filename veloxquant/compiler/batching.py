"""Which plans batch, and how: the declared capability `explain` prints and the runtime's batch methods obey.

A batch of B sequences is one cache per layer whose tiers hold B rows. Two layouts keep each
sequence's meaning exactly:
- "plain": a layer that is one 16-bit tier holding every token it is given (fp16, sliding windows
  included: a window is a column distance, the same for every row). Rows are left-padded to a common
  end, as mlx-lm's BatchKVCache (runtime/batch.py).
- "chain": sink(n)? >> recent(n)? >> one tier holding the rest in codes, or drop (kivi, kivi_sink, gear,
  turboquant, ...). Such tiers act at each sequence's own positions (a spill when *its* window
  fills, code groups from *its* first spilled token), so each row starts at column 0 of every tier
  and fills its own count; padding is never written (runtime/batch_chain.py).
- "heads": one per-head eviction tier in 16 bits whose scorer keeps its state per token or per row
  (h2o, tova, pyramidkv, snapkv, observed_attention, knorm, keydiff): each row keeps its own budget by
  its own scores, cut at its own positions; unused slots hold position PAD (runtime/eviction/batch_heads.py).
Everything else refuses, with the reason, and is served one sequence at a time: other scorers and
eviction options (budgets allocated across layers or heads, merging, slack, votes), cross-layer groups,
tier kinds of their own (latent, merged, anchor, query-aware), positional or fitted codes and coded
windows. A chain may end in drop (streaming_llm): the window's spill is let go, and it sees n+1 keys
back as alone.
"""

from typing import Optional

from .plan import CodecPlan, LayerPlan, Plan, TierPlan

SIXTEEN_BIT_STORES = ("fp16", "identity")


def _sixteen_bit(c: CodecPlan) -> bool:
    return (
        c.store.stage_name in SIXTEEN_BIT_STORES
        and not c.transforms
        and not c.residuals
        and getattr(c.store, "tier_kind", None) is None
    )


def _plain(tier: TierPlan) -> bool:
    return not tier.drops and tier.route is None and all(_sixteen_bit(c) for c in (tier.keys, tier.values))


def _codes_refusal(c: CodecPlan) -> Optional[str]:
    """Why a codec cannot code a batch's rows as each would alone (None: it can: it codes each token, or
    each group of a row's tokens, from those tokens only)."""
    if getattr(c.store, "tier_kind", None) is not None:
        return f"{c.store.stage_name} keeps its tokens in a tier kind of its own ({c.store.tier_kind})"
    if any(getattr(t, "positional", False) for t in c.transforms):
        return "its keys are coded before RoPE (a positional transform reads each row's first position)"
    if getattr(c.store, "fitted_once", False):
        return f"{c.store.stage_name} fits its levels on the first block it codes (per sequence)"
    if getattr(c.store, "scored", False):
        return f"{c.store.stage_name} routes tokens by the attention they received"
    return None


def _chain_refusal(layer: LayerPlan) -> Optional[str]:
    tiers = list(layer.tiers)
    routes = [t.route.stage_name if t.route is not None else None for t in tiers]
    text = " >> ".join(t.name for t in tiers)
    allowed = [
        ["sink", "recent", None],
        ["recent", None],
        ["sink", None],
        [None],
        ["sink", "recent", "drop"],
        ["recent", "drop"],
    ]
    if routes not in allowed:
        return (
            f"its tiers ({text}) are not sink? >> recent? >> rest (coded windows, drops and tier "
            "kinds of their own are not batched yet)"
        )
    rest = tiers[-1]
    if rest.drops:  # streaming_llm: what the window spills is let go
        tiers = tiers[:-1]
    if any(not all(_sixteen_bit(c) for c in (t.keys, t.values)) for t in tiers[:-1]):
        return f"its tiers ({text}) code tokens before the last tier (a coded window is not batched yet)"
    for c in () if rest.drops else (rest.keys, rest.values):
        why = _codes_refusal(c)
        if why is not None:
            return why
    return None


# Scorers whose state a batch keeps per row: in the tier's per-token arrays, or (window) its own rows.
BATCHED_SCORES = {"evict": ("mass", "current", "mean", "knorm", "keydiff"), "snap": ("window",)}
# Route fields a batch does not carry yet: the value it needs, and what another value does.
_EVICT_DEFAULTS = (
    ("layers", "fixed", "budgets allocated across layers"),
    ("heads", "equal", "budgets allocated across heads"),
    ("merge", "drop", "evicted tokens merged into kept ones"),
    ("slack", 0, "decode queries held and scored before a cut"),
    ("votes", 0.0, "SnapKV's votes beside the score"),
    ("shared_heads", False, "one ranking shared by the heads"),
)


def _heads_refusal(layer: LayerPlan) -> Optional[str]:
    """Why a scoring layer cannot batch as one per-head eviction tier (None: it can)."""
    route = layer.tiers[0].route if len(layer.tiers) == 1 else None
    if route is None or not getattr(route, "per_head", False) or route.stage_name not in BATCHED_SCORES:
        return f"it scores tokens ({', '.join(sorted(layer.needs))}) in tiers other than one evict or snap"
    if layer.needs != frozenset({"attention"}) or getattr(route, "tier_kind", None) is not None:
        return f"its {route.stage_name} needs more than the attention it receives ({', '.join(sorted(layer.needs))})"
    score = getattr(route, "score", None)
    if score not in BATCHED_SCORES[route.stage_name]:
        return f"its scorer '{score}' keeps state that is not batched yet"
    for name, value, what in _EVICT_DEFAULTS:
        if getattr(route, name, value) != value:
            return f"its {route.stage_name}({name}={getattr(route, name)}: {what}) is not batched yet"
    tier = layer.tiers[0]
    if not all(_sixteen_bit(c) for c in (tier.keys, tier.values)):
        return "its eviction tier codes keys or values, which is not batched yet"
    return None


def layer_layout(layer: LayerPlan) -> Optional[str]:
    """ "plain", "chain", "heads" or None (this layer refuses: layer_refusal says why)."""
    if layer.share is not None:
        return None
    if layer.needs:
        return "heads" if _heads_refusal(layer) is None else None
    if len(layer.tiers) == 1 and _plain(layer.tiers[0]):
        return "plain"
    return "chain" if _chain_refusal(layer) is None else None


def layer_refusal(layer: LayerPlan) -> Optional[str]:
    """Why this layer's cache cannot hold a batch (None: it can)."""
    if layer.share is not None:
        return "its layers share codes across layers (a cross-layer group is not batched yet)"
    held = [t.route for t in layer.tiers if getattr(t.route, "tier_kind", None) and not t.route.per_head]
    if held:  # duo: some kv heads only
        return f"its {held[0].stage_name} route holds tokens in a tier kind of its own ({held[0].tier_kind})"
    if layer.needs:
        return _heads_refusal(layer)
    if len(layer.tiers) == 1 and _plain(layer.tiers[0]):
        return None
    return _chain_refusal(layer)


def refusal(plan: Plan) -> Optional[str]:
    """Why `plan`'s caches cannot be merged into a batch, naming the first such layer; None if they can."""
    for layer in plan.layers:
        why = layer_refusal(layer)
        if why is not None:
            return f"recipe '{plan.recipe}' does not batch: layer {layer.index}: {why}"
    return None


LAYOUT_TEXT = {
    "plain": "16-bit rows, left-padded",
    "chain": "tier chains, each row at its own positions",
    "heads": "eviction rows, each sequence its own budget, scores and cuts",
}


def layouts(plan: Plan) -> str:
    """The batch layouts of a plan that batches, in words (explain's batching line)."""
    found = sorted({layer_layout(layer) for layer in plan.layers} - {None})
    return "; ".join(LAYOUT_TEXT[name] for name in found)
