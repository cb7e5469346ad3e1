"""The hidden states a layer's attention is called with, handed to the scorers that read them (KVzap).

mlx-lm's attention modules are called as `self_attn(x, mask, cache)` with x the
layer's input after its norm; the cache then sees only the keys and values made
from x. Scorers that declare the need "hidden" (runtime/eviction/scorers/kvzap.py)
score each token from x, so, with the attention hook (hook.install calls
`install`), each attention class's __call__ is wrapped (reversibly, as the model
pass records ids: runtime/eviction/model_pass.py) to hand x to the listening
tiers of the cache it is called with, before the cache is updated. The scorer
turns it into scores at once and keeps nothing of it. Only caches with such a
tier install the watch (`attach`): other recipes' attention calls are not wrapped.
"""

import inspect
from contextlib import contextmanager
from typing import Callable, List

from .call_watch import CallWatch

NEED = "hidden"
_WATCH = CallWatch()  # the attention classes whose calls are watched
_TAPS: List[Callable] = []  # fn(cache, x) also told of every call (calibration records with it: `tapped`)


def attention_modules(model) -> List:
    """The modules of `model` that attend with a cache: a layer's `self_attn` / `attention`, called with `cache`."""
    named = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in ("self_attn", "attention")]
    takes = {cls: "cache" in inspect.signature(cls.__call__).parameters for cls in {type(m) for m in named}}
    return [m for m in named if takes[type(m)]]


def attach(model, caches) -> None:
    """Watch `model`'s attention calls where some tier of `caches` reads hidden states."""
    if any(NEED in getattr(t, "needs", ()) for c in caches for t in getattr(c, "tiers", ())):
        install(model)


def install(model) -> None:
    """Wrap the attention classes of `model` (once per class)."""
    for module in attention_modules(model):
        _WATCH.install(module, _observe)


@contextmanager
def tapped(model, fn: Callable):
    """Meanwhile `fn(cache, x)` sees every attention call of `model` (one watch for both uses: two
    wrappers of one class, removed out of order, would drop each other)."""
    install(model)
    _TAPS.append(fn)
    try:
        yield
    finally:
        _TAPS.remove(fn)


def _observe(arg, args, kwargs) -> None:
    cache = arg("cache")
    for fn in _TAPS:
        fn(cache, args[0] if args else arg("x"))
    tiers = getattr(cache, "tiers", None)
    if not tiers:
        return
    for t in tiers:
        if NEED in getattr(t, "needs", ()):
            t.scorer.hear(args[0] if args else arg("x"))


def uninstall(model=None) -> None:
    """Restore the attention classes' own __call__ (of `model`, or every class wrapped)."""
    if model is None:
        _WATCH.uninstall()
        return
    for module in attention_modules(model):
        _WATCH.uninstall(module)
