"""Layers that attend over another layer's cache (Gemma 4's KV-shared layers).

Such a layer gets no cache from the model (it pads the cache list with None): it attends with the keys
and values its owner layer's update_and_fetch returned. Those are the owner's newest block only once the
hook answers attention from the tiers, so the hook remembers, per lending cache, the keys its own
attention call was given, and answers a cache-less call with those very keys from the owner's tiers,
with the shared layer's queries. Scorers see the owner's queries only (observe=False): a shared layer
reads the tokens its owner keeps. The registry holds weak references: the model keeps the keys alive for
its pass (it hands them on to the shared layers), and once the pass returns they are freed, so no key
block outlives the step outside the caches' nbytes.
"""

import weakref

_LENT = weakref.WeakKeyDictionary()  # lending cache -> a weak reference to the keys its own attention call last got


def lend(cache, keys) -> None:
    _LENT[cache] = weakref.ref(keys)


def lender(keys):
    """The cache whose owner layer last attended with exactly `keys`, or None."""
    for cache, lent in list(_LENT.items()):
        if lent() is keys:
            return cache
    return None


def lending() -> bool:
    return bool(_LENT)


def lent_blocks() -> list:
    """The lent key blocks still alive (none once the model's pass has returned and dropped them)."""
    return [k for k in (ref() for ref in list(_LENT.values())) if k is not None]
