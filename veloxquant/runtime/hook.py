"""The attention hook: routes mlx-lm's attention to the cache, reversibly.

mlx-lm model files import `scaled_dot_product_attention` by name from
`mlx_lm.models.base`, so the name is rebound in each model module that uses
it. Caches with `attend` answer attention themselves (seeing real queries);
any other cache falls through to mlx-lm's original function.
"""

import sys
from typing import Dict

from . import shared_kv
from .eviction import hidden, model_pass, protected

_ORIGINALS: Dict[str, object] = {}
_NAME = "scaled_dot_product_attention"
NOT_ROUTED = (
    "this '{recipe}' cache scores tokens by the model's real attention, but attention did not come "
    "through it (the attention hook is not installed for this model): load a saved cache with "
    "veloxquant.load_prompt_cache(path, model=model), or call veloxquant.install(model) first"
)
EPOCH = [0]  # bumped by every install/uninstall: caches trust the hook only within one epoch (EPOCH[0])


def epoch() -> int:
    return EPOCH[0]


def _routed(original):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None, **kwargs):
        attend = getattr(cache, "attend", None)
        if attend is not None:
            if getattr(cache, "lends", False):  # later layers attend over this one's cache (runtime/shared_kv.py)
                shared_kv.lend(cache, keys)
            return attend(queries, scale=scale, mask=mask, sinks=sinks)
        if cache is None and shared_kv.lending():
            owner = shared_kv.lender(keys)
            if owner is not None:  # a KV-shared layer: its owner's tiers answer, with this layer's queries
                return owner.attend(queries, scale=scale, mask=mask, sinks=sinks, observe=False)
        if sinks is not None:
            kwargs["sinks"] = sinks
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)

    scaled_dot_product_attention.veloxquant_original = original
    return scaled_dot_product_attention


def model_modules(model):
    """The python modules whose classes make up `model`."""
    names = {type(m).__module__ for _, m in model.named_modules()} | {type(model).__module__}
    return [sys.modules[n] for n in sorted(names) if n in sys.modules]


def install(model, hidden_states: bool = True) -> int:
    """Route attention of every module of `model`; returns how many were rebound. With `hidden_states`,
    also hand each attention call's inputs to the scorers that read them (kvzap): a caller that built
    the caches (make_prompt_cache, load_prompt_cache) passes False and attaches that watch only where
    a cache needs it (runtime/eviction/hidden.py), so other recipes' attention calls stay unwrapped."""
    count = 0
    for module in model_modules(model):
        current = getattr(module, _NAME, None)
        if current is None or hasattr(current, "veloxquant_original"):
            continue
        _ORIGINALS[module.__name__] = current
        setattr(module, _NAME, _routed(current))
        count += 1
    if hidden_states:
        hidden.install(model)
    EPOCH[0] += 1
    return count


def any_installed() -> bool:
    """Some model's attention is routed (a cache cannot tell which model it serves)."""
    return bool(_ORIGINALS)


def installed(model) -> bool:
    return any(hasattr(getattr(m, _NAME, None), "veloxquant_original") for m in model_modules(model))


def uninstall(model=None) -> None:
    """Restore mlx-lm's attention (in the modules of `model`, or everywhere)."""
    names = [m.__name__ for m in model_modules(model)] if model is not None else list(_ORIGINALS)
    for name in names:
        if name in _ORIGINALS and name in sys.modules:
            setattr(sys.modules[name], _NAME, _ORIGINALS.pop(name))
    EPOCH[0] += 1
    model_pass.uninstall(model)  # and the prompt-id recording of a model pass (runtime/eviction/model_pass.py)
    protected.uninstall(getattr(model, "language_model", model) if model is not None else None)  # image tokens
    hidden.uninstall(model)  # and the attention inputs handed to scorers (runtime/eviction/hidden.py)
