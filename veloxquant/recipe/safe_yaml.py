"""PyYAML's safe loader with bounds a hostile file cannot get past.

The safe loader already refuses to build Python objects, but three things still
end in a crash or a hang: an alias inside the node it names (`a: &p {b: *p}` ->
endless recursion when walked), aliases that expand exponentially ("billion
laughs": each level names the one below nine times), and nesting deep enough to
overflow the stack (PyYAML composes recursively). Each is refused here, at the
place in the file that crosses the bound, before anything walks the document.
"""

from typing import Any, Dict

import yaml
from yaml.events import AliasEvent, CollectionStartEvent

from ..errors import brief
from .limits import MAX_YAML_DEPTH, MAX_YAML_NODES


class YamlLimitError(yaml.MarkedYAMLError):
    """A document that is valid YAML but asks for more than a recipe may."""


class BoundedLoader(yaml.SafeLoader):
    def __init__(self, stream):
        super().__init__(stream)
        self._open_anchors = set()  # anchors of collections still being composed
        self._size: Dict[int, int] = {}  # id(node) -> values in it with aliases expanded
        self._height: Dict[int, int] = {}  # id(node) -> nesting depth with aliases expanded
        self._depth = 0
        self._total = 0

    def _refuse(self, problem: str, mark) -> None:
        raise YamlLimitError(None, None, problem, mark)

    def compose_node(self, parent, index):
        if self.check_event(AliasEvent):
            event = self.peek_event()
            if event.anchor in self._open_anchors:
                self._refuse(
                    f"the alias *{event.anchor} is inside the value &{event.anchor} names, so it would repeat forever",
                    event.start_mark,
                )
            node = super().compose_node(parent, index)  # an undefined alias is PyYAML's error
            self._count(self._size[id(node)], self._height[id(node)], event.start_mark, f"the alias *{event.anchor}")
            return node
        event = self.peek_event()
        self._depth += 1
        if self._depth > MAX_YAML_DEPTH:
            self._refuse(f"maps and lists nest more than {MAX_YAML_DEPTH} deep", event.start_mark)
        opened = isinstance(event, CollectionStartEvent) and event.anchor is not None
        if opened:
            self._open_anchors.add(event.anchor)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
            if opened:
                self._open_anchors.discard(event.anchor)
        children = (
            node.value
            if isinstance(node, yaml.SequenceNode)
            else [n for pair in node.value for n in pair]
            if isinstance(node, yaml.MappingNode)
            else []
        )
        self._size[id(node)] = 1 + sum(self._size[id(c)] for c in children)
        self._height[id(node)] = 1 + max((self._height[id(c)] for c in children), default=0)
        self._count(1, 0, event.start_mark, "this file")
        return node

    def _count(self, size: int, height: int, mark, what: str) -> None:
        self._total += size
        if self._total > MAX_YAML_NODES:
            self._refuse(
                f"{what} makes the recipe hold more than {MAX_YAML_NODES} YAML values (aliases count once per use)",
                mark,
            )
        if self._depth + height > MAX_YAML_DEPTH:
            self._refuse(f"{what} makes maps and lists nest more than {MAX_YAML_DEPTH} deep", mark)

    def scan_flow_scalar_non_spaces(self, double, start_mark):
        # PyYAML turns "\U001BC1C3" into chr(0x1BC1C3): a ValueError with no place. A surrogate
        # ("\uD800") is no character either, and could not even be printed in a message.
        try:
            chunks = super().scan_flow_scalar_non_spaces(double, start_mark)
        except (ValueError, OverflowError):
            chunks = None
        if chunks is None or any(0xD800 <= ord(c) <= 0xDFFF for chunk in chunks for c in chunk):
            raise yaml.scanner.ScannerError(
                "while scanning a quoted string", start_mark, "an escape names no Unicode character", self.get_mark()
            )
        return chunks

    def construct_object(self, node, deep=False):
        # A tagged scalar the constructor cannot read (`!!timestamp x`, an int of
        # 5,000 digits) raises a plain Python error: place it at the node.
        try:
            return super().construct_object(node, deep)
        except (yaml.MarkedYAMLError, RecursionError, MemoryError):
            raise
        except Exception as e:
            tag = node.tag.rsplit(":", 1)[-1]
            reason = f" ({str(e).split(';')[0]})" if isinstance(e, ValueError) else ""
            what = brief(node.value) if isinstance(node, yaml.ScalarNode) else "this value"
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read {what} as {tag}{reason}", node.start_mark
            ) from None


def load_value(text: str) -> Any:
    """One YAML value (e.g. of `--set name=VALUE`) under the same bounds."""
    loader = BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
