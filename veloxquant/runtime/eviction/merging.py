"""CaM (Zhang et al., ICML 2024): a token that eviction removes is merged into survivors.

Dropping a token perturbs every later attention output; CaM folds the evicted
value into the values that stay, in proportion to how prominent the evicted
token was: with A the attention each token has received (H2O's accumulator),
the paper's merge probability is p = clip(A_evicted / mean(A_targets), 0, 1),
and each of the m targets takes v_evicted in at weight p / m (`prominence`, the
expected merge) or, as in the paper's code, Bernoulli(p) / m (`sample`, keyed
on the position counter so a run repeats). A target's value becomes the
weighted average of itself (weight 1) and what was merged into it -- a convex
combination, so it stays inside the hull of the merged values however many
tokens it takes in (the paper's additive v += p v_e / m does not). The paper merges into the
newest tokens; here the m targets are the survivors whose keys are most similar
(cosine) to the evicted key, so what is folded lands where similar queries look.
Keys are kept as they were. Nothing extra is held: merged values replace the
survivors' values (re-encoded by the tier's codec), so the bytes stay those of
the kept tokens.
"""

import mlx.core as mx

BLOCK = 256  # evicted tokens whose similarities to the survivors are held at once


def _unit(k: mx.array) -> mx.array:
    return k / mx.maximum(mx.linalg.norm(k, axis=-1, keepdims=True), 1e-12)


def merged_values(
    keys: mx.array,
    values: mx.array,
    scores: mx.array,
    kept: mx.array,
    gone: mx.array,
    targets: int,
    how: str,
    offset: int,
) -> mx.array:
    """Values of the kept tokens [B, H, b, D] after the tokens `gone` [B, H, e] merge into them.

    keys, values [B, H, L, D] and scores [B, H, L] are the tier's before eviction; kept [B, H, b]."""
    take = lambda x, idx: mx.take_along_axis(x, idx[..., None] if x.ndim == 4 else idx, axis=2)
    k_kept, k_gone = _unit(take(keys, kept)), _unit(take(keys, gone))
    v_kept, v_gone = take(values, kept), take(values, gone)
    a_kept, a_gone = take(scores, kept), take(scores, gone)
    B, H, b, D = v_kept.shape
    e = gone.shape[2]
    m = min(targets, b)
    # The m most similar survivors of each evicted token, BLOCK evicted tokens at a time: the bulk
    # eviction at the end of a long prompt never holds the whole [heads x evicted x kept] similarity.
    to = mx.concatenate(
        [
            mx.argpartition(-(k_gone[:, :, s : s + BLOCK] @ k_kept.swapaxes(-1, -2)), kth=m - 1, axis=-1)[..., :m]
            for s in range(0, e, BLOCK)
        ],
        axis=2,
    )  # [B, H, e, m]
    a_to = mx.take_along_axis(mx.broadcast_to(a_kept[:, :, None], (B, H, e, b)), to, axis=-1)
    p = mx.clip(a_gone / mx.maximum(mx.mean(a_to, axis=-1), 1e-30), 0.0, 1.0)  # [B, H, e]
    if how == "sample":
        p = (mx.random.uniform(shape=p.shape, key=mx.random.key(offset)) < p).astype(mx.float32)
    # Each target holds a weighted average: itself at weight 1 (its own prominence, the reference of p)
    # and each token merged into it at weight p/m. The paper's additive fold (v += p v_e / m) adds the
    # numerator of that average but not its denominator: over a long prompt a survivor takes in hundreds
    # of tokens and its value grows without bound (the H200 4k rows: +10,422% PPL on SmolLM2).
    w = mx.broadcast_to((p / m)[..., None], (B, H, e, m))  # [B, H, e, m]
    share = (w[..., None] * v_gone[:, :, :, None, :]).reshape(-1, D)
    rows = (mx.arange(B * H, dtype=mx.int32).reshape(B, H, 1, 1) * b + to.astype(mx.int32)).reshape(-1)
    num = v_kept.astype(mx.float32).reshape(B * H * b, D).at[rows].add(share)
    den = mx.ones((B * H * b,), mx.float32).at[rows].add(w.reshape(-1))
    return (num / den[:, None]).reshape(B, H, b, D)


def merged_for(tier, kept: mx.array, gone: mx.array, offset: int):
    """An eviction tier's values with the evicted tokens folded into the kept ones (`merge=`
    prominence or sample), from the values before the gather; None for merge=drop."""
    merge = getattr(tier.route, "merge", "drop")
    if merge == "drop":
        return None
    keys, values = tier.decoded(mx.float32)
    return merged_values(keys, values, tier.scores, kept, gone, tier.route.targets, merge, offset)


def store_values(tier, merged: mx.array) -> None:
    """Code the merged values back into the tier's value buffers, in the dtype they are held in."""
    stored = [a.dtype for a in tier.encoded("v").values() if mx.issubdtype(a.dtype, mx.floating)]
    for name, arr in tier.codecs["v"].encode(merged.astype(stored[0] if stored else mx.float16)).items():
        tier.buffers["v"][name].set(arr)
