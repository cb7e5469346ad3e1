"""Layer selectors in `layers:` overrides: 0, -1, 0-3, 0,2,4, sliding, full, all."""

import re
from typing import List

from ..errors import Location, RecipeError
from .shape import ModelShape


def select_layers(selector: str, shape: ModelShape, where: Location) -> List[int]:
    n = shape.n_layers
    chosen: List[int] = []
    for part in str(selector).split(","):
        part = part.strip()
        if part == "all":
            chosen += range(n)
        elif part in ("sliding", "full"):
            chosen += [i for i, w in enumerate(shape.windows) if (w is not None) == (part == "sliding")]
        else:
            m = re.fullmatch(r"(-?\d+)\s*(?:(?:-|\.\.)\s*(-?\d+))?", part)
            lo = int(m.group(1))
            hi = int(m.group(2)) if m.group(2) is not None else lo
            lo, hi = (lo + n if lo < 0 else lo), (hi + n if hi < 0 else hi)
            if not (0 <= lo <= hi < n):
                raise RecipeError(f"layer selector '{part}' is outside this model's layers 0-{n - 1}", where)
            chosen += range(lo, hi + 1)
    return sorted(set(chosen))
