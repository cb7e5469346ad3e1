"""`veloxquant explain`: the per-layer plan, its storage cost and implementations."""

import math
from typing import List

import attrs

from ..recipe.params import Schedule
from ..stages.scorers import SPECS as SCORER_SPECS
from .groups import codec_bits, render_groups
from .plan import LayerPlan, Plan, TierPlan, _stage_text


def tier_bits(tier: TierPlan, head_dim: int) -> str:
    if tier.drops:
        return "dropped"
    k, v = tier.keys.bits_per_element(head_dim), tier.values.bits_per_element(head_dim)
    if math.isnan(k) or math.isnan(v):
        return "set by the data" if _fitted(tier) else "model dtype"
    return f"{(k + v) / 2:.2f}"


def _fitted(tier: TierPlan) -> bool:
    """A store whose cost the data decides (a `latent` basis fitted at the end of the prompt)."""
    return any(getattr(c.store, "tier_kind", None) for c in (tier.keys, tier.values))


def _tier_line(tier: TierPlan, head_dim: int, values: dict = None) -> str:
    route = _route_text(tier.route, values or {})
    if tier.drops:
        return f"    {route:<16} tokens are discarded"
    if tier.keys == tier.values:
        codec = f"K,V: {tier.keys.text()}"
    else:
        codec = f"K: {tier.keys.text()}  V: {tier.values.text()}"
    impl = tier.keys.impl if tier.keys.impl == tier.values.impl else f"{tier.keys.impl}/{tier.values.impl}"
    moves = f"  moves {tier.chunk} at a time" if tier.route is not None and tier.route.spills else ""
    line = f"    {route:<16} {codec}\n{'':21}bits/elem {tier_bits(tier, head_dim)}  impl {impl}{moves}"
    if tier.keys.entropy or tier.values.entropy:
        # Coded codes cannot be attended: the live cost above stays, the file shrinks.
        line += (
            f"\n{'':21}entropy-coded when saved (K: {_chain(tier.keys)}, V: {_chain(tier.values)}); "
            "live bytes unchanged"
        )
    return line


def _chain(codec) -> str:
    return " | ".join(_stage_text(s) for s in codec.entropy) or "none"


def _call(stage) -> str:
    import attrs

    values = attrs.asdict(stage)
    return f"{stage.stage_name}({', '.join(str(v) for v in values.values())})" if values else stage.stage_name


def _scheduled(plan: Plan) -> dict:
    return {k: v for k, v in plan.params.items() if isinstance(v, Schedule)}


def _route_text(route, values: dict) -> str:
    """The route's fields by name: its first (budget, n) always, the others only where they differ
    from the stage's defaults (evict has two dozen); a field that takes a scheduled parameter's
    value is shown as $name."""
    if route is None:
        return "rest"
    declared = attrs.fields(type(route))
    defaults = {f.name: f.default for f in declared}
    first = declared[0].name if declared else None
    fields = {
        k: v
        for k, v in attrs.asdict(route, recurse=False).items()
        if not k.startswith("_") and (k == first or v != defaults.get(k, attrs.NOTHING))
    }
    for f, v in fields.items():
        for name, sv in values.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v == sv:
                fields[f] = f"${name}"
    shown = ", ".join(f"{k}={v}" for k, v in fields.items())
    return f"{route.stage_name}({shown})" if fields else route.stage_name


def _layer_values(plan: Plan, index: int) -> dict:
    n = plan.shape.n_layers
    return {k: round(s.at(index, n)) for k, s in _scheduled(plan).items()}


def _signature(layer: LayerPlan, plan: Plan = None) -> tuple:
    values = _layer_values(plan, layer.index) if plan is not None else {}
    tiers = tuple((_route_text(t.route, values), t.keys, t.values, t.chunk) for t in layer.tiers)
    return (layer.n_kv_heads, layer.head_dim, layer.window, tiers)


def group_layers(plan: Plan) -> List[List[LayerPlan]]:
    """Runs of consecutive layers with the same plan, so 30 equal layers print once."""
    groups: List[List[LayerPlan]] = []
    for layer in plan.layers:
        if groups and _signature(groups[-1][-1], plan) == _signature(layer, plan):
            groups[-1].append(layer)
        else:
            groups.append([layer])
    return groups


def long_run_bits(layer: LayerPlan) -> float:
    """Bits per element once the context is long: the last non-dropping tier dominates."""
    kept = [
        t
        for t in layer.tiers
        if not t.drops
        and not (t.route is not None and t.route.bounded)
        and not (getattr(t.route, "per_head", False) and not t.route.once)
    ]  # h2o/tova: a fixed budget
    if not kept:
        return 0.0  # bounded memory: bits per element of context tends to zero
    t = kept[-1]
    share = getattr(t.route, "held_share", 1.0)  # duo: the retrieval heads alone hold the long context
    return (
        share * (codec_bits(t.keys, layer.head_dim, layer.role) + codec_bits(t.values, layer.head_dim, layer.role)) / 2
    )


def render(plan: Plan) -> str:
    s = plan.shape
    lines = [
        f"recipe {plan.recipe}  fingerprint {plan.fingerprint}",
        f"model  {s.name}: {s.n_layers} {'layers' if s.trivial_layout else 'attention caches'}, "
        f"kv heads {sorted(set(s.n_kv_heads))}, "
        f"head_dim {sorted(set(s.head_dim))}, sliding-window layers {sum(w is not None for w in s.windows)}",
    ]
    if not s.trivial_layout:
        lines.append(f"layout {s.layout_text()}")
    if plan.params:
        shown = ", ".join(f"{k}={v.text() if isinstance(v, Schedule) else v}" for k, v in plan.params.items())
        lines.append(f"params {shown}")
    lines.append("")
    for group in group_layers(plan):
        first, last = group[0].index, group[-1].index
        which = f"layer {first}" if first == last else f"layers {first}-{last}"
        layer = group[0]
        window = f", sliding window {layer.window}" if layer.window else ""
        model = (
            ""
            if s.trivial_layout
            else f"model layers {', '.join(str(m) for l in group for m in s.model_layers(l.index))}; "
        )
        lines.append(f"{which} ({model}{layer.kind}{window}; {layer.n_kv_heads} kv heads x {layer.head_dim}):")
        values = _layer_values(plan, layer.index)
        lines += [_tier_line(t, layer.head_dim, values) for t in layer.tiers]
        lines += _per_head_lines(layer)
        shared = any(l.share for l in group)  # anchors and reuse layers hold different bytes: average them
        bits = sum(map(long_run_bits, group)) / len(group) if shared else long_run_bits(layer)
        if math.isnan(bits) and any(_fitted(t) for t in layer.tiers if not t.drops):
            lines.append("    long-context cost: set by the basis fitted at the end of the prompt (see run/eval bytes)")
        elif math.isnan(bits):
            lines.append("    long-context cost: the model's own dtype (identity store)")
        else:
            ratio = f"{bits / 16:.3f} of fp16" if bits else "bounded memory"
            mean = ", mean over anchor and reuse layers" if shared else ""
            lines.append(f"    long-context cost: {bits:.2f} bits/elem ({ratio}), metadata included{mean}")
        if layer.needs:
            lines.append(f"    needs: {', '.join(sorted(layer.needs))}")
    lines += _schedule_lines(plan)
    lines += render_groups(plan)
    return "\n".join(lines)


def _per_head_lines(layer: LayerPlan) -> List[str]:
    out = []
    for t in layer.tiers:
        if getattr(t.route, "per_head", False):
            token_state = SCORER_SPECS[t.route.score].token_state(t.route)  # what the scorer keeps per token
            extra = 4 * sum(math.prod(shape) for shape in token_state.values())
            slack = t.route.slack
            when = (
                "once, at the end of the prompt"
                if t.route.once
                else f"once a head holds {slack} past the budget"
                if slack
                else "every step"
            )
            out.append(
                f"    each kv head keeps its own tokens; evicts {when} by score={t.route.score}; "
                f"+{8 + extra} bytes/token/head of positions and scores"
            )
            if getattr(t.route, "votes", 0) > 0:
                out.append(
                    f"    round({t.route.votes} x budget) of each head's tokens kept first by SnapKV's vote "
                    f"(last {t.route.vote_window} prompt queries, max-pooled over {t.route.vote_pool}), "
                    f"the rest by score={t.route.score}"
                )
            if allocation_rule(t.route):
                out.append(
                    f"    budgets decided once at the end of the prompt by the coordinator: {allocation_rule(t.route)}"
                )
            if getattr(t.route, "explain_pass", None):
                out.append(f"    {t.route.explain_pass()}")
            if getattr(t.route, "explain_decode", None):
                out.append(f"    {t.route.explain_decode()}")
    return out


def allocation_rule(route) -> str:
    """How this tier's budgets are decided (runtime/eviction/allocation.py decides them)."""
    parts = []
    if route.layers == "squeeze":
        parts.append(
            f"layer budgets moved by SqueezeAttention (strength {route.strength}): "
            "proportional to budget x breadth^strength, breadth = exp(entropy) of the layer's real "
            "prefill attention, total over layers fixed"
        )
    if route.heads == "adakv":
        parts.append(
            f"kv-head budgets by Ada-KV (alpha {route.alpha}): each head keeps its best "
            f"max(alpha x budget, {route.floor}), the rest of the layer's budget goes to the heads whose "
            "tokens carry the most attention; unequal heads held ragged (no padding)"
        )
    if route.heads == "score":
        parts.append(
            f"kv-head budgets by competition on score={route.score} (alpha {route.alpha}): each head keeps "
            f"its best max(alpha x budget, {route.floor}), the rest of the layer's budget goes to the "
            "highest scores pooled over heads; unequal heads held ragged (no padding)"
        )
    return "; ".join(parts)


def _schedule_lines(plan: Plan) -> List[str]:
    """Per-layer values of scheduled parameters (PyramidKV's budgets)."""
    out = []
    n = plan.shape.n_layers
    for name, sched in _scheduled(plan).items():
        values = [round(sched.at(i, n)) for i in range(n)]
        out += [
            "",
            f"layer schedule {name} = {sched.text()}: " + " ".join(map(str, values)),
            f"    mean {sum(values) / n:.1f} over {n} layers",
        ]
    return out
