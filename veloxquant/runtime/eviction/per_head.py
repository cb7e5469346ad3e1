"""Attention and scoring for layers whose kv heads keep different tokens.

When a layer has an eviction tier (HeadTier), keys are masked by their
per-head positions, and the tier's scorer is fed from the very attention the
model computes. Each tier's scorer (runtime/eviction/scorers/) declares what it needs
("weights", "queries", "new_keys"); this module gathers exactly that, and
computes attention with an explicit softmax only when some scorer needs the
weights. It never branches on which scorer it feeds.
"""

from typing import List, Optional

import mlx.core as mx

from . import deferred
from .scorers import Seen
from .scoring import additive, attend_blocked, block_size, expand_heads, position_mask

SCORE_BLOCK = 128  # at most this many queries' explicit softmax weights are held at once
SCORE_BYTES = 16 * 2**20  # and at most this many bytes of them (long contexts get shorter blocks)
# A prefill step's blocks are evaluated whenever this many bytes of weights were built since the last
# evaluation: unevaluated, every block's temporaries stay allocated until the device runs them (prefill's peak).
SYNC_BYTES = SCORE_BYTES  # about every block at 8k keys; every other block at 2k


def _positions(tier, B: int, H: int) -> mx.array:
    if tier.per_head:
        return tier.positions
    return mx.broadcast_to(mx.arange(tier.start, tier.end, dtype=mx.int32), (B, H, tier.count))


def _gather(cache, held: List, dtype, queries: Optional[mx.array] = None):
    """Keys, values and per-head positions of everything held, plus each tier's slice.

    With `queries` (one decode step that feeds no scorer), a tier that selects (`pick`,
    RocketKV's stage 2) gives only the tokens those queries are to attend to."""
    parts = []
    for t in held:
        picked = t.pick(queries, dtype) if queries is not None else None
        parts.append(picked or (*t.decoded(dtype), None))
    k, v = (_joined([p[i] for p in parts]) for i in (0, 1))
    B, H = k.shape[:2]
    kpos = _joined([_positions(t, B, H) if p[2] is None else p[2] for t, p in zip(held, parts)])
    slices, at = [], 0
    for p in parts:
        slices.append(slice(at, at + p[0].shape[2]))
        at += p[0].shape[2]
    return k, v, kpos, slices


def _joined(arrays: List[mx.array]) -> mx.array:
    return arrays[0] if len(arrays) == 1 else mx.concatenate(arrays, axis=2)  # decode: no op for one tier


def _mask(cache, held, kpos, slices, first_q: int, Lq: int) -> Optional[mx.array]:
    """Per-kv-head mask, or None when every held key is visible to every query."""
    windows = [cache._window(t) for t in held]
    if Lq == 1 and all(w is None for w in windows) and not any(t.ragged for t in held):
        return None  # decode: everything held is older than the one query (no unused ragged slots)
    masks = [position_mask(kpos[:, :, where], first_q, Lq, window) for where, window in zip(slices, windows)]
    return mx.concatenate(masks, axis=-1)


def _causal(cache, held: List, end: int) -> bool:
    """Every head holds the same contiguous run of positions ending at the last query
    (nothing evicted yet, no window): SDPA's "causal" is exact, no mask array needed."""
    spans = []
    for t in held:
        if cache._window(t) is not None or (t.per_head and not t.uniform):
            return False
        spans.append((t.first, t.first + t.count) if t.per_head else (t.start, t.end))
    # In the order _gather concatenates them: "causal" masks by index, not by position.
    contiguous = all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    return contiguous and spans[-1][1] == end


def _weigher(cache, held: List, k: mx.array, kpos: mx.array, slices, scale: float):
    """weigh(queries, first_q, where) -> attention received [B, Hkv, L], summed over the queries and the
    group, sliced to one tier: the queries' softmax over everything the layer holds (causal, windowed),
    a block of queries at a time."""

    def weigh(queries: mx.array, first_q: int, where: slice) -> mx.array:
        _, total, _ = attend_blocked(
            queries,
            k,
            None,
            scale,
            _masker(cache, held, kpos, slices, first_q),
            _block(queries, k),
            sync_bytes=SYNC_BYTES,
        )
        return total[..., where]

    return weigh


def _masker(cache, held: List, kpos: mx.array, slices, first_q: int):
    """mask_for(s, n): the mask of the n queries from first_q + s, built for that block alone."""
    return lambda s, n: _mask(cache, held, kpos, slices, first_q + s, n)


def _block(queries: mx.array, keys: mx.array) -> int:
    return block_size(queries.shape[1], keys.shape[2], SCORE_BLOCK, SCORE_BYTES)


def attend(cache, held: List, queries: mx.array, scale: float, first_q: int, observe: bool) -> mx.array:
    """The layer's attention over everything held; feeds each listening scorer what it declared
    (now, or, for slack routes, when a cut is due: runtime/eviction/deferred.py)."""
    Lq, Hq = queries.shape[2], queries.shape[1]
    listeners = _listeners(held) if observe else []
    if deferred.defers(listeners, Lq):
        deferred.hold(cache, queries, first_q)
        listeners = []  # attends as an unscored layer does
    elif observe:
        score_held(cache)  # queries held earlier are scored first, in order
    needs = set().union(*(t.needs for t, _ in listeners))  # the scorer's, plus weights while budgets are open
    live = "weights" in needs
    rows = max([t.scorer.rows for t, _ in listeners if "weights" in t.needs] or [1])
    select = queries if Lq == 1 and not listeners else None  # decode steps that score nothing may select
    k, v, kpos, slices = _gather(cache, held, mx.float32 if live else queries.dtype, select)
    total = tail = None
    if live:  # explicit softmax, a block of queries at a time
        out, total, tail = attend_blocked(
            queries,
            k,
            v,
            scale,
            _masker(cache, held, kpos, slices, first_q),
            _block(queries, k),
            rows,
            sync_bytes=SYNC_BYTES,
        )
    elif Lq > 1 and not _causal(cache, held, first_q + Lq):
        # heads differ: a per-head mask, built and applied a block of queries at a time
        out, _, _ = attend_blocked(
            queries,
            k,
            v,
            scale,
            _masker(cache, held, kpos, slices, first_q),
            _block(queries, k),
            weigh=False,
            sync_bytes=SYNC_BYTES,
        )
    else:  # fused SDPA: "causal" while heads agree; one query needs a mask only for windows
        mask = "causal" if Lq > 1 else _mask(cache, held, kpos, slices, first_q, Lq)
        out = mx.fast.scaled_dot_product_attention(
            queries,
            k,
            v,
            scale=scale,
            mask=mask if mask is None or isinstance(mask, str) else additive(expand_heads(mask, Hq), queries.dtype),
        )
    if listeners:
        _feed(cache, held, listeners, queries, first_q, k.astype(mx.float32), kpos, slices, total, tail)
    cache.new_keys = None  # fed: the block's keys are held by the tiers, not twice by the cache
    return out.astype(queries.dtype)


def _listeners(held: List) -> List:
    return [(t, i) for i, t in enumerate(held) if t.scorer is not None and t.listening]


def _feed(cache, held, listeners, queries, first_q, k, kpos, slices, total, tail) -> None:
    weigh = _weigher(cache, held, k, kpos, slices, cache.scale_seen)
    for t, i in listeners:
        where = slices[i]
        t.scorer.observe(
            t,
            Seen(
                first_q=first_q,
                received=None if total is None else total[..., where],
                rows=None if tail is None else tail[..., where],
                queries=queries if "queries" in t.scorer.needs else None,
                new_keys=cache.new_keys if "new_keys" in t.scorer.needs else None,
                weigh=lambda q, f, where=where: weigh(q, f, where),
            ),
        )
        if "seen" in t.meta:
            t.collect(total[..., where])


def observe_block(cache, queries: mx.array, first_q: int) -> None:
    """Feed the listening scorers the weights of a block of earlier queries over what is held
    (masked by position: tokens newer than a query stay unseen by it); no attention output."""
    held = cache.held()
    listeners = _listeners(held)
    if not listeners:
        return
    k, _, kpos, slices = _gather(cache, held, mx.float32)
    rows = max(t.scorer.rows for t, _ in listeners)
    _, total, tail = attend_blocked(
        queries,
        k,
        None,
        cache.scale_seen,
        _masker(cache, held, kpos, slices, first_q),
        _block(queries, k),
        rows,
        sync_bytes=SYNC_BYTES,
    )
    _feed(cache, held, listeners, queries, first_q, k, kpos, slices, total, tail)


def score_held(cache) -> None:
    """Score the decode queries runtime/eviction/deferred.py holds now, as one block (see its module doc)."""
    taken = deferred.take(cache)
    if taken is not None:
        observe_block(cache, *taken)


def settle_held(cache) -> None:
    """Before a layer settles (and may cut): score the held queries if deferred.due says so."""
    if deferred.due(cache):
        score_held(cache)


def finish_prompt(cache) -> None:
    """End of the prompt: budgets across layers and heads are allocated (once, for the model), then
    `once` tiers (SnapKV, evict(once=true)) rank with what they saw and decide, once."""
    coordinator = getattr(cache, "coordinator", None)
    if coordinator is not None:
        coordinator.allocate()
    # Budgets just allocated (squeeze's every-step eviction): a tier over its own cuts back now, not
    # at the next update (a caller scoring chunks may never send one).
    if any(t.scorer is not None and not t.route.once and t.cut_due() for t in cache.tiers):
        cache._unsettled = True
        cache._settle()
    pending = [t for t in cache.tiers if t.scorer is not None and t.route.once and not t.decided]
    if not pending:
        return
    cache._settle()
    held = cache.held()
    weigh = None
    if any(t.over() for t in pending):
        k, _, kpos, slices = _gather(cache, held, mx.float32)
        weigh = _weigher(cache, held, k, kpos, slices, cache.scale_seen)
    for t in pending:
        if t.over():
            where = slices[held.index(t)]
            t.keep(t.scorer.priority(t, cache.offset, lambda q, f, where=where: weigh(q, f, where)), cache.offset)
        t.decided = True
        t.scorer.release()


def new_turn(cache) -> None:
    """A block of several tokens after a `once` tier decided is a new prompt (a chat's next turn, a
    scored continuation): the tier listens again, and decides again over everything it holds (the
    kept prompt, the tokens generated since, the new block) at the next prompt's end."""
    for t in cache.tiers:
        if t.scorer is not None and t.route.once and t.decided:
            t.decided = False
