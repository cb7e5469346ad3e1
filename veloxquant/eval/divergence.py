"""KL divergence and top-1 agreement against the fp16 cache's next-token distributions.

Perplexity only reads the probability of the token that came; KL(fp16 || row)
reads the whole distribution at every scored position, and top-1 agreement
says how often the row would have picked fp16's most likely token. The fp16
reference log-probabilities are computed once per window (by `reference`, the
same feed as the scoring pass), then each row's scoring pass compares its own
logits chunk by chunk (`Tracker.observe`), so nothing beyond [positions ×
vocabulary] per chunk is ever built.
"""

from typing import Dict, List

import mlx.core as mx
import numpy as np

from .feed import prefill, score


def log_probs(logits: mx.array) -> mx.array:
    """[1, L, V] logits -> float32 log-softmax."""
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def compare(logits: mx.array, ref: mx.array):
    """Per position KL(ref || row) in nats and whether the argmaxes agree; [L] each."""
    own = log_probs(logits)
    kld = mx.sum(mx.exp(ref) * (ref - own), axis=-1).reshape(-1)
    agree = (mx.argmax(own, axis=-1) == mx.argmax(ref, axis=-1)).reshape(-1)
    return kld, agree


def reference(
    model, make_caches, window: List[int], prefix: int, prefill_chunk: int, score_chunk: int
) -> List[mx.array]:
    """fp16's log-probabilities at every scored position of `window`, one array per scoring chunk."""
    caches = make_caches()
    x = mx.array(window)[None]
    prefill(model, x[:, :prefix], caches, prefill_chunk)
    chunks: List[mx.array] = []

    def keep(logits):
        chunks.append(log_probs(logits))
        return [chunks[-1]]

    score(model, x, caches, prefix, score_chunk, observe=keep)
    return chunks


class Tracker:
    """Collects one row's per-position divergences over the windows it scores."""

    def __init__(self):
        self.kld: List[np.ndarray] = []
        self.agree: List[np.ndarray] = []

    def observer(self, ref_chunks: List[mx.array]):
        """An `observe` callback for feed.score comparing each chunk with its reference."""
        chunks = iter(ref_chunks)

        def observe(logits):
            kld, agree = compare(logits, next(chunks))
            mx.eval(kld, agree)
            self.kld.append(np.array(kld))
            self.agree.append(np.array(agree))
            return []

        return observe

    def summary(self) -> Dict[str, float]:
        if not self.kld:
            return {"kld_mean": None, "kld_p99": None, "top1_agreement": None, "positions": 0}
        kld = np.concatenate(self.kld).astype(np.float64)
        # Rounding can leave a lossless row at -1e-9: a divergence is never negative.
        kld = np.maximum(kld, 0.0)
        return {
            "kld_mean": float(kld.mean()),
            "kld_p99": float(np.percentile(kld, 99)),
            "top1_agreement": float(np.concatenate(self.agree).mean()),
            "positions": int(kld.size),
        }
