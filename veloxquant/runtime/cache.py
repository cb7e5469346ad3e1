"""TieredCache: the one cache class. mlx-lm drives it unchanged; a recipe's
LayerPlan decides what it holds. Methods are recipes, never subclasses.

A new block of tokens is placed in the tiers at once (so the block attends to
itself exactly); overflow moves on between tiers lazily, when the cache is
next touched ("settling"), so a block never loses its own context mid-chunk.
"""

from typing import List, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache

from ..compiler.plan import LayerPlan
from ..errors import VeloxError
from . import batch, hook, kinds, layer_attention, trimming
from .batch_protocol import BatchProtocol
from .copying import copy_sharing
from .eviction import deferred, per_head
from .eviction.saliency import Saliency
from .eviction.scoring import position_mask
from .kinds.tier import Tier


def _min(a: Optional[int], b: Optional[int]) -> Optional[int]:
    return b if a is None else a if b is None else min(a, b)


class TieredCache(BatchProtocol, _BaseCache):
    lends = False  # later layers attend over this cache too (Gemma 4): runtime/shared_kv.py

    def __init__(self, plan: LayerPlan):
        self.plan = plan
        self.tiers = [kinds.build(t, plan, kinds.fed_in_chunks(plan, i)) for i, t in enumerate(plan.tiers)]
        self.per_head = any(t.per_head for t in self.tiers)  # heads keep different tokens
        self.new_keys = None  # the newest block's keys (proxy scorers use them as queries)
        self.scale_seen = None
        # A recent(n) tier whose overflow is dropped acts as a sliding window of
        # n+1 keys (n settled + the newest), also for queries inside one block.
        self.horizons = [kinds.horizon(plan, i) for i in range(len(plan.tiers))]
        # Positions each tier takes end below this (a sink's n; None: every token offered), compiled once.
        self._takes_below = [None if t.route is None else t.route.takes_below for t in plan.tiers]
        self.windows = [_min(plan.window, h) for h in self.horizons]  # how far back each tier's tokens are seen
        self._unwindowed = all(w is None for w in self.windows)
        self._tail_layouts = {}  # (query shape, dtype, dense tier count) -> reduce_tail's verdict on their layout
        self.offset = 0  # positions seen: RoPE offsets, never the count held
        self.dtype = mx.float16
        self.attended = False  # True once attention ran through attend() (the hook)
        self._attend_epoch = -1  # hook epoch of the last attend() call
        self._unsettled = False
        # Scorers fed by real attention (h2o, tova, snapkv) must see every step's queries:
        # a step whose attention did not come through attend() is refused, not run with frozen scores.
        self.scored = "attention" in plan.needs
        self._awaiting_attend = False
        self.saliency = Saliency.attach(self)  # a salient tier routes tokens by the attention they received
        # Tiers that act when the prompt is over (latent tiers fit their basis then).
        self._prompt_tiers = [t for t in self.tiers if t.ends_prompt]
        # The fp16 recipe's layer (one unrouted 16-bit tier, nothing scored, windowed or settled):
        # decode does KVCache's work and skips the routing (host time per layer, docs/kernels.md).
        self._plain = None if self.scored or self.saliency is not None else kinds.plain_tier(self.tiers)
        self.route = layer_attention.route_for(self)  # how attend() answers (a batch's rows set their own)

    def __deepcopy__(self, memo):
        # Copies start settled, MiniCache partners too (a copy and an original read later continue
        # alike); frozen plan, dtype and layout verdicts are shared, tiers/arrays/coordinator copied.
        self._settle() or [t.settle_group() for t in self.tiers]
        return copy_sharing(
            self,
            memo,
            shared=(
                "plan",
                "plan_root",
                "fingerprint",
                "dtype",
                "horizons",
                "windows",
                "_takes_below",
                "_tail_layouts",
            ),
        )

    # --- mlx-lm protocol ------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        if self._rows is not None:  # B sequences (runtime/batch.py); the field, not the property: every step
            return batch.update_and_fetch(self, keys, values)
        plain = self._plain
        if plain is not None and (self._unwindowed or keys.shape[2] == 1):
            # KVCache's work, nothing else (Tier.append's 16-bit path); never scored. A window's decode
            # step forgets the oldest token first, as _settle would: the query then sees all.
            if not self._unwindowed:
                plain.expire(self.offset - self.plan.window + 1)
                self._unsettled = True  # readers (size, state, trim) see the next query's window, as before
            self.dtype = keys.dtype
            plain.append(keys, values, self.offset)
            self.offset += keys.shape[2]
            return (keys, values) if self.hook_answers() else plain.decoded(keys.dtype)
        if self.scored and (self._awaiting_attend or not hook.any_installed()):
            raise VeloxError(hook.NOT_ROUTED.format(recipe=getattr(getattr(self, "plan_root", None), "recipe", "?")))
        self._awaiting_attend = self.scored
        if (self.per_head or self._prompt_tiers) and keys.shape[2] == 1:
            self.finish_prompt()  # mlx-lm feeds the prompt's last token alone: the prompt is over
        elif self.per_head:
            per_head.new_turn(self)  # a block after a decision opens the next prompt (docs/eviction.md)
        self._settle()
        self.dtype = keys.dtype
        self.new_keys = keys if self.per_head else None
        self._place(0, keys, values, self.offset)
        self.offset += keys.shape[2]
        self._unsettled = True
        if self.hook_answers():
            # The hook answered the last step and is unchanged: attend() will read the
            # tiers, so skip building the decoded K/V (they would never be computed).
            return keys, values
        return self._fetch()  # lazy: never computed when the hook routes to attend()

    def hook_answers(self) -> bool:
        """The hook answered the last step and is unchanged since: attend() will read the tiers, so the
        decoded K/V and mlx-lm's mask of a step would never be read."""
        return self._attend_epoch == hook.EPOCH[0]

    def attend(self, queries: mx.array, scale: float, mask=None, sinks=None, observe: bool = True) -> mx.array:
        """Attention for the newest queries over everything held: the layer's route answers
        (runtime/layer_attention.py: chosen once from what the tiers declare; a batch's with its rows).

        `observe=False` answers without feeding scorers (a measurement on the side)."""
        if sinks is not None:
            raise VeloxError("models with learned attention sinks are not supported by veloxquant caches yet")
        self.attended = True
        self._awaiting_attend = False
        self._attend_epoch = hook.EPOCH[0]
        return self.route(self, queries, scale, mask, observe)

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        """The mask for mlx-lm's own attention over _fetch()'s keys (no-hook mode; a batch's: both)."""
        if self.rows is not None:
            return batch.make_mask(self, N, window_size)
        if self.per_head:
            return None if N == 1 else "causal"  # unused: attend() masks by per-head positions
        if N == 1 and self._unwindowed and window_size is None:
            return None  # one query, and every token held is older than it and within no window
        if N == 1 and self._plain is not None and window_size in (None, self.plan.window):
            return None  # a plain window's decode step keeps just what the query sees (update_and_fetch)
        self._settle()
        window = window_size or self.plan.window
        held = [(t.start, t.end, h) for t, h in zip(self.tiers, self.horizons) if t.count and not t.drops]
        new = [(s, e, self.horizons[i]) for i, s, e in self._routing(self.offset, N)]
        spans = sorted(held + new)  # by position: the order _fetch() returns keys in
        simple = all(h is None for _, _, h in spans) and window is None
        if simple and sum(e - s for s, e, _ in spans) == self.offset + N:
            if N == 1:
                return None  # every held token is older than the one query
            return create_causal_mask(N, self.offset) if return_array else "causal"
        # Each span masks by position, with its tier's horizon.
        return mx.concatenate(
            [self._position_mask(mx.arange(s, e), self.offset, N, _min(window, h)) for s, e, h in spans], axis=1
        )

    @property
    def state(self) -> List[mx.array]:
        self._settle()
        # by name within a tier: the same list however the arrays were made (live, or restored from a file)
        return [a for t in self.tiers for _, a in sorted(t.arrays().items())]

    @state.setter
    def state(self, v):
        raise VeloxError("a TieredCache is restored with veloxquant.load_prompt_cache, not from_state")

    @property
    def meta_state(self) -> Tuple[str, ...]:
        """Positions seen and each tier's (start, count), as strings (mlx-lm's convention)."""
        self._settle()
        return (str(self.offset), *(f"{t.start},{t.count}" for t in self.tiers))

    def is_trimmable(self) -> bool:
        return trimming.trimmable(self)

    def trim(self, n: int) -> int:
        return trimming.trim(self, n)

    def size(self) -> int:
        """Tokens held (after settling), not positions seen."""
        self._settle()
        return sum(t.count for t in self.tiers if not t.drops)

    def empty(self) -> bool:
        return self.offset == 0 if self.rows is None else self.rows.end == 0

    @property
    def nbytes(self) -> int:
        self._settle()
        return sum(t.nbytes for t in self.tiers) + deferred.nbytes(self)  # scorers' pending queries included

    def finish_prompt(self) -> None:
        """The prompt is over: prompt-time eviction (SnapKV, evict(once=true)) decides now. Idempotent."""
        if self.per_head:
            per_head.finish_prompt(self)
        if self._prompt_tiers:
            self._settle()  # what the window spilled at the end of the prompt belongs to it
            for tier in self._prompt_tiers:
                tier.finish_prompt()

    def held(self) -> List:
        return layer_attention.held(self.tiers)

    def held_in_order(self) -> List:
        """The tiers holding tokens, by position (the order decoded keys are laid out in)."""
        return layer_attention.held_in_order(self.tiers)

    # --- routing ----------------------------------------------------------
    def _place(self, first: int, keys: mx.array, values: mx.array, start: int) -> None:
        """Offer a block to tiers[first:] in order; each takes what its route accepts."""
        n = keys.shape[2]
        for i, s, e in self._routing(start, n, first):
            scored = (self.saliency.scores_for(s, e - s),) if self.saliency and i == self.saliency.index else ()
            if e - s == n:  # the whole block (every decode step): no slice ops
                self.tiers[i].append(keys, values, s, *scored)
            else:
                self.tiers[i].append(keys[:, :, s - start : e - start], values[:, :, s - start : e - start], s, *scored)

    def _settle(self) -> None:
        if not self._unsettled:
            return
        self._unsettled = False
        if self._rows is not None:  # B sequences: an eviction batch cuts (runtime/batch.py)
            return batch.settle(self)
        if self.per_head:  # only per-head layers hold decode queries: scored before a cut (evict(slack))
            per_head.settle_held(self)
        for i, tier in enumerate(self.tiers):
            after = tier.spill_after  # declared by the kind (a Tier: compiled from its route)
            if after is None or tier.count <= after:
                continue
            moved = tier.spill(self.offset, self.dtype)
            if moved:
                self._place(i + 1, *moved)
        if self.plan.window:
            self._expire(self.offset - self.plan.window + 1)

    def _expire(self, oldest_visible: int) -> None:
        """Sliding-window layers: forget tokens no future query can see."""
        for tier in self.tiers:
            tier.expire(oldest_visible)

    # --- attention helpers --------------------------------------------------
    def _fetch(self) -> Tuple[mx.array, mx.array]:
        return layer_attention.decoded_run(self.held_in_order(), self.dtype)

    def _routing(self, start: int, n: int, first: int = 0) -> List[Tuple[int, int, int]]:
        """Which tier takes which positions of a block: (tier index, start, end)."""
        spans = []
        for i in range(first, len(self.tiers)):
            tier = self.tiers[i]
            if n == 0 or tier.drops:
                break
            below = self._takes_below[i]
            take = n if below is None else max(0, min(n, below - start))
            if take:
                spans.append((i, start, start + take))
            start, n = start + take, n - take
        return spans

    def _window(self, tier: Tier) -> Optional[int]:
        return self.windows[self.tiers.index(tier)]

    def _needs_mask(self, tier: Tier, first_q: int, Lq: int) -> bool:
        if tier.start + tier.count - 1 > first_q:
            return True  # holds tokens newer than the first query
        window = self.windows[self.tiers.index(tier)] if len(self.tiers) > 1 else self.windows[0]
        return window is not None and (first_q + Lq - 1) - tier.start >= window

    def _tier_mask(self, tier: Tier, first_q: int, Lq: int):
        return self._position_mask(mx.arange(tier.start, tier.end), first_q, Lq, self._window(tier))

    _position_mask = staticmethod(position_mask)
