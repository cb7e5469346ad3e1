"""Attention of one tier straight from its codes: a partial (out, lse) like any other.

The key codec scores the codes (`Codec.scores`: the query is transformed once,
then look-up tables or sign products per stage); the values are summed in the
value codec's transformed domain and rotated back once per query row, not once
per token. A fused kernel for a codec plugs in through
`kernels.dispatch.code_kernel`, which answers this module's contract; the MLX-ops
path below is its reference, and tests pin it to decode-then-attend.

Taken for query blocks of up to CODES_MAX_QUERIES (decode steps, scoring chunks):
there the codes are read once per step instead of decoded and rotated back.
Longer blocks (prefill chunks) decode once and run the fused SDPA, which never
materialises their scores.
"""

from typing import Dict, Optional

import mlx.core as mx

from ..kernels import dispatch
from ..kernels.partials import Partial
from .codec import Codec

CODES_MAX_QUERIES = 64


def applies(tier, n_queries: int) -> bool:
    """This tier can answer from its codes for a block of `n_queries` queries."""
    codecs = getattr(tier, "codecs", None)
    return bool(codecs) and n_queries <= CODES_MAX_QUERIES and getattr(codecs["k"], "scores_from_codes", False)


def tier_partial(tier, queries: mx.array, scale: float, mask: Optional[mx.array] = None) -> Partial:
    k_enc, v_enc = tier.encoded("k"), tier.encoded("v")
    k_codec, v_codec = tier.codecs["k"], tier.codecs["v"]
    kernel = dispatch.code_kernel(tier.plan, queries, mask)
    if kernel is not None and not kernel.scope(queries, k_enc, v_enc, k_codec, v_codec, mask):
        return kernel.launch(queries, k_enc, v_enc, k_codec, v_codec, scale)
    if k_codec.positional:
        # Pre-RoPE key codes re-rotate by position: the keys start at tier.start and the
        # queries are the newest positions this tier holds (the tier that takes new tokens).
        return codes_partial_attention(
            queries,
            k_enc,
            v_enc,
            k_codec,
            v_codec,
            scale,
            mask,
            key_start=tier.start,
            first_q=tier.end - queries.shape[2],
        )
    return codes_partial_attention(queries, k_enc, v_enc, k_codec, v_codec, scale, mask)


def codes_partial_attention(
    queries: mx.array,
    k_enc: Dict[str, mx.array],
    v_enc: Dict[str, mx.array],
    k_codec: Codec,
    v_codec: Codec,
    scale: float,
    mask: Optional[mx.array] = None,
    key_start: int = 0,
    first_q: Optional[int] = None,
) -> Partial:
    """softmax(scores(q) * scale) v over one coded tier, GQA-aware, in float32.

    `mask`: boolean, broadcastable to [Lq, Lk] (True = may attend). `key_start`, `first_q`:
    positions of the first key and first query, for key codes kept before RoPE."""
    B, Hq, Lq, D = queries.shape
    Hkv = next(iter(k_enc.values())).shape[1]
    rep = Hq // Hkv
    q = queries.reshape(B, Hkv, rep * Lq, D).astype(mx.float32) * scale  # a kv head's query heads: one block
    if getattr(k_codec, "positional", False):
        Lk = next(iter(k_enc.values())).shape[2]
        first = key_start + Lk - Lq if first_q is None else first_q
        query_pos = mx.tile(mx.arange(first, first + Lq, dtype=mx.int32), rep)  # row r*Lq + i: query i
        scores = k_codec.scores(q, k_enc, key_start, query_pos)
    else:
        scores = k_codec.scores(q, k_enc)  # [B, Hkv, rep*Lq, Lk]
    if mask is not None:
        Lk = scores.shape[-1]
        scores = mx.where(mask, scores.reshape(B, Hkv, rep, Lq, Lk), -mx.inf).reshape(B, Hkv, rep * Lq, Lk)
    peak = mx.max(scores, axis=-1, keepdims=True)
    if mask is not None:
        peak = mx.where(mx.isinf(peak), 0.0, peak)  # a row with nothing to attend: lse -inf, weight 0
    weights = mx.exp(scores - peak)
    total = mx.sum(weights, axis=-1, keepdims=True)
    if mask is not None:
        total = mx.maximum(total, 1e-30)
    if v_codec.linear_transforms:
        # sum_i w_i R^-1 y_i == R^-1 sum_i w_i y_i: rotate back the rows, not every token.
        out = v_codec.untransform((weights @ v_codec.decode_transformed(v_enc)) / total)
    else:
        out = (weights @ v_codec.decode(v_enc, mx.float32)) / total
    lse = mx.log(total) + peak
    return out.reshape(B, Hq, Lq, D), lse.reshape(B, Hq, Lq)
