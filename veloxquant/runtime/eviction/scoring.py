"""Attention with its weights in hand, for scorers that rank tokens by the
attention they receive (H2O, TOVA, SnapKV) — masks by per-head positions.

mlx's fused SDPA never materialises the weights, so scoring layers compute
softmax(q k^T) explicitly, in float32, over everything the layer holds.
"""

from typing import Callable, Optional, Tuple

import mlx.core as mx


def position_mask(kpos: mx.array, first_q: int, Lq: int, window: Optional[int]) -> mx.array:
    """kpos [..., L] -> boolean [..., Lq, L]: key not after the query, inside its window."""
    qpos = mx.arange(first_q, first_q + Lq, dtype=mx.int32)[:, None]
    kpos = kpos[..., None, :]
    mask = kpos <= qpos
    if window is not None:
        mask = mask & (qpos - kpos < window)
    return mask


def additive(mask: mx.array, dtype) -> mx.array:
    """A boolean mask (True = may attend) as the additive one SDPA takes, in the queries' dtype.

    Handed a boolean mask, MLX's CUDA SDPA first broadcasts it to [B, q_heads, Lq, L] and converts
    that in full (one [heads x queries x keys] copy per layer, and prefill keeps several layers'
    copies in flight); an additive mask reaches the fused kernel as a broadcast view. Same softmax:
    a masked key adds -inf (weight 0) where the boolean form put the dtype's minimum (weight 0)."""
    return mx.where(mask, mx.array(0, dtype), mx.array(-mx.inf, dtype))


def expand_heads(mask: mx.array, n_q_heads: int) -> mx.array:
    """A per-kv-head mask [B, Hkv, Lq, L] repeated for the query heads of each group."""
    B, Hkv, Lq, L = mask.shape
    rep = n_q_heads // Hkv
    return mx.broadcast_to(mask[:, :, None], (B, Hkv, rep, Lq, L)).reshape(B, n_q_heads, Lq, L)


def attention_weights(queries: mx.array, keys: mx.array, scale: float, mask: Optional[mx.array]) -> mx.array:
    """softmax(q k^T * scale), GQA-aware: [B, Hkv, rep, Lq, L] in float32.

    `mask` is per kv head, [B, Hkv, Lq, L] (True = may attend)."""
    B, Hq, Lq, D = queries.shape
    Hkv = keys.shape[1]
    # The group's query heads become rows of one matmul per kv head (no broadcast keys).
    q = queries.astype(mx.float32).reshape(B, Hkv, Hq // Hkv * Lq, D) * scale
    scores = (q @ keys.astype(mx.float32).swapaxes(-1, -2)).reshape(B, Hkv, Hq // Hkv, Lq, -1)
    if mask is not None:
        scores = mx.where(mask[:, :, None], scores, -mx.inf)
    return mx.softmax(scores, axis=-1, precise=True)


def attend_blocked(
    queries: mx.array,
    keys: mx.array,
    values: Optional[mx.array],
    scale: float,
    mask_for: Callable,
    block: int,
    rows: int = 1,
    weigh: bool = True,
    sync_bytes: int = 0,
    real_for: Optional[Callable] = None,
):
    """Attention `block` queries at a time, each block masked by `mask_for(first, n)` (per kv head,
    or None): only one block's [heads x block x keys] weights ever exist, never the whole prompt's.

    Returns (output [B, Hq, Lq, D] float32, or None without `values`; received [B, Hkv, L],
    newest `rows` rows [B, Hkv, rows, L]);
    the last two are None unless `weigh`. Rows are independent softmaxes, so each row's weights are
    those of attention_weights(...) over all queries, and the sums equal its column sums up to float
    summation order. The first block is the short one, so the newest rows lie in the last block.

    `sync_bytes` (> 0): once the blocks' weights built since the last evaluation reach this many bytes,
    what the blocks have answered so far is evaluated, and a call that did so is evaluated once more
    at its end. A lazy graph would otherwise hold every block's
    temporaries until the device has run them (on CUDA the host runs far ahead; a 2048-query prefill
    step over 8k keys builds 0.56 GiB of float32 weights per layer, plus masked and softmaxed copies).

    `real_for(first, n)` (a batch's right-padded prompt: runtime/eviction/batch_heads.py): [B, 1, 1, n, 1],
    False for the query rows that are padding, whose weights are zeroed (no key receives them)."""
    B, Hq, Lq, _ = queries.shape
    first = Lq - (Lq - 1) // block * block  # 1..block queries
    outs, total, tail = [], None, None
    pending, synced = 0, False  # bytes of weights built since the last evaluation; evaluated at all
    for s in [0, *range(first, Lq, block)]:
        n = first if s == 0 else block
        q = queries[:, :, s : s + n]
        if s:  # mlx would otherwise compute every block's weights before reducing any: order them
            q = mx.depends(q, [a for a in (outs[-1] if outs else None, total) if a is not None])
        w = attention_weights(q, keys, scale, mask_for(s, n))
        if real_for is not None:
            w = mx.where(real_for(s, n), w, 0.0)
        if values is not None:
            rows_w = w.reshape(B, w.shape[1], -1, w.shape[-1])  # [B, Hkv, rep * n, L]: no broadcast values
            outs.append((rows_w @ values.astype(mx.float32)).reshape(B, Hq, n, -1))
        if weigh:
            t, tail = received(w, rows)
            total = t if total is None else total + t
        pending += w.nbytes
        if sync_bytes and pending >= sync_bytes and s + n < Lq:
            mx.eval([a for a in (outs[-1] if outs else None, total, tail) if a is not None])
            pending, synced = 0, True
    if weigh and tail.shape[2] < min(rows, Lq):  # more rows asked than one block holds
        _, tail = received(attention_weights(queries[:, :, -rows:], keys, scale, mask_for(Lq - rows, rows)), rows)
    out = None if not outs else outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
    if synced:
        # The last block too: left lazy, it would hold its inputs (this layer's float32 keys and values,
        # the earlier blocks' outputs) until the whole prefill step is evaluated, every layer's at once
        # (observed_attention, SmolLM2 at 4k on the CPU: 635 -> 169 MiB over start). Calls too small to
        # have synced (decode steps, deferred scoring's held queries) stay lazy: no host wait.
        mx.eval([a for a in (out, total, tail) if a is not None])
    return out, total, tail


def block_size(n_q_heads: int, n_keys: int, most: int, budget_bytes: int) -> int:
    """Queries per block: at most `most`, and one block's float32 weights within `budget_bytes`."""
    return max(1, min(most, budget_bytes // max(1, 4 * n_q_heads * n_keys)))


def received(weights: mx.array, rows: int = 1) -> Tuple[mx.array, mx.array]:
    """Attention each key received, summed over the query heads sharing its kv head:
    (from all queries [B, Hkv, L], from each of the newest `rows` queries [B, Hkv, rows, L])."""
    return mx.sum(weights, axis=(2, 3)), mx.sum(weights[:, :, :, -rows:], axis=2)


def max_pool(x: mx.array, size: int) -> mx.array:
    """Max over `size` neighbouring tokens (axis -1), same length (SnapKV's pooling)."""
    if size <= 1:
        return x
    left = size // 2
    pad = mx.full((*x.shape[:-1], left), -mx.inf, x.dtype)
    pad_r = mx.full((*x.shape[:-1], size - 1 - left), -mx.inf, x.dtype)
    padded = mx.concatenate([pad, x, pad_r], axis=-1)
    L = x.shape[-1]
    out = padded[..., :L]
    for i in range(1, size):  # a loop over the kernel width, not over tokens
        out = mx.maximum(out, padded[..., i : i + L])
    return out
