"""Attention fidelity: per layer, how close a compressed cache's attention
output is to fp16's, on the very same queries.

One pass drives the model with the fp16 cache. Each layer's cache is a `Tee`
that also feeds the same K/V to one shadow cache per row and, for every query
block, asks each shadow for its attention output; the model continues on the
fp16 output, so every row sees identical queries, keys and values at every
layer and the cosine isolates that layer's cache error (no compounding).
"""

from typing import Dict, List, Sequence

import mlx.core as mx
from mlx_lm.models.base import quantized_scaled_dot_product_attention

from .feed import prefill, score


def cosine(a: mx.array, b: mx.array) -> mx.array:
    """Per output vector (batch, head, position) cosine similarity, float32."""
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    num = mx.sum(a * b, axis=-1)
    den = mx.sqrt(mx.sum(a * a, axis=-1) * mx.sum(b * b, axis=-1))
    return num / mx.maximum(den, 1e-30)


def shadow_attend(cache, queries: mx.array, scale: float) -> mx.array:
    """The attention output `cache` gives for the newest queries."""
    if hasattr(cache, "attend"):
        return cache.attend(queries, scale=scale)
    # mlx-lm's QuantizedKVCache: its own quantized attention over everything held,
    # the newest block included. Pre-scaled queries: that function scales in place.
    Lq = queries.shape[2]
    qk, qv = cache.keys_and_values()
    return quantized_scaled_dot_product_attention(
        queries * scale,
        qk,
        qv,
        scale=1.0,
        mask="causal" if Lq > 1 else None,
        group_size=cache.group_size,
        bits=cache.bits,
    )


class Tee:
    """A layer cache for mlx-lm: answers with `ref`, measures `shadows` on the side."""

    def __init__(self, ref, shadows: Sequence, sums: List[mx.array], counts: List[int]):
        self.ref, self.shadows = ref, list(shadows)
        self.sums, self.counts = sums, counts  # per shadow, for this layer
        self.recording = False

    @property
    def offset(self) -> int:
        return self.ref.offset

    def update_and_fetch(self, keys, values):
        for s in self.shadows:
            s.update_and_fetch(keys, values)
        return self.ref.update_and_fetch(keys, values)

    def attend(self, queries, scale, mask=None, sinks=None):
        out = self.ref.attend(queries, scale=scale, mask=mask, sinks=sinks)
        for i, s in enumerate(self.shadows):
            if self.recording:
                self.sums[i] = self.sums[i] + mx.sum(cosine(out, shadow_attend(s, queries, scale)))
                self.counts[i] += out.size // out.shape[-1]
            elif getattr(s, "scored", False):
                # Caches that learn from attention (eviction scorers, saliency routing,
                # per-head bit allocation) must see the prefill queries too.
                s.attend(queries, scale=scale)
        return out

    @property
    def wrapped(self):
        """The caches this tee feeds: a model pass they run records the prompt's ids
        (runtime/eviction/model_pass.py)."""
        return (self.ref, *self.shadows)

    def finish_prompt(self):
        for c in (self.ref, *self.shadows):
            getattr(c, "finish_prompt", lambda: None)()

    def make_mask(self, *args, **kwargs):
        return self.ref.make_mask(*args, **kwargs)

    @property
    def state(self):
        return [self.ref.state, [s.state for s in self.shadows], self.sums]

    @property
    def nbytes(self) -> int:
        return self.ref.nbytes


def measure(
    model,
    ref_row,
    rows: Sequence,
    windows: Sequence[List[int]],
    prefix: int,
    prefill_chunk: int,
    score_chunk: int,
    on_window=None,
) -> Dict[str, List[float]]:
    """Mean cosine per layer for each row, over the continuation queries of `windows`.

    Prefill queries are not recorded: a prefill block attends to itself
    exactly, so what matters is how later queries read the settled cache.
    """
    n_layers = len(model.layers)
    sums = [[mx.array(0.0) for _ in rows] for _ in range(n_layers)]
    counts = [[0 for _ in rows] for _ in range(n_layers)]
    for w in windows:
        shadows = [row.make(model) for row in rows]
        tees = [Tee(ref, [s[i] for s in shadows], sums[i], counts[i]) for i, ref in enumerate(ref_row.make(model))]
        x = mx.array(w)[None]
        prefill(model, x[:, :prefix], tees, prefill_chunk)
        for t in tees:
            t.recording = True
        score(model, x, tees, prefix, score_chunk)
        if on_window:
            on_window()
    return {
        row.name: [float(sums[layer][j]) / max(counts[layer][j], 1) for layer in range(n_layers)]
        for j, row in enumerate(rows)
    }


def summarize(per_layer: List[float]) -> Dict[str, object]:
    worst = min(range(len(per_layer)), key=per_layer.__getitem__)
    return {
        "mean": sum(per_layer) / len(per_layer),
        "min": per_layer[worst],
        "min_layer": worst,
        "per_layer": per_layer,
    }
