"""The merged tier kind (MiniCache): a pair of layers holds one direction per token.

The anchor layer's tier stages what reaches it in float16 (attended exactly)
until the reuse layer of its group -- run later in the same step by mlx-lm --
receives the same tokens. Then the pair merges them (stages/slerp.py): the
anchor holds the shared directions and its magnitudes, the reuse layer only
its magnitudes, plus its own float16 vectors for the tokens kept unmerged.
The anchor's float16 copy is freed; nothing else is held.

Attention reads the shared direction array itself, from both layers, never
copied and never rebuilt: scores mag·(q·dir), output (Σ a·mag·dir); the reuse
layer's unmerged tokens are scored from its own vectors. `decoded` (K/V rebuilt
as mag·dir) is the reference path, used only without the attention hook.
Groups come from the cross-layer coordinator (runtime/coordinator.py), as
xquant's and xKV's do; a slerp layer outside a group is a float16 passthrough.
"""

import weakref
from typing import Dict, Optional

import mlx.core as mx

from ...compiler.plan import TierPlan
from ...kernels.partials import Partial, partial_from_scores
from .latent_side import PlainSide, SidesHeld
from .merged_side import MergedSide
from .protocol import kind
from .tier import expire_front, front_mask


@kind("merged")
class MergedTier(SidesHeld):
    """Behind the tier protocol (runtime/kinds/tier.py), like the latent tier: place, hold, answer a partial."""

    joins_groups = True  # a pair of layers holds one direction per token
    can_rewind = False  # a merged pair cannot give one layer's tokens back
    fusable = sixteen_bit = drops = False
    granularity = 1

    def __init__(self, plan: TierPlan, n_kv_heads: int, head_dim: int):
        self.plan, self.route, self.n_kv_heads = plan, plan.route, n_kv_heads
        self.launch_key, self.launch, self.link, self.group = None, None, None, ()
        self.sides = {
            side: (MergedSide if hasattr(codec.store, "tier_kind") else PlainSide)(codec, n_kv_heads, head_dim)
            for side, codec in (("k", plan.keys), ("v", plan.values))
        }
        self.start = self.count = 0

    @property
    def end(self) -> int:
        return self.start + self.count

    def join_group(self, link, layers) -> None:
        """Called by the cross-layer coordinator: the anchor holds the directions, the others read them."""
        if len(layers) < 2:
            return  # a group of one: a float16 passthrough
        self.link, self.group = link, tuple(layers)
        for name, s in self.sides.items():
            if isinstance(s, MergedSide):
                s.role = "anchor" if link.layer == link.anchor else "reuse"
                s._tier, s.name = weakref.ref(self), name

    def _anchor(self) -> "MergedTier":
        return self.link.cache(self.link.anchor).tiers[self.link.tier]

    def group_problem(self) -> Optional[str]:
        """A reuse layer must hold exactly the merged tokens of its anchor (a saved file that does not add up)."""
        if self.link is None or self.link.layer == self.link.anchor:
            return None
        for name, s in self.sides.items():
            if isinstance(s, MergedSide) and (self._anchor().start != self.start or s.peer().merged < s.merged):
                return (
                    f"layer {self.link.layer} holds {s.merged} merged {name} tokens from {self.start}, its "
                    f"anchor layer {self.link.anchor} directions for {s.peer().merged} from {self._anchor().start}"
                )
        return None

    def answer(self, queries: mx.array, scale: float, mask=None, hidden: int = 0):
        """The tier protocol's attention method (runtime/kinds/tier.py): always its own partial, never decoded."""
        if hidden:
            mask = front_mask(self.count, hidden)
        return lambda: self.partial(queries, scale, mask)

    def expire(self, oldest_visible: int) -> None:
        expire_front(self, oldest_visible)

    def partial(self, queries: mx.array, scale: float, mask=None) -> Partial:
        B, Hq, Lq, D = queries.shape
        q = (queries.astype(mx.float32) * scale).reshape(B, self.n_kv_heads, (Hq // self.n_kv_heads) * Lq, D)
        return partial_from_scores(self.sides["k"].scores(q), mask, Lq, self.sides["v"].combine)

    def decoded(self, dtype):
        return self.sides["k"].decoded(dtype), self.sides["v"].decoded(dtype)

    def _drop(self, n: int, front: bool) -> None:
        for s in self.sides.values():
            if isinstance(s, MergedSide):
                s.drop(n, front)
            else:
                for b in s.buffers.values():
                    (b.drop_front if front else b.drop_back)(n)
        self.start += n if front else 0
        self.count -= n

    def drop_front(self, n: int) -> None:
        self._drop(n, True)

    def drop_back(self, n: int) -> None:
        self._drop(n, False)

    def settle_group(self) -> None:
        """An anchor's arrays change when its partner merges the tokens both have staged (on the
        partner's settle): settle the partners first, so what is read (state, nbytes) is final."""
        if self.link is not None and self.link.layer == self.link.anchor:
            for layer in self.group:  # the anchor first: partners merge only what it has staged
                self.link.cache(layer)._settle()

    @property
    def nbytes(self) -> int:
        self.settle_group()
        return SidesHeld.nbytes.fget(self)

    def arrays(self) -> Dict[str, mx.array]:
        self.settle_group()
        return super().arrays()
