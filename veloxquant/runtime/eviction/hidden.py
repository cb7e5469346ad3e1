"""The hidden states a layer's attention is called with, handed to the scorers that read them (KVzap).

mlx-lm's attention modules are called as `self_attn(x, mask, cache)` with x the
layer's input after its norm; the cache then sees only the keys and values made
from x. Scorers that declare the need "hidden" (runtime/eviction/scorers/kvzap.py)
score each token from x, so each attention class's __call__ is wrapped
(reversibly, as the model pass records ids: runtime/eviction/model_pass.py) to
hand x to the tiers of the cache it is called with, before the cache is
updated. The scorer turns it into scores at once and keeps nothing of it.
"""

from typing import List

from .call_watch import CallWatch

NEED = "hidden"
_WATCH = CallWatch()  # the attention classes whose calls are watched


def attention_modules(model) -> List:
    """The attention module of each of the model's (text model's) layers."""
    layers = getattr(model, "layers", None)
    if layers is None:
        layers = getattr(getattr(model, "model", None), "layers", [])
    found = (getattr(layer, name, None) for layer in layers for name in ("self_attn", "attention"))
    return [m for m in found if m is not None]


def listeners(cache) -> List:
    return [t for t in getattr(cache, "tiers", ()) if NEED in t.needs]


def attach(model, caches) -> None:
    """Wrap the model's attention classes if a tier of `caches` scores from hidden states
    (make_prompt_cache and load_prompt_cache call this)."""
    if any(listeners(c) for c in caches):
        for module in attention_modules(model):
            _WATCH.install(module, _observe)


def _observe(arg, args, kwargs) -> None:
    tiers = listeners(arg("cache"))
    if tiers:
        x = args[0] if args else arg("x")
        for t in tiers:
            t.scorer.hear(x)


def uninstall(model=None) -> None:
    """Restore the attention classes' own __call__ (of `model`, or every class wrapped)."""
    if model is None:
        _WATCH.uninstall()
        return
    for module in attention_modules(model):
        _WATCH.uninstall(module)
