"""`duo`: DuoAttention's head split (calibrated): retrieval kv heads keep every token, streaming
heads keep only what the tiers before this one hold (sinks + a recent window).

The route stands last in a layer (`sink(s) >> recent(w) >> duo(...)`) and takes what the window
spills, but holds it for the retrieval heads only (runtime/kinds/head_subset.py): a streaming
head's spilled tokens are let go. Its codec applies to what it holds, so the retrieval heads'
long context may be coded (`duo(...) | keys: affine(...) values: ...`).

Calibration (veloxquant calibrate, on synthetic passkey text: corpus `passkey`) optimises one
gate a_h in [0, 1] per kv head, DuoAttention's (Xiao et al., arXiv:2410.10819) mixed attention
a_h * full_h + (1 - a_h) * streaming_h against full attention's output, with an L1 penalty:

    min_a  ||W_o (mixed(a) - full)||^2 / ||W_o full||^2  +  l1 * sum_h a_h,   a in [0, 1]^H

per layer, over the real queries of the calibration text (W_o: the layer's output projection,
so heads whose errors cancel are weighed together). The paper's loss is on the model's last
hidden states; this one is each layer's attention output (no backward pass through the model).
It is a box-constrained quadratic, solved by projected Adam as in the paper (lr 0.02, from a=1).
At run time `retrieval` (a runtime parameter: no new artifact) keeps that share of the model's
kv heads whole: the highest gates, ties broken by the error a head alone would cause streaming.
"""

from functools import lru_cache
from typing import Dict, Optional, Tuple

import attrs
import numpy as np

from ..artifacts import arrays as artifact_arrays
from .registry import in_range, stage

QUERIES = 512  # the calibration queries (latest first) the gates are fitted on


def _softmax_out(scores: np.ndarray, visible: np.ndarray, v: np.ndarray) -> np.ndarray:
    """softmax over the visible keys of scores [M, N], times v [N, D]."""
    s = np.where(visible, scores, -np.inf)
    s = s - s.max(-1, keepdims=True)
    w = np.exp(s)
    return (w / w.sum(-1, keepdims=True)) @ v


def error_gram(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    pos: np.ndarray,
    scale: float,
    held: Tuple[int, int],
    o_proj: Optional[np.ndarray],
    layer_window: Optional[int],
) -> np.ndarray:
    """G [H, H]: mean over the queries of <W_o,h d_h, W_o,h' d_h'> / mean ||W_o full||^2, d_h the
    streaming-minus-full output of kv head h's query heads. q [Hq, M, D] at positions `pos` [M];
    k, v [H, N, D]; held = (sinks, window) a streaming head sees."""
    Hq, M, D = q.shape
    H, N, _ = k.shape
    rep = Hq // H
    keys = np.arange(N)[None, :]
    seen = keys <= pos[:, None]
    if layer_window:
        seen &= keys > pos[:, None] - layer_window
    sinks, window = held
    streaming = seen & ((keys < sinks) | (keys >= pos[:, None] - window))
    W = o_proj if o_proj is not None else np.eye(Hq * D, dtype=np.float32)
    diff = np.zeros((H, M, W.shape[0]), np.float32)
    ref = np.zeros((M, W.shape[0]), np.float32)
    for j in range(Hq):  # calibration only: one query head's [M, N] scores at a time
        h = j // rep
        scores = (q[j] * scale) @ k[h].T
        full = _softmax_out(scores, seen, v[h])
        part = W[:, j * D : (j + 1) * D]
        diff[h] += (_softmax_out(scores, streaming, v[h]) - full) @ part.T
        ref += full @ part.T
    norm = max(float(np.mean(np.sum(ref**2, -1))), 1e-30)
    return np.einsum("hmc,gmc->hg", diff, diff) / M / norm


def optimise_gates(gram: np.ndarray, l1: float, steps: int, lr: float = 0.02) -> np.ndarray:
    """argmin over a in [0, 1]^H of (1-a)^T G (1-a) + l1 * sum(a): projected Adam from a = 1."""
    a = np.ones(gram.shape[0])
    m, s = np.zeros_like(a), np.zeros_like(a)
    for t in range(1, steps + 1):
        grad = -2 * gram @ (1 - a) + l1
        m = 0.9 * m + 0.1 * grad
        s = 0.999 * s + 0.001 * grad**2
        a = np.clip(a - lr * (m / (1 - 0.9**t)) / (np.sqrt(s / (1 - 0.999**t)) + 1e-8), 0.0, 1.0)
    return a.astype(np.float32)


def gate_loss(gram: np.ndarray, a: np.ndarray, l1: float) -> float:
    u = 1 - np.asarray(a, np.float64)
    return float(u @ gram @ u + l1 * np.sum(a))


@lru_cache(maxsize=64)
def retrieval_heads(digest: str, share: float) -> Dict[str, Tuple[int, ...]]:
    """{slot: kv heads kept whole}: the `share` of all the artifact's heads with the highest gates
    (ties: the larger error alone), one ranking over the whole model."""
    found = artifact_arrays(digest)
    slots = sorted({name.rsplit(".", 1)[0] for name in found if name.endswith(".route.gate")})
    rows = []
    for slot in slots:
        gate, err = (np.array(found[f"{slot}.{n}"]) for n in ("gate", "error"))
        rows += [(-float(g), -float(e), slot, h) for h, (g, e) in enumerate(zip(gate, err))]
    rows.sort()
    kept = rows[: int(round(share * len(rows)))]
    return {slot: tuple(sorted(h for _, _, s, h in kept if s == slot)) for slot in slots}


@stage("duo", "route", needs=("attention",))
@attrs.frozen
class Duo:
    """DuoAttention: the retrieval share of kv heads (calibrated gates) keeps everything; streaming heads let go."""

    retrieval: float = attrs.field(default=0.5, validator=in_range(0.0, 1.0))
    l1: float = attrs.field(default=0.02, validator=in_range(0.0, 1e3))
    steps: int = attrs.field(default=500, validator=in_range(1, 1 << 20))
    corpus: str = "passkey"
    tokens: int = attrs.field(default=4096, validator=in_range(64, 1 << 20))
    _artifact: str = ""
    _slot: str = ""

    calibrated = True
    fit_version = 1
    runtime_params = ("retrieval",)  # the head ranking is the artifact's; the share is chosen at run time
    bounded = False
    spills = False
    takes_below = None
    per_head = False
    tier_kind = "heads"

    def spill(self, held: int, chunk: int) -> int:
        return 0

    @property
    def held_share(self) -> float:
        """The model's share of kv heads holding the long context (explain's long-context cost)."""
        return self.retrieval

    def kept_heads(self, n_kv_heads: int) -> Tuple[int, ...]:
        """The kv heads this layer keeps whole (all of them at retrieval=1, before binding too)."""
        if self.retrieval >= 1.0 or not self._artifact:
            return tuple(range(n_kv_heads))
        return retrieval_heads(self._artifact, float(self.retrieval))[self._slot]

    def fit_gates(self, layer: Dict[str, np.ndarray], held: Tuple[int, int], scale: float, o_proj, window):
        """The layer's gates and each head's error alone, from its calibration samples (calibration/collect.py:
        k, v [H, N, D]; q [Hq, N / stride, D] at positions 0, stride, ...)."""
        k, v, q = layer["k"], layer["v"], layer["q"]
        stride = max(1, -(-k.shape[1] // q.shape[1]))
        pos = np.arange(q.shape[1]) * stride
        pick = np.flatnonzero(pos > sum(held))[-QUERIES:]  # queries a streaming head sees less of
        if pick.size == 0:
            raise ValueError(f"the calibration text is shorter than sinks + window ({sum(held)} tokens)")
        gram = error_gram(q[:, pick], k, v, pos[pick], scale, held, o_proj, window)
        gate = optimise_gates(gram, self.l1, self.steps)
        return {"gate": gate, "error": np.diag(gram).astype(np.float32), "gram": gram.astype(np.float32)}
