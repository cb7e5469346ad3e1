"""Watching what a model class's __call__ is fed, reversibly: model_pass records the prompt's ids,
protected the image placeholders' positions. Each watcher keeps its own originals, so one can be
installed or removed without the other."""

import inspect
from typing import Callable, Dict

# observe(arg, args, kwargs): arg(name) is the call's argument of that name (positional or keyword), or None
Observer = Callable[[Callable[[str], object], tuple, dict], None]


class CallWatch:
    def __init__(self):
        self.originals: Dict[type, Callable] = {}  # model class -> its own __call__, while watched

    def install(self, model, observe: Observer) -> None:
        """Wrap `model`'s class's __call__ so `observe` sees each call before the model runs it."""
        cls = type(model)
        if cls in self.originals:
            return
        original = cls.__call__
        at = {n: i for i, n in enumerate(list(inspect.signature(original).parameters)[1:])}  # after self

        def __call__(self, *args, **kwargs):
            def arg(name):
                i = at.get(name)
                return kwargs.get(name, args[i] if i is not None and len(args) > i else None)

            observe(arg, args, kwargs)
            return original(self, *args, **kwargs)

        __call__.veloxquant_original = original
        cls.__call__ = __call__
        self.originals[cls] = original

    def uninstall(self, model=None) -> None:
        """Restore the class's own __call__ (of `model`, or of every class wrapped)."""
        for cls in [type(model)] if model is not None else list(self.originals):
            if cls in self.originals:
                cls.__call__ = self.originals.pop(cls)
