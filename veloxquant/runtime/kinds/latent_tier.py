"""The latent tier kind: K and/or V held as low-rank latents plus their basis.

Until the prompt is over the tier stages what reaches it in float16 (the model
attends to it exactly, and its bytes count). At the end of the prompt
(TieredCache.finish_prompt: mlx-lm's first single-token step, `eval`'s end of
prefill, or saving) each latent side fits its basis on the staged tokens
(stages/latent.py), codes them as latents and frees the float16 copy. Tokens
that arrive later -- spilled from the recent window in whole groups -- are
projected onto the frozen basis. Nothing else is kept: no parent float16 copy.

Attention is answered from the latents: scores (q·P)·zᵀ (+ q·mean) and output
(Σ a·z)·Pᵀ (+ mean), as one partial (out, lse) that the cache merges with the
other tiers'. `decoded` (K/V rebuilt as z·Pᵀ) is the reference path, used only
without the attention hook.
"""

import functools
from typing import Dict, Optional

import mlx.core as mx

from ...compiler.plan import TierPlan
from ...kernels.partials import Partial, partial_from_scores
from .amc_side import AmcSide
from .latent_side import BASIS, LatentSide, PlainSide, SidesHeld
from .protocol import kind
from .think_side import ThinkSide
from .tier import expire_front, front_mask

SIDES = {"latent": LatentSide, "amc": AmcSide, "think": ThinkSide}  # a latent store's `side` -> the class holding it


@kind("latent")
class LatentTier(SidesHeld):
    """Behind the tier protocol (runtime/kinds/tier.py): place, drop, hold, answer a partial."""

    ends_prompt = joins_groups = True  # fits its basis when the prompt ends; xKV groups share it
    can_rewind = False  # trimming: latents cannot give their fp16 values back (runtime/trimming.py)

    fusable = False
    sixteen_bit = False
    drops = False

    def __init__(self, plan: TierPlan, n_kv_heads: int, head_dim: int):
        self.plan, self.route, self.n_kv_heads = plan, plan.route, n_kv_heads
        self.launch_key, self.launch = None, None
        self.sides = {
            side: (SIDES[getattr(codec.store, "side", "latent")] if hasattr(codec.store, "tier_kind") else PlainSide)(
                codec, n_kv_heads, head_dim
            )
            for side, codec in (("k", plan.keys), ("v", plan.values))
        }
        self.start = self.count = 0

    @property
    def end(self) -> int:
        return self.start + self.count

    @property
    def granularity(self) -> int:
        """Tokens leave (sliding-window expiry, trim) in whole groups, staged ones too:
        what is staged is coded a group at a time at the end of the prompt."""
        return max([self.token_group] + [u for s in self.sides.values() for u in s.units().values()])

    @property
    def token_group(self) -> int:
        return max([s.store.group for s in self.sides.values() if isinstance(s, LatentSide)] + [1])

    def finish_prompt(self) -> None:
        for name, s in self.sides.items():
            if s.shared and self.link is not None:
                s.finish_prompt(self._group_basis(name))
            else:
                s.finish_prompt()

    # --- cross-layer groups (xKV): one basis fitted on every member's keys -----------------
    link = None

    def join_group(self, link, layers) -> None:
        """Called by the coordinator: this tier's shared sides take their basis from the anchor's."""
        self.link, self.members = link, tuple(layers)
        for name, s in self.sides.items():
            if s.shared and link.layer != link.anchor:
                # a partial of the link, not a closure over self: no cycle, and deep copies follow the copied link
                s.basis_of = functools.partial(anchor_fitted, link, name)

    def _member(self, layer: int, side: str) -> LatentSide:
        return member_side(self.link, layer, side)

    def _group_basis(self, side: str) -> Optional[Dict[str, mx.array]]:
        """The group's basis, fitted by the first member to finish (the anchor: mlx-lm runs layers in
        order) on the staged vectors of every member (fan-in); None while nothing is staged."""
        anchor = self._member(self.link.anchor, side)
        if anchor.widths is None:
            for layer in self.members:
                self.link.cache(layer)._settle()  # the window's last spill belongs to the prompt
            staged = [x for x in (self._member(l, side).staged.view() for l in self.members) if x is not None]
            if not staged:
                return None
            anchor.finish_prompt(anchor.store.fit(mx.concatenate(staged, axis=2)))
        return {n: anchor.fitted[n] for n in BASIS}

    def partial(self, queries: mx.array, scale: float, mask=None) -> Partial:
        B, Hq, Lq, D = queries.shape
        # The query heads of a kv head become rows of one matmul, as in partial_attention.
        q = (queries.astype(mx.float32) * scale).reshape(B, self.n_kv_heads, (Hq // self.n_kv_heads) * Lq, D)
        if hasattr(self.sides["k"], "observe"):
            self.sides["k"].observe(q, Lq)  # before the fit: the queries weigh the key allocation (queries=true)
        return partial_from_scores(self.sides["k"].scores(q), mask, Lq, self.sides["v"].combine)

    def answer(self, queries: mx.array, scale: float, mask=None, hidden: int = 0):
        """The tier protocol's attention method (runtime/kinds/tier.py): always its own partial, never decoded."""
        if hidden:
            mask = front_mask(self.count, hidden)
        return lambda: self.partial(queries, scale, mask)

    def expire(self, oldest_visible: int) -> None:
        expire_front(self, oldest_visible)

    def decoded(self, dtype):
        return self.sides["k"].decoded(dtype), self.sides["v"].decoded(dtype)

    def drop_front(self, n: int) -> None:
        """Sliding-window expiry: the oldest latents leave; the basis stays."""
        for s in self.sides.values():
            if hasattr(s, "drop"):  # sides holding tokens in more than one order (amc's tiers)
                s.drop(n, True)
                continue
            for name, per_unit in s.units().items():
                s._live()[name].drop_front(n // per_unit)
        self.start += n
        self.count -= n

    def drop_back(self, n: int) -> None:
        for s in self.sides.values():
            if hasattr(s, "drop"):
                s.drop(n, False)
                continue
            for name, per_unit in s.units().items():
                s._live()[name].drop_back(n // per_unit)
        self.count -= n


def member_side(link, layer: int, side: str) -> LatentSide:
    """`side` of the group's tier in `layer`'s cache."""
    return link.cache(layer).tiers[link.tier].sides[side]


def anchor_fitted(link, side: str):
    """The basis the group's anchor fitted for `side` (None until it has)."""
    return member_side(link, link.anchor, side).fitted
