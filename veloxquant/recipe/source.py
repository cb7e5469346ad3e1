"""YAML with positions: every value keeps the file line/column it came from."""

import bisect
from collections.abc import Hashable
from typing import Any, Dict, Tuple

import attrs
import yaml

from ..errors import Location, RecipeError, quoted
from .limits import MAX_FILE_BYTES
from .safe_yaml import BoundedLoader, YamlLimitError


class Source:
    """A parsed YAML file plus the place of each key path (e.g. ("params", "bits"))."""

    def __init__(self, file: str, text: str):
        self.file, self.text = file, text
        self.marks: Dict[Tuple, yaml.Node] = {}
        self._line_starts = None
        loader = None
        try:
            loader = BoundedLoader(text)  # checks the characters first: may raise ReaderError
            node = loader.get_single_node()
            if node is None:
                raise RecipeError(
                    "the recipe file is empty",
                    Location(file, 1, 1),
                    "a recipe starts with 'veloxquant: 1' and a 'name:'",
                )
            self._walk(node, (), loader)
            self.data = loader.construct_document(node)
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            problem = str(e.problem or e.context)
            raise RecipeError(
                problem if isinstance(e, YamlLimitError) else f"invalid YAML: {problem}",
                self._index_location(mark.index) if mark else Location(file),
                _yaml_hint(problem),
            ) from None
        except yaml.reader.ReaderError as e:  # a character YAML does not allow (NUL, most control codes)
            raise RecipeError(
                f"invalid YAML: character U+{e.character:04X} is not allowed in a YAML file",
                self._index_location(e.position),
                "remove it, or write it as an escape inside a double-quoted string",
            ) from None
        finally:
            if loader is not None:
                loader.dispose()

    def _index_location(self, index: int) -> Location:
        """file:line:col of a character index (a bisect: a pipeline places each of its nodes).

        Lines end at "\n" only, as editors count them; PyYAML's own marks also break lines at
        U+0085 and U+2028, which would name lines the file does not have."""
        if self._line_starts is None:
            self._line_starts = [0] + [i + 1 for i, c in enumerate(self.text) if c == "\n"]
        line = bisect.bisect_right(self._line_starts, index)
        return Location(self.file, line, index - self._line_starts[line - 1] + 1)

    def _walk(self, node: yaml.Node, path: Tuple, loader: yaml.SafeLoader) -> None:
        self.marks[path] = node
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    raise RecipeError("a key must be a name or a number, not a map or a list", self._at(key_node, path))
                key = loader.construct_object(key_node)
                if not isinstance(key, Hashable):  # e.g. `? !!set a`
                    raise RecipeError("a key must be a name or a number", self._at(key_node, path))
                if key in seen:
                    raise RecipeError(
                        f"duplicate key {quoted(key)}",
                        self._at(key_node, path + (key,)),
                        f"first given at line {seen[key]}",
                    )
                seen[key] = self._index_location(key_node.start_mark.index).line
                self.marks[path + (key, "<key>")] = key_node
                self._walk(value_node, path + (key,), loader)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._walk(item, path + (i,), loader)

    def _at(self, node: yaml.Node, path: Tuple) -> Location:
        return attrs.evolve(self._index_location(node.start_mark.index), field=_field(path) or None)

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
        field = _field(path)
        where = self._align(node)
        if where is None:  # escapes in a quoted string: place line 1 exactly, the rest roughly
            shift = 1 if node.style in ("'", '"') else 0
            last = self._index_location(node.end_mark.index).line  # "a\n>> b" may be one line in the file

            def rough(line: int, col: int) -> Location:
                if base.line + line - 1 > last:
                    return base
                return Location(
                    self.file, base.line + line - 1, (base.column + shift + col - 1) if line == 1 else col, field
                )

            return rough
        value, raw = node.value, where
        placed = sorted(raw)  # offsets in the value that have a place in the file
        starts = [0] + [i + 1 for i, c in enumerate(value) if c == "\n"]

        def locate(line: int, col: int) -> Location:
            offset = starts[min(line, len(starts)) - 1] + col - 1
            n_before = bisect.bisect_right(placed, offset)
            if not n_before:
                index = raw[placed[0]] if placed else node.start_mark.index
            else:  # a blank or the end of the text: just after the nearest character before it
                k = placed[n_before - 1]
                index = raw[k] + (offset - k)
                newline = self.text.find("\n", raw[k])
                if newline != -1:
                    index = min(index, newline)
            return attrs.evolve(self._index_location(index), field=field)

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
                skip = (
                    self.text[j].isspace()
                    or (node.style == '"' and self.text[j] == "\\")
                    or (node.style == "'" and self.text[j] == "'")
                )  # escapes: \" and ''
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
        return (
            "check this line's indentation; a value that contains ': ' (such as a 'keys:' split) "
            "must be quoted or written as a block ('pipeline: |')"
        )
    if "constructor for the tag" in problem or "base64" in problem or "as a timestamp" in problem:
        return "a recipe holds plain YAML values (maps, lists, strings, numbers): remove the '!' tag"
    if "digits" in problem:
        return "numbers in a recipe have a few digits"
    return ""


_BOMS = (
    ("utf-32", b"\xff\xfe\x00\x00"),
    ("utf-32", b"\x00\x00\xfe\xff"),
    ("utf-16", b"\xff\xfe"),
    ("utf-16", b"\xfe\xff"),
    ("utf-8-sig", b"\xef\xbb\xbf"),
)


def read_text(path) -> str:
    """A recipe file's text: UTF-8, or UTF-16/32 with a byte-order mark (as YAML allows).

    The mark is dropped so that columns are the ones an editor shows."""
    where = Location(str(path))
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise RecipeError(f"cannot read recipe: {e.strerror or e}", where) from None
    if len(data) > MAX_FILE_BYTES:
        raise RecipeError(
            f"the recipe file is larger than {MAX_FILE_BYTES >> 20} MiB",
            Location(str(path), 1, 1),
            "a recipe is a few lines of YAML",
        )
    encoding = next((enc for enc, bom in _BOMS if data.startswith(bom)), "utf-8")
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        before = data[: e.start].decode(encoding, "replace").removeprefix("\ufeff")
        line, column = before.count("\n") + 1, len(before) - before.rfind("\n")
        raise RecipeError(
            f"the recipe is not {encoding.upper().replace('-SIG', '')} text: byte "
            f"0x{data[e.start]:02x} cannot be decoded ({e.reason})",
            Location(str(path), line, column),
            "save the recipe as UTF-8",
        ) from None


def _field(path: Tuple) -> str:
    """The dotted YAML path of a value, e.g. "params.bits"; a huge key is cut (a message stays readable)."""
    return ".".join(str(p) if len(str(p)) <= 40 else str(p)[:37] + "..." for p in path)
