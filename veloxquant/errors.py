"""User-facing errors: each names where the problem is and what was expected."""

import difflib
from typing import Iterable, Optional

import attrs


@attrs.frozen
class Location:
    file: str
    line: Optional[int] = None  # 1-based
    column: Optional[int] = None  # 1-based
    field: Optional[str] = None  # dotted YAML path, e.g. "params.bits"

    def __str__(self) -> str:
        where = self.file
        if self.line is not None:
            where += f":{self.line}"
            if self.column is not None:
                where += f":{self.column}"
        if self.field:
            where += f" ({self.field})"
        return where


class VeloxError(Exception):
    """Base class of the errors the CLI prints without a traceback."""


class RecipeError(VeloxError):
    def __init__(self, message: str, location: Optional[Location] = None, hint: str = ""):
        self.message, self.location, self.hint = message, location, hint
        text = f"{location}: {message}" if location else message
        if hint:
            text += f"\n  hint: {hint}"
        super().__init__(text)


class CacheFileError(VeloxError):
    """A saved cache that cannot be loaded (corrupt, or made by another recipe)."""


def nearest(word: str, choices: Iterable[str]) -> str:
    """'did you mean' text for an unknown name, or '' when nothing is close."""
    choices = sorted(set(choices))
    close = difflib.get_close_matches(word, choices, n=3, cutoff=0.5)
    if close:
        return "did you mean " + " or ".join(f"'{c}'" for c in close) + "?"
    return "valid names: " + ", ".join(choices) if choices else ""


def brief(value) -> str:
    """repr() cut to a readable length: a message quotes what the user wrote, not 1 MB of it."""
    import reprlib

    short = reprlib.Repr()
    short.maxstring, short.maxother, short.maxlong, short.maxlevel = 60, 60, 40, 3
    return short.repr(value)


def quoted(name) -> str:
    """'name' for a message, cut to 60 characters (a key or path in a hostile file can be 1 MB)."""
    text = str(name)
    return f"'{text if len(text) <= 60 else text[:57] + '...'}'"
