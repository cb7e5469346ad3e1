"""Feeding tokens through caches the way mlx-lm's generate does.

Caches settle (move overflow between tiers) lazily; generate evaluates
`cache.state` after every prefill chunk, which is where compression happens.
We do the same, so an evaluation sees the cache a real generation would.
"""

import time
from typing import Callable, List, Optional

import mlx.core as mx


def settle(caches, *extra) -> None:
    mx.eval([c.state for c in caches], *extra)


def prefill(model, tokens: mx.array, caches, chunk: int) -> float:
    """Feed `tokens` [1, L] in chunks; returns the seconds it took.

    The logits are never evaluated, so MLX never computes the LM head (or the
    last layer's attention) for the prefix: only what the cache depends on.
    """
    start = time.perf_counter()
    for s in range(0, tokens.shape[1], chunk):
        model(tokens[:, s : s + chunk], cache=caches)
        settle(caches)
    for c in caches:  # the prefix is the prompt: prompt-time eviction (SnapKV) decides here
        getattr(c, "finish_prompt", lambda: None)()
    settle(caches)
    return time.perf_counter() - start


def chunk_nll(logits: mx.array, targets: mx.array) -> mx.array:
    """Summed negative log-likelihood of `targets` [1, L] under `logits` [1, L, V], in float32."""
    logits = logits.astype(mx.float32)
    lse = mx.logsumexp(logits, axis=-1)
    picked = mx.take_along_axis(logits, targets[..., None], axis=-1).squeeze(-1)
    return mx.sum(lse - picked)


def score(
    model,
    tokens: mx.array,
    caches,
    start: int,
    chunk: int,
    extra: Optional[List] = None,
    observe: Optional[Callable[[mx.array], List]] = None,
) -> mx.array:
    """NLL of tokens[start+1:] fed from position `start` in chunks of `chunk`.

    Position p's logits predict token p+1, so the tokens scored are those after
    `start`, and every prediction is made by a query that sees the prefix
    through the (compressed) cache. Returns a float32 scalar (evaluated).
    `observe(logits)`, if given, sees each chunk's logits and returns arrays to
    evaluate with it (eval/divergence.py compares them with fp16's).
    """
    total = mx.array(0.0)
    end = tokens.shape[1] - 1
    for s in range(start, end, chunk):
        e = min(s + chunk, end)
        logits = model(tokens[:, s:e], cache=caches)
        total = total + chunk_nll(logits, tokens[:, s + 1 : e + 1])
        seen = observe(logits) if observe is not None else []
        settle(caches, total, *(extra or []), *seen)
    return total
