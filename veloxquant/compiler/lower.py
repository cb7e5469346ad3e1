"""Recipe -> Plan: resolve params per layer, instantiate stages, check stage order."""

import math
from typing import Any, Dict, Iterable, List, Optional, Tuple

import attrs

from ..errors import Location, RecipeError, nearest
from ..kernels import dispatch
from ..kernels.table import mlx_attend, verified
from ..recipe import Recipe
from ..recipe.ast import Call, Pipeline, Tier
from ..recipe.params import coerce, parse_set
from ..stages import REGISTRY, needs_of
from .bind import bind_positions
from .groups import assign_groups
from .instantiate import instantiate
from .plan import CodecPlan, LayerPlan, Plan, TierPlan
from .selectors import select_layers
from .shape import ModelShape

KERNEL_SPILL = 32  # tokens a window hands at once to a kernel-read tier: its buffers stay exact (docs/kernels.md)


def apply_sets(recipe: Recipe, sets: Iterable[str]) -> Dict[str, Any]:
    """Recipe defaults with `--set name=value` overrides applied (type-checked)."""
    values = {name: p.default for name, p in recipe.params.items()}
    for text in sets or ():
        name, raw = parse_set(text)
        where = Location("--set", field=name)
        if name not in recipe.params:
            raise RecipeError(
                f"recipe '{recipe.name}' has no parameter '{name}'",
                where,
                nearest(name, recipe.params) if recipe.params else "this recipe takes no parameters",
            )
        values[name] = coerce(recipe.params[name], raw, where)
    return values


def compile_recipe(recipe: Recipe, shape: ModelShape, sets: Iterable[str] = (), hook: bool = True) -> Plan:
    base = apply_sets(recipe, sets)
    per_layer: List[Tuple[Pipeline, Dict[str, Any]]] = [(recipe.pipeline, dict(base)) for _ in range(shape.n_layers)]
    for override in recipe.layers:
        for i in select_layers(override.selector, shape, override.where):
            pipeline, params = per_layer[i]
            params = {**params, **{k: v for k, v in override.params.items() if k not in _set_names(sets)}}
            per_layer[i] = (override.pipeline or pipeline, params)
    layers = tuple(_lower_layer(i, pipe, params, recipe, shape, hook) for i, (pipe, params) in enumerate(per_layer))
    layers = assign_groups(layers, [pipe for pipe, _ in per_layer])  # cross-layer groups (xquant)
    return Plan(recipe.name, shape, layers, base)


def _set_names(sets) -> set:
    return {parse_set(s)[0] for s in sets or ()}


def _lower_layer(
    index: int, pipeline: Pipeline, params: Dict[str, Any], recipe: Recipe, shape: ModelShape, hook: bool
) -> LayerPlan:
    head_dim = shape.head_dim[index]
    raw = [_lower_tier(t, params, recipe, index, shape, head_dim) for t in pipeline.tiers]
    _check_stores(raw, pipeline.tiers, shape.n_kv_heads[index], head_dim)
    tiers = _check_order(raw, pipeline.tiers)
    needs = frozenset().union(*(needs_of(s) for t in tiers for s in _stages_of(t)))
    if "attention" in needs and not hook:
        stage = next(s for t in tiers for s in _stages_of(t) if "attention" in needs_of(s))
        raise RecipeError(
            f"stage '{stage.stage_name}' scores tokens by real attention, which needs the attention hook",
            pipeline.tiers[0].pos,
            "keep the hook installed: the default of veloxquant.make_prompt_cache; on the command line, drop --no-hook",
        )
    return LayerPlan(index, shape.n_kv_heads[index], head_dim, shape.windows[index], tuple(tiers), needs)


def _check_stores(tiers: List[TierPlan], ast_tiers, n_kv_heads: int, head_dim: int) -> None:
    """Stores held by their own tier kind (`latent`) stand in the last tier, which keeps
    every token it gets; stores that code heads together check the layer's heads."""
    for i, (tier, node) in enumerate(zip(tiers, ast_tiers)):
        for codec, calls in ((tier.keys, node.keys), (tier.values, node.values)):
            if codec is None:
                continue
            name = codec.store.stage_name
            call = next((c for c in (calls or ()) + node.stages if c.name == name), node)
            if getattr(codec.store, "tier_kind", None) and (i < len(tiers) - 1 or tier.route is not None):
                raise RecipeError(
                    f"'{name}' fits its basis once and keeps every token that reaches it, so it "
                    "must stand in the last tier, without a route",
                    call.pos,
                    f"e.g. recent(128) >> keys: {name}(...) values: fp16",
                )
            problem = getattr(codec.store, "check_heads", lambda h, d: "")(n_kv_heads, head_dim)
            if problem:
                raise RecipeError(f"'{name}' cannot code this model's heads: {problem}", call.pos)


def _stages_of(tier: TierPlan):
    out = [tier.route] if tier.route is not None else []
    for codec in (tier.keys, tier.values):
        if codec:
            out += list(codec.transforms) + [codec.store]
    return out


def _lower_tier(tier: Tier, params, recipe, layer, shape, head_dim) -> TierPlan:
    stages = [instantiate(c, params, recipe, layer, shape) for c in tier.stages]
    route = None
    if stages and REGISTRY[stages[0][1].stage_name].family == "route":
        route = stages.pop(0)[1]
    for call, inst in stages:
        if REGISTRY[inst.stage_name].family == "route":
            raise RecipeError(
                f"'{call.name}' decides which tokens a tier holds, so it must come first in its tier",
                call.pos,
                f"start a new tier with '>> {call.name}(...)'",
            )
    if route is not None and route.stage_name == "drop":
        if stages or tier.keys is not None:
            raise RecipeError("'drop' discards tokens, so it takes no codec stages", tier.pos)
        return TierPlan(route, None, None)
    if tier.keys is not None:
        k_stages = stages + [instantiate(c, params, recipe, layer, shape) for c in tier.keys]
        v_stages = stages + [instantiate(c, params, recipe, layer, shape) for c in tier.values]
    else:
        k_stages = v_stages = stages
    k = _codec(bind_positions(k_stages, "keys", route, layer, shape), head_dim, tier.pos)
    v = _codec(bind_positions(v_stages, "values", route, layer, shape), head_dim, tier.pos)
    return TierPlan(route, k, v)


def _codec(stages: List[Tuple[Call, Any]], head_dim: int, where: Location) -> CodecPlan:
    transforms, store, residuals, entropy = [], None, [], []
    for call, inst in stages:
        family = REGISTRY[inst.stage_name].family
        if entropy and family != "entropy":
            raise RecipeError(
                f"'{call.name}' follows the entropy stage '{entropy[-1][0].name}', but entropy stages "
                "code the finished integer codes",
                call.pos,
                f"put '{call.name}' before '{entropy[0][0].name}'",
            )
        if family == "transform":
            if store is not None:
                raise RecipeError(
                    f"'{call.name}' transforms real values, but '{store.stage_name}' before it already stored them",
                    call.pos,
                    f"put '{call.name}' before '{store.stage_name}'",
                )
            transforms.append(inst)
        elif family == "store":
            if store is not None:
                raise RecipeError(
                    f"a codec holds values once; '{call.name}' follows '{store.stage_name}'",
                    call.pos,
                    "use one store stage (fp16, identity, affine, ...) per codec",
                )
            store = inst
        elif family == "residual":
            if store is None:
                raise RecipeError(
                    f"'{call.name}' codes what a store before it left over, but none comes before it",
                    call.pos,
                    "put a store stage such as lloydmax(bits=2) or affine(bits=2) before it",
                )
            residuals.append(inst)
        elif family == "entropy":
            if store is None or not getattr(store, "codes", False):
                raise RecipeError(
                    f"'{call.name}' entropy-codes integer codes, but "
                    f"{'nothing' if store is None else repr(store.stage_name)} before it yields codes",
                    call.pos,
                    "put a quantizer such as affine(bits=2) before it",
                )
            if entropy and getattr(entropy[-1][1], "coder", False):
                raise RecipeError(
                    f"'{call.name}' follows the coder '{entropy[-1][0].name}', whose output is bytes, not codes",
                    call.pos,
                    f"end the codec with '{entropy[-1][0].name}'",
                )
            entropy.append((call, inst))
        problem = getattr(inst, "check_head_dim", lambda d: "")(head_dim)
        if problem:
            raise RecipeError(f"'{call.name}' cannot code this model's heads: {problem}", call.pos)
    if entropy and not getattr(entropy[-1][1], "coder", False):
        call = entropy[-1][0]
        raise RecipeError(
            f"'{call.name}' prepares codes for an entropy coder, but no coder follows it",
            call.pos,
            f"add a coder after it, e.g. '{call.name} | rans'",
        )
    if store is None:
        store = REGISTRY["fp16"].cls()  # a tier with no store holds 16-bit values
    return CodecPlan(tuple(transforms), store, residuals=tuple(residuals), entropy=tuple(i for _, i in entropy))


def _check_order(tiers: List[TierPlan], ast_tiers) -> List[TierPlan]:
    """Where tokens go between tiers, and whether they arrive in whole groups."""
    out = []
    for i, (tier, node) in enumerate(zip(tiers, ast_tiers)):
        last = i == len(tiers) - 1
        if tier.drops and not last:
            raise RecipeError(
                "nothing comes after 'drop': it discards every token that reaches it",
                ast_tiers[i + 1].pos,
                "remove the tiers after 'drop'",
            )
        if tier.route is None and not last:
            raise RecipeError(
                "this tier has no routing stage, so it holds every token that reaches it and the "
                "tiers after it would stay empty",
                node.pos,
                "begin this tier with recent(N) or sink(N), or make it the last tier",
            )
        if getattr(tier.route, "per_head", False):
            if not last:
                raise RecipeError(
                    f"'{tier.name}' discards the tokens it evicts, so it must be the last tier",
                    ast_tiers[i + 1].pos,
                    f"remove the tiers after '{tier.name}'",
                )
            held = [
                c.store
                for c in (tier.keys, tier.values)
                if getattr(c.store, "fitted_once", False) or getattr(c.store, "scored", False)
            ]
            if held:
                raise RecipeError(
                    f"'{held[0].stage_name}' keeps per-tier state (fitted levels, gathered scores), "
                    f"which a '{tier.name}' tier does not hold yet",
                    node.pos,
                    "use a stateless codec here, e.g. affine(bits=4, axis=token) | sparse(0.01)",
                )
            if _multiple(tier) > 1:
                raise RecipeError(
                    f"'{tier.name}' keeps different tokens in each head, so its codec must code "
                    f"tokens one by one, not {_multiple(tier)} at a time",
                    node.pos,
                    "use a per-token codec, e.g. affine(bits=4, axis=token)",
                )
        if tier.route is not None and tier.route.bounded and last:
            raise RecipeError(
                f"tokens leaving '{tier.name}' have nowhere to go",
                node.pos,
                "add a tier after it, e.g. '>> drop' or '>> affine(bits=2)'",
            )
        multiple = _multiple(tier)
        if multiple > 1:
            prev = tiers[i - 1] if i else None
            if prev is None or prev.route is None or prev.route.stage_name != "recent":
                raise RecipeError(
                    f"this tier quantizes {multiple} tokens at a time, so tokens must reach it in whole groups",
                    node.pos,
                    "put a recent(N) tier before it",
                )
            if tier.route is not None and tier.route.stage_name == "sink":
                raise RecipeError("a sink tier holds single tokens; give it a per-token codec", node.pos)
        nxt = tiers[i + 1] if not last else None
        chunk = math.lcm(multiple, _multiple(nxt) if nxt is not None else 1)
        if nxt is not None and nxt.plain_affine and tier.route is not None and tier.route.stage_name == "recent":
            chunk = math.lcm(chunk, KERNEL_SPILL)  # the kernel's tier then holds exact buffers (docs/kernels.md)
        out.append(_with_impl(attrs.evolve(tier, chunk=chunk)))
    return out


def _with_impl(tier: TierPlan) -> TierPlan:
    """Pick how the tier's attention runs: a fused kernel where one is verified."""
    if tier.drops or getattr(tier.route, "per_head", False):
        return tier  # per-head tiers attend with masks by position: no fused kernel yet
    plain_affine = all(
        not c.transforms and not c.residuals and c.store.stage_name == "affine" for c in (tier.keys, tier.values)
    )
    backend = dispatch.backend()
    if plain_affine and verified("v1", backend):
        impl = f"{backend}:affine_attention"
    elif plain_affine and mlx_attend(backend):  # MLX's own kernels (kernels/mlx_affine.py), where its scope allows
        impl = f"{backend}:{mlx_attend(backend)} (mx.quantized_matmul)"
    else:
        return tier
    return attrs.evolve(tier, keys=attrs.evolve(tier.keys, impl=impl), values=attrs.evolve(tier.values, impl=impl))


def _multiple(tier: Optional[TierPlan]) -> int:
    if tier is None or tier.drops:
        return 1
    return math.lcm(tier.keys.token_multiple, tier.values.token_multiple)
