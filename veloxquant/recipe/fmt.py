"""`veloxquant fmt`: the canonical text of a recipe file, so git diffs stay small.

Canonical: fixed key order, one spelling per value, the pipeline one tier per
line. Full-line comments stay with the key they precede; formatting twice
changes nothing, and the compiled plan never changes.
"""

import json
import re
from typing import Any, Dict, List, Tuple

import yaml

from ..errors import Location, RecipeError
from .ast import Call, Num, Pipeline, Ref, Str, Word
from .load import TOP_KEYS, load_recipe
from .parse import parse_pipeline
from .source import Source, read_text

PARAM_KEYS = ("default", "type", "doc")


def value_text(node) -> str:
    if isinstance(node, Num):
        return repr(node.value)
    if isinstance(node, Str):
        return json.dumps(node.value)
    if isinstance(node, Word):
        return node.name
    if isinstance(node, Ref):
        return f"${node.name}"
    return call_text(node)


def call_text(call: Call) -> str:
    if not call.args:
        return call.name
    args = ", ".join((f"{a.name}=" if a.name else "") + value_text(a.value) for a in call.args)
    return f"{call.name}({args})"


def pipeline_text(pipeline: Pipeline) -> str:
    tiers = []
    for tier in pipeline.tiers:
        head = " | ".join(call_text(c) for c in tier.stages)
        if tier.keys is None:
            tiers.append(head)
            continue
        lead = f"{head} | " if head else ""
        keys = " | ".join(call_text(c) for c in tier.keys)
        values = " | ".join(call_text(c) for c in tier.values)
        pad = " " * (len(lead) + 3 if tiers else len(lead))
        tiers.append(f"{lead}keys:   {keys}\n{pad}values: {values}")
    return "\n>> ".join(tiers)


def _scalar(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text[:-4].strip() if text.endswith("\n...") or text.endswith(" ...") else text


def _flow_scalar(value: Any) -> str:
    """A scalar that is safe inside a flow map {a: b, c: d} (commas get quoted)."""
    return yaml.safe_dump([value], default_flow_style=True, width=10**6).strip()[1:-1]


def _pipeline_field(key: str, text: str, indent: str) -> List[str]:
    if "\n" not in text and yaml.safe_load(f"k: {text}") == {"k": text}:
        return [f"{indent}{key}: {text}"]
    return [f"{indent}{key}: |"] + [f"{indent}  {line}" for line in text.splitlines()]


def _param(name: str, spec: Any) -> str:
    if isinstance(spec, dict):
        inner = ", ".join(f"{k}: {_flow_scalar(spec[k])}" for k in PARAM_KEYS if k in spec)
        return f"{name}: {{{inner}}}"
    return f"{name}: {_scalar(spec)}"


def format_text(src: Source) -> str:
    """Canonical text of one recipe file (its own keys; `extends` is not inlined)."""
    comments = _comments(src)
    out: List[str] = []

    def emit(path: Tuple, lines: List[str]) -> None:
        node = src.marks.get(path + ("<key>",))
        indent = re.match(r"\s*", lines[0]).group(0)
        if node is not None:
            for c in comments.pop(node.start_mark.line, []):
                out.append(indent + c)
        out.extend(lines)

    data = src.data
    for key in TOP_KEYS:
        if key not in data:
            continue
        value = data[key]
        if key == "pipeline":
            text = _canonical_pipeline(src, ("pipeline",))
            emit((key,), _pipeline_field(key, text, ""))
        elif key == "params":
            emit((key,), ["params:"] if value else ["params: {}"])
            for name, spec in (value or {}).items():
                emit((key, name), ["  " + _param(name, spec)])
        elif key == "layers":
            emit((key,), ["layers:"] if value else ["layers: {}"])
            for sel, body in (value or {}).items():
                emit((key, sel), [f"  {_scalar(str(sel))}:"])
                if "pipeline" in body:
                    text = _canonical_pipeline(src, ("layers", sel, "pipeline"))
                    emit((key, sel, "pipeline"), _pipeline_field("pipeline", text, "    "))
                if "params" in body:
                    inner = ", ".join(f"{k}: {_flow_scalar(v)}" for k, v in (body["params"] or {}).items())
                    emit((key, sel, "params"), [f"    params: {{{inner}}}"])
        else:
            emit((key,), [f"{key}: {_scalar(value)}"])
    for rest in comments.values():  # comments after the last key
        out.extend(rest)
    return "\n".join(out) + "\n"


def _canonical_pipeline(src: Source, path: Tuple) -> str:
    text = src.get(*path)
    if "#" in text:  # keep the author's comments: normalise indentation only
        return "\n".join(line.strip() for line in text.strip().splitlines())
    return pipeline_text(parse_pipeline(text, src.text_locator(*path)))


def _comments(src: Source) -> Dict[int, List[str]]:
    """Full-line comments keyed by the 0-based line of the key they precede."""
    lines = src.text.splitlines()
    inside_block = set()
    for node in src.marks.values():
        if isinstance(node, yaml.ScalarNode) and node.style in ("|", ">"):
            # the scalar ends at the start (column 0) of the first line that is not its own
            inside_block.update(
                range(node.start_mark.line + 1, node.end_mark.line + (1 if node.end_mark.column else 0))
            )
    key_lines = sorted(n.start_mark.line for p, n in src.marks.items() if p and p[-1] == "<key>")
    found: Dict[int, List[str]] = {}
    for i, line in enumerate(lines):
        if i in inside_block:
            continue
        stripped = line.strip()
        if stripped.startswith("#"):
            target = next((k for k in key_lines if k > i), len(lines) + 1)
            found.setdefault(target, []).append(stripped)
        elif re.search(r"\s#", line) and "#" not in json.dumps(src.data):
            raise RecipeError(
                "fmt keeps full-line comments only; this line has a comment after a value",
                Location(src.file, i + 1, line.index("#") + 1),
                "move the comment to its own line",
            )
    return found


def format_file(path: str) -> Tuple[str, bool]:
    """(canonical text, changed?) for a recipe file; the recipe must be valid."""
    load_recipe(path)  # refuse to format a recipe that does not load
    src = Source(path, read_text(path))
    text = format_text(src)
    return text, text != src.text
