"""Held bytes of a recipe at a context, from its compiled plan: explain's cost machinery per tier.

Per layer, tokens fill the tiers newest first as the runtime routes them:
`sink(n)` holds the first n, `recent(n)` the newest n, a per-head route
(`evict`, `snap`, ...) `budget` (+ `slack`) tokens, `drop` none, the last
tier the rest (`duo`: for its retrieval share of the model's heads, spread evenly over the layers);
each at its codecs' bits per element (compiler/groups.py
codec_bits, metadata included; a per-head tier's positions and scores too);
a 16-bit unbounded tier is rounded up to its 256-token allocation step, as
the runtime allocates it (coded tiers hold exactly their tokens). A sliding-window
layer sees at most its window. `context` is the prompt: recipes that decide
once at the end of the prompt grow again by the tokens generated after it.
Tiers this cannot account for (bases fitted per prompt, saliency routing,
cross-layer sharing) give None rather than a guess.
"""

import math
from typing import Optional

from ..compiler import compile_recipe
from ..compiler.groups import codec_bits
from ..compiler.plan import LayerPlan, Plan
from ..compiler.shape import ModelShape
from ..recipe import load_recipe
from ..runtime.kinds.tier import UNBOUNDED_STEP

META_BYTES = 8  # a per-head tier's position (int32) and running score (float32) per token and head


def _sixteen_bit(tier) -> bool:
    return all(
        c.store.stage_name in ("fp16", "identity") and not c.transforms and not c.residuals
        for c in (tier.keys, tier.values)
    )


def _tokens_held(tier, remaining: int) -> Optional[int]:
    route = tier.route
    if route is None:
        if not tier.drops and _sixteen_bit(tier):  # grown in steps like mlx-lm's KVCache (runtime/buffer.py)
            return -(-remaining // UNBOUNDED_STEP) * UNBOUNDED_STEP if remaining else 0
        return remaining  # coded tiers read by kernels hold exactly their tokens
    name = route.stage_name
    if name == "sink":
        return min(remaining, route.n)
    if name == "recent":  # spills whole chunks while it holds more than n
        over = remaining - route.n
        return remaining if over <= 0 else remaining - -(-over // tier.chunk) * tier.chunk
    if name == "drop":
        return 0
    if getattr(route, "held_share", None) is not None:  # duo: the rest, for the retrieval share of the heads
        step = UNBOUNDED_STEP if _sixteen_bit(tier) else 1
        return -(-remaining // step) * step if remaining else 0
    # A fixed per-layer budget (squeeze moves budgets between layers at run time).
    if getattr(route, "per_head", False) and hasattr(route, "budget") and getattr(route, "layers", "fixed") == "fixed":
        return min(remaining, route.budget + getattr(route, "slack", 0))
    return None


def layer_bytes(layer: LayerPlan, context: int) -> Optional[float]:
    if layer.share is not None:
        return None
    remaining = min(context, layer.window or context)
    total = 0.0
    for tier in layer.tiers:
        held = _tokens_held(tier, remaining)
        if held is None:
            return None
        if not tier.drops:
            bits = codec_bits(tier.keys, layer.head_dim, layer.role) + codec_bits(
                tier.values, layer.head_dim, layer.role
            )
            if math.isnan(bits):
                return None
            share = getattr(tier.route, "held_share", 1.0)  # duo: the model's share of heads (not this layer's)
            total += share * held * layer.n_kv_heads * layer.head_dim * bits / 8
            if getattr(tier.route, "per_head", False):
                total += held * layer.n_kv_heads * META_BYTES
        remaining -= min(held, remaining)
        if remaining <= 0:
            break
    return total


def plan_bytes(plan: Plan, context: int) -> Optional[float]:
    per_layer = [layer_bytes(layer, context) for layer in plan.layers]
    return None if any(b is None for b in per_layer) else sum(per_layer)


def held_bytes(ref: str, sets, shape: ModelShape, context: int) -> Optional[float]:
    """Predicted bytes of recipe `ref` with `sets` on `shape` after `context` tokens, or None."""
    return plan_bytes(compile_recipe(load_recipe(ref), shape, list(sets)), context)


def fp16_bytes(shape: ModelShape, context: int) -> int:
    return sum(
        min(context, w or context) * 2 * h * d * 2 for h, d, w in zip(shape.n_kv_heads, shape.head_dim, shape.windows)
    )
