"""Kernel source files: sections on '//@@ name' lines, and the text MLX is handed."""
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
    """The source without comment lines and blank lines: MLX rebuilds the full
    kernel text on every call (graph construction), so shorter is cheaper."""
    out = []
    for line in src.splitlines():
        t = line.strip()
        if not t or t.startswith("//"):
            continue
        out.append(line)
    return "\n".join(out) + "\n"
