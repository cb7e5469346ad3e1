"""Recipe files -> Recipe objects: schema, params, `extends`, per-layer overrides."""

import re
from pathlib import Path
from typing import Dict, Optional, Tuple

import attrs

from ..errors import Location, RecipeError, brief, nearest, quoted
from ..paths import recipes_dir
from .ast import Pipeline
from .limits import MAX_EXTENDS, MAX_PIPELINE_CHARS
from .params import Param, coerce, declare
from .parse import parse_pipeline
from .source import Source, read_text

SCHEMA_VERSION = 1
TOP_KEYS = ("veloxquant", "name", "summary", "paper", "extends", "params", "pipeline", "layers")
LAYER_KEYS = ("pipeline", "params")
# at most 18 digits: a layer index fits in an int64, and int() refuses numbers of > 4,300 digits
_SELECTOR = re.compile(r"^\s*(all|sliding|full|-?\d{1,18}(\s*(-|\.\.)\s*-?\d{1,18})?)\s*$")


@attrs.frozen
class LayerOverride:
    selector: str
    pipeline: Optional[Pipeline]
    pipeline_text: Optional[str]
    params: Dict[str, object]
    where: Location = attrs.field(eq=False)


@attrs.frozen
class Recipe:
    name: str
    summary: str
    paper: str
    params: Dict[str, Param]
    pipeline: Pipeline
    pipeline_text: str
    layers: Tuple[LayerOverride, ...]
    path: str
    extends: Optional[str] = None
    sources: Tuple[Source, ...] = attrs.field(default=(), eq=False, repr=False)


def builtin_names():
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def resolve(ref: str, relative_to: Optional[Path] = None, where: Optional[Location] = None) -> Path:
    """A recipe reference -> file: a path, or the name of a built-in recipe."""
    candidates = []
    if relative_to is not None and not Path(ref).is_absolute():
        candidates.append(relative_to / ref)
    candidates.append(Path(ref))
    builtin = recipes_dir() / f"{Path(ref).stem if ref.endswith('.yaml') else ref}.yaml"
    if "/" not in ref:
        candidates.append(builtin)
    for c in candidates:
        if _is_file(c):
            return c.resolve()
    hint = nearest(ref, builtin_names())
    if not hint.startswith("did you mean"):  # dozens of built-ins: point at the list rather than print it
        hint = "`veloxquant list` shows the built-in recipes"
    raise RecipeError(
        f"no recipe file or built-in recipe named {quoted(ref)}", where or Location(quoted(ref)[1:-1]), hint
    )


class _PipelineBudget:
    """Pipeline characters left to parse in one file (the parser is the slow part of a hostile file)."""

    def __init__(self):
        self.left = MAX_PIPELINE_CHARS

    def spend(self, text: str, where: Location) -> str:
        self.left -= len(text)
        if self.left < 0:
            raise RecipeError(
                f"the recipe's pipelines hold more than {MAX_PIPELINE_CHARS} characters",
                where,
                "a pipeline is a few tiers of a few stages each",
            )
        return text


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):  # a name too long for the OS, a NUL in it: no such recipe
        return False


def check_selector(selector: str, where: Location) -> None:
    for part in str(selector).split(","):
        if not _SELECTOR.match(part):
            raise RecipeError(
                f"bad layer selector {brief(part.strip())}",
                where,
                "use a layer index (0, -1), a range (0-3), a list (0,2,4), 'sliding', 'full' or 'all'",
            )


def load_recipe(ref: str, _chain: Tuple[Path, ...] = (), _where: Optional[Location] = None) -> Recipe:
    path = resolve(ref, where=_where) if not _chain else resolve(ref, _chain[-1].parent, _where)
    if path in _chain:
        cycle = " -> ".join(p.name for p in _chain + (path,))
        raise RecipeError(f"cyclic extends: {cycle}", _where)
    if len(_chain) >= MAX_EXTENDS:
        raise RecipeError(
            f"the extends chain is more than {MAX_EXTENDS} recipes long", _where, "extend a recipe that extends fewer"
        )
    src = Source(str(path), read_text(path))
    if not isinstance(src.data, dict):
        raise RecipeError("a recipe is a YAML map", src.loc(), "start with 'veloxquant: 1'")
    for key in src.data:
        if key not in TOP_KEYS:
            raise RecipeError(f"unknown field {quoted(key)}", src.loc(key, key=True), nearest(str(key), TOP_KEYS))
    version = src.get("veloxquant")
    if version is None:
        raise RecipeError("missing schema version", src.loc(), f"add 'veloxquant: {SCHEMA_VERSION}' as the first line")
    if type(version) is not int or version != SCHEMA_VERSION:
        raise RecipeError(
            f"unsupported schema version {brief(version)}",
            src.loc("veloxquant"),
            f"this veloxquant reads 'veloxquant: {SCHEMA_VERSION}'",
        )
    for key in ("name", "summary", "paper", "extends", "pipeline"):
        value = src.get(key)
        if value is not None and not isinstance(value, str):
            raise RecipeError(f"'{key}' must be a string, got {type(value).__name__}", src.loc(key))

    parent = None
    if src.get("extends"):
        parent = load_recipe(src.get("extends"), _chain + (path,), src.loc("extends"))
    name = src.get("name")
    if not name:
        raise RecipeError("missing 'name'", src.loc(), "add 'name: my_recipe'")

    params = dict(parent.params) if parent else {}
    raw_params = src.get("params", default={}) or {}
    if not isinstance(raw_params, dict):
        raise RecipeError("'params' must be a map of name: value", src.loc("params"))
    for pname, spec in raw_params.items():
        where = src.loc("params", pname)
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(pname)):
            raise RecipeError(f"bad parameter name {quoted(pname)}", src.loc("params", pname, key=True))
        if pname in params and not isinstance(spec, dict):  # an override keeps the parent's type
            params[pname] = attrs.evolve(params[pname], default=coerce(params[pname], spec, where), where=where)
        else:
            params[pname] = declare(pname, spec, where)

    pipeline_text = src.get("pipeline")
    budget = _PipelineBudget()
    if pipeline_text is not None:
        pipeline = parse_pipeline(budget.spend(pipeline_text, src.loc("pipeline")), src.text_locator("pipeline"))
    elif parent:
        pipeline, pipeline_text = parent.pipeline, parent.pipeline_text
    else:
        raise RecipeError("missing 'pipeline'", src.loc(), "add e.g. 'pipeline: fp16'")

    layers = {o.selector: o for o in parent.layers} if parent else {}
    raw_layers = src.get("layers", default={}) or {}
    if not isinstance(raw_layers, dict):
        raise RecipeError("'layers' must be a map of selector: {pipeline, params}", src.loc("layers"))
    seen = {}
    for selector, body in raw_layers.items():
        where = src.loc("layers", selector, key=True)
        check_selector(str(selector), where)
        if str(selector) in seen:  # e.g. 0 and "0": two YAML keys, one selector
            raise RecipeError(
                f"layer selector '{selector}' given twice", where, f"first given at line {seen[str(selector)]}"
            )
        seen[str(selector)] = where.line
        if not isinstance(body, dict):
            raise RecipeError("a layer override is a map with 'pipeline' and/or 'params'", src.loc("layers", selector))
        for key in body:
            if key not in LAYER_KEYS:
                raise RecipeError(
                    f"unknown field {quoted(key)} in a layer override",
                    src.loc("layers", selector, key, key=True),
                    nearest(str(key), LAYER_KEYS),
                )
        text = body.get("pipeline")
        if text is not None and not isinstance(text, str):
            raise RecipeError("'pipeline' must be a string", src.loc("layers", selector, "pipeline"))
        sub = (
            parse_pipeline(
                budget.spend(text, src.loc("layers", selector, "pipeline")),
                src.text_locator("layers", selector, "pipeline"),
            )
            if text is not None
            else None
        )
        overrides = body.get("params") or {}
        if not isinstance(overrides, dict):
            raise RecipeError("'params' must be a map", src.loc("layers", selector, "params"))
        checked = {}
        for pname, value in overrides.items():
            if pname not in params:
                raise RecipeError(
                    f"unknown parameter {quoted(pname)}",
                    src.loc("layers", selector, "params", pname, key=True),
                    nearest(str(pname), params),
                )
            checked[pname] = coerce(params[pname], value, src.loc("layers", selector, "params", pname))
        layers[str(selector)] = LayerOverride(str(selector), sub, text, checked, where)

    return Recipe(
        name=name,
        summary=src.get("summary") or (parent.summary if parent else ""),
        paper=src.get("paper") or (parent.paper if parent else ""),
        params=params,
        pipeline=pipeline,
        pipeline_text=pipeline_text,
        layers=tuple(layers.values()),
        path=str(path),
        extends=src.get("extends"),
        sources=((src,) + (parent.sources if parent else ())),
    )
