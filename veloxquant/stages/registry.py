"""The stage registry: DSL name -> attrs class with typed, validated params.

Families say where a stage may stand in a tier:
  route     -- first in a tier; decides which tokens the tier holds
  transform -- codec stage on real values, before the quantizer
  store     -- the codec stage that holds the values (fp16, affine, ...)
  residual  -- after a store: codes what the stages before it left over
  entropy   -- after a store that yields integer codes
"""

import importlib
import pkgutil
from pathlib import Path
from typing import Dict, FrozenSet, Tuple, Type

import attrs

FAMILIES = ("route", "transform", "store", "residual", "entropy")


@attrs.frozen
class StageInfo:
    name: str
    family: str
    cls: Type
    needs: FrozenSet[str]  # e.g. {"attention"}: needs the attention hook

    @property
    def doc(self) -> str:
        return (self.cls.__doc__ or "").strip().splitlines()[0] if self.cls.__doc__ else ""

    @property
    def params(self) -> Tuple[attrs.Attribute, ...]:
        return tuple(a for a in attrs.fields(self.cls) if not a.name.startswith("_"))


REGISTRY: Dict[str, StageInfo] = {}


def needs_of(instance) -> FrozenSet[str]:
    """What a stage instance needs: its stage's declared needs, plus what its parameters
    ask for (`split(by=queries)` needs attention; `split(by=variance)` does not)."""
    return REGISTRY[instance.stage_name].needs | frozenset(getattr(instance, "runtime_needs", ()))


def stage(name: str, family: str, needs: Tuple[str, ...] = ()):
    """Class decorator: register an attrs class as the stage `name`."""
    assert family in FAMILIES, family

    def register(cls):
        if name in REGISTRY:
            raise ValueError(f"stage '{name}' registered twice")
        cls.stage_name = name
        REGISTRY[name] = StageInfo(name, family, cls, frozenset(needs))
        return cls

    return register


def choices(*allowed):
    """An enum-like param (str or int values): validated, and listed in errors and docs."""

    def check(instance, attribute, value):
        if value not in allowed:
            raise ValueError(f"must be one of {', '.join(map(str, allowed))}")

    check.json_schema = {"enum": list(allowed)}  # read by `veloxquant schema`
    return check


def in_range(lo, hi):
    def check(instance, attribute, value):
        if not (lo <= value <= hi):
            raise ValueError(f"must be between {lo} and {hi}")

    check.json_schema = {"minimum": lo, "maximum": hi}  # read by `veloxquant schema`
    return check


def lookup(name: str) -> StageInfo:
    return REGISTRY[name]


def load_builtin_stages() -> None:
    """Import every module of this package (and its subpackages): their @stage decorators register them.

    Discovered rather than listed, so a new stage is one new module and no edit here."""
    here = str(Path(__file__).parent)  # this package's folder, without importing the package itself
    for info in pkgutil.walk_packages([here], prefix=__package__ + "."):
        importlib.import_module(info.name)
