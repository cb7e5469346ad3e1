"""Deep copies of caches, as mlx-lm makes them (LRUPromptCache, BatchGenerator, evaluate.py).

Held arrays are copied; what is frozen (the compiled plan, stage objects, dtypes,
kernel choices) is shared, since it never changes and some of it (mx.Dtype,
compiled functions) cannot be copied. Everything else goes through `memo`, so a
deep copy of a model's list of caches keeps its cross-layer coordinator and
links inside the copy, never pointing back at the original.
"""

import copy
import weakref


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


def copy_owned(obj, memo, owner_attr: str):
    """A deep copy of `obj`, which its owner holds and which refers back to the owner
    through the weak reference `owner_attr` (a strong one would be a cycle: a dropped cache
    would keep its arrays until Python's cyclic collector ran). The copy refers to the
    owner's copy; weakrefs would deep-copy as themselves, i.e. to the original."""
    new = copy_sharing(obj, memo, shared=(owner_attr,))
    ref = getattr(obj, owner_attr)  # None: no owner yet
    setattr(new, owner_attr, ref and weakref.ref(copy.deepcopy(ref(), memo)))
    return new
