"""Layers that attend over another layer's cache (Gemma 4's KV-shared layers).

Such a layer gets no cache from the model (it pads the cache list with None): it attends with the keys
and values its owner layer's update_and_fetch returned. Those are the owner's newest block only once the
hook answers attention from the tiers, so the hook remembers, per lending cache, the keys its own
attention call was given, and answers a cache-less call with those very keys from the owner's tiers,
with the shared layer's queries. Scorers see the owner's queries only (observe=False): a shared layer
reads the tokens its owner keeps.
"""
import weakref

_LENT = weakref.WeakKeyDictionary()  # lending cache -> the keys its own attention call last got


def lend(cache, keys) -> None:
    _LENT[cache] = keys


def lender(keys):
    """The cache whose owner layer last attended with exactly `keys`, or None."""
    for cache, lent in list(_LENT.items()):
        if lent is keys:
            return cache
    return None


def lending() -> bool:
    return bool(_LENT)
