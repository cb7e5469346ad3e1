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


_WORD = re.compile(r"[A-Za-z_]\w*")
_NAMED = re.compile(r"(?:struct|union|class)\s+([A-Za-z_]\w*)|([A-Za-z_]\w*)\s*(?:\(|=|\{|;)")


def _items(header: str):
    """The header's top-level items (a preprocessor line, or a declaration with its braces),
    each as (its name or None, its text). Template heads join the item they introduce."""
    items, cur, depth = [], [], 0
    for line in header.splitlines(keepends=True):
        if depth == 0 and not cur and line.startswith("#"):
            items.append((None, line))
            continue
        cur.append(line)
        depth += line.count("{") - line.count("}")
        text = "".join(cur)
        if depth == 0 and (line.rstrip().endswith(("}", ";")) and "{" in text or line.rstrip().endswith(";")):
            items.append((_name(text), text))
            cur = []
    if cur:
        items.append((None, "".join(cur)))
    return items


def _name(item: str):
    """The name an item declares (the identifier before its first '(', '=', '{' or ';',
    past a template head), or None when unsure (the item is then always kept)."""
    head = item.split("{", 1)[0]
    if head.startswith("template"):
        depth, i = 0, 0
        for i, c in enumerate(head):
            depth += (c == "<") - (c == ">")
            if c == ">" and depth == 0:
                break
        head = head[i + 1 :]
    m = _NAMED.search(head)
    if not m:
        return None
    name = m.group(1) or m.group(2)
    return None if name in ("if", "for", "while", "return", "static_assert", "operator") else name


def prune(header: str, body: str) -> str:
    """The header without the declarations neither `body` nor a kept declaration names:
    MLX hashes a kernel's whole text at each launch, and shared headers carry helpers
    for other kernels. Preprocessor lines and items whose name is unclear are kept; the
    compiled code is the same (nvcc_check compares the SASS)."""
    items = _items(header)
    keep = [name is None for name, _ in items]
    used = set(_WORD.findall(body)).union(*(_WORD.findall(t) for k, (_, t) in zip(keep, items) if k))
    grew = True
    while grew:
        grew = False
        for i, (name, text) in enumerate(items):
            if not keep[i] and name in used:
                keep[i] = grew = True
                used |= set(_WORD.findall(text))
    return "".join(text for k, (_, text) in zip(keep, items) if k)


_STRING = re.compile(r'"(?:\\.|[^"\\])*"')
_PUNCT = set(";,(){}[]")
_OPS = set("=+-*/<>!&|^%?:~.")


def _tight(a: str, b: str) -> bool:
    """Whether the space between characters a and b can go: one side is punctuation that
    never joins into another token, or a word meets an operator. Two operators keep their
    space (`- -`, `< <`, `/ *` would become other tokens)."""
    if a in _PUNCT or b in _PUNCT:
        return True
    word_a, word_b = a.isalnum() or a == "_", b.isalnum() or b == "_"
    return (word_a and b in _OPS) or (a in _OPS and word_b)


def squeeze(src: str) -> str:
    """`src` (already `strip`ped) without the spaces the compiler does not need, outside
    string literals (asm text) and preprocessor lines: fewer bytes for MLX to hash."""
    out = []
    for line in src.splitlines():
        if line.startswith("#"):
            out.append(line)
            continue
        parts, last = [], 0
        for m in _STRING.finditer(line):
            parts.append(_squeeze_code(line[last : m.start()]))
            parts.append(m.group(0))
            last = m.end()
        parts.append(_squeeze_code(line[last:]))
        out.append("".join(parts))
    return "\n".join(out) + "\n"


def _squeeze_code(code: str) -> str:
    pieces = re.split(r"(\s+)", code)
    kept = []
    for i, p in enumerate(pieces):
        if p and p.isspace():
            a = kept[-1][-1] if kept and kept[-1] else ""
            b = pieces[i + 1][:1] if i + 1 < len(pieces) else ""
            if not a or not b or _tight(a, b):
                continue
            p = " "
        kept.append(p)
    return "".join(kept)
