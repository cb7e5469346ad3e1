"""What a cache costs: bytes it really holds, and what fp16 would hold.

Bytes are measured from the arrays each cache holds (`nbytes`, metadata and
allocation slack included: veloxquant's unbounded tiers and mlx-lm's caches
grow in 256-token steps), never estimated from a bit count.
"""

from typing import Dict, Optional

import mlx.core as mx


def held_bytes(caches) -> int:
    return int(sum(c.nbytes for c in caches))


def fp16_bytes(shape, tokens: int) -> int:
    """An uncompressed 16-bit cache for `tokens` positions (no slack), all layers.

    Sliding-window layers (Gemma 3) hold at most their window.
    """
    total = 0
    for h, d, w in zip(shape.n_kv_heads, shape.head_dim, shape.windows):
        total += min(tokens, w or tokens) * 2 * h * d * 2
    return total


def summary(
    cache_bytes: int,
    tokens: int,
    base_bytes: int,
    peak: Optional["PeakMemory"],
    prefill_tok_s: Optional[float],
    decode_tok_s: Optional[float],
) -> Dict[str, object]:
    return {
        "tokens": tokens,
        "cache_bytes": cache_bytes,
        "bytes_per_token": cache_bytes / tokens if tokens else None,
        "fp16_bytes": base_bytes,
        "ratio": cache_bytes / base_bytes if base_bytes else None,
        "peak_memory_bytes": peak.peak if peak else None,
        "peak_over_start_bytes": peak.peak - peak.start if peak else None,
        "prefill_tok_s": prefill_tok_s,
        "decode_tok_s": decode_tok_s,
    }


class PeakMemory:
    """Peak MLX memory over a block, measured from a reset (weights included);
    `start` is what was allocated when it began, so peak - start is what the
    block itself needed at most (caches, activations, logits)."""

    def __enter__(self):
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        self.start = int(mx.get_active_memory())  # the weights, mostly
        self.peak = None
        return self

    def __exit__(self, *exc):
        mx.synchronize()
        self.peak = int(mx.get_peak_memory())
        return False
