"""The pipeline's syntax tree: what the lark grammar parses into.

Every node keeps `pos`, its place in the recipe file, for error messages;
positions never take part in equality."""

from typing import Optional, Tuple, Union

import attrs

from ..errors import Location


@attrs.frozen
class Num:
    value: Union[int, float]
    pos: Location = attrs.field(eq=False)


@attrs.frozen
class Str:
    value: str
    pos: Location = attrs.field(eq=False)


@attrs.frozen
class Word:
    """A bare name used as a value: an enum member (axis=channel) or true/false."""

    name: str
    pos: Location = attrs.field(eq=False)


@attrs.frozen
class Ref:
    """`$name`: a recipe parameter."""

    name: str
    pos: Location = attrs.field(eq=False)


@attrs.frozen
class Arg:
    name: Optional[str]  # None for a positional argument
    value: "Value"
    pos: Location = attrs.field(eq=False)


@attrs.frozen
class Call:
    """`name(args)`: a stage in a pipeline, or a schedule / nested stage as a value."""

    name: str
    args: Tuple[Arg, ...]
    pos: Location = attrs.field(eq=False)


Value = Union[Num, Str, Word, Ref, Call]


@attrs.frozen
class Tier:
    """Stages shared by K and V, then optionally separate K and V chains."""

    stages: Tuple[Call, ...]
    keys: Optional[Tuple[Call, ...]] = None
    values: Optional[Tuple[Call, ...]] = None
    pos: Optional[Location] = attrs.field(eq=False, default=None)


@attrs.frozen
class Pipeline:
    tiers: Tuple[Tier, ...]
