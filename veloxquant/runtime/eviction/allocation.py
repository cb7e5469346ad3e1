"""Budgets allocated once, at the end of the prompt, from the real prefill attention.

The coordinator (runtime/coordinator.py) calls `decide` when the first layer
learns that the prompt is over; every layer has then seen every prompt query.
Each eviction tier that allocates has collected, per token, the attention it
received from all the queries (summed over the GQA group); divided by the
number of queries that could see the token and normalised per head, that is
the head's attention distribution p over its tokens.

layers=squeeze (SqueezeAttention): a layer whose attention is spread needs
  more tokens to keep the same share of it than one whose attention is
  concentrated on a few. Each layer's breadth is the effective number of tokens
  its heads attend to, exp(entropy(p)), averaged over heads; budgets are moved
  in proportion to base_l * breadth_l ** strength, the total over the layers
  fixed (base: the recipe's budget, a schedule included). strength 0 returns
  the base budgets themselves (h2o bit for bit).
heads=score (NestedKV's head-wise competition): the same rule on the scorer's own
  scores, which must be comparable across heads (nested's lie in [0, 1]).
keep=threshold (KVzap, as kvpress's DMSPress): each head keeps the tokens its scorer puts at
  or above a threshold (the scorer's `head_budgets`), so heads and layers keep different counts.
heads=adakv (Ada-KV): a layer's H * B tokens go to the heads whose tokens
  carry the most attention: every head keeps its `alpha` * B best (the
  paper's safeguard; at least the protected tokens), and the rest of the
  layer's budget is the top of all heads' remaining p, pooled, so a head that
  concentrates gives budget to one that spreads. Heads with the same sorted p
  (tied) get B each: the uniform recipe.
On a sharded model (runtime/sharding.py) a layer's breadth is the mean over all
ranks' heads and head budgets are split over all heads, gathered, as unsharded.
"""

from typing import Dict, List

import mlx.core as mx
import numpy as np

from .. import sharding


def allocates(route) -> bool:
    """The route's budgets are open until the end of the prompt (squeeze with strength > 0, or adakv
    below alpha=1); otherwise they are the recipe's, nothing is collected, and it runs as it would without."""
    thresholded = getattr(route, "keep", "budget") == "threshold"
    return watches(route) or thresholded or (getattr(route, "heads", "equal") == "score" and route.alpha < 1)


def watches(route) -> bool:
    """The allocation reads the attention tokens received (squeeze, adakv), so the tier collects it."""
    squeezed = getattr(route, "layers", "fixed") == "squeeze" and route.strength > 0
    return squeezed or (getattr(route, "heads", "equal") == "adakv" and route.alpha < 1)


def decide(caches: List) -> Dict[str, list]:
    """Allocate every collecting tier's budgets; returns what was chosen (for `run --json`)."""
    found = [(c, t) for c in caches for t in c.tiers if t.collecting]
    if not found:
        return {}
    dists = [_distribution(t.signal(c.offset)) if watches(t.route) else None for c, t in found]  # [H, L]
    bases = [t.budget for _, t in found]  # the route's, at most a sliding window
    squeezed = [i for i, (_, t) in enumerate(found) if t.route.layers == "squeeze" and t.route.strength > 0]
    layer = list(bases)
    if squeezed:
        shard = sharding.of(found[0][0].plan_root)
        breadth = [float(sharding.mean_heads(shard, mx.exp(_entropy(dists[i])), 0).item()) for i in squeezed]
        strength = [found[i][1].route.strength for i in squeezed]
        moved = squeeze([bases[i] for i in squeezed], breadth, strength, [found[i][1].route.floor for i in squeezed])
        for i, b in zip(squeezed, moved):
            layer[i] = b
    chosen = []
    for (c, t), p, b in zip(found, dists, layer):
        if t.route.heads == "score" and t.route.alpha < 1:  # NestedKV: heads compete on the scorer's own scores
            p = mx.mean(t.scorer.priority(t, c.offset, None), axis=0)
        if getattr(t.route, "keep", "budget") == "threshold":  # KVzap: the scorer's own per-head counts
            heads = t.scorer.head_budgets(t, c.offset)
        elif t.route.heads in ("adakv", "score") and t.route.alpha < 1:  # over all ranks' heads, this rank's share
            shard = sharding.of(c.plan_root)
            heads = sharding.my_heads(shard, adakv(sharding.gather_heads(shard, p), b, t.route.alpha, t.route.floor))
        else:
            heads = [b] * len(t.lengths())
        t.allocate(heads)
        chosen.append(heads)
    return {"layers": layer, "heads": chosen}


def _distribution(signal: mx.array) -> mx.array:
    """[B, H, L] attention per observing query -> [H, L] per-head distribution (batch mean)."""
    p = signal / mx.maximum(mx.sum(signal, axis=-1, keepdims=True), 1e-30)
    return mx.mean(p, axis=0)


def _entropy(p: mx.array) -> mx.array:
    return -mx.sum(mx.where(p > 0, p * mx.log(mx.maximum(p, 1e-30)), 0.0), axis=-1)


def squeeze(bases: List[int], breadth: List[float], strength: List[float], floors: List[int]) -> List[int]:
    """Integer budgets summing to sum(bases), proportional to base * breadth ** strength, none under its floor."""
    if all(s == 0 for s in strength):
        return list(bases)
    total = sum(bases)
    w = np.array(bases, float) * np.array(breadth, float) ** np.array(strength, float)
    floors = np.array(floors, float)
    pinned = np.zeros(len(w), bool)
    for _ in range(len(w)):  # water-filling: layers that fall under their floor are pinned there
        share = (total - floors[pinned].sum()) * w / w[~pinned].sum()
        low = ~pinned & (share < floors)
        if not low.any():
            break
        pinned |= low
    share = np.where(pinned, floors, share)
    out = np.floor(share).astype(int)
    rest = total - out.sum()
    for i in np.argsort(-(share - out))[:rest]:  # largest remainders keep the total exact
        out[i] += 1
    return out.tolist()


def adakv(p: mx.array, budget: int, alpha: float, floor: int) -> List[int]:
    """Per-head budgets [H] summing to H * budget, from the heads' distributions p [H, L]."""
    H, L = p.shape
    ranked = -mx.sort(-p, axis=-1)
    if budget >= L or bool(mx.all(ranked == ranked[:1]).item()):
        return [budget] * H
    reserve = min(budget, max(floor, int(alpha * budget)))
    rest = ranked[:, reserve:]
    pooled = H * (budget - reserve)
    if pooled == 0:
        return [budget] * H
    top = np.array(mx.argpartition(-rest.reshape(-1), pooled - 1)[:pooled])
    counts = np.bincount(top // rest.shape[1], minlength=H)
    return [reserve + int(n) for n in counts]
