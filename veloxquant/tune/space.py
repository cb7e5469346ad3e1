"""What `tune` searches: a base recipe's parameters, and per-layer mixes of them.

A candidate is a recipe that `extends` a built-in, sets some of its integer
parameters, and may give some layers other values (more bits or a larger
window on the first or last layers). Each is written as the YAML text it will
be saved as, so what is measured is exactly what is written.

Before measuring, candidates are ranked by an estimate of their bytes at the
calibration context (tokens per tier x bits per element from the compiled
plan): only to skip the ones far from the budget. Every figure `tune`
reports is measured.
"""
import itertools
from typing import Dict, Iterator, List, Optional, Tuple

import attrs

from ..compiler import ModelShape, compile_recipe
from ..compiler.groups import codec_bits
from ..errors import VeloxError
from ..recipe import load_recipe

# Values tried for the parameters the built-ins share; others keep their default.
GRID = {"bits": (2, 3, 4), "window": (16, 32, 64, 128), "group": (32, 64), "budget": (64, 96, 128, 192, 256)}
LAYER_SETS = ("0", "0-1", "-1", "0,-1", "0-3")  # which layers a mix treats differently


@attrs.frozen
class Candidate:
    base: str
    params: Tuple[Tuple[str, int], ...] = ()
    layers: Tuple[Tuple[str, Tuple[Tuple[str, int], ...]], ...] = ()

    @property
    def label(self) -> str:
        text = self.base + "".join(f" {k}={v}" for k, v in self.params)
        for sel, ps in self.layers:
            text += f" [{sel}: " + ", ".join(f"{k}={v}" for k, v in ps) + "]"
        return text

    def yaml(self, name: str, header: str = "") -> str:
        lines = [f"# {line}" if line else "#" for line in header.splitlines()]
        lines += ["veloxquant: 1", f"name: {name}", f"extends: {self.base}"]
        if self.params:
            lines.append("params:")
            lines += [f"  {k}: {v}" for k, v in self.params]
        if self.layers:
            lines.append("layers:")
            for sel, ps in self.layers:
                inner = ", ".join(f"{k}: {v}" for k, v in ps)
                lines.append(f'  "{sel}": {{params: {{{inner}}}}}')
        return "\n".join(lines) + "\n"


def grid(base: str) -> Iterator[Candidate]:
    """Every combination of GRID values for the integer parameters `base` declares."""
    recipe = load_recipe(base)
    names = [n for n in GRID if n in recipe.params and recipe.params[n].type == "int"]
    for values in itertools.product(*(GRID[n] for n in names)):
        yield Candidate(base, tuple(zip(names, values)))


def mixes(best: Candidate) -> Iterator[Candidate]:
    """Per-layer variants of `best`: some layers get more bits or a larger window, the rest
    may give some back (fewer bits or a smaller window), so the mix can stay within budget."""
    params = dict(best.params)
    ups, downs = [], [dict()]
    if "bits" in params:
        ups += [{"bits": b} for b in (params["bits"] + 1, params["bits"] + 2) if b <= 8]
        if params["bits"] > 2:
            downs.append({"bits": params["bits"] - 1})
    if "window" in params:
        ups.append({"window": params["window"] * 2})
        if params["window"] >= 32:
            downs.append({"window": params["window"] // 2})
    for up, down, sel in itertools.product(ups, downs, LAYER_SETS):
        glob = {**params, **down}
        yield Candidate(best.base, tuple(glob.items()), ((sel, tuple(up.items())),))


def estimate_ratio(cand: Candidate, shape: ModelShape, context: int) -> Optional[float]:
    """Bytes at `context` tokens / fp16's, from the plan (None if it does not compile here)."""
    from ..tune.measure import recipe_from_text
    try:
        plan = compile_recipe(recipe_from_text(cand.yaml("estimate")), shape)
    except VeloxError:
        return None
    held = base = 0.0
    for layer in plan.layers:
        ctx = min(context, layer.window or context)
        left, bits = ctx, 0.0
        for t in layer.tiers:
            route = t.route
            n = getattr(route, "n", None) if route is not None else None
            if getattr(route, "per_head", False):
                n = route.budget
            take = left if n is None or route.stage_name == "drop" else min(left, n)
            if not t.drops:
                per = (codec_bits(t.keys, layer.head_dim, layer.role) + codec_bits(t.values, layer.head_dim, layer.role)) / 2
                bits += take * (per if per == per else 16.0)  # NaN: the model's dtype, counted as 16-bit
                if getattr(route, "per_head", False):
                    bits += take * 64 / (2 * layer.head_dim)  # 8 bytes per token and head, of positions and scores
            left -= take
            if left <= 0:
                break
        held += bits * layer.n_kv_heads * layer.head_dim
        base += ctx * 16.0 * layer.n_kv_heads * layer.head_dim
    return held / base if base else None


def shortlist(cands: List[Candidate], shape: ModelShape, context: int, max_ratio: float,
              floor: float = 0.6) -> List[Tuple[Candidate, float]]:
    """Candidates whose estimate lies in [floor x budget, 1.1 x budget], most bytes first
    (more bytes usually means lower perplexity); the measurement decides."""
    out: Dict[Candidate, float] = {}
    for c in cands:
        est = estimate_ratio(c, shape, context)
        if est is not None and floor * max_ratio <= est <= 1.1 * max_ratio:
            out[c] = est
    return sorted(out.items(), key=lambda kv: -kv[1])
