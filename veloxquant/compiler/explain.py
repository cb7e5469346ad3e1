"""`veloxquant explain`: the per-layer plan, its storage cost and implementations."""
import math
from typing import List

from .plan import LayerPlan, Plan, TierPlan


def tier_bits(tier: TierPlan, head_dim: int) -> str:
    if tier.drops:
        return "dropped"
    k, v = tier.keys.bits_per_element(head_dim), tier.values.bits_per_element(head_dim)
    if math.isnan(k) or math.isnan(v):
        return "model dtype"
    return f"{(k + v) / 2:.2f}"


def _tier_line(tier: TierPlan, head_dim: int) -> str:
    route = tier.name if tier.route is None else _call(tier.route)
    if tier.drops:
        return f"    {route:<16} tokens are discarded"
    if tier.keys == tier.values:
        codec = f"K,V: {tier.keys.text()}"
    else:
        codec = f"K: {tier.keys.text()}  V: {tier.values.text()}"
    impl = tier.keys.impl if tier.keys.impl == tier.values.impl else f"{tier.keys.impl}/{tier.values.impl}"
    moves = f"  moves {tier.chunk} at a time" if tier.route is not None and tier.route.spills else ""
    return f"    {route:<16} {codec}\n{'':21}bits/elem {tier_bits(tier, head_dim)}  impl {impl}{moves}"


def _call(stage) -> str:
    import attrs
    values = attrs.asdict(stage)
    return f"{stage.stage_name}({', '.join(str(v) for v in values.values())})" if values else stage.stage_name


def _signature(layer: LayerPlan) -> tuple:
    return (layer.n_kv_heads, layer.head_dim, layer.window, layer.tiers)


def group_layers(plan: Plan) -> List[List[LayerPlan]]:
    """Runs of consecutive layers with the same plan, so 30 equal layers print once."""
    groups: List[List[LayerPlan]] = []
    for layer in plan.layers:
        if groups and _signature(groups[-1][-1]) == _signature(layer):
            groups[-1].append(layer)
        else:
            groups.append([layer])
    return groups


def long_run_bits(layer: LayerPlan) -> float:
    """Bits per element once the context is long: the last non-dropping tier dominates."""
    kept = [t for t in layer.tiers if not t.drops and not (t.route is not None and t.route.bounded)]
    if not kept:
        return 0.0  # bounded memory: bits per element of context tends to zero
    t = kept[-1]
    return (t.keys.bits_per_element(layer.head_dim) + t.values.bits_per_element(layer.head_dim)) / 2


def render(plan: Plan) -> str:
    s = plan.shape
    lines = [f"recipe {plan.recipe}  fingerprint {plan.fingerprint}",
             f"model  {s.name}: {s.n_layers} layers, kv heads {sorted(set(s.n_kv_heads))}, "
             f"head_dim {sorted(set(s.head_dim))}, sliding-window layers {sum(w is not None for w in s.windows)}"]
    if plan.params:
        from ..recipe.params import Schedule
        shown = ", ".join(f"{k}={v.text() if isinstance(v, Schedule) else v}" for k, v in plan.params.items())
        lines.append(f"params {shown}")
    lines.append("")
    for group in group_layers(plan):
        first, last = group[0].index, group[-1].index
        which = f"layer {first}" if first == last else f"layers {first}-{last}"
        layer = group[0]
        window = f", sliding window {layer.window}" if layer.window else ""
        lines.append(f"{which} ({layer.kind}{window}; {layer.n_kv_heads} kv heads x {layer.head_dim}):")
        lines += [_tier_line(t, layer.head_dim) for t in layer.tiers]
        bits = long_run_bits(layer)
        if math.isnan(bits):
            lines.append("    long-context cost: the model's own dtype (identity store)")
        else:
            ratio = f"{bits / 16:.3f} of fp16" if bits else "bounded memory"
            lines.append(f"    long-context cost: {bits:.2f} bits/elem ({ratio}), metadata included")
        if layer.needs:
            lines.append(f"    needs: {', '.join(sorted(layer.needs))}")
    return "\n".join(lines)
