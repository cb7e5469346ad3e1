"""Perplexity with the compressed cache in the loop.

Per window of prefix + continuation + 1 tokens: the prefix is prefilled
through the cache in chunks (compression happens between chunks, as in
generation), then the continuation is fed in small chunks through the same
cache and each of its next tokens is scored. So every scored prediction reads
the prefix from the compressed cache, and older continuation tokens too once
they leave a recipe's uncompressed window.
"""

from typing import Dict, List

import mlx.core as mx

from ..errors import VeloxError
from .cost import held_bytes
from .feed import prefill, score


def windows(tokens: List[int], count: int, length: int) -> List[List[int]]:
    """`count` non-overlapping windows of `length` tokens, spread evenly over `tokens`."""
    fit = len(tokens) // length
    if fit < 1:
        raise VeloxError(f"the corpus has {len(tokens)} tokens, fewer than one window of {length}")
    count = min(count, fit)
    stride = len(tokens) // count
    return [tokens[i * stride : i * stride + length] for i in range(count)]


def window_nll(
    model, make_caches, window: List[int], prefix: int, prefill_chunk: int, score_chunk: int, observe=None
) -> Dict[str, float]:
    """Scores one window under fresh caches; also what the cache held at the end.
    `observe` sees each scoring chunk's logits (feed.score)."""
    caches = make_caches()
    x = mx.array(window)[None]
    prefill_s = prefill(model, x[:, :prefix], caches, prefill_chunk)
    nll = score(model, x, caches, prefix, score_chunk, observe=observe)
    return {
        "nll": float(nll),
        "tokens": x.shape[1] - 1 - prefix,
        "prefill_s": prefill_s,
        "prefill_tokens": prefix,
        "cache_bytes": held_bytes(caches),
        "context": caches[0].offset,
        "attention": _mode(caches[0]),
    }


def _mode(cache) -> str:
    if not hasattr(cache, "attended"):  # an mlx-lm cache: mlx-lm's own attention
        return "mlx-lm quantized SDPA" if hasattr(cache, "bits") else "mlx-lm SDPA"
    return "by tiers (hook)" if cache.attended else "decoded K/V (no hook)"
