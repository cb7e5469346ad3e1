"""A stage call of a recipe -> a stage instance: arguments matched to the stage's parameters,
values resolved (parameter references, per-layer schedules, nested stages), typed and validated,
each error located at the value it is about."""

import math
from typing import Any, Dict

import attrs

from ..errors import RecipeError, brief, nearest
from ..recipe import Recipe
from ..recipe.ast import Arg, Call, Num, Ref, Str, Word
from ..recipe.params import Schedule
from ..stages import REGISTRY
from .shape import ModelShape


def instantiate(call: Call, params, recipe: Recipe, layer: int, shape: ModelShape):
    info = REGISTRY.get(call.name)
    if info is None:
        raise RecipeError(f"unknown stage '{call.name}'", call.pos, nearest(call.name, REGISTRY))
    fields = info.params
    by_name = {f.name: f for f in fields}
    kwargs: Dict[str, Any] = {}
    for i, arg in enumerate(call.args):
        if arg.name is None:
            if kwargs and any(a.name for a in call.args[:i]):
                raise RecipeError("positional arguments come before named ones", arg.pos)
            if i >= len(fields):
                raise RecipeError(
                    f"'{call.name}' takes at most {len(fields)} positional argument(s)", arg.pos, _signature(info)
                )
            field = fields[i]
        else:
            field = by_name.get(arg.name)
            if field is None:
                raise RecipeError(
                    f"stage '{call.name}' has no parameter '{arg.name}'",
                    arg.pos,
                    nearest(arg.name, by_name) if by_name else f"'{call.name}' takes no parameters",
                )
        if field.name in kwargs:
            raise RecipeError(f"parameter '{field.name}' given twice", arg.pos)
        scheduled = isinstance(arg.value, Ref) and isinstance(params.get(arg.value.name), Schedule)
        kwargs[field.name] = _typed(_value(arg.value, params, recipe, layer, shape), field, call, arg, scheduled)
        _validate(kwargs[field.name], field, call, arg, info)
    try:
        return call, info.cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise RecipeError(f"stage '{call.name}': {e}", call.pos, _signature(info)) from None


def _value(node, params, recipe: Recipe, layer: int, shape: ModelShape):
    if isinstance(node, Ref):
        if node.name not in params:
            raise RecipeError(
                f"unknown parameter '${node.name}'",
                node.pos,
                nearest(node.name, recipe.params) if recipe.params else "declare it under 'params:'",
            )
        value = params[node.name]
        if isinstance(value, Schedule):
            try:
                return value.at(layer, shape.n_layers)
            except ValueError as e:
                raise RecipeError(f"parameter '{node.name}': {e}", recipe.params[node.name].where) from None
        return value
    if isinstance(node, (Num, Str)):
        return node.value
    if isinstance(node, Word) and node.name in REGISTRY and REGISTRY[node.name].family == "store":
        return instantiate(Call(node.name, (), node.pos), params, recipe, layer, shape)[1]  # residual(rabitq)
    if isinstance(node, Word):
        if node.name in REGISTRY and REGISTRY[node.name].family == "store":  # split(hi=fp16, ...): a stage
            return instantiate(Call(node.name, (), node.pos), params, recipe, layer, shape)[1]
        return {"true": True, "false": False}.get(node.name.lower(), node.name)
    if isinstance(node, Call) and node.name in REGISTRY and REGISTRY[node.name].family == "store":
        return instantiate(node, params, recipe, layer, shape)[1]  # a nested stage: residual(lloydmax(...))
    raise RecipeError(f"'{node.name}(...)' is not a value a stage parameter takes here", node.pos)


def _typed(value, field, call: Call, arg: Arg, scheduled: bool = False):
    want = (
        field.type
        if isinstance(field.type, type)
        else {"int": int, "float": float, "str": str, "bool": bool}.get(str(field.type), object)
    )
    if want is int and isinstance(value, float) and scheduled and math.isfinite(value):
        value = int(round(value))  # schedules yield floats
    ok = isinstance(value, want) and not (want in (int, float) and isinstance(value, bool))
    if want is float and isinstance(value, int) and not isinstance(value, bool) and abs(value) <= 1e308:
        value, ok = float(value), True
    if not ok:
        raise RecipeError(
            f"stage '{call.name}' parameter '{field.name}' is {want.__name__}, got {brief(value)}",
            arg.value.pos,
            _signature(REGISTRY[call.name]),
        )
    return value


def _validate(value, field, call: Call, arg: Arg, info) -> None:
    """Run one parameter's validator, so a bad value is reported at the value, with its name."""
    if field.validator is None:
        return
    try:
        field.validator(None, field, value)
    except ValueError as e:
        raise RecipeError(
            f"stage '{call.name}' parameter '{field.name}' {e}, got {brief(value)}", arg.value.pos, _signature(info)
        ) from None
    except Exception:  # a validator that needs the instance: left to the constructor below
        return


def _signature(info) -> str:
    parts = [f"{f.name}={f.default!r}" if f.default is not attrs.NOTHING else f.name for f in info.params]
    return f"{info.name}({', '.join(parts)})"
