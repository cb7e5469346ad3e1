"""What each eviction scorer is, as the stage layer sees it: what it needs gathered, and its parameters.

The scorers themselves (runtime/eviction/scorers/, one module each) rank tokens; they
register under a name declared here and take their `needs` and per-token state
from this table, so `evict` validates `score=` and its parameters, and
`explain` prices a scorer, without importing the runtime that runs them.

params: the `evict` fields the scorer reads. `evict` keeps the routing fields
(budget, sinks, recent, once, slack, heads, votes, ...) for every scorer; a
scorer parameter set away from its default on a scorer that does not read it is
an error naming the scorers that do.
"""

from typing import Callable, Dict, FrozenSet, Tuple

import attrs


def _no_token_state(route) -> Dict[str, Tuple[int, ...]]:
    return {}


@attrs.frozen
class ScorerSpec:
    name: str
    needs: FrozenSet[str] = frozenset()  # what per_head gathers for it (runtime/eviction/scorers/__init__.py)
    params: Tuple[str, ...] = ()
    # extra per-token arrays the scorer keeps: name -> trailing shape, from the route's parameters
    token_state: Callable[..., Dict[str, Tuple[int, ...]]] = _no_token_state
    selectable: bool = True  # an `evict(score=...)` choice (window is snap's vote, reconstruct its own stage)


def _morph_rows(route) -> Dict[str, Tuple[int, ...]]:
    return {"rows": (route.window,)}  # each token's weights from the newest `window` queries


_WEIGHTS = frozenset({"weights"})
_QUERIES = frozenset({"queries"})
SPECS: Dict[str, ScorerSpec] = {
    s.name: s
    for s in (
        ScorerSpec("mass", _WEIGHTS),
        ScorerSpec("mean", _WEIGHTS, ("pool",)),
        ScorerSpec("current", _WEIGHTS),
        ScorerSpec("chunk", _WEIGHTS, ("chunk",)),
        ScorerSpec("curd", _WEIGHTS, ("rank",)),
        ScorerSpec("keyformer", _WEIGHTS, ("tau",)),
        ScorerSpec("morph", _WEIGHTS, ("window",), _morph_rows),
        ScorerSpec("expected", _QUERIES, ("window",)),
        ScorerSpec("qfilters", _QUERIES, ("window",)),
        ScorerSpec("proxy", frozenset({"new_keys"})),
        ScorerSpec("knorm"),
        ScorerSpec("keydiff"),
        ScorerSpec("lagkv", params=("chunk",)),
        ScorerSpec("nested", params=("window", "beta", "tau", "kappa")),
        ScorerSpec("newest"),
        ScorerSpec("window", _QUERIES, ("window", "pool"), selectable=False),
        ScorerSpec("reconstruct", frozenset({"model_pass"}), ("chunk", "sinks"), selectable=False),
        ScorerSpec("kvzap", frozenset({"hidden"}), selectable=False),
    )
}


def declare(spec: ScorerSpec) -> ScorerSpec:
    """A scorer declared outside this table (a plug-in, a test); runtime/eviction/scorers registers its class."""
    if spec.name in SPECS:
        raise ValueError(f"scorer '{spec.name}' declared twice")
    SPECS[spec.name] = spec
    return spec


def scorer_params() -> frozenset:
    """The evict fields some selectable scorer reads (the rest of evict's fields route)."""
    return frozenset(p for s in SPECS.values() if s.selectable for p in s.params)


def selectable() -> Tuple[str, ...]:
    return tuple(sorted(n for n, s in SPECS.items() if s.selectable))


def check_params(route, defaults: Dict[str, object]) -> None:
    """A scorer parameter given a value on a scorer that does not read it: say which scorers do."""
    reads = SPECS[route.score].params
    for name in sorted(scorer_params() - set(reads)):
        if getattr(route, name) != defaults[name]:
            users = ", ".join(n for n in selectable() if name in SPECS[n].params)
            raise ValueError(
                f"{name}={getattr(route, name)} is a parameter of score={users}, "
                f"not of score={route.score} (it reads {', '.join(reads) or 'none'})"
            )
