"""A tier: a contiguous run of positions held with one codec for K and one for V."""

from typing import Dict, Optional, Tuple

import mlx.core as mx

from ...compiler.plan import TierPlan
from ...kernels import dispatch
from ...stages.store import SIXTEEN_BIT
from .. import code_attention, fused
from ..buffer import UNBOUNDED_STEP, Buffer
from ..codec import Codec
from ..copying import copy_sharing
from .protocol import KindBase
from .tier_arrays import TierArrays
from .tier_rows import TierRows

# UNBOUNDED_STEP (runtime/buffer.py) is the growth step of tiers that keep everything they get.
EXACT_MIN_CHUNK = 16  # tokens; tiers fed chunks at least this long may grow exactly (one copy per chunk)


def fusable(plan: TierPlan) -> bool:
    """K and V are plain affine codes: the fused attention kernels read them."""
    return plan.plain_affine


class Tier(TierRows, TierArrays, KindBase):
    scorer = None  # only per-head tiers rank their tokens (head_tier.py)

    def __init__(self, plan: TierPlan, exact: bool = False):
        """`exact`: buffers hold exactly their tokens (grown by concatenation). For
        tiers fed whole chunks whose codes a kernel reads: a sliced buffer is not
        row-contiguous, and the kernel launch would copy the whole tier every call."""
        self.plan = plan
        self._fusable = fusable(plan)
        self.reroute(plan.route)
        self.drops = plan.drops  # the plan is frozen: these facts are read every decode step
        self.sixteen_bit = not plan.drops and all(
            c.store.stage_name in ("fp16", "identity") and not c.transforms and not c.residuals
            for c in (plan.keys, plan.values)
        )
        self.codes_attend = False
        self.start = 0  # position of the oldest token held
        self.count = 0
        self.launch_key, self.launch = None, None  # the fused kernel chosen for the last call's shapes
        self._views: Dict[str, Dict[str, mx.array]] = {}  # encoded(side), until the buffers change
        # running sums a tier keeps for its codec (runtime/eviction/saliency.py)
        self.side_state: Dict[str, mx.array] = {}
        self.narrows = None
        self._lays = False
        self.dequant_kernel = None
        if plan.drops:
            self.codecs: Dict[str, Codec] = {}
            self.buffers: Dict[str, Dict[str, Buffer]] = {}
            return
        self.codecs = {"k": Codec(plan.keys), "v": Codec(plan.values)}
        # Buffers holding exactly their tokens are contiguous: their reshapes for decode are views, kept.
        self._lays = self._fusable and (exact or (plan.route is not None and plan.route.bounded))
        # The dequant kernel's binding (None: not verified here, or VELOXQUANT_KERNELS=off), looked up
        # once: every decode step of every layer would otherwise ask the kernel table again.
        self.dequant_kernel = dispatch.dequantizer() if self._fusable else None
        # The key codec scores its codes (runtime/code_attention.py): decided once, asked every step.
        self.codes_attend = code_attention.applies(self, 1)
        self.buffers = {}
        for side, codec in self.codecs.items():
            bounded = plan.route is not None and plan.route.bounded
            self.buffers[side] = {
                name: Buffer(None if bounded or exact else max(1, UNBOUNDED_STEP // per_unit))
                for name, per_unit in codec.units().items()
            }
        if self.sixteen_bit:  # what the stores hold float32 activations as, read once (fp16 narrows, identity not)
            self.narrows = (plan.keys.store.narrows_to, plan.values.store.narrows_to)
        # Neither a kernel nor its codes answer for it (windows, sinks): decided once, not asked every step.
        self.decodes_only = type(self) is Tier and self.sixteen_bit and not (self._fusable or self.codes_attend)

    def __deepcopy__(self, memo):
        # The kernel choice is keyed by shapes and dtypes, valid for a copy too; views are rebuilt on use.
        return copy_sharing(
            self,
            memo,
            shared=("plan", "route", "drops", "narrows", "launch_key", "launch", "dequant_kernel"),
            reset={"_views": {}},
        )

    def reroute(self, route) -> None:
        """Hold by `route`; what it declares is compiled here once: a decode step asks no route."""
        self.route = route
        self.spill_after = route.holds if route is not None and route.spills else None

    # --- contents -------------------------------------------------------
    @property
    def end(self) -> int:
        return self.start + self.count

    def append(self, keys: mx.array, values: mx.array, start: int, scores: Optional[mx.array] = None) -> None:
        """`scores` [B, H, L]: per-token scores for stores that route by them (salient)."""
        if self.drops:
            return
        if self.count == 0:
            self.start = start
        self._views = {}
        if self.sixteen_bit and scores is None:
            # 16-bit storage (fp16 windows and sinks, the fp16 recipe): KVCache's work, no codec calls
            if keys.dtype not in SIXTEEN_BIT:
                k_to, v_to = self.narrows
                keys = keys if k_to is None else keys.astype(k_to)
                values = values if v_to is None else values.astype(v_to)
            k_held, v_held = self.buffers["k"]["x"], self.buffers["v"]["x"]
            k_held.append(keys)
            v_held.append(values)
            self.count += keys.shape[2]
            self._views = {"k": {"x": k_held.view()}, "v": {"x": v_held.view()}}  # what decoded() reads
            return
        for side, x in (("k", keys), ("v", values)):
            for name, arr in self.codecs[side].encode(x, start, scores).items():
                self.buffers[side][name].append(arr)
        self.count += keys.shape[2]

    def encoded(self, side: str) -> Dict[str, mx.array]:
        # A coded tier changes only when a chunk arrives or leaves; decode steps read it every layer.
        if side not in self._views:
            self._views[side] = {name: buf.view() for name, buf in self.buffers[side].items()}
        return self._views[side]

    def answer(self, queries: mx.array, scale: float, mask: Optional[mx.array] = None, hidden: int = 0):
        """The tier-kind protocol's attention method: a callable answering this tier's partial
        (out, lse) from its own storage, or None (decode me: the cache attends over my values).

        `mask`: None when every held token is visible to every query. `hidden` (given without a
        mask): the first `hidden` tokens are invisible, every other one visible (one decode query
        past a sliding window's edge); a kind that cannot leave them out by count masks them
        (`front_mask`). Plain affine codes go to the fused kernel where a verified one takes the
        call; codecs that score their codes answer from them (runtime/code_attention.py)."""
        if mask is None and self._fusable:
            found = fused.kernel_answer(self, queries, scale, hidden=hidden)
            if found is not None:
                return found
        if hidden:
            mask = front_mask(self.count, hidden)
        if self.codes_attend and queries.shape[2] <= code_attention.CODES_MAX_QUERIES:
            return lambda: code_attention.tier_partial(self, queries, scale, mask)
        return None

    def spill(self, offset: int, dtype) -> Optional[Tuple[mx.array, mx.array, int]]:
        """What overflows this tier's route now, removed and decoded, with its start; or None.
        The cache asks only once the tier holds more than `spill_after`."""
        n = self.route.spill(self.count, self.plan.chunk)
        return self.take_front(n, dtype) if n else None

    def expire(self, oldest_visible: int) -> None:
        if self.sixteen_bit:  # granularity 1: a sliding layer's 16-bit tier forgets a token every decode step
            n = min(self.count, oldest_visible - self.start)
            if n > 0:
                self.drop_front(n)
            return
        expire_front(self, oldest_visible)

    def decoded(self, dtype) -> Tuple[mx.array, mx.array]:
        if self.sixteen_bit:  # the stored arrays themselves (a cast only if dtypes differ)
            k, v = self.encoded("k")["x"], self.encoded("v")["x"]
            return (k, v) if k.dtype == dtype else (k.astype(dtype), v.astype(dtype))
        return self.decoded_side("k", dtype), self.decoded_side("v", dtype)

    def decoded_side(self, side: str, dtype, length: Optional[int] = None, offset: int = 0) -> mx.array:
        """One side's values; with `length`, placed at `offset` of a `length`-token buffer
        (only where `placeable`: the dequant kernel writes it there, in one launch)."""
        enc = self.encoded(side)
        kernels = self._dequantizer(dtype, (side,)) if self.dequant_kernel is not None else None
        if kernels is not None:
            return kernels.dequantize(enc, self.codecs[side].store, dtype, length, offset)  # no float32 copies
        assert length is None, "decoded_side(length=...) needs placeable(dtype)"
        prepared = self._prepared(side, enc, dtype) if self._lays else None
        if prepared is not None:  # one compiled kernel over arrays reshaped once per chunk, not per step
            run, shape = prepared
            return run().reshape(shape)
        return self.codecs[side].decode(enc, dtype, self.start)

    def _prepared(self, side: str, enc: Dict[str, mx.array], dtype):
        """The affine store's one-kernel decode (stages/store.py: `prepared_decode`), kept with the
        views: it reads reshapes of the contiguous buffers, so they share their storage."""
        key = (side, "decode", dtype)
        if key not in self._views:
            self._views[key] = self.codecs[side].store.prepared_decode(enc, dtype)
        return self._views[key]

    def placeable(self, dtype) -> bool:
        """decoded_side can write into a longer buffer (the CUDA dequant kernel takes both sides)."""
        return self.dequant_kernel is not None and self._dequantizer(dtype) is not None

    def _dequantizer(self, dtype, sides=("k", "v")):
        """The dequant kernel's binding where it decodes these sides, else None."""
        kernels = self.dequant_kernel
        if kernels is None or any(
            kernels.dequant_unsupported(self.encoded(s), self.codecs[s].store, dtype) for s in sides
        ):
            return None
        return kernels

    def take_front(self, n: int, dtype) -> Tuple[mx.array, mx.array, int]:
        """Remove the n oldest tokens and return them decoded, with their start."""
        start = self.start
        # Decode only the front n tokens (n is a whole number of every array's units).
        k, v = (self._front(side, n, dtype) for side in ("k", "v"))
        self.drop_front(n)
        return k, v, start

    def _front(self, side: str, n: int, dtype) -> mx.array:
        units = self.codecs[side].units()
        return self.codecs[side].decode(
            {name: buf.view()[:, :, : n // units[name]] for name, buf in self.buffers[side].items()}, dtype, self.start
        )

    def drop_front(self, n: int) -> None:
        self._views = {}
        for side, codec in self.codecs.items():
            for name, per_unit in codec.units().items():
                self.buffers[side][name].drop_front(n // per_unit)
        self.start += n
        self.count -= n

    def take_back(self, n: int, dtype) -> Tuple[mx.array, mx.array, int]:
        """Remove the n newest tokens (whole units) and return them decoded, with their start."""
        units = {side: self.codecs[side].units() for side in ("k", "v")}
        k, v = (
            self.codecs[side].decode(
                {
                    name: buf.view()[:, :, buf.used - n // units[side][name] :]
                    for name, buf in self.buffers[side].items()
                },
                dtype,
            )
            for side in ("k", "v")
        )
        self.drop_back(n)
        return k, v, self.end

    def drop_back(self, n: int) -> None:
        self._views = {}
        for side, codec in self.codecs.items():
            for name, per_unit in codec.units().items():
                self.buffers[side][name].drop_back(n // per_unit)
        self.count -= n

    @property
    def fusable(self) -> bool:
        """K and V are plain affine codes: the fused attention kernels read them."""
        return self._fusable

    @property
    def granularity(self) -> int:
        """Tokens that must leave or be trimmed together."""
        return max([p for c in self.codecs.values() for p in c.units().values()] or [1])

    @property
    def nbytes(self) -> int:
        fitted = sum(a.nbytes for c in self.codecs.values() for a in getattr(c, "fitted", {}).values())
        fitted += sum(a.nbytes for a in self.side_state.values())
        return sum(b.nbytes for bufs in self.buffers.values() for b in bufs.values()) + fitted


def front_mask(count: int, hidden: int) -> mx.array:
    """The [1, count] mask of one query that sees a tier's tokens but its first `hidden`
    (Tier.answer's `hidden` for kinds that attend with a mask)."""
    return (mx.arange(count) >= hidden)[None]


def expire_front(tier, oldest_visible: int) -> None:
    """Sliding-window layers: forget the tokens no future query can see, in whole granules."""
    n = min(tier.count, oldest_visible - tier.start) // tier.granularity * tier.granularity
    if tier.count and n > 0:
        tier.drop_front(n)
