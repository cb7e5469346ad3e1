"""A tier whose kv heads each keep their own tokens (eviction by score).

Every array's axis 2 counts tokens, so evicting is one gather per array.
Heads hold equally many tokens but at different positions: `pos` [B, H, L]
says which, and masks are built from it. Positions and scores are real
memory and count in nbytes.
"""
from typing import Dict, List, Optional, Tuple

import mlx.core as mx

from ..compiler.plan import TierPlan
from . import scorers
from .buffer import Buffer
from .codec import Codec
from .copying import copy_sharing
from .tier import UNBOUNDED_STEP

META = ("pos", "score")  # arrays beside the codec's: positions and running scores (+ the scorer's own)


class HeadTier:
    per_head = True
    fusable = False
    granularity = 1

    def __init__(self, plan: TierPlan):
        self.plan = plan
        self.route = plan.route
        self.codecs = {"k": Codec(plan.keys), "v": Codec(plan.values)}
        self.scorer = scorers.make(plan.route)
        # Routes that evict every step re-gather every array each step: exact-size
        # buffers then cost one concatenation per append, not a regrowth and copy.
        step = UNBOUNDED_STEP if plan.route.once else None
        self.buffers: Dict[str, Dict[str, Buffer]] = {
            side: {name: Buffer(step) for name in codec.units()} for side, codec in self.codecs.items()}
        self.meta = {name: Buffer(step) for name in (*META, *self.scorer.token_state)}
        self.count = 0  # tokens per head
        self.decided = False  # `once` routes (SnapKV) decide a single time
        # Until the first eviction every head holds the same run [first, first + count):
        # attention can then use SDPA's "causal" instead of a per-head mask array.
        self.uniform, self.first = True, 0

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
        return int(mx.max(self.positions).item()) + 1 if self.count else 0

    def append(self, keys: mx.array, values: mx.array, start: int) -> None:
        B, H, n, _ = keys.shape
        if self.count == 0:
            self.first = start
        for side, x in (("k", keys), ("v", values)):
            for name, arr in self.codecs[side].encode(x).items():
                self.buffers[side][name].append(arr)
        pos = mx.broadcast_to(mx.arange(start, start + n, dtype=mx.int32), (B, H, n))
        self.meta["pos"].append(pos)
        self.meta["score"].append(self.scorer.initial(keys))
        for name, trailing in self.scorer.token_state.items():
            self.meta[name].append(mx.zeros((B, H, n, *trailing), mx.float32))
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

    def set_scores(self, scores: mx.array) -> None:
        self.meta["score"].set(scores)

    def keep(self, priority: mx.array, offset: int) -> None:
        """Keep the `budget` highest-priority tokens of each head, in position order;
        `offset` (positions seen) places the protected recent window."""
        budget = self.route.budget
        recent = getattr(self.route, "recent", 0)
        protected = (self.positions < self.route.sinks) | (self.positions >= offset - recent)
        priority = mx.where(protected, mx.inf, priority)
        idx = mx.argpartition(-priority, kth=budget - 1, axis=2)[:, :, :budget]
        idx = mx.sort(idx, axis=2)  # older first, so the newest tokens stay at the back
        for bufs in (*self.buffers.values(), self.meta):
            for buf in bufs.values():
                arr = buf.view()
                gather = idx.reshape(*idx.shape, *([1] * (arr.ndim - 3)))
                buf.set(mx.take_along_axis(arr, gather, axis=2))
        self.count = budget
        self.uniform = False

    def evict(self, offset: int) -> None:
        """Every-step routes (H2O, TOVA) evict on settle; `once` routes wait for the prompt's end."""
        if not self.route.once and self.count > self.route.budget:
            self.keep(self.scorer.priority(self, offset, None), offset)

    # --- trimming (only while nothing was evicted: TieredCache.is_trimmable) ---
    def drop_back(self, n: int) -> None:
        for bufs in (*self.buffers.values(), self.meta):
            for buf in bufs.values():
                buf.drop_back(n)
        self.count -= n

    def drop_front(self, n: int) -> None:
        pass  # sliding-window expiry: heads differ, so old tokens are masked, not dropped

    def expire(self, oldest_visible: int) -> None:
        pass  # the same: masked by per-head positions (runtime/per_head.py), never dropped

    def spill(self, offset: int, dtype) -> None:
        """Settling evicts by score (every-step routes); nothing moves on to another tier."""
        self.evict(offset)

    @property
    def nbytes(self) -> int:
        held = sum(b.nbytes for bufs in (*self.buffers.values(), self.meta) for b in bufs.values())
        return held + self.scorer.nbytes

    # --- persistence ----------------------------------------------------
    def arrays(self) -> Dict[str, mx.array]:
        out = {f"{side}.{name}": buf.view() for side, bufs in self.buffers.items() for name, buf in bufs.items()}
        out.update({name: buf.view() for name, buf in self.meta.items()})
        out.update({f"scorer.{name}": arr for name, arr in self.scorer.state().items()})
        return {k: v for k, v in out.items() if v is not None}

    def expected_names(self) -> List[str]:
        return [f"{side}.{name}" for side, bufs in self.buffers.items() for name in bufs] + list(self.meta)

    def restore(self, start: int, count: int, arrays: Dict[str, mx.array]) -> Optional[str]:
        self.count = count
        self.decided = True  # saving ends the prompt (persist calls finish_prompt first)
        self.uniform = False  # what was evicted before saving is not known here
        self.scorer.load({k[len("scorer."):]: v for k, v in arrays.items() if k.startswith("scorer.")})
        for key in self.expected_names():
            side, _, name = key.partition(".") if key.split(".")[0] in self.buffers else ("", "", key)
            buf = self.buffers[side][name] if side else self.meta[name]  # residual arrays: "k.r0.idx"
            arr = arrays.get(key)
            if count == 0:
                buf.set(None)
                continue
            if arr is None:
                return f"missing array {key}"
            if arr.ndim < 3 or arr.shape[2] != count:
                return f"array {key} has shape {tuple(arr.shape)}, which does not hold {count} tokens per head"
            buf.set(arr)
        pos = self.positions
        if count and (pos.dtype != mx.int32 or bool(mx.any(pos[..., 1:] <= pos[..., :-1]).item())):
            return "positions are not increasing int32 per head"
        return None
