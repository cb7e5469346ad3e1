"""Kernel source files: sections on '//@@ name' lines, and the text MLX is handed."""
import re
from typing import Dict


def split_sections(text: str) -> Dict[str, str]:
    """A kernel source split on its '//@@ name' lines (what precedes the first is dropped)."""
    parts: Dict[str, str] = {}
    name = None
    for line in text.splitlines(keepends=True):
        if line.startswith("//@@ "):
            name = line[5:].strip()
            parts[name] = ""
        elif name is not None:
            parts[name] += line
    return parts


def strip(src: str) -> str:
    """The source without comments, indentation and blank lines: MLX rebuilds and
    hashes the full kernel text on every call, so shorter is cheaper (measured on the
    H200: docs/kernels.md). Kernels hold no string
    literals, so '//' always starts a comment."""
    out = []
    for line in src.splitlines():
        t = _COMMENT.sub("", line).strip()
        if t:
            out.append(t)
    return "\n".join(out) + "\n"


_COMMENT = re.compile(r"\s*//.*$")
