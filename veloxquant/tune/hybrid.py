"""The hybrid space `tune --from hybrid` searches: eviction composed with codecs, under one byte budget.

A point is a whole recipe (its own pipeline, no `extends`): 4 sinks and the newest
`window` tokens in fp16, then each kv head keeps `budget` tokens by LagKV's
attention-free score, every step (so the held bytes are bounded by the budget
whatever the context), and the survivors are rotated and coded per side by a
codec family -- Lloyd-Max levels (per-vector norm) or min/max affine groups per
token -- at a width per layer (a base width, plus one bit on a layer selector).

The eviction fraction is not a grid of its own: for each codec choice, widths
and window, `points` solves for the largest budget whose held bytes fit the
byte budget (bytes are exact before the model runs, space.estimate_ratio), so
every point spends the budget and the search trades tokens kept against bits
per token. Points are measured in a seeded random order (`seed`), so a run
that stops at its time budget has sampled the space evenly and a repeated run
measures the same points first.
"""

import itertools
import random
from typing import Iterator, List, Optional, Tuple

import attrs

from ..compiler import ModelShape
from .space import LAYER_SETS, estimate_ratio, layer_lines

NAME = "hybrid"  # what `--from` names this space by
CODECS = {
    "lloydmax": "lloydmax(bits=${side}_bits)",
    "affine": "affine(bits=${side}_bits, group=32, axis=token)",
}
BITS = (2, 3, 4)
WINDOWS = (0, 16, 32, 64, 128)
BUDGET_STEP = 8  # budgets are solved to a multiple of this many tokens
SIDES = ("key", "value")


@attrs.frozen
class Hybrid:
    budget: int
    key_codec: str = "lloydmax"
    key_bits: int = 3
    value_codec: str = "lloydmax"
    value_bits: int = 2
    window: int = 16
    sinks: int = 4
    lag: int = 128
    layers: Tuple[Tuple[str, Tuple[Tuple[str, int], ...]], ...] = ()  # (selector, ((param, value), ...))

    @property
    def base(self) -> str:
        return NAME

    @property
    def label(self) -> str:
        text = (
            f"hybrid budget={self.budget} K={self.key_codec}{self.key_bits} "
            f"V={self.value_codec}{self.value_bits} window={self.window}"
        )
        for sel, ps in self.layers:
            text += f" [{sel}: " + ", ".join(f"{k}={v}" for k, v in ps) + "]"
        return text

    def pipeline(self) -> str:
        keys = CODECS[self.key_codec].replace("${side}", "$key")
        values = CODECS[self.value_codec].replace("${side}", "$value")
        head = "  >> evict(budget=$budget, sinks=0, score=lagkv, chunk=$lag) | rotation(seed=42) | "
        return f"  sink($sinks)\n  >> recent($window)\n{head}keys:   {keys}\n{' ' * len(head)}values: {values}\n"

    def yaml(self, name: str, header: str = "") -> str:
        lines = [f"# {line}" if line else "#" for line in header.splitlines()]
        lines += [
            "veloxquant: 1",
            f"name: {name}",
            f"summary: Hybrid found by tune - LagKV eviction every step (each kv head keeps {self.budget} coded "
            f"tokens), rotated {self.key_codec} keys and {self.value_codec} values; sinks and newest tokens fp16",
            "paper: LagKV (Liang et al., arXiv:2504.04704) eviction composed with rotated codes (see lagquant)",
            "params:",
            f"  budget: {{default: {self.budget}, type: int, doc: coded tokens each kv head keeps}}",
            f"  key_bits: {{default: {self.key_bits}, type: int, doc: {self.key_codec} bits per key coordinate}}",
            f"  value_bits: {{default: {self.value_bits}, type: int, "
            f"doc: {self.value_codec} bits per value coordinate}}",
            f"  window: {{default: {self.window}, type: int, doc: newest tokens kept in fp16}}",
            f"  sinks: {{default: {self.sinks}, type: int, doc: first positions kept in fp16}}",
            f"  lag: {{default: {self.lag}, type: int, doc: tokens per LagKV partition}}",
            "pipeline: |",
            self.pipeline().rstrip("\n"),
        ]
        return "\n".join(lines + layer_lines(self.layers)) + "\n"


def fit_budget(point: Hybrid, shape: ModelShape, context: int, max_ratio: float) -> Optional[Hybrid]:
    """`point` with the largest budget (a multiple of BUDGET_STEP, below the context) whose held bytes
    at `context` tokens are within max_ratio of fp16's; None if even the smallest budget exceeds it."""
    top = (context - point.sinks - point.window - 1) // BUDGET_STEP
    if top < 1:
        return None

    def ratio(steps: int) -> float:
        r = estimate_ratio(attrs.evolve(point, budget=steps * BUDGET_STEP), shape, context)
        return float("inf") if r is None else r

    low, high = ratio(1), ratio(top)
    if low > max_ratio:
        return None
    # an every-step eviction tier holds exactly `budget` tokens, so bytes are linear in it:
    # solve, then step down while the exact bytes still exceed the budget
    steps = top if high <= max_ratio else 1 + int((max_ratio - low) / ((high - low) / (top - 1)))
    while steps > 1 and ratio(steps) > max_ratio:
        steps -= 1
    return attrs.evolve(point, budget=steps * BUDGET_STEP)


def points(shape: ModelShape, context: int, max_ratio: float, seed: int = 0) -> List[Hybrid]:
    """Every codec family, width and window combination at the budget that spends `max_ratio`,
    in a seeded random order (the search measures them in this order)."""
    out = []
    for kc, vc, kb, vb, w in itertools.product(CODECS, CODECS, BITS, BITS, WINDOWS):
        fitted = fit_budget(Hybrid(0, kc, kb, vc, vb, w), shape, context, max_ratio)
        if fitted is not None:
            out.append(fitted)
    random.Random(seed).shuffle(out)
    return out


def mixes(best: Hybrid, shape: ModelShape, context: int, max_ratio: float) -> Iterator[Hybrid]:
    """Per-layer widths around `best`: one more bit of keys, values or both on a layer selector,
    the budget re-solved so the mix still spends (and fits) the byte budget."""
    for sel, sides in itertools.product(LAYER_SETS, (("key",), ("value",), SIDES)):
        ups = tuple((f"{s}_bits", getattr(best, f"{s}_bits") + 1) for s in sides)
        if any(b > 8 for _, b in ups):
            continue
        fitted = fit_budget(attrs.evolve(best, layers=((sel, ups),)), shape, context, max_ratio)
        if fitted is not None:
            yield fitted
