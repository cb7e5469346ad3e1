"""A tier whose kv heads each keep their own tokens (eviction by score).

Every array's axis 2 counts tokens, so evicting is one gather per array.
Heads hold equally many tokens but at different positions: `pos` [B, H, L]
says which, and masks are built from it. Positions and scores are real
memory and count in nbytes. Once the coordinator gives heads unequal budgets
(Ada-KV), the first eviction makes the tier ragged (runtime/eviction/ragged.py): each
head's tokens held flat, no padding; the arrays below are then padded views.
"""

from typing import Dict, List, Optional, Tuple

import mlx.core as mx

from ...compiler.plan import TierPlan
from .. import sharding
from ..buffer import Buffer
from ..codec import Codec
from ..copying import copy_sharing
from ..kinds.protocol import KindBase
from ..kinds.tier import UNBOUNDED_STEP
from . import scorers
from .allocation import allocates, watches
from .head_arrays import HeadArrays
from .merging import merged_for, store_values
from .protected import protect
from .protected import room as protected_room
from .ragged import FREE_AFTER, PAD, Ragged, keep_ragged

META = ("pos", "score")  # arrays beside the codec's: positions and running scores (+ the scorer's own)


class HeadTier(HeadArrays, KindBase):
    per_head = True
    protected = None  # image tokens it never drops (runtime/eviction/protected.py)
    fusable = False
    granularity = 1
    spill_after = -1  # its route keeps every token offered; the tier cuts by score at every settle (spill)

    def __init__(self, plan: TierPlan, window: Optional[int] = None):
        self.plan = plan
        # A sliding-window layer (Gemma 3's local layers): no future query sees a token
        # older than the window, so such tokens go first and the tier never holds more
        # than the window (a budget above it would hold more than fp16's own cache).
        self.window = window
        self.route = plan.route
        self.codecs = {"k": Codec(plan.keys), "v": Codec(plan.values)}
        self.scorer = scorers.make(plan.route)
        # Routes that evict every step re-gather every array each step: exact-size
        # buffers then cost one concatenation per append, not a regrowth and copy.
        step = UNBOUNDED_STEP if plan.route.once else None
        self.buffers: Dict[str, Dict[str, Buffer]] = {
            side: {name: Buffer(step) for name in codec.units()} for side, codec in self.codecs.items()
        }
        self.meta = {name: Buffer(step) for name in (*META, *self.scorer.token_state)}
        self.count = 0  # tokens per head
        self.decided = False  # `once` routes (SnapKV) decide a single time
        self.shard = ()  # (rank, world size) of a sharded model (runtime/sharding.py), set by make.caches_for
        # Until the first eviction every head holds the same run [first, first + count):
        # attention can then use SDPA's "causal" instead of a per-head mask array.
        self.uniform, self.first = True, 0
        self.ragged: Optional[Ragged] = None  # per-head lengths, once heads keep different counts
        self.budgets: Optional[List[int]] = None  # per kv head, once the coordinator allocated them
        self.budget_array: Optional[mx.array] = None  # the same, int32: held as saved (alloc.budgets)
        # Budgets allocated at the end of the prompt (squeeze, adakv) are read from the attention
        # each token received, collected here until the coordinator has decided.
        self.collecting = allocates(plan.route)  # budgets still open: the prompt is held whole until decided
        if watches(plan.route):
            self.meta["seen"] = Buffer(step)

    def __deepcopy__(self, memo):
        return copy_sharing(self, memo, shared=("plan", "route"))

    # --- contents -------------------------------------------------------
    drops = False

    @property
    def positions(self) -> Optional[mx.array]:
        return self.meta["pos"].view()

    @property
    def scores(self) -> Optional[mx.array]:
        return self.meta["score"].view()

    @property
    def start(self) -> int:
        return int(mx.min(self.positions).item()) if self.count else 0

    @property
    def end(self) -> int:
        if not self.count:
            return 0
        pos = self.positions
        return int(mx.max(mx.where(pos < PAD, pos, -1)).item()) + 1

    @property
    def can_rewind(self) -> bool:
        return self.ragged is None

    def append(self, keys: mx.array, values: mx.array, start: int, pos: Optional[mx.array] = None) -> None:
        """`pos` [B, H, n]: each row's own positions (a batch: runtime/eviction/batch_heads.py; PAD for
        a right-padded prompt's columns); by default start, start + 1, ... for every row."""
        B, H, n, _ = keys.shape
        if self.count == 0:
            self.first = start
        for side, x in (("k", keys), ("v", values)):
            for name, arr in self.codecs[side].encode(x).items():
                self.buffers[side][name].append(arr)
        if pos is None:
            pos = mx.broadcast_to(mx.arange(start, start + n, dtype=mx.int32), (B, H, n))
        self.meta["pos"].append(pos)
        self.meta["score"].append(self.scorer.initial(keys))
        for name, trailing in self.scorer.token_state.items():
            self.meta[name].append(mx.zeros((B, H, n, *trailing), mx.float32))
        if "seen" in self.meta:
            self.meta["seen"].append(mx.zeros((B, H, n), mx.float32))
        self.count += n

    def encoded(self, side: str) -> Dict[str, mx.array]:
        return {name: buf.view() for name, buf in self.buffers[side].items()}

    def decoded(self, dtype) -> Tuple[mx.array, mx.array]:
        return tuple(self.codecs[s].decode(self.encoded(s), dtype) for s in ("k", "v"))

    # --- scoring and eviction ---------------------------------------------
    @property
    def listening(self) -> bool:
        """Scorers are fed until a `once` route has decided (then tokens are only appended)."""
        return not (self.route.once and self.decided)

    @property
    def needs(self) -> frozenset:
        return self.scorer.needs | ({"weights"} if "seen" in self.meta else frozenset())

    def set_scores(self, scores: mx.array) -> None:
        self.meta["score"].set(scores)

    # --- budgets the coordinator allocates (runtime/eviction/allocation.py) -----------
    def collect(self, received: mx.array) -> None:
        self.meta["seen"].set(self.meta["seen"].view() + received)

    def signal(self, offset: int) -> mx.array:
        """[B, H, L]: attention each held token received per query that could see it (0 for unused slots)."""
        pos = self.positions
        mean = self.meta["seen"].view() / mx.maximum(offset - pos, 1).astype(mx.float32)
        return mx.where(pos < PAD, mean, 0.0)

    def allocate(self, budgets: List[int]) -> None:
        self.budgets = [int(b) for b in budgets]
        self.budget_array = mx.array(self.budgets, mx.int32)
        self.collecting = False
        self.meta.pop("seen", None)  # only held to make the decision

    def lengths(self) -> List[int]:
        if self.ragged is not None:
            return [n + self.count - self.ragged.width for n in self.ragged.lens]
        return [self.count] * (self.positions.shape[1] if self.count else 0)

    def head_budgets(self) -> List[int]:
        """Tokens each head keeps: allocated, or the route's; at most the layer's sliding window."""
        budgets = self.budgets or [self.route.budget] * len(self.lengths())
        return [min(b, self.window) for b in budgets] if self.window else budgets

    def over(self, slack: int = 0) -> bool:
        """Some head holds more than its budget (plus `slack`)."""
        if self.budgets is None:
            return self.count > protected_room(self, self.budget) + slack
        return any(n > protected_room(self, b) + slack for n, b in zip(self.lengths(), self.head_budgets()))

    @property
    def budget(self) -> int:
        """Tokens kept per head: the route's budget, at most the layer's sliding window."""
        return min(self.route.budget, self.window) if self.window else self.route.budget

    def keep(self, priority: mx.array, offset: int, budget: Optional[int] = None) -> None:
        """Keep the `budget` highest-priority tokens of each head, in position order;
        `offset` (positions seen) places the protected recent window."""
        if self.ragged is not None or (self.budgets is not None and len(set(self.budgets)) > 1):
            return keep_ragged(self, priority, offset, budget)
        budget = min(
            budget or protected_room(self, self.head_budgets()[0] if self.budgets else self.budget, offset), self.count
        )
        if getattr(self.route, "shared_heads", False):  # heads hold the same tokens: one ranking
            priority = mx.broadcast_to(sharding.mean_heads(self.shard, priority, 1), priority.shape)  # all ranks' heads
        recent = getattr(self.route, "recent", 0)
        protected = protect(self, self.positions < self.route.sinks, self.positions)
        if recent:  # held positions are all < offset: with no recent window there is nothing to compare (decode ops)
            protected = protected | (self.positions >= offset - recent)
        priority = mx.where(protected, mx.inf, priority)
        if self.window:  # expired tokens leave first, sinks included: no query sees them again
            priority = mx.where(self.positions < offset - self.window + 1, -mx.inf, priority)
        order = mx.argpartition(-priority, kth=budget - 1, axis=2)
        idx = mx.sort(order[:, :, :budget], axis=2)  # older first, so the newest tokens stay at the back
        merged = merged_for(self, idx, order[:, :, budget:], offset)  # CaM; None when tokens just leave
        for bufs in (*self.buffers.values(), self.meta):
            for buf in bufs.values():
                arr = buf.view()
                gather = idx.reshape(*idx.shape, *([1] * (arr.ndim - 3)))
                buf.set(mx.take_along_axis(arr, gather, axis=2))
        if merged is not None:
            store_values(self, merged)
        if self.count - budget >= FREE_AFTER:  # a prefill step's or the prompt's eviction: free the dropped now
            mx.eval([buf.view() for bufs in (*self.buffers.values(), self.meta) for buf in bufs.values()])
        self.count = budget
        self.uniform = False

    def evict(self, offset: int) -> None:
        """Every-step routes (H2O, TOVA) evict on settle; `once` routes wait for the prompt's end."""
        cut = self._cut()
        if cut == "score":
            self.keep(self.scorer.priority(self, offset, None), offset)
        elif cut == "window":
            # `once` routes append until (and after) their decision; on a sliding layer the
            # expired tokens are dropped meanwhile, so the tier stays within the window.
            self.keep(mx.zeros(self.positions.shape, mx.float32), offset, self.window)

    def cut_due(self) -> bool:
        """Settling would drop tokens now (runtime/eviction/deferred.py scores held queries first)."""
        return self._cut() is not None

    def _cut(self) -> Optional[str]:
        # While budgets are open the prompt is held whole: they are decided before any eviction.
        # `slack` lets heads grow past the budget and cuts them back in one ranking (evict.py);
        # on a sliding layer too (tokens past the window are masked until then, never seen).
        slack = self.route.slack
        if not self.route.once and not self.collecting and self.over(slack):
            return "score"
        if self.window and self.count > self.window + slack:
            return "window"
        return None

    # --- trimming (only while nothing was evicted: TieredCache.is_trimmable) ---
    def drop_back(self, n: int) -> None:
        for bufs in (*self.buffers.values(), self.meta):
            for buf in bufs.values():
                buf.drop_back(n)
        self.count -= n

    def drop_front(self, n: int) -> None:
        pass  # sliding-window expiry: heads differ, so old tokens are masked, not dropped

    def expire(self, oldest_visible: int) -> None:
        pass  # the same: masked by per-head positions (runtime/eviction/per_head.py), never dropped

    def spill(self, offset: int, dtype) -> None:
        """Settling evicts by score (every-step routes); nothing moves on to another tier."""
        self.evict(offset)

    @property
    def nbytes(self) -> int:
        held = sum(b.nbytes for bufs in (*self.buffers.values(), self.meta) for b in bufs.values())
        # per-head lengths and allocated budgets (the int32 arrays saved) and the ragged index arrays
        books = (self.ragged.nbytes if self.ragged is not None else 0) + (
            self.budget_array.nbytes if self.budget_array is not None else 0
        )
        return held + self.scorer.nbytes + books
