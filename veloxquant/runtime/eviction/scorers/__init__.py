"""Eviction scorers: one small module per way of ranking the tokens a head keeps.

A scorer declares what it needs, and `runtime/eviction/per_head.py` gathers exactly
that and hands it over in a `Seen`; the scorer folds it into per-head state
(the tier's `score` array, extra per-token arrays it names in `token_state`,
or its own small arrays) and ranks tokens when the tier evicts. per_head never
branches on which scorer it feeds.

Needs:
  "weights"   this step's softmax weights, received per token (summed over the
              queries and the GQA group) and the newest `rows` query rows;
              the layer then computes attention with an explicit softmax
  "queries"   this step's real queries [B, Hq, Lq, D] and their first position
  "new_keys"  the keys of the block just placed [B, Hkv, n, D]
Every scorer may also read the tier's own keys and values when it ranks.

Modules in this package register with @scorer(name) under a name declared in
stages/scorers.py, which holds the scorer's needs, parameters and per-token
state (the stage layer validates recipes with it); they are discovered, so a
new scorer is one new module here and one line there.
"""

import importlib
import pkgutil
from typing import Tuple

from .base import SCORERS, QueryWindowScorer, Scorer, Seen, observers, scorer
from .votes import Voted

__all__ = ["SCORERS", "QueryWindowScorer", "Scorer", "Seen", "observers", "scorer", "names", "make"]


def names() -> Tuple[str, ...]:
    _discover()
    return tuple(sorted(SCORERS))


def make(route) -> Scorer:
    _discover()
    base = SCORERS[route.score](route)
    if getattr(route, "votes", 0) > 0:  # SnapKV's window votes take a share of the budget (votes.py)
        return Voted(route, base)
    return base


_found = False


def _discover() -> None:
    global _found
    if _found:
        return
    _found = True
    for info in pkgutil.iter_modules(__path__, prefix=__name__ + "."):
        importlib.import_module(info.name)
