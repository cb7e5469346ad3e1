"""Deferred scoring for every-step eviction with slack (`evict(slack=s)`, runtime/eviction/head_tier.py).

A decode step of such a layer attends through fused SDPA, as if nothing were
scored, and holds its query. The weights the held queries gave are computed in
one block, and fed to the scorers, just before a head is cut (or when `slack`
queries wait). This is exact: between cuts nothing leaves the layer, so a held
query's softmax over what the layer holds now, masked causally by position, is
the one it had at its own step; and the scorers that allow it fold the weights
as a sum (`received`) and the newest `rows` rows, which a block of queries
gives as its steps would have (tests/test_deferred.py pins it against the
per-step path). Decode then costs what an unscored layer costs, plus one
concatenated query per step (docs/eviction.md, "Decode speed: slack").
"""

from typing import List, Optional, Tuple

import mlx.core as mx

ALLOWED_NEEDS = frozenset({"weights"})  # scorers fed only this step's weights (received, rows)


def defers(listeners: List, Lq: int) -> bool:
    """This step's scoring can wait: one query, and every listening tier cuts with slack, once its
    prompt is over (no budgets still being collected), from weights alone."""
    return (
        Lq == 1
        and bool(listeners)
        and all(
            t.route.slack and not t.route.once and not t.collecting and t.needs <= ALLOWED_NEEDS for t, _ in listeners
        )
    )


def hold(cache, queries: mx.array, first_q: int) -> None:
    held = _held(cache)
    if not held:
        cache.held_first_q = first_q
    held.append(queries)


def due(cache) -> bool:
    """Before a layer settles (and may cut): the held queries must be scored if a cut is due, or if as
    many queries wait as the largest slack (so a head under its budget holds a bounded list).
    per_head.settle_held scores them (this module only holds them: per_head imports it)."""
    held = _held(cache)
    if not held:
        return False
    tiers = [t for t in cache.tiers if t.per_head]
    return len(held) >= max(t.route.slack for t in tiers) or any(t.cut_due() for t in tiers)


def take(cache) -> Optional[Tuple[mx.array, int]]:
    """The held queries as one block and the position of the first, forgotten here; None if none."""
    held = _held(cache)
    if not held:
        return None
    queries = held[0] if len(held) == 1 else mx.concatenate(held, axis=2)
    cache.held_queries = []
    return queries, cache.held_first_q


def rewind(cache, n: int) -> None:
    """A trim of n positions: the newest n held queries are forgotten, unscored."""
    held = _held(cache)
    cache.held_queries = held[: max(0, len(held) - n)]


def nbytes(cache) -> int:
    return sum(q.nbytes for q in _held(cache))


def _held(cache) -> List[mx.array]:
    return cache.__dict__.setdefault("held_queries", [])
