"""YAML with positions: every value keeps the file line/column it came from."""
from typing import Any, Dict, Tuple

import yaml

from ..errors import Location, RecipeError


class Source:
    """A parsed YAML file plus the place of each key path (e.g. ("params", "bits"))."""

    def __init__(self, file: str, text: str):
        self.file, self.text = file, text
        self.marks: Dict[Tuple, yaml.Node] = {}
        try:
            node = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            raise RecipeError(f"invalid YAML: {e.problem or e.context}",
                              Location(file, mark.line + 1, mark.column + 1) if mark else Location(file),
                              _yaml_hint(str(e.problem or e.context))) from None
        if node is None:
            raise RecipeError("the recipe file is empty", Location(file, 1, 1),
                              "a recipe starts with 'veloxquant: 1' and a 'name:'")
        self._walk(node, ())
        self.data = yaml.SafeLoader("").construct_document(node)

    def _walk(self, node: yaml.Node, path: Tuple) -> None:
        self.marks[path] = node
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key_node, value_node in node.value:
                key = yaml.SafeLoader("").construct_object(key_node)
                if key in seen:
                    raise RecipeError(f"duplicate key '{key}'", self._at(key_node, path + (key,)),
                                      f"first given at line {seen[key]}")
                seen[key] = key_node.start_mark.line + 1
                self.marks[path + (key, "<key>")] = key_node
                self._walk(value_node, path + (key,))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._walk(item, path + (i,))

    def _at(self, node: yaml.Node, path: Tuple) -> Location:
        mark = node.start_mark
        return Location(self.file, mark.line + 1, mark.column + 1, ".".join(map(str, path)) or None)

    def loc(self, *path, key: bool = False) -> Location:
        """Where a key path is written; the nearest enclosing node if it is absent."""
        path = tuple(path)
        while path:
            node = self.marks.get(path + ("<key>",) if key else path)
            if node is not None:
                return self._at(node, path)
            path, key = path[:-1], False
        return Location(self.file, 1, 1)

    def text_locator(self, *path):
        """A function placing (line, col) of the text at `path` back in the file."""
        node = self.marks.get(tuple(path))
        base = self.loc(*path)
        if node is None or not isinstance(node, yaml.ScalarNode):
            return lambda line, col: base
        field = ".".join(map(str, path))
        where = self._align(node)
        if where is None:  # escapes in a quoted string: place line 1 exactly, the rest roughly
            shift = 1 if node.style in ("'", '"') else 0
            return lambda line, col: Location(
                self.file, base.line + line - 1, (base.column + shift + col - 1) if line == 1 else col, field)
        value, raw = node.value, where
        starts = [0] + [i + 1 for i, c in enumerate(value) if c == "\n"]

        def locate(line: int, col: int) -> Location:
            offset = starts[min(line, len(starts)) - 1] + col - 1
            before = [i for i in raw if i <= offset]
            if not before:
                index = raw[min(raw)] if raw else node.start_mark.index
            else:  # a blank or the end of the text: just after the nearest character before it
                k = max(before)
                index = raw[k] + (offset - k)
                newline = self.text.find("\n", raw[k])
                if newline != -1:
                    index = min(index, newline)
            return Location(self.file, self.text.count("\n", 0, index) + 1,
                            index - (self.text.rfind("\n", 0, index) + 1) + 1, field)
        return locate

    def _align(self, node: yaml.ScalarNode):
        """{offset of each non-blank character in the scalar's value: its index in the file},
        or None where the value's characters are not the file's (escape sequences).

        YAML folds plain and '>' scalars and strips block indentation, so the value's
        line/column are not the file's; its non-blank characters are, in order."""
        start, end = node.start_mark.index, node.end_mark.index
        if node.style in ("|", ">"):
            start = self.text.find("\n", start) + 1  # content starts on the line after the indicator
            if start == 0:
                return None
        elif node.style in ("'", '"'):
            start += 1
        out, j = {}, start
        for i, c in enumerate(node.value):
            if c.isspace():
                continue
            while j < end and self.text[j] != c:
                skip = self.text[j].isspace() or (node.style == '"' and self.text[j] == "\\") \
                    or (node.style == "'" and self.text[j] == "'")  # escapes: \" and ''
                if not skip:
                    return None
                j += 1
            if j >= end:
                return None
            out[i], j = j, j + 1
        return out

    def get(self, *path, default: Any = None) -> Any:
        value = self.data
        for key in path:
            if not isinstance(value, dict) or key not in value:
                return default
            value = value[key]
        return value


def _yaml_hint(problem: str) -> str:
    if "'\\t'" in problem:
        return "YAML indents with spaces, not tabs"
    if "mapping values are not allowed" in problem:
        return ("check this line's indentation; a value that contains ': ' (such as a 'keys:' split) "
                "must be quoted or written as a block ('pipeline: |')")
    return ""
