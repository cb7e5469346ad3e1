"""`veloxquant schema`: a JSON Schema (draft-07) for recipe files, built from the stage registry.

It joins the language (veloxquant.recipe) and the vocabulary (veloxquant.stages),
so it sits in the compiler, which imports both. Generated at run time, so a stage added as a module
appears without an edit here: each stage's family, doc, and parameters with their types, defaults,
ranges (`in_range`) and enums (`choices`) come from its attrs class. YAML
language servers read it through a first line
`# yaml-language-server: $schema=PATH-OR-URL`.

The pipeline itself is one string in the pipeline language, which JSON Schema
cannot parse: the schema describes it (every stage and parameter, in markdown
for hover) and carries the stages as `definitions/stages/NAME`, a map an editor
or `veloxquant schema --stage NAME` turns into completion items. Loading the
recipe (`veloxquant check`) stays the full check.
"""

import inspect
import re
from typing import Any, Dict, List

import attrs

from ..errors import VeloxError, nearest
from ..recipe.load import LAYER_KEYS, SCHEMA_VERSION, TOP_KEYS, builtin_names
from ..recipe.params import SCHEDULES, TYPES
from ..stages import REGISTRY

DRAFT = "http://json-schema.org/draft-07/schema#"
_JSON_TYPES = {
    int: "integer",
    float: "number",
    bool: "boolean",
    str: "string",
    "int": "integer",
    "float": "number",
    "bool": "boolean",
    "str": "string",
}
_NUMBER_LIST = {"type": "array", "minItems": 1, "items": {"type": "number"}, "description": "one value per layer"}
_SCHEDULE = {
    "type": "string",
    "pattern": r"^\s*(" + "|".join(SCHEDULES) + r")\s*\(",
    "description": "a per-layer schedule: linear(from=A, to=B) or pyramid(from=A, to=B)",
}
_SELECTOR = r"^\s*(all|sliding|full|-?\d+(\s*(-|\.\.)\s*-?\d+)?)(\s*,\s*(-?\d+(\s*(-|\.\.)\s*-?\d+)?))*\s*$"


def stage_param_schema(info, field: attrs.Attribute) -> Dict[str, Any]:
    """One stage parameter: JSON type, default, range/enum from its validators, doc."""
    out: Dict[str, Any] = {}
    kind = _JSON_TYPES.get(field.type)
    if kind:
        out["type"] = kind
    else:  # e.g. residual(inner): a stage call is the value
        out["type"] = "string"
        out["x-veloxquant-value"] = "stage"
    for check in _validators(field.validator):
        out.update(getattr(check, "json_schema", {}))
    if field.default is not attrs.NOTHING and field.default is not None and not callable(field.default):
        out["default"] = field.default
    out["description"] = param_doc(info, field, out)
    return out


def _validators(v) -> List:
    if v is None:
        return []
    inner = getattr(v, "_validators", None) or getattr(v, "validators", None)  # attrs' and_() of a list
    if inner:
        return [x for i in inner for x in _validators(i)]
    return [v]


def param_doc(info, field: attrs.Attribute, schema: Dict[str, Any]) -> str:
    """metadata['doc'] when the stage gives one, else the sentences of its docstring that name it."""
    facts = [schema.get("type", "")]
    if "minimum" in schema:
        facts.append(f"{schema['minimum']}..{schema['maximum']}")
    if "enum" in schema:
        facts.append(" | ".join(map(str, schema["enum"])))
    if "default" in schema:
        facts.append(f"default {schema['default']}")
    head = f"{info.name}({field.name}=...): " + ", ".join(f for f in facts if f)
    doc = field.metadata.get("doc") if field.metadata else None
    if not doc:
        text = " ".join(inspect.getdoc(info.cls).split()) if info.cls.__doc__ else ""
        said = [s for s in re.split(r"(?<=\.)\s+", text) if re.search(rf"(`{field.name}`|\b{field.name}=)", s)]
        doc = " ".join(said) or (f"(of: {text.split('. ')[0].rstrip('.')})" if text else "")
    return f"{head}. {doc}".strip() if doc else head


def stage_schema(info) -> Dict[str, Any]:
    params = {f.name: stage_param_schema(info, f) for f in info.params}
    doc = " ".join(inspect.getdoc(info.cls).split()) if info.cls.__doc__ else ""
    return {
        "type": "object",
        "description": doc,
        "x-veloxquant-family": info.family,
        "x-veloxquant-needs": sorted(info.needs),
        "properties": params,
        "x-veloxquant-positional": list(params),
        "additionalProperties": False,
    }


def _pipeline_markdown(stages: Dict[str, Any]) -> str:
    lines = [
        "Tiers, newest first, joined by `>>`; stages in a tier joined by `|`; "
        "`keys: CHAIN values: CHAIN` splits K and V. Stages:",
        "",
    ]
    for name, s in stages.items():
        args = ", ".join(f"{p}={v.get('default', '...')}" for p, v in s["properties"].items())
        lines.append(f"- `{name}({args})` *{s['x-veloxquant-family']}*: {s['description'].split('. ')[0]}")
    return "\n".join(lines)


def recipe_schema() -> Dict[str, Any]:
    stages = {name: stage_schema(info) for name, info in sorted(REGISTRY.items())}
    param_value = {"anyOf": [{"type": "number"}, {"type": "boolean"}, {"type": "string"}, _NUMBER_LIST]}
    param_spec = {
        "anyOf": [
            param_value,
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["default"],
                "properties": {
                    "default": {**param_value, "description": "the default value (or a schedule)"},
                    "type": {"enum": list(TYPES), "description": "int, float, bool or str"},
                    "doc": {"type": "string", "description": "one line shown by explain and here"},
                },
            },
        ],
        "description": "name: value, or name: {default: value, type: int|float|bool|str, doc: text}",
    }
    pipeline = {
        "type": "string",
        "minLength": 1,
        "description": "The tiers and stages, in the pipeline language (docs/recipe-language.md). Stages: "
        + ", ".join(f"{n} ({s['x-veloxquant-family']})" for n, s in stages.items()),
        "markdownDescription": _pipeline_markdown(stages),
        "examples": ["recent(128) >> affine(bits=4)", "sink(4) >> recent(1020) >> drop"],
    }
    layer = {
        "type": "object",
        "additionalProperties": False,
        "minProperties": 1,
        "properties": {
            "pipeline": {"$ref": "#/definitions/pipeline"},
            "params": {
                "type": "object",
                "additionalProperties": param_value,
                "description": "values of parameters the recipe declares, on these layers",
            },
        },
    }
    assert set(layer["properties"]) == set(LAYER_KEYS)
    props = {
        "veloxquant": {"const": SCHEMA_VERSION, "description": f"the schema version: exactly {SCHEMA_VERSION}"},
        "name": {"type": "string", "minLength": 1, "description": "the recipe's name"},
        "summary": {"type": "string", "description": "one line shown by `veloxquant list`"},
        "paper": {"type": "string", "description": "the method's citation"},
        "extends": {
            "type": "string",
            "description": "a recipe to start from: a path relative to this file, or a built-in name",
            "examples": builtin_names(),
        },
        "params": {
            "type": ["object", "null"],
            "description": "named, typed parameters the pipeline uses as $name",
            "propertyNames": {"pattern": r"^[A-Za-z_][A-Za-z0-9_]*$"},
            "additionalProperties": {"$ref": "#/definitions/param"},
        },
        "pipeline": {"$ref": "#/definitions/pipeline"},
        "layers": {
            "type": ["object", "null"],
            "description": "per-layer overrides keyed by selector: 0, -1, 0-3, 0..3, 0,2,4, sliding, full, all",
            "propertyNames": {"pattern": _SELECTOR},
            "additionalProperties": {"$ref": "#/definitions/layer"},
        },
    }
    assert list(props) == list(TOP_KEYS)  # the loader's fields, no more and no fewer
    return {
        "$schema": DRAFT,
        "title": "veloxquant recipe",
        "description": "A KV-cache compression recipe for veloxquant (generated by `veloxquant schema`).",
        "type": "object",
        "required": ["veloxquant", "name"],
        "additionalProperties": False,
        "properties": props,
        "definitions": {
            "param": param_spec,
            "pipeline": pipeline,
            "layer": layer,
            "stages": stages,
            "schedule": _SCHEDULE,
        },
    }


def completions(schema: Dict[str, Any], stage: str) -> List[str]:
    """Editor-style completion items for a stage's parameters, read from the schema alone."""
    stages = schema["definitions"]["stages"]
    if stage not in stages:
        raise VeloxError(f"no stage '{stage}' in the schema; {nearest(stage, stages)}")
    props = stages[stage]["properties"]
    width = max((len(p) for p in props), default=0) + 1
    items = []
    for name, p in props.items():
        detail = p.get("type", "")
        if "enum" in p:
            detail = " | ".join(map(str, p["enum"]))
        elif "minimum" in p:
            detail += f" {p['minimum']}..{p['maximum']}"
        default = f" = {p['default']}" if "default" in p else ""
        doc = p["description"].split(". ", 1)[1] if ". " in p["description"] else ""
        items.append(f"{name + '=':<{width}} {detail}{default}" + (f"    {doc}" if doc else ""))
    return items or ["(no parameters)"]
