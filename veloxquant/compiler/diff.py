"""`veloxquant diff`: two recipes compared by their compiled per-layer plans, not their text.

Two files that compile to the same plan (formatting, comments, key order, a
renamed recipe) have the same fingerprint and report "no change to the plan";
otherwise the changes are listed per run of layers that change alike: tiers
added or removed, stage parameters before -> after, bits/element before -> after.
"""

import difflib
import math
from typing import Any, List, Sequence, Tuple

import attrs

from ..recipe import Recipe
from ..recipe.params import Schedule
from .explain import long_run_bits
from .plan import CodecPlan, LayerPlan, Plan, TierPlan, _fmt, _stage_text

# One change: (what, before, after); `what` names the tier, side and field.
Change = Tuple[str, Any, Any]


@attrs.frozen
class PlanDiff:
    a: Plan
    b: Plan
    layer_changes: Tuple[Tuple[Change, ...], ...]  # per layer, () when the layer is unchanged

    @property
    def same(self) -> bool:
        return self.a.fingerprint == self.b.fingerprint


def diff_plans(a: Plan, b: Plan) -> PlanDiff:
    return PlanDiff(a, b, tuple(tuple(layer_changes(la, lb)) for la, lb in zip(a.layers, b.layers)))


def layer_changes(a: LayerPlan, b: LayerPlan) -> List[Change]:
    out: List[Change] = []
    names_a, names_b = [_tier_key(t) for t in a.tiers], [_tier_key(t) for t in b.tiers]
    matcher = difflib.SequenceMatcher(a=names_a, b=names_b, autojunk=False)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            for i, j in zip(range(i1, i2), range(j1, j2)):
                out += _tier_changes(f"tier {j + 1} {names_b[j]}", a.tiers[i], b.tiers[j])
            continue
        for i in range(i1, i2):
            out.append((f"tier {i + 1} removed", tier_text(a.tiers[i]), None))
        for j in range(j1, j2):
            out.append((f"tier {j + 1} added", None, tier_text(b.tiers[j])))
    role_a, role_b = _share_text(a), _share_text(b)
    if role_a != role_b:
        out.append(("cross-layer groups", role_a, role_b))
    return out


def _tier_key(t: TierPlan) -> str:
    return t.name


def _share_text(layer: LayerPlan) -> str:
    if layer.share is None:
        return "none"
    return f"groups of {len(layer.share.layers)} layers sharing the anchor's codes"


def tier_text(t: TierPlan) -> str:
    route = _stage_text(t.route) if t.route is not None else "rest"
    if t.drops:
        return f"{route} (discards)"
    if t.keys == t.values:
        return f"{route} K,V: {t.keys.text()}"
    return f"{route} K: {t.keys.text()} V: {t.values.text()}"


def _tier_changes(where: str, a: TierPlan, b: TierPlan) -> List[Change]:
    out = _fields(where, a.route, b.route) if a.route is not None and b.route is not None else []
    if a.drops or b.drops:
        if a.drops != b.drops:
            out.append((where, tier_text(a), tier_text(b)))
        return out
    if a.keys == a.values and b.keys == b.values:
        out += _codec_changes(f"{where} K,V", a.keys, b.keys)
    else:
        out += _codec_changes(f"{where} K", a.keys, b.keys) + _codec_changes(f"{where} V", a.values, b.values)
    if a.chunk != b.chunk and a.route is not None and a.route.spills:
        out.append((f"{where} moves tokens", a.chunk, b.chunk))
    return out


def _codec_changes(where: str, a: CodecPlan, b: CodecPlan) -> List[Change]:
    if a == b:
        return []
    names_a, names_b = [s.stage_name for s in a.stages], [s.stage_name for s in b.stages]
    if names_a != names_b:
        return [(where, a.text(), b.text())]
    out = []
    for sa, sb in zip(a.stages, b.stages):
        out += _fields(f"{where} {sa.stage_name}", sa, sb)
    if a.impl != b.impl:
        out.append((f"{where} impl", a.impl, b.impl))
    return out


def _fields(where: str, a, b) -> List[Change]:
    if a == b:
        return []
    if type(a) is not type(b):
        return [(where, _stage_text(a), _stage_text(b))]
    va, vb = attrs.asdict(a, recurse=False), attrs.asdict(b, recurse=False)
    out = []
    for k in va:
        if va[k] != vb[k]:
            if hasattr(va[k], "stage_name") and hasattr(vb[k], "stage_name"):
                out += _fields(f"{where}.{k}", va[k], vb[k])
            else:
                out.append((f"{where} {k}", va[k], vb[k]))
    return out


# --- rendering ---------------------------------------------------------------------------


def _show(v) -> str:
    if v is None:
        return "-"
    if hasattr(v, "stage_name"):
        return _stage_text(v)
    return _fmt(v)


def _bits(layer: LayerPlan) -> float:
    return long_run_bits(layer)


def _bits_text(bits: float) -> str:
    if math.isnan(bits):
        return "model dtype"
    return "bounded" if bits == 0 else f"{bits:.2f}"


def _mean_bits(plan: Plan) -> float:
    return sum(map(_bits, plan.layers)) / len(plan.layers)


def _cost_text(bits: float) -> str:
    if math.isnan(bits):
        return "the model's own dtype"
    if bits == 0:
        return "bounded memory (0 bits/elem at long context)"
    return f"{bits:.2f} bits/elem ({bits / 16:.3f} of fp16)"


def _groups(d: PlanDiff) -> List[Tuple[int, int]]:
    """Runs of consecutive layers that change alike. Runs of single layers whose changes
    differ only in values (a schedule) merge into one run that lists the values per layer."""
    runs: List[Tuple[int, int]] = []
    changes = d.layer_changes
    for i, ch in enumerate(changes):
        if ch and runs and runs[-1][1] == i - 1 and changes[runs[-1][0]] == ch:
            runs[-1] = (runs[-1][0], i)
        elif ch:
            runs.append((i, i))
    merged: List[Tuple[int, int]] = []
    for run in runs:
        prev = merged[-1] if merged else None
        if (
            prev
            and prev[1] == run[0] - 1
            and run[0] == run[1]
            and _fields_of(changes[prev[0]]) == _fields_of(changes[run[0]])
            and all(changes[k] != changes[k + 1] for k in range(prev[0], prev[1]))
        ):
            merged[-1] = (prev[0], run[1])
        else:
            merged.append(run)
    return merged


def _fields_of(changes) -> tuple:
    return tuple(c[0] for c in changes)


def _values(vs: list) -> str:
    """Per-layer values, equal neighbours folded: '2 x3, 4, 8 x2'."""
    out, k = [], 0
    while k < len(vs):
        n = 1
        while k + n < len(vs) and _show(vs[k + n]) == _show(vs[k]):
            n += 1
        out.append(_show(vs[k]) + (f" x{n}" if n > 1 else ""))
        k += n
    return ", ".join(out)


def _run_lines(d: PlanDiff, first: int, last: int) -> List[str]:
    lines = []
    changes = [d.layer_changes[i] for i in range(first, last + 1)]
    for k, (what, before, after) in enumerate(changes[0]):
        if before is None or after is None:  # a tier added or removed
            lines.append(f"    {what}: {_show(after if before is None else before)}")
            continue
        befores = [c[k][1] for c in changes]
        afters = [c[k][2] for c in changes]
        if len(set(map(_show, befores))) == 1 and len(set(map(_show, afters))) == 1:
            lines.append(f"    {what}: {_show(before)} -> {_show(after)}")
        else:
            lines.append(f"    {what}, per layer: {_values(befores)} -> {_values(afters)}")
    ba = [_bits(d.a.layers[i]) for i in range(first, last + 1)]
    bb = [_bits(d.b.layers[i]) for i in range(first, last + 1)]
    if [_bits_text(x) for x in ba] != [_bits_text(x) for x in bb]:
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        lines.append(
            f"    long-context bits/elem: {_bits_text(mean(ba))} -> {_bits_text(mean(bb))}"
            + (" (mean over these layers)" if first != last else "")
        )
    return lines


def _param_lines(a: Plan, b: Plan) -> List[str]:
    def text(v):
        return v.text() if isinstance(v, Schedule) else _fmt(v)

    out = []
    for name in list(a.params) + [n for n in b.params if n not in a.params]:
        va, vb = a.params.get(name), b.params.get(name)
        if name not in b.params:
            out.append(f"{name} {text(va)} -> (removed)")
        elif name not in a.params:
            out.append(f"{name} (new) -> {text(vb)}")
        elif text(va) != text(vb):
            out.append(f"{name} {text(va)} -> {text(vb)}")
    return out


def render(d: PlanDiff, label_a: str, label_b: str, ra: Recipe, rb: Recipe) -> str:
    a, b = d.a, d.b
    width = max(len(label_a), len(label_b))
    lines = [
        f"A  {label_a:<{width}}  recipe {a.recipe}  fingerprint {a.fingerprint}",
        f"B  {label_b:<{width}}  recipe {b.recipe}  fingerprint {b.fingerprint}",
        f"model {a.shape.name} ({a.shape.n_layers} layers)",
    ]
    meta = [f"{k} changed" for k in ("name", "summary", "paper", "extends") if getattr(ra, k) != getattr(rb, k)]
    params = _param_lines(a, b)
    if d.same:
        lines.append(
            "no change to the plan: same per-layer tiers, stages and parameters; "
            "caches saved under one load under the other"
        )
        if params:
            lines.append("params (no effect on the plan): " + "; ".join(params))
        if meta:
            lines.append("metadata: " + ", ".join(meta))
        return "\n".join(lines)
    if params:
        lines.append("params: " + "; ".join(params))
    if meta:
        lines.append("metadata: " + ", ".join(meta))
    runs = _groups(d)
    changed = sum(1 for ch in d.layer_changes if ch)
    lines.append(f"{changed} of {a.shape.n_layers} layers change:")
    for first, last in runs:
        lines.append(f"  layer {first}:" if first == last else f"  layers {first}-{last}:")
        lines += _run_lines(d, first, last)
    if not runs:  # same tiers and stages, yet another hash: say so rather than print nothing
        lines.append("  the plans' JSON differs outside the tiers (see `veloxquant explain` of each)")
    ma, mb = _mean_bits(a), _mean_bits(b)
    lines.append(f"long-context cost (mean over layers): {_cost_text(ma)} -> {_cost_text(mb)}")
    lines.append(f"fingerprint {a.fingerprint} -> {b.fingerprint}: caches saved under A do not load under B")
    return "\n".join(lines)


def compare(labels: Sequence[str], compiled: Sequence[Tuple[Recipe, Plan]]) -> Tuple[PlanDiff, str]:
    (ra, a), (rb, b) = compiled
    d = diff_plans(a, b)
    return d, render(d, labels[0], labels[1], ra, rb)
