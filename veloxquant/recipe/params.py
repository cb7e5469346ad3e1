"""Recipe parameters: typed values, per-layer schedules, `--set` overrides."""

import math
from typing import Any, Optional, Tuple, Union

import attrs
import yaml

from ..errors import Location, RecipeError, brief
from .ast import Call, Num
from .limits import MAX_SCHEDULE_CHARS
from .parse import parse_value
from .safe_yaml import load_value

TYPES = {"int": int, "float": float, "bool": bool, "str": str}
SCHEDULES = ("linear", "pyramid")


@attrs.frozen
class Schedule:
    """A numeric parameter that varies over layers.

    linear(from=a, to=b) / pyramid(from=a, to=b): a straight line from layer 0
    to the last layer (PyramidKV's budget shape); a YAML list gives each layer.
    """

    kind: str
    start: float = 0.0
    stop: float = 0.0
    values: Tuple[float, ...] = ()

    def at(self, layer: int, n_layers: int) -> float:
        if self.kind == "list":
            if len(self.values) != n_layers:
                raise ValueError(f"the list has {len(self.values)} values but the model has {n_layers} layers")
            return self.values[layer]
        if n_layers == 1:
            return self.start
        return self.start + (self.stop - self.start) * layer / (n_layers - 1)

    def text(self) -> Union[str, list]:
        if self.kind == "list":
            return list(self.values)
        return f"{self.kind}(from={_num(self.start)}, to={_num(self.stop)})"


def _num(x: float):
    return int(x) if float(x).is_integer() else x


@attrs.frozen
class Param:
    name: str
    type: str
    default: Any  # a value of `type`, or a Schedule for int/float params
    doc: str = ""
    where: Optional[Location] = attrs.field(default=None, eq=False)


def type_of(value: Any) -> Optional[str]:
    for name in ("bool", "int", "float", "str"):  # bool first: True is an int
        if isinstance(value, TYPES[name]):
            return name
    return None


def _schedule_from_text(text: str, where: Location) -> Optional[Schedule]:
    if text.strip().split("(")[0].strip() not in SCHEDULES:
        return None
    if len(text) > MAX_SCHEDULE_CHARS:
        raise RecipeError(
            f"a schedule is at most {MAX_SCHEDULE_CHARS} characters, got {len(text)}",
            where,
            "e.g. linear(from=1024, to=128)",
        )
    node = parse_value(text, lambda line, col: where)
    if not isinstance(node, Call):
        return None
    args = {}
    for i, arg in enumerate(node.args):
        key = arg.name or ("from", "to")[min(i, 1)]
        if key not in ("from", "to") or not isinstance(arg.value, Num):
            raise RecipeError(
                f"{node.name}() takes numbers from= and to=", where, f"e.g. {node.name}(from=1024, to=128)"
            )
        try:
            args[key] = float(arg.value.value)
        except OverflowError:
            args[key] = math.inf
        if not math.isfinite(args[key]):
            raise RecipeError(f"{node.name}() takes finite numbers, got {key}={brief(arg.value.value)}", where)
    if set(args) != {"from", "to"}:
        raise RecipeError(f"{node.name}() needs both from= and to=", where)
    return Schedule(node.name, args["from"], args["to"])


def coerce(param: Param, value: Any, where: Location) -> Any:
    """Check `value` against the parameter's type; numbers may be schedules."""
    want = param.type
    if want in ("int", "float"):
        if isinstance(value, Schedule):
            return value
        if isinstance(value, list) and value and all(type_of(v) in ("int", "float") for v in value):
            return Schedule("list", values=tuple(value))
        if isinstance(value, str):
            sched = _schedule_from_text(value, where)
            if sched is not None:
                return sched
    got = type_of(value)
    if got == want or (want == "float" and got == "int"):
        if want == "float" and abs(value) > 1e308:  # float() of a 400-digit int overflows
            raise RecipeError(f"parameter '{param.name}' is float, got {brief(value)}, too large for a float", where)
        return float(value) if want == "float" else value
    if got:
        shown = f"{brief(value)} ({got})"
    elif isinstance(value, list):
        odd = [v for v in value if type_of(v) not in ("int", "float")]
        shown = f"a list holding {brief(odd[0])}" if odd and want in ("int", "float") else "a list"
    else:
        shown = "a map" if isinstance(value, dict) else type(value).__name__
    extra = (
        ", a per-layer list of numbers or a schedule such as linear(from=1024, to=128)"
        if want in ("int", "float")
        else ""
    )
    raise RecipeError(
        f"parameter '{param.name}' is {want}, got {shown}",
        where,
        f"give {'an' if want == 'int' else 'a'} {want}{extra}",
    )


def declare(name: str, spec: Any, where: Location) -> Param:
    """A param from its YAML: `bits: 2` or `bits: {default: 2, type: int, doc: ...}`."""
    if isinstance(spec, dict):
        unknown = set(spec) - {"default", "type", "doc"}
        if unknown or "default" not in spec:
            what = (
                f"unknown key {', '.join(repr(str(k)) for k in sorted(unknown, key=str))}"
                if unknown
                else "no 'default'"
            )
            raise RecipeError(
                f"parameter '{name}' is a map but not {{default, type, doc}}: {what}",
                where,
                "write 'name: value' or 'name: {default: value, type: int, doc: ...}'; "
                "quote a doc that contains a comma",
            )
        default, declared = spec["default"], spec.get("type")
        if declared is not None and (not isinstance(declared, str) or declared not in TYPES):  # [int] is unhashable
            raise RecipeError(
                f"parameter '{name}' has unknown type {brief(declared)}", where, "types: " + ", ".join(TYPES)
            )
        doc = str(spec.get("doc", ""))
    else:
        default, declared, doc = spec, None, ""
    if declared is None:
        if isinstance(default, list) and not (default and all(type_of(v) in ("int", "float") for v in default)):
            odd = [v for v in default if type_of(v) not in ("int", "float")]
            raise RecipeError(
                f"parameter '{name}' is a per-layer list, which holds numbers"
                + (f"; got {brief(odd[0])}" if odd else " (this one is empty)"),
                where,
                "give one number per layer, e.g. [256, 128, ...], or a schedule such as linear(from=256, to=64)",
            )
        if isinstance(default, list) or (isinstance(default, str) and _schedule_from_text(default, where)):
            listed = default if isinstance(default, list) else []
            declared = "int" if all(isinstance(v, int) for v in listed) else "float"
            if isinstance(default, str):
                sched = _schedule_from_text(default, where)
                declared = "int" if float(sched.start).is_integer() and float(sched.stop).is_integer() else "float"
        else:
            declared = type_of(default)
        if declared is None:
            raise RecipeError(f"parameter '{name}' needs a number, bool, string or schedule", where)
    param = Param(name, declared, None, doc, where)
    return attrs.evolve(param, default=coerce(param, default, where))


def parse_set(text: str) -> Tuple[str, Any]:
    """'bits=4' -> ('bits', 4), with YAML scalar typing for the value."""
    if "=" not in text:
        raise RecipeError(f"--set expects name=value, got '{text}'", Location("--set", field=text))
    name, raw = text.split("=", 1)
    try:
        value = load_value(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return name.strip(), value
