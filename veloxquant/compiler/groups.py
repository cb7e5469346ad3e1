"""Cross-layer groups: adjacent layers that share what the anchor layer holds.

A layer whose last tier stores with `xquant(layers=N)` (XQuant: the anchor's codes),
`slerp(layers=2)` (MiniCache: the anchor's directions)
or `latent(layers=N)` with N > 1 (xKV: the anchor's basis) joins a group: the
first layer of a run of such layers is the anchor, the next N-1 reuse what it
holds. A group never reaches over a layer without such a store, and its layers
must hold the same tokens the same way (same shape, same tiers) and no sliding
window, or the reuse layers would ask for what the anchor never made or freed
(slerp's pairs may slide: both layers of a pair have one window and drop the
same tokens in the same step; a group never spans two windows).
"""

from typing import List, Optional, Sequence, Tuple

import attrs

from ..errors import RecipeError
from ..recipe.ast import Pipeline
from .plan import CodecPlan, LayerPlan, Plan, Share, TierPlan

STAGE = "xquant"


def shares(codec: Optional[CodecPlan]) -> bool:
    """The codec's store is shared across layers: xquant always (a group of 1 is one anchor),
    other stores with a `layers` parameter when it is above 1 (latent: one basis for the group)."""
    return codec is not None and (codec.store.stage_name == STAGE or getattr(codec.store, "layers", 1) > 1)


def _name(tier: TierPlan) -> str:
    return next(c.store.stage_name for c in (tier.keys, tier.values) if shares(c))


def shared_tiers(layer: LayerPlan) -> List[int]:
    """Indices of the tiers whose K or V codes a group shares."""
    return [i for i, t in enumerate(layer.tiers) if shares(t.keys) or shares(t.values)]


def assign_groups(layers: Sequence[LayerPlan], pipelines: Sequence[Pipeline]) -> Tuple[LayerPlan, ...]:
    sizes = [_group_size(layer, pipe, len(layers)) for layer, pipe in zip(layers, pipelines)]
    out, group, i = list(layers), 0, 0
    while i < len(layers):
        if sizes[i] is None:
            i += 1
            continue
        members = [i]
        while (
            len(members) < sizes[i]
            and i + len(members) < len(layers)
            and sizes[i + len(members)] is not None
            and layers[i + len(members)].window == layers[i].window
        ):  # slerp pairs: one window per group
            members.append(i + len(members))
        for m in members[1:]:
            _check_match(layers[i], layers[m], pipelines[m])
        if len(members) == 1 and _name(layers[i].tiers[-1]) == "slerp":
            i += 1  # a slerp layer without a partner shares nothing: a float16 passthrough, no group
            continue
        for m in members:
            out[m] = attrs.evolve(layers[m], share=Share(group, tuple(members)))
        group, i = group + 1, i + len(members)
    return tuple(out)


def _group_size(layer: LayerPlan, pipeline: Pipeline, n_layers: int) -> Optional[int]:
    """`layers` of this layer's shared stores, after checking where they stand; None without them
    (or above the store's first shared layer: slerp's `start`, MiniCache's depth)."""
    where = shared_tiers(layer)
    if not where:
        return None
    last = len(layer.tiers) - 1
    tier = layer.tiers[where[0]]
    if any(
        layer.index < c.store.first_layer(n_layers)
        for c in (tier.keys, tier.values)
        if shares(c) and hasattr(c.store, "first_layer")
    ):
        return None
    name = _name(tier)
    pos = _stage_pos(pipeline, name)
    if where != [last] or tier.route is not None:
        raise RecipeError(
            f"{name} stores are shared across layers for as long as the cache lives, so {name} must "
            "stand in the last tier, which keeps every token that reaches it",
            pos,
            f"e.g. recent(128) >> keys: {name}(...) values: {name}(...)",
        )
    if layer.window is not None and not any(
        getattr(c.store, "expires_together", False) for c in (tier.keys, tier.values) if shares(c)
    ):
        raise RecipeError(
            f"layer {layer.index} has a sliding window of {layer.window} tokens, so it frees old "
            f"tokens that {name} layers share across layers",
            pos,
            "give sliding layers another pipeline: layers: {sliding: {pipeline: ...}}",
        )
    for codec in (tier.keys, tier.values):
        if shares(codec) and name == STAGE and codec.residuals:
            raise RecipeError("xquant codes its drift itself (residual_bits); residual(...) cannot follow it", pos)
        if shares(codec) and name == STAGE and getattr(codec, "entropy", ()):
            raise RecipeError(
                "xquant's codes live in the anchor layer only, so saved caches cannot entropy-code them per layer yet",
                pos,
                "remove the entropy stages after xquant",
            )
    sizes = {c.store.layers for c in (tier.keys, tier.values) if shares(c)}
    if len(sizes) > 1:
        asked = " and ".join(map(str, sorted(sizes)))
        raise RecipeError(
            f"the keys and values of layer {layer.index} ask for groups of {asked} layers; a group shares both",
            pos,
            f"give both {name} stages the same layers=",
        )
    return sizes.pop()


def _check_match(anchor: LayerPlan, layer: LayerPlan, pipeline: Pipeline) -> None:
    name = _name(anchor.tiers[-1])
    if (anchor.n_kv_heads, anchor.head_dim) != (layer.n_kv_heads, layer.head_dim):
        raise RecipeError(
            f"layers {anchor.index} and {layer.index} would share {name} stores, but their heads differ "
            f"({anchor.n_kv_heads}x{anchor.head_dim} vs {layer.n_kv_heads}x{layer.head_dim})",
            _stage_pos(pipeline, name),
            "end the group earlier: a smaller layers= or a layer override",
        )
    if anchor.tiers != layer.tiers:
        raise RecipeError(
            f"layers {anchor.index} and {layer.index} would share {name} stores, but their tiers differ "
            f"({_tiers_text(anchor.tiers)} vs {_tiers_text(layer.tiers)}); the layers of a group must "
            "hold the same tokens the same way",
            _stage_pos(pipeline, name),
            "use the same pipeline and parameters for every layer of a group",
        )


def _tiers_text(tiers: Sequence[TierPlan]) -> str:
    return (
        " >> ".join(t.name if t.route is None else f"{t.route.stage_name}({getattr(t.route, 'n', '')})" for t in tiers)
        + f" [{tiers[-1].keys.text()}]"
    )


def _stage_pos(pipeline: Pipeline, name: str = STAGE):
    for tier in pipeline.tiers:
        for call in tier.stages + (tier.keys or ()) + (tier.values or ()):
            if call.name == name:
                return call.pos
    return pipeline.tiers[0].pos


# --- cost and explain ----------------------------------------------------------------


def codec_bits(codec: CodecPlan, head_dim: int, role: Optional[str]) -> float:
    """Bits per element this layer really holds: a reuse layer holds no codes."""
    if role == "reuse" and shares(codec) and hasattr(codec.store, "reuse_bits_per_element"):
        return codec.store.reuse_bits_per_element(head_dim)
    if role == "anchor" and shares(codec) and hasattr(codec.store, "anchor_bits_per_element"):
        return codec.store.anchor_bits_per_element(head_dim)
    return codec.bits_per_element(head_dim)


def render_groups(plan: Plan) -> List[str]:
    """One line per cross-layer group: who holds the codes, who reuses them, and what each costs."""
    seen, lines = set(), []
    for layer in plan.layers:
        share = layer.share
        if share is None or share.group in seen:
            continue
        seen.add(share.group)
        span = f"layer {share.anchor}" if len(share.layers) == 1 else f"layers {share.layers[0]}-{share.layers[-1]}"
        reuse = ", ".join(map(str, share.layers[1:])) or "none"
        tier = layer.tiers[shared_tiers(layer)[0]]
        costs = ", ".join(
            f"{r} {_bits_text(_bits(tier, layer.head_dim, r))}" for r in ("anchor", "reuse")[: len(share.layers)]
        )
        lines.append(
            f"    {span + ':':<14} group {share.group}, anchor {share.anchor}, reuse {reuse}"
            f"  (bits/elem in the shared tier: {costs})"
        )
    if not lines:
        return []
    name = _name(plan.layers[next(i for i, l in enumerate(plan.layers) if l.share)].tiers[-1])
    if name == "slerp":
        return [
            "",
            "cross-layer groups (slerp: the anchor holds one direction per token for the pair and its own "
            "magnitudes; the reuse layer holds its magnitudes and its unmerged tokens):",
        ] + lines
    if name != STAGE:
        return [
            "",
            "cross-layer groups (latent: the anchor fits and holds one basis from the keys of every layer "
            "of its group; each layer holds its own latents on it):",
        ] + lines
    return [
        "",
        "cross-layer groups (xquant: the anchor holds the codes; reuse layers hold their own "
        "scale/zero [+ residual] and read the anchor's codes):",
    ] + lines


def _bits_text(bits: float) -> str:
    return "set by the data" if bits != bits else f"{bits:.2f}"  # NaN: a basis fitted at the end of the prompt


def _bits(tier: TierPlan, head_dim: int, role: str) -> float:
    return (codec_bits(tier.keys, head_dim, role) + codec_bits(tier.values, head_dim, role)) / 2
