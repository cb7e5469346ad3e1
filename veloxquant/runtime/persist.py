"""Save and load compressed prompt caches: safetensors, no pickle.

The file carries the compiled plan (JSON) and its fingerprint; loading rebuilds
the caches from that plan and refuses a file whose plan does not match the
recipe asked for, or whose arrays do not fit the plan.
"""

import json
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx

from ..compiler import ModelShape
from ..compiler.rebuild import plan_from_json
from ..errors import CacheFileError, VeloxError
from . import cache_list, checksums, coded, hook, kept_state, sharding
from .cache_list import kept_caches, recipe_caches
from .eviction import hidden, per_head
from .make import caches_for

FORMAT = "veloxquant-cache/2"  # /2: per-array and metadata checksums (runtime/checksums.py)


def save_prompt_cache(path: str, caches: list, metadata: Optional[Dict[str, str]] = None) -> int:
    """Write `caches` (the list make_prompt_cache returned) to `path` (.safetensors); returns the file's
    size in bytes. A hybrid model's own state caches in the list are saved beside the recipe's."""
    everything, caches = caches, recipe_caches(caches)
    plan = getattr(caches[0], "plan_root", None) if caches else None
    if (
        plan is None
        or len(kept_caches(everything)) + len(caches) != len(everything)
        or len(everything) != len(plan.shape.slots or plan.layers)
    ):
        raise VeloxError("save_prompt_cache takes the caches made by veloxquant.make_prompt_cache")
    arrays: Dict[str, mx.array] = {}
    layers = []
    for cache in caches:  # all layers first: a later layer can still change an earlier one (MiniCache's pairs)
        cache.finish_prompt()  # a saved prompt is over: prompt-time eviction (SnapKV) decides first
        per_head.score_held(cache)  # decode queries held unscored (evict(slack)) are scored into what is saved
        cache._settle()
    for i, cache in enumerate(caches):
        tiers = []
        for t, tier in enumerate(cache.tiers):
            # Tiers whose codecs have entropy stages save their codes entropy-coded.
            for name, arr in coded.encode(tier.arrays(), coded.sides_of(tier.plan)).items():
                arrays[f"{i}.{t}.{name}"] = arr
            tiers.append([tier.start, tier.count])
        layers.append({"offset": cache.offset, "dtype": str(cache.dtype).split(".")[-1], "tiers": tiers})
    meta = {
        "format": FORMAT,
        "fingerprint": plan.fingerprint,
        "recipe": plan.recipe,
        "plan": json.dumps(plan.to_dict(), default=str),
        "layers": json.dumps(layers),
    }
    if plan.shape.shard:  # a sharded model's rank holds its own kv heads: loaded on that rank of that world only
        meta["rank"], meta["world"] = (str(v) for v in plan.shape.shard)
    if not plan.shape.trivial_layout:
        meta["kept"] = json.dumps(kept_state.save(kept_caches(everything), arrays))
    meta.update({f"user.{k}": str(v) for k, v in (metadata or {}).items()})
    mx.save_safetensors(str(path), arrays, checksums.sign(arrays, meta))
    return Path(path).stat().st_size


def load_prompt_cache(path: str, expect_fingerprint: Optional[str] = None, model=None) -> Tuple[list, Dict[str, str]]:
    """Rebuild the caches saved at `path`, laid out as make_prompt_cache laid them out; returns
    (caches, user metadata).

    Given `model`, checks the file was made for a model of its shape and installs the
    attention hook, as make_prompt_cache does. Without it, a recipe whose scorers need the
    hook (h2o, tova, snapkv, pyramidkv) is refused unless the hook is already installed."""
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
    except (OSError, RuntimeError, ValueError) as e:
        raise CacheFileError(f"{path}: not a readable safetensors cache file ({e})") from None
    if meta.get("format") != FORMAT:
        raise CacheFileError(
            f"{path}: not a veloxquant cache (format {meta.get('format')!r}, expected {FORMAT!r}; "
            "files saved before checksums (/1) must be saved again)"
        )
    damaged = checksums.problem(arrays, meta)
    if damaged:
        raise CacheFileError(f"{path}: {damaged}")
    try:
        plan = plan_from_json(meta["plan"], meta.get("recipe", "saved"))
        layers = json.loads(meta["layers"])
    except (KeyError, ValueError, TypeError, VeloxError) as e:
        raise CacheFileError(f"{path}: corrupt plan metadata ({e})") from None
    if plan.fingerprint != meta.get("fingerprint"):
        raise CacheFileError(f"{path}: the stored plan does not hash to the stored fingerprint (corrupt file)")
    if expect_fingerprint is not None and expect_fingerprint != plan.fingerprint:
        raise CacheFileError(
            f"{path}: made by recipe '{plan.recipe}' (fingerprint {plan.fingerprint}); the recipe asked for "
            f"compiles to fingerprint {expect_fingerprint}. Re-run the prompt with this recipe instead."
        )
    shard = tuple(int(meta[k]) for k in ("rank", "world") if k in meta)
    problem = sharding.mismatch(shard) or (
        ""
        if shard == plan.shape.shard
        else f"rank/world metadata differ from the stored plan's {plan.shape.shard} (corrupt file)"
    )
    if problem:
        raise CacheFileError(f"{path}: {problem}")
    _check_model(path, plan, model)
    caches = caches_for(plan)
    if len(layers) != len(caches):
        raise CacheFileError(f"{path}: {len(layers)} layers saved but the plan has {len(caches)}")
    for i, (cache, info) in enumerate(zip(caches, layers)):
        cache.offset = int(info["offset"])
        cache.dtype = getattr(mx, info.get("dtype", "float16"))
        for t, (tier, (start, count)) in enumerate(zip(cache.tiers, info["tiers"])):
            mine = {k.split(".", 2)[2]: v for k, v in arrays.items() if k.startswith(f"{i}.{t}.")}
            try:
                mine = coded.decode(mine, coded.sides_of(tier.plan), int(count))
            except coded.CodedStreamError as e:
                raise CacheFileError(f"{path}: layer {i} tier {t} ({tier.plan.name}): {e}") from None
            problem = tier.restore(int(start), int(count), mine)
            if problem:
                raise CacheFileError(f"{path}: layer {i} tier {t} ({tier.plan.name}): {problem}")
    coordinator = getattr(caches[0], "coordinator", None) if caches else None
    for problem in coordinator.problems() if coordinator else ():
        raise CacheFileError(f"{path}: {problem}")  # re-linked, but the groups' tiers do not add up
    user = {k[5:]: v for k, v in meta.items() if k.startswith("user.")}
    kept = None
    if not plan.shape.trivial_layout:
        try:
            kept = kept_state.load(json.loads(meta["kept"]), arrays, len(plan.shape.slots))
        except (KeyError, ValueError, TypeError) as e:
            raise CacheFileError(f"{path}: corrupt state of the model's own caches ({e})") from None
    try:
        caches = cache_list.assemble(plan, caches, kept)
    except VeloxError as e:
        raise CacheFileError(f"{path}: {e}") from None
    if model is not None:
        hook.install(model, hidden_states=False)
        hidden.attach(model, caches)  # a next prompt's kvzap scores read the attention inputs
    return caches, user


def _check_model(path: str, plan, model) -> None:
    if model is not None:
        shape = ModelShape.from_model(model)
        mine = (shape.n_kv_heads, shape.head_dim, shape.windows, shape.slots, shape.readers, shape.shard)
        if mine != (
            plan.shape.n_kv_heads,
            plan.shape.head_dim,
            plan.shape.windows,
            plan.shape.slots,
            plan.shape.readers,
            plan.shape.shard,
        ):
            raise CacheFileError(
                f"{path}: made for a model with {len(plan.shape.head_dim)} layers, kv heads "
                f"{_runs(plan.shape.n_kv_heads)}, head_dim {_runs(plan.shape.head_dim)}; the model given has "
                f"{len(shape.head_dim)} layers, kv heads {_runs(shape.n_kv_heads)}, head_dim {_runs(shape.head_dim)}"
                + (
                    ""
                    if mine[3:5] == (plan.shape.slots, plan.shape.readers)
                    else f"; cache layout: the file's {plan.shape.layout_text()}, the model's {shape.layout_text()}"
                )
                + (
                    ""
                    if shape.shard == plan.shape.shard
                    else f"; sharding: the file's {_sharded(plan.shape.shard)}, the model's {_sharded(shape.shard)}"
                )
            )
    elif any("attention" in layer.needs for layer in plan.layers) and not hook.any_installed():
        raise VeloxError(
            f"{path}: recipe '{plan.recipe}' scores tokens by the model's real attention, which needs "
            "the attention hook: pass the model (veloxquant.load_prompt_cache(path, model=model)) "
            "and the hook is installed for it"
        )


def _sharded(shard) -> str:
    return f"rank {shard[0]} of {shard[1]}" if shard else "not sharded"


def _runs(values) -> str:
    return str(values[0]) if len(set(values)) == 1 else str(list(values))
