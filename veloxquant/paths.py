"""Where the data directories (grammar/, recipes/, kernels/) live.

In a checkout or an editable install they sit beside the package; in a wheel
they are shipped inside it under ``veloxquant/_data``.
"""

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def data_dir(name: str) -> Path:
    for candidate in (_PACKAGE / "_data" / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"veloxquant data directory '{name}' is missing from the installation")


def grammar_file() -> Path:
    return data_dir("grammar") / "recipe.lark"


def recipes_dir() -> Path:
    return data_dir("recipes")


def kernels_dir() -> Path:
    return data_dir("kernels")
