"""Deep copies of caches, as mlx-lm makes them (LRUPromptCache, BatchGenerator, evaluate.py).

Held arrays are copied; what is frozen (the compiled plan, stage objects, dtypes,
kernel choices) is shared, since it never changes and some of it (mx.Dtype,
compiled functions) cannot be copied. Everything else goes through `memo`, so a
deep copy of a model's list of caches keeps its cross-layer coordinator and
links inside the copy, never pointing back at the original.
"""
import copy


def copy_sharing(obj, memo, shared=(), reset=None):
    """A deep copy of `obj` whose attributes named in `shared` are the same objects,
    and those in `reset` start from the given values (caches recomputed on use)."""
    new = obj.__class__.__new__(obj.__class__)
    memo[id(obj)] = new
    reset = reset or {}
    for name, value in obj.__dict__.items():
        if name in reset:
            value = copy.copy(reset[name])
        elif name not in shared:
            value = copy.deepcopy(value, memo)
        new.__dict__[name] = value
    return new
