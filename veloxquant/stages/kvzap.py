"""`kvzap`: KVzap (arXiv:2601.07891; NVIDIA kvpress's KVzapPress + DMSPress).

A small model per layer predicts, from the hidden state a token enters the
layer's attention with (after the input norm), the log of the score KVzip would
give it, per kv head: `predictor=linear` (hidden -> heads) or `predictor=mlp` (hidden ->
`width` -> GELU -> heads), as kvpress's KVzapModel. It is fitted by `veloxquant
calibrate` on our own kvzip scores over `tokens` tokens of `corpus`
(calibration/kvzip_targets.py), stored as a hashed artifact; at run time every
token is scored once, as it arrives (runtime/eviction/scorers/kvzap.py), so no
model pass runs at the prompt's end. Once, at the end of the prompt:

keep=budget: each kv head keeps its `budget` best (kvpress's KVzapPress used
  as a ScorerPress at a compression ratio);
keep=threshold: each kv head keeps the tokens predicted at or above
  `threshold` (kvpress's DMSPress: heads and layers keep different counts;
  `budget` is not used).
The first `sinks` positions and the newest `recent` prompt tokens are kept
whatever their score (DMSPress protects a sliding window of 128).
"""

from typing import Dict

import attrs
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from ..artifacts import CalibrationError, slot_arrays
from .evict import _PerHeadRoute, _room_after_protected, _sinks_below_budget
from .registry import choices, in_range, stage

HELD_OUT = 0.1  # share of the calibration tokens (the last ones) kept out of the fit to measure it (r2)
RIDGE = 1.0  # sklearn Ridge's default alpha, as kvpress's train_linear
EPOCHS, BATCH, LR = 15, 512, 5e-3  # kvpress's train.py defaults for the MLP


@stage("kvzap", "route", needs=("attention", "hidden"))
@attrs.frozen
class KVzap(_PerHeadRoute):
    """KVzap: per-layer model from hidden states to KVzip's log-scores; once at the prompt's end,
    keep per head the `budget` best (keep=budget) or those >= `threshold` (keep=threshold)."""

    budget: int = attrs.field(default=256, validator=in_range(1, 1 << 24))
    sinks: int = attrs.field(default=4, validator=[in_range(0, 1 << 20), _sinks_below_budget])
    recent: int = attrs.field(default=0, validator=in_range(0, 1 << 24))
    keep: str = attrs.field(default="budget", validator=choices("budget", "threshold"))
    threshold: float = attrs.field(default=-5.0, validator=in_range(-1e6, 1e6))
    predictor: str = attrs.field(default="mlp", validator=choices("linear", "mlp"))
    width: int = attrs.field(default=512, validator=in_range(1, 1 << 16))
    corpus: str = "austen:emma"
    tokens: int = attrs.field(default=8192, validator=in_range(1024, 1 << 22))
    _artifact: str = ""  # set when bound: the content hash of the calibration artifact
    _slot: str = ""  # set when bound: this stage's arrays in it, "layer.tier.route"

    calibrated = True
    fit_version = 1
    once = True
    score = "kvzap"
    # budgets: the route's, or per head from the threshold (runtime/eviction/allocation.py)
    layers, strength, heads, alpha = "fixed", 0.0, "equal", 1.0
    # How it keeps is not fitted on: the artifact's key sees these fixed values (not the defaults, so a
    # changed default keeps artifacts valid), and any budget or threshold runs on one artifact.
    CALIBRATION_VIEW = {"budget": 256, "sinks": 4, "recent": 0, "keep": "budget", "threshold": -6.0}

    @property
    def floor(self) -> int:
        return self.sinks + self.recent + 1

    def __attrs_post_init__(self):
        _room_after_protected(self)

    def for_calibration(self) -> "KVzap":
        """The stage as its artifact's key sees it: what it is fitted on, not how it evicts."""
        return attrs.evolve(self, artifact="", slot="", **self.CALIBRATION_VIEW)

    def explain_pass(self) -> str:
        model = "a linear map" if self.predictor == "linear" else f"a 2-layer MLP (width {self.width}, GELU)"
        rule = f"the {self.budget} best" if self.keep == "budget" else f"those scoring >= {self.threshold}"
        return (
            f"each token scored as it arrives by {model} from the layer's input hidden state to KVzip's "
            f"log-score per kv head (fitted by `veloxquant calibrate` on kvzip's scores over {self.tokens} "
            f"tokens of '{self.corpus}'); once, at the end of the prompt, each kv head keeps {rule}"
        )

    # --- calibration ------------------------------------------------------
    def fit_scores(self, hidden: np.ndarray, scores: np.ndarray) -> Dict[str, np.ndarray]:
        """hidden [N, D], scores [N, H] (log kvzip scores) -> the layer's model, and its r2 per head on
        the last HELD_OUT of the tokens (fitted on the rest)."""
        n = len(hidden)
        cut = n - max(1, int(n * HELD_OUT))
        fitter = _ridge if self.predictor == "linear" else lambda x, y: _mlp(x, y, self.width)
        params = fitter(hidden[:cut], scores[:cut])
        pred = np.array(predict({k: mx.array(v) for k, v in params.items()}, mx.array(hidden[cut:])))
        truth = scores[cut:]
        r2 = 1 - ((pred - truth) ** 2).sum(0) / np.maximum(((truth - truth.mean(0)) ** 2).sum(0), 1e-12)
        return {**params, "r2": r2.astype(np.float32)}

    # --- runtime ------------------------------------------------------------
    def params(self) -> Dict[str, mx.array]:
        if not self._artifact:
            raise CalibrationError(
                "stage 'kvzap' is not bound to a calibration artifact: run `veloxquant calibrate kvzap "
                "--model M` and make caches with veloxquant.make_prompt_cache"
            )
        return slot_arrays(self._artifact, self._slot)


def predict(params: Dict[str, mx.array], hidden: mx.array) -> mx.array:
    """[..., D] hidden states -> [..., H] predicted log-scores (float32)."""
    x = hidden.astype(mx.float32)
    if "w1" in params:
        x = nn.gelu(x @ params["w1"] + params["b1"])
        return x @ params["w2"] + params["b2"]
    return x @ params["w"] + params["b"]


def _ridge(x: np.ndarray, y: np.ndarray) -> Dict[str, np.ndarray]:
    """Least squares with an L2 penalty on the weights, intercept unpenalised (sklearn's Ridge)."""
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    mx_, my = x64.mean(0), y64.mean(0)
    xc = x64 - mx_
    w = np.linalg.solve(xc.T @ xc + RIDGE * np.eye(x.shape[1]), xc.T @ (y64 - my))
    return {"w": w.astype(np.float32), "b": (my - mx_ @ w).astype(np.float32)}


class _MLP(nn.Module):
    def __init__(self, d: int, width: int, h: int):
        super().__init__()
        self.l1, self.l2 = nn.Linear(d, width), nn.Linear(width, h)

    def __call__(self, x):
        return self.l2(nn.gelu(self.l1(x)))


def _mlp(x: np.ndarray, y: np.ndarray, width: int) -> Dict[str, np.ndarray]:
    """kvpress's train_mlp: MSE, AdamW, cosine learning rate over the epochs, gradients clipped to norm 1,
    shuffled batches; seeded, so a calibration is repeatable."""
    mx.random.seed(0)
    rng = np.random.default_rng(0)
    model = _MLP(x.shape[1], width, y.shape[1])
    steps = EPOCHS * -(-len(x) // BATCH)
    opt = optim.AdamW(learning_rate=optim.cosine_decay(LR, steps))
    loss_and_grad = nn.value_and_grad(model, lambda m, a, b: mx.mean((m(a) - b) ** 2))

    def step(a, b):
        loss, grads = loss_and_grad(model, a, b)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return loss

    xs, ys = mx.array(x, mx.float32), mx.array(y, mx.float32)
    for _ in range(EPOCHS):
        order = mx.array(rng.permutation(len(x)))
        for s in range(0, len(x), BATCH):
            idx = order[s : s + BATCH]
            step(xs[idx], ys[idx])
            mx.eval(model.parameters(), opt.state)
    return {
        "w1": np.array(model.l1.weight.T),
        "b1": np.array(model.l1.bias),
        "w2": np.array(model.l2.weight.T),
        "b2": np.array(model.l2.bias),
    }
