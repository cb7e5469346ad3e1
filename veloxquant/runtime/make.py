"""Recipe + model -> the per-layer caches mlx-lm is handed as `prompt_cache`."""

import importlib
from typing import Iterable, List, Union

from ..compiler import ModelShape, Plan, compile_recipe
from ..compiler.binding import bind
from ..compiler.layout import own_caches
from ..errors import VeloxError
from ..models.vlm import image_token_ids, is_vlm, text_model
from ..recipe import Recipe, load_recipe
from . import batch, cache_list, hook, sharding
from .batch_protocol import BatchProtocol
from .cache import TieredCache
from .coordinator import link_groups
from .eviction import hidden, model_pass, protected


def plan_for(model, recipe: Union[str, Recipe], sets: Iterable[str] = (), use_hook: bool = True) -> Plan:
    recipe = load_recipe(recipe) if isinstance(recipe, str) else recipe
    model = text_model(model)  # an mlx-vlm model's caches are its language model's (models/vlm.py)
    plan = compile_recipe(recipe, ModelShape.from_model(model), sets, hook=use_hook)
    return bind(plan, model)  # calibrated stages: their artifact for this model, or a clear error


def caches_for(plan: Plan) -> List[TieredCache]:
    shard = sharding.of(plan)
    if shard:
        sharding.group(shard)  # a sharded model's caches run in the launch they were made for
    caches = [TieredCache(layer) for layer in plan.layers]
    for c in caches:
        c.fingerprint = plan.fingerprint
        c.plan_root = plan
        for tier in c.tiers:
            if hasattr(tier, "shard"):  # tiers whose decisions look across a layer's heads
                tier.shard = shard
    link_groups(plan, caches)  # cross-layer groups (xquant): one coordinator shared by the caches
    return caches


def make_prompt_cache(
    model,
    recipe: Union[str, Recipe] = "fp16",
    sets: Iterable[str] = (),
    use_hook: bool = True,
    tokenizer=None,
    images: str = "keep",
) -> list:
    """`model`'s cache list under `recipe` (a built-in name or a path): a TieredCache for each attention
    cache of the model's own make_cache(); a hybrid model's non-attention state caches are its own,
    untouched; Gemma 4's KV-shared layers attend over their owners' caches (compiler/layout.py).

    With `use_hook` (the default) attention is routed to the caches
    (veloxquant.uninstall(model) undoes it); without it the caches return
    decoded K/V to mlx-lm's own attention. `tokenizer` tokenizes the prompt of a
    model pass the caches run (KVzip's repeat instruction); models loaded with
    veloxquant.models.load_model bring their own.

    An mlx-vlm model (mlx_vlm.load) gets its language model's caches, for mlx-vlm's
    generate(..., prompt_cache=caches); with `images="keep"` (the default) its eviction
    tiers keep every image token of the prompt on top of their budget
    (runtime/eviction/protected.py); `images="evict"` ranks them as any other token.
    """
    if images not in ("keep", "evict"):
        raise VeloxError(f"images={images!r}: must be 'keep' (image tokens are never evicted) or 'evict'")
    plan = plan_for(model, recipe, sets, use_hook)
    vlm, lm = is_vlm(model), text_model(model)
    if vlm and any(model_pass.NEED in layer.needs for layer in plan.layers):
        raise VeloxError(
            f"recipe '{plan.recipe}' scores tokens by a pass through the model, which would run an "
            "mlx-vlm language model on token ids without the prompt's image embeddings: not supported"
        )
    caches = prompt_caches(lm, plan, tokenizer)
    if vlm and images == "keep":
        protected.attach(lm, caches, image_token_ids(model))
    if use_hook:
        hook.install(model, hidden_states=False)
    return caches


def prompt_caches(model, plan: Plan, tokenizer=None) -> list:
    """A fresh cache list for `model` from its compiled `plan`, laid out as the model's own make_cache()
    lays it out (make_prompt_cache, and `veloxquant serve` for each sequence; the hook is the caller's)."""
    if not plan.shape.trivial_layout and any(model_pass.NEED in layer.needs for layer in plan.layers):
        raise VeloxError(
            f"recipe '{plan.recipe}' scores tokens by a pass through the model, which would run this "
            "model's non-attention or KV-shared layers outside their own caches: not supported "
            "on this layout (see `veloxquant explain --model`)"
        )
    caches = caches_for(plan)
    guard_merges()  # a refused recipe's batch fails with its reason, a VeloxError
    model_pass.attach(model, caches, tokenizer)  # recipes whose scores come from a pass through the model
    hidden.attach(model, caches)  # recipes whose scores come from the attention inputs (kvzap)
    return cache_list.assemble(plan, caches, None if plan.shape.trivial_layout else own_caches(model))


def guard_merges() -> None:
    """mlx-lm's _merge_caches (BatchGenerator, batch_generate) tests hasattr(cache, "merge") and raises its
    own ValueError ("does not yet support batching with history"), which hides the reason. Wrapped once
    (make_prompt_cache does it), it first asks veloxquant's caches and raises their BatchRefused, a
    VeloxError naming the recipe, the layer and why. mlx-lm's server decides at load, by hasattr, and
    never merges a refused recipe's caches: it serves them one sequence at a time."""
    mlx_generate = importlib.import_module("mlx_lm.generate")  # the module: mlx_lm.generate is also a function
    original = mlx_generate._merge_caches
    if getattr(original, "veloxquant_checked", False):
        return

    def _merge_caches(caches):
        for c in caches[0] if caches else ():
            if isinstance(c, BatchProtocol):
                batch.check(c)
        return original(caches)

    _merge_caches.veloxquant_checked = True
    mlx_generate._merge_caches = _merge_caches
