"""The coordinator shared by one model's layer caches: cross-layer groups, and
budgets allocated across layers and heads (runtime/eviction/allocation.py).

The compiler puts layers in groups (LayerPlan.share). Here each reuse layer's
shared tier is linked to its anchor: an ordinary tier becomes a ReuseTier whose
Link reads the anchor layer's packed codes (XQuant); a tier kind that shares by
itself (`join_group`: the latent tier, one basis per group, xKV) is handed the
Links of its group and does the rest. Layers stay in step because mlx-lm runs
layer i before layer j in every step and all layers of a group route tokens
the same way; the Link checks that, and refuses reads or trims that would let
a reuse layer drift from its anchor's codes.
"""

import copy
import weakref
from typing import List, Optional

import mlx.core as mx

from ..compiler.groups import shared_tiers
from ..compiler.plan import Plan
from ..errors import VeloxError
from .copying import copy_owned, copy_sharing
from .eviction import model_pass
from .eviction.allocation import allocates, decide
from .kinds.reuse_tier import ReuseTier

TRIM_HINT = "trim every layer's cache by the same amount (mlx_lm.models.cache.trim_prompt_cache does)"


class Link:
    """One reuse layer's way to its anchor's codes in one tier."""

    def __init__(self, coordinator: "Coordinator", anchor: int, layer: int, tier: int):
        self._coordinator = weakref.ref(coordinator)  # which holds this link (Coordinator.links)
        self.anchor, self.layer, self.tier = anchor, layer, tier

    def __deepcopy__(self, memo):
        return copy_owned(self, memo, "_coordinator")

    @property
    def coordinator(self) -> "Coordinator":
        return self._coordinator()

    def _anchor_tier(self):
        return self.coordinator.cache(self.anchor).tiers[self.tier]

    def cache(self, layer: int):
        return self.coordinator.cache(layer)

    def codes(self, side: str, start: int, end: int) -> mx.array:
        """The anchor's packed codes for positions [start, end): a slice, never a copy."""
        anchor = self.coordinator.cache(self.anchor)
        tier = self._anchor_tier()
        if not (tier.start <= start and end <= tier.end):
            anchor._settle()  # the anchor moves its overflow on lazily; it has seen these tokens first
        problem = self.problem(start, end)
        if problem:
            raise VeloxError(problem)
        codes = tier.buffers[side]["codes"].view()
        return codes[:, :, start - tier.start : end - tier.start]

    def problem(self, start: int, end: int) -> Optional[str]:
        anchor, mine = self.coordinator.cache(self.anchor), self.coordinator.cache(self.layer)
        tier = self._anchor_tier()
        if anchor.offset < mine.offset:
            return (
                f"layer {self.layer} reuses layer {self.anchor}'s xquant codes, but layer {self.anchor} has seen "
                f"{anchor.offset} positions and layer {self.layer} {mine.offset}: the anchor was trimmed or "
                f"skipped alone; {TRIM_HINT}"
            )
        if start < end and not (tier.start <= start and end <= tier.end):
            held = f"{tier.start}-{tier.end - 1}" if tier.count else "none"
            return (
                f"layer {self.layer} reads layer {self.anchor}'s xquant codes for positions {start}-{end - 1}, "
                f"but layer {self.anchor} holds codes for {held}; {TRIM_HINT}"
            )
        return None

    def check_trim(self, start: int, end: int) -> None:
        """A reuse layer may drop positions only once its anchor has dropped them too."""
        if start < self._anchor_tier().end:
            raise VeloxError(
                f"refused: trimming layer {self.layer} would drop its xquant params for positions "
                f"{start}-{end - 1} while its anchor, layer {self.anchor}, still holds their codes; "
                f"{TRIM_HINT}, anchors first"
            )


class Coordinator:
    """Shared by the caches of one model; built by caches_for, so loading a saved cache re-links it."""

    def __init__(self, plan: Plan, caches: List):
        # Weak: the caches own their coordinator (strong references both ways would be a cycle, and a
        # dropped model's caches would keep their arrays until Python's cyclic collector ran).
        self._caches = [weakref.ref(c) for c in caches]
        self.links: List[Link] = []
        self.budgets: dict = {}  # what `allocate` chose: per-layer budgets and per-head lists
        self.allocated = False
        self.model_pass = None  # a pass the caches run at the end of the prompt (model_pass.attach)
        for layer, cache in zip(plan.layers, caches):
            cache.coordinator = self
            for t in shared_tiers(layer) if layer.share else ():  # slerp layers above `start` share nothing
                link = Link(self, layer.share.anchor, layer.index, t)
                if cache.tiers[t].joins_groups:
                    cache.tiers[t].join_group(link, layer.share.layers)  # it shares by itself (latent: the basis)
                elif layer.role == "reuse":
                    cache.tiers[t] = ReuseTier(layer.tiers[t], link, layer.head_dim)
                    self.links.append(link)

    @property
    def caches(self) -> List:
        return [ref() for ref in self._caches]

    def cache(self, layer: int):
        return self._caches[layer]()

    def __deepcopy__(self, memo):
        # The copy links the caches' copies (made here or already in memo; a deep copy of the list
        # of caches holds them all), never the originals.
        new = copy_sharing(self, memo, shared=("_caches",))
        new._caches = [weakref.ref(copy.deepcopy(ref(), memo)) for ref in self._caches]
        return new

    def allocate(self) -> None:
        """Once, when the prompt ends (the first layer to learn it calls): every layer has seen every
        prompt query, so budgets across layers and heads are decided from all of their attention."""
        if self.allocated:
            return
        self.allocated = True
        model_pass.run(self)  # scores from a model pass (KVzip) come first: allocations may read them
        self.budgets = decide(self.caches)

    def problems(self) -> List[str]:
        """Reuse tiers whose positions their anchors do not hold (a saved file that does not add up)."""
        out = [p for c in self.caches for t in c.tiers for p in [t.group_problem()] if p]
        for link in self.links:
            tier = self.cache(link.layer).tiers[link.tier]
            problem = link.problem(tier.start, tier.end) if tier.count else link.problem(0, 0)
            if problem:
                out.append(problem)
        return out


def link_groups(plan: Plan, caches: List) -> Optional[Coordinator]:
    """One coordinator for the model when its plan has cross-layer groups, allocated budgets or a model pass."""
    if not any(
        layer.share or model_pass.NEED in layer.needs or any(allocates(t.route) for t in layer.tiers)
        for layer in plan.layers
    ):
        return None
    return Coordinator(plan, caches)
