"""Recipe + model -> the per-layer caches mlx-lm is handed as `prompt_cache`."""
from typing import Iterable, List, Union

from ..compiler import ModelShape, Plan, compile_recipe
from ..compiler.binding import bind
from ..compiler.layout import own_caches
from ..errors import VeloxError
from ..recipe import Recipe, load_recipe
from . import cache_list, hook
from .cache import TieredCache
from .coordinator import link_groups
from .eviction import model_pass


def plan_for(model, recipe: Union[str, Recipe], sets: Iterable[str] = (), use_hook: bool = True) -> Plan:
    recipe = load_recipe(recipe) if isinstance(recipe, str) else recipe
    plan = compile_recipe(recipe, ModelShape.from_model(model), sets, hook=use_hook)
    return bind(plan, model)  # calibrated stages: their artifact for this model, or a clear error


def caches_for(plan: Plan) -> List[TieredCache]:
    caches = [TieredCache(layer) for layer in plan.layers]
    for c in caches:
        c.fingerprint = plan.fingerprint
        c.plan_root = plan
    link_groups(plan, caches)  # cross-layer groups (xquant): one coordinator shared by the caches
    return caches


def make_prompt_cache(model, recipe: Union[str, Recipe] = "fp16", sets: Iterable[str] = (),
                      use_hook: bool = True, tokenizer=None) -> list:
    """`model`'s cache list under `recipe` (a built-in name or a path): a TieredCache for each attention
    cache of the model's own make_cache(); a hybrid model's non-attention state caches are its own,
    untouched; Gemma 4's KV-shared layers attend over their owners' caches (compiler/layout.py).

    With `use_hook` (the default) attention is routed to the caches
    (veloxquant.uninstall(model) undoes it); without it the caches return
    decoded K/V to mlx-lm's own attention. `tokenizer` tokenizes the prompt of a
    model pass the caches run (KVzip's repeat instruction); models loaded with
    veloxquant.models.load_model bring their own.
    """
    plan = plan_for(model, recipe, sets, use_hook)
    caches = prompt_caches(model, plan, tokenizer)
    if use_hook:
        hook.install(model)
    return caches


def prompt_caches(model, plan: Plan, tokenizer=None) -> list:
    """A fresh cache list for `model` from its compiled `plan`, laid out as the model's own make_cache()
    lays it out (make_prompt_cache, and `veloxquant serve` for each sequence; the hook is the caller's)."""
    if not plan.shape.trivial_layout and any(model_pass.NEED in layer.needs for layer in plan.layers):
        raise VeloxError(f"recipe '{plan.recipe}' scores tokens by a pass through the model, which would run this "
                         "model's non-attention or KV-shared layers outside their own caches: not supported "
                         "on this layout (see `veloxquant explain --model`)")
    caches = caches_for(plan)
    model_pass.attach(model, caches, tokenizer)  # recipes whose scores come from a pass through the model
    return cache_list.assemble(plan, caches, None if plan.shape.trivial_layout else own_caches(model))
