"""Bit allocation by dynamic programming (KVTC): widths for components of known variance.

Given variances v_i and a budget of bits per vector, pick each component's width
b_i from `choices` (0 = drop the component) to minimise sum_i v_i * beta**(-b_i)
with sum_i b_i <= budget. beta = 4 is the high-rate rule (each bit quarters the
error); KVTC's default is 3.5. Any stage may call `allocate` to turn a spectrum
into widths; the `latent` store does with `budget=`.
"""

from typing import Optional, Sequence

import numpy as np

TIE = 1e-9  # relative: costs this close are equal, and the later component takes the smaller width


def parse_choices(text: str) -> tuple:
    """'0,1,2,4' -> (0, 1, 2, 4); raises ValueError naming what is wrong."""
    try:
        out = tuple(sorted({int(t) for t in text.split(",") if t.strip()}))
    except ValueError:
        raise ValueError(f"must be comma-separated integers, e.g. '0,1,2,4'; got {text!r}") from None
    if not out or out[0] < 0 or out[-1] > 8:
        raise ValueError(f"must list widths between 0 and 8 bits; got {text!r}")
    return out


def allocate(
    variances: Sequence[float],
    budget: int,
    choices: Sequence[int],
    beta: float = 4.0,
    distortion: Optional[Sequence[float]] = None,
) -> np.ndarray:
    """Widths (int array, one per component) minimising the distortion proxy within `budget` bits.

    `distortion[b]`: the error of a unit-variance component coded in b bits, in place of beta**-b
    (the Lloyd-Max codebook's own: 1-bit codes keep 0.36 of the variance, not 0.25). With equal
    variances, contiguous choices and a convex distortion this is floor(budget/n) bits each, the
    remainder one extra bit for the first components."""
    v = np.asarray(variances, dtype=np.float64)
    n, choices = len(v), sorted(set(int(c) for c in choices))
    cost = (lambda b: float(distortion[b])) if distortion is not None else (lambda b: beta**-b)
    if 0 not in choices:
        raise ValueError("the choices must include 0 (a component may always be dropped)")
    budget = int(min(budget, n * choices[-1]))
    # best[i, c]: least distortion of the first i components with at most c bits.
    best = np.zeros((n + 1, budget + 1))
    for i in range(n):
        options = [
            np.concatenate([np.full(min(b, budget + 1), np.inf), best[i, : max(budget + 1 - b, 0)]]) + v[i] * cost(b)
            for b in choices
        ]
        best[i + 1] = np.min(options, axis=0)
    widths, c = np.zeros(n, dtype=np.int64), budget
    for i in reversed(range(n)):  # the smallest width that stays optimal: earlier components get the rest
        totals = [best[i, c - b] + v[i] * cost(b) if b <= c else np.inf for b in choices]
        low = min(totals)
        widths[i] = next(b for b, t in zip(choices, totals) if t <= low + TIE * max(abs(low), 1e-300))
        c -= widths[i]
    return widths
