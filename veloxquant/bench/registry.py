"""The benches `veloxquant bench NAME` runs: each bench module registers its `main` with `@bench(NAME)`.

A bench is a module of this package whose `main(argv) -> int` prints a Markdown table. Adding one
is one decorator; `veloxquant bench --list` finds it (every module of the package is imported to
list them). Research instruments that are no part of the installed tool live in `benchmarks/` at
the repository root and are run with `python -m benchmarks.NAME`.
"""

import importlib
import pkgutil
import sys
from typing import Callable, Dict, List, NamedTuple, Optional

from ..errors import VeloxError


class Bench(NamedTuple):
    name: str
    purpose: str  # one line, for --list
    module: str
    main: Callable[[Optional[List[str]]], int]


BENCHES: Dict[str, Bench] = {}


def bench(name: str, purpose: str = ""):
    """Register `main(argv) -> int` as `veloxquant bench NAME`; the purpose defaults to the first line
    of the module's docstring."""

    def register(main):
        doc = sys.modules[main.__module__].__doc__ or ""
        line = purpose or next((x.strip() for x in doc.splitlines() if x.strip()), "")
        if name in BENCHES and BENCHES[name].module != main.__module__:
            raise VeloxError(f"bench {name!r} is registered twice ({BENCHES[name].module}, {main.__module__})")
        BENCHES[name] = Bench(name, line.strip("`"), main.__module__, main)
        return main

    return register


def discover() -> Dict[str, Bench]:
    """Import every module of this package, so each registers itself; the registry, by name."""
    package = sys.modules[__package__]
    for info in pkgutil.iter_modules(package.__path__):
        if info.name != "registry":
            importlib.import_module(f"{__package__}.{info.name}")
    return dict(sorted(BENCHES.items()))


def listing() -> str:
    benches = discover()
    width = max(len(n) for n in benches)
    return "\n".join(f"  {b.name:<{width}}  {b.purpose}  ({b.module})" for b in benches.values())


def run(name: str, argv: List[str]) -> int:
    benches = discover()
    if name not in benches:
        raise VeloxError(f"no bench named {name!r}; the benches are: {', '.join(benches)} (veloxquant bench --list)")
    return benches[name].main(argv) or 0
