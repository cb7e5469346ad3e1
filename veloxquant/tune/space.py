"""What `tune` searches: a base recipe's parameters, and per-layer mixes of them.

A candidate is a recipe that `extends` a built-in, sets some of its integer
parameters, and may give some layers other values (more bits or a larger
window on the first or last layers). Each is written as the YAML text it will
be saved as, so what is measured is exactly what is written.

Before perplexity is measured, each candidate's held bytes at the calibration
context are found without the model (random K/V fed to its caches: bytes do
not depend on values; eviction recipes, which need real attention, fall back
to tokens per tier x bits per element), to skip the ones that cannot fit. The
bytes `tune` reports are those held while perplexity was measured.
"""

import itertools
from typing import Dict, Iterator, List, Optional, Tuple

import attrs

from ..compiler import ModelShape, compile_recipe
from ..compiler.groups import codec_bits
from ..errors import VeloxError
from ..eval.cost import fp16_bytes
from ..recipe import load_recipe
from ..runtime.kinds.tier import UNBOUNDED_STEP
from ..runtime.make import caches_for
from .measure import recipe_from_text

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
        return "\n".join(lines + layer_lines(self.layers)) + "\n"


def layer_lines(layers) -> List[str]:
    """A recipe's `layers:` block for per-layer parameter overrides ((selector, ((name, value), ...)), ...)."""
    lines = ["layers:"] if layers else []
    for sel, ps in layers:
        inner = ", ".join(f"{k}: {v}" for k, v in ps)
        lines.append(f'  "{sel}": {{params: {{{inner}}}}}')
    return lines


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


def estimate_ratio(cand: Candidate, shape: ModelShape, context: int, chunk: int = 512) -> Optional[float]:
    """Bytes at `context` tokens / fp16's (None if it does not compile for this shape).

    Held bytes depend on the shape and the token count, not on the values, so the
    caches are fed random K/V of the model's shape in prefill-sized chunks (no
    model) and their arrays counted. Recipes that need the attention hook
    (eviction) cannot be fed that way: for them, tokens per tier x bits/element."""
    try:
        recipe = recipe_from_text(cand.yaml("estimate"))
        plan = compile_recipe(recipe, shape)
    except VeloxError:
        return None
    if not any(layer.needs for layer in plan.layers):
        return _fed_ratio(compile_recipe(recipe, shape, hook=False), context, chunk)
    return _plan_ratio(plan, context)


def needs_attention(cand: Candidate, shape: ModelShape) -> bool:
    """Whether a candidate's stages need the attention hook (so its bytes are estimated, not fed)."""
    plan = compile_recipe(recipe_from_text(cand.yaml("estimate")), shape)
    return any(layer.needs for layer in plan.layers)


def _fed_ratio(plan, context: int, chunk: int) -> float:
    import mlx.core as mx

    caches = caches_for(plan)
    for s in range(0, context, chunk):
        n = min(chunk, context - s)
        for cache, layer in zip(caches, plan.layers):
            kv = mx.random.normal((1, layer.n_kv_heads, n, layer.head_dim)).astype(mx.float16)
            cache.update_and_fetch(kv, kv)
        mx.eval([c.state for c in caches])  # settle, as generation does between prefill chunks
    return sum(c.nbytes for c in caches) / fp16_bytes(plan.shape, context)


def _plan_ratio(plan, context: int) -> float:
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
            held_tokens = take
            if n is None and not t.drops:  # unbounded tiers allocate in steps: the slack is held too
                held_tokens = -(-take // UNBOUNDED_STEP) * UNBOUNDED_STEP
            if not t.drops:
                per = (
                    codec_bits(t.keys, layer.head_dim, layer.role) + codec_bits(t.values, layer.head_dim, layer.role)
                ) / 2
                bits += held_tokens * (per if per == per else 16.0)  # NaN: the model's dtype, counted as 16-bit
                if getattr(route, "per_head", False):
                    bits += take * 64 / (2 * layer.head_dim)  # 8 bytes per token and head, of positions and scores
            left -= take
            if left <= 0:
                break
        held += bits * layer.n_kv_heads * layer.head_dim
        base += ctx * 16.0 * layer.n_kv_heads * layer.head_dim
    return held / base if base else None


def shortlist(
    cands: List[Candidate], shape: ModelShape, context: int, max_ratio: float, floor: float = 0.6
) -> List[Tuple[Candidate, float]]:
    """Candidates whose bytes lie in [floor x budget, budget], most bytes first (more bytes
    usually means lower perplexity); the measurement decides. Plan-based estimates (eviction
    recipes) are uncertain, so they may exceed the budget by 10% here."""
    out: Dict[Candidate, float] = {}
    for c in cands:
        est = estimate_ratio(c, shape, context)
        exact = est is not None and not needs_attention(c, shape)
        if est is not None and floor * max_ratio <= est <= (1.0 if exact else 1.1) * max_ratio:
            out[c] = est
    return sorted(out.items(), key=lambda kv: -kv[1])
