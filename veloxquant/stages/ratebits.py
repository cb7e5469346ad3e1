"""`ratebits`: codes at a per-layer width allocated by RateQuant (calibrated).

The codes are Lloyd-Max's (per-vector norm; the default) or, with codec=affine,
min/max group codes (`affine`'s group and axis: KIVI's per-channel keys, which
never clip the tails that real queries attend to -- Gemma-3's keys need that).
With context=N the allocation counts each site's bits by the tokens it holds at
N tokens of context (a sliding-window layer holds at most its window), so the
mean is over bytes held, not over layers; context=0 weighs every layer alike.

Calibration measures, for every layer and every width b in lo..hi, the error
this stage's codes at b bits cause in the layer's attention output for the
model's real queries (keys: the scores move; values: the summed values move),
D_l(b) = mean ||o - o_b||^2 / mean ||o||^2 over the last queries of the calibration
text (relative: deeper layers' outputs are larger, not more important).
`allocate` then picks the widths across layers, keys and values together (their
errors are errors of the same output), by dynamic programming: minimise
sum D(b) with the widths' mean = target -- the measured curves, not RateQuant's
fitted alpha * beta^-b proxy. Equal curves give equal widths. The widths are artifact arrays, so they enter the plan's
fingerprint with its content hash; `bits_per_element` (explain) shows the target.
"""

from typing import Dict, Optional, Tuple

import attrs
import mlx.core as mx
import numpy as np

from ..artifacts import QUERY_STRIDE, CalibrationError, slot_arrays
from .codebook import LloydMax
from .registry import choices, in_range, stage
from .store import Affine

QUERIES = 64  # the last calibration queries the errors are measured on
_WIDTHS: Dict[Tuple[str, str], int] = {}


def _softmax(s: np.ndarray) -> np.ndarray:
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def allocate_widths(errors: np.ndarray, lo: int, target: float, weights: Optional[np.ndarray] = None) -> np.ndarray:
    """errors [sites, widths] (widths lo, lo+1, ...): the widths minimising the summed error with
    their mean = target, each site's width counted `weights` times (integers: the tokens a site
    holds, in units; none = 1 each), clipped to what the widths allow."""
    L, W = errors.shape
    w = np.ones(L, dtype=np.int64) if weights is None else np.asarray(weights, dtype=np.int64)
    total = int(w.sum())
    budget = int(np.clip(round(target * total) - lo * total, 0, (W - 1) * total))  # extra bits above lo
    best = np.full((L + 1, budget + 1), np.inf)
    best[0, 0] = 0.0
    pick = np.zeros((L, budget + 1), dtype=np.int64)
    for i in range(L):
        for c in range(budget + 1):
            opts = [best[i, c - x * w[i]] + errors[i, x] if x * w[i] <= c else np.inf for x in range(W)]
            pick[i, c] = int(np.argmin(opts))
            best[i + 1, c] = opts[pick[i, c]]
    # the least error within the budget, spending the most bits among equals (with unequal weights
    # the full budget may be out of reach, or reachable only through a worse mix)
    c = int(np.flatnonzero(best[L] == best[L].min())[-1])
    widths = np.zeros(L, dtype=np.int64)
    for i in reversed(range(L)):
        widths[i] = pick[i, c]
        c -= widths[i] * w[i]
    return widths + lo


def site_weights(helds: np.ndarray, context: int) -> Optional[np.ndarray]:
    """Integer weights proportional to the tokens each site holds at `context` tokens
    (a sliding-window layer holds at most its window); context 0: equal weights."""
    if not context:
        return None
    held = np.array([min(context, h) if h else context for h in helds], dtype=np.int64)
    return np.maximum(1, np.round(held / held.min())).astype(np.int64)


@stage("ratebits", "store")
@attrs.frozen
class RateBits:
    """Lloyd-Max codes (per-vector norm) at a per-layer width from measured attention-output error (calibrated)."""

    target: float = attrs.field(default=3.0, validator=in_range(1.0, 8.0))
    lo: int = attrs.field(default=2, validator=in_range(1, 8))
    hi: int = attrs.field(default=4, validator=in_range(1, 8))
    corpus: str = "austen:emma"
    tokens: int = attrs.field(default=2048, validator=in_range(64, 1 << 20))
    codec: str = attrs.field(default="lloydmax", validator=choices("lloydmax", "affine"))
    group: int = attrs.field(default=64, validator=in_range(1, 1 << 16))  # affine's group
    axis: str = attrs.field(default="token", validator=choices("token", "channel"))  # affine's axis
    context: int = attrs.field(default=0, validator=in_range(0, 1 << 24))
    _artifact: str = ""
    _slot: str = ""

    calibrated = True
    fit_version = 3  # 3: sliding windows masked; 2: one allocation over keys and values (1: each side alone)
    fits_layer = True
    codes = False  # the width is the artifact's: entropy stages cannot know it from the plan

    @property
    def token_multiple(self) -> int:
        return self._affine(self.lo).token_multiple if self.codec == "affine" else 1

    def units(self) -> Dict[str, int]:
        return self._affine(self.lo).units() if self.codec == "affine" else {"codes": 1, "norms": 1}

    def bits_per_element(self, head_dim: int) -> float:
        return self.target + (32 / self.group if self.codec == "affine" else 16 / head_dim)

    def check_head_dim(self, head_dim: int) -> str:
        if self.lo > self.hi:
            return f"lo={self.lo} is above hi={self.hi}"
        if self.codec == "affine" and self.axis == "token" and head_dim % self.group:
            return f"group={self.group} does not divide head_dim {head_dim}"
        bad = [b for b in range(self.lo, self.hi + 1) if (head_dim * b) % 32]
        return f"{head_dim} channels of {bad[0]} bits do not fill 32-bit words" if bad else ""

    # --- calibration -----------------------------------------------------
    def fit(
        self, x: np.ndarray, q: np.ndarray, layer: Dict[str, np.ndarray], side: str, window: Optional[int] = None
    ) -> Dict[str, np.ndarray]:
        """D_l(b) for b = lo..hi: attention-output error of the last QUERIES real queries.
        `x`, `q`: the samples in this stage's domain; `layer`: the raw q, k, v; `side`: "k" or "v";
        `window`: the layer's sliding window (its queries see only that many keys)."""
        k, v, qr = layer["k"], layer["v"], layer["q"]  # raw: the exact attention
        H, N, D = k.shape
        rep = qr.shape[0] // H
        n = min(QUERIES, qr.shape[1])
        pos = (np.arange(qr.shape[1]) * QUERY_STRIDE)[-n:]  # the positions of the queries collect.py kept
        mask = np.arange(N)[None] <= pos[:, None]
        if window:
            mask &= np.arange(N)[None] > pos[:, None] - window
        scale = D**-0.5
        qh = qr[:, -n:].reshape(H, rep * n, D)
        qs = q[:, -n:].reshape(H, rep * n, D)  # the same queries in this stage's domain (keys)
        exact_s = np.where(np.tile(mask, (rep, 1)), qh @ k.transpose(0, 2, 1) * scale, -np.inf)
        weights = _softmax(exact_s)
        ref = weights @ v
        errors = []
        cut = N - N % self.token_multiple  # whole groups; the tail's error counts as zero
        for b in range(self.lo, self.hi + 1):
            coder = self._coder(b)
            xm = mx.array(x[:, :cut])[None]
            err = np.zeros_like(x)
            err[:, :cut] = np.array((xm - coder.decode(coder.encode(xm), mx.float32))[0])  # what the codes lose
            if side == "k":
                moved = _softmax(exact_s - (qs @ err.transpose(0, 2, 1)) * scale) @ v - ref
            else:
                moved = weights @ err  # in the stage's domain: orthogonal transforms keep its size
            errors.append(float(np.mean(np.sum(moved**2, -1)) / np.mean(np.sum(ref**2, -1))))
        return {"errors": np.array(errors, dtype=np.float32), "held": np.array([window or 0], dtype=np.int64)}

    @classmethod
    def allocate(cls, fits: Dict[tuple, Dict[str, np.ndarray]]) -> Dict[tuple, Dict[str, np.ndarray]]:
        """Widths across the layers and both sides of each tier together: key and value errors are
        errors of the same attention output, so bits go where they cut it most (keys, mostly).
        The mean width over a tier's sites is the mean of their targets."""
        out = {}
        groups: Dict[int, list] = {}
        for site in fits:
            groups.setdefault(site[1], []).append(site)
        for sites in groups.values():
            sites.sort(key=lambda s: (s[0], s[2]))
            lo = min(s[3].lo for s in sites)
            errors = np.full((len(sites), max(s[3].hi for s in sites) - lo + 1), np.inf)
            for row, s in enumerate(sites):  # a site's own range; widths outside it cost infinity
                errors[row, s[3].lo - lo : s[3].hi - lo + 1] = fits[s]["errors"]
            weights = site_weights(np.array([fits[s].get("held", [0])[0] for s in sites]), sites[0][3].context)
            widths = allocate_widths(errors, lo, float(np.mean([s[3].target for s in sites])), weights)
            out.update({s: {**fits[s], "bits": np.array([w], dtype=np.int32)} for s, w in zip(sites, widths)})
        return out

    # --- coding at the allocated width ----------------------------------------
    def width(self) -> int:
        if not self._artifact:
            raise CalibrationError(
                "stage 'ratebits' is not bound to a calibration artifact: run `veloxquant "
                "calibrate RECIPE` and make caches with veloxquant.make_prompt_cache"
            )
        key = (self._artifact, self._slot)
        if key not in _WIDTHS:  # read once: encode runs every decode step
            _WIDTHS[key] = int(slot_arrays(self._artifact, self._slot)["bits"][0].item())
        return _WIDTHS[key]

    def _affine(self, bits: int) -> Affine:
        return Affine(bits=bits, group=self.group, axis=self.axis)

    def _coder(self, bits: Optional[int] = None):
        bits = self.width() if bits is None else bits
        return self._affine(bits) if self.codec == "affine" else LloydMax(bits=bits)

    def encode(self, x: mx.array) -> Dict[str, mx.array]:
        return self._coder().encode(x)

    def decode(self, enc: Dict[str, mx.array], dtype) -> mx.array:
        return self._coder().decode(enc, dtype)

    def scores(self, q: mx.array, enc: Dict[str, mx.array]) -> mx.array:
        if self.codec == "affine":  # min/max codes have no code-domain scores: decode, then dot
            return q @ self.decode(enc, q.dtype).swapaxes(-1, -2)
        return self._coder().scores(q, enc)
