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
from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np

from ..compiler.plan import CodecPlan, TierPlan
from .attention import Partial, partial_from_scores
from .buffer import Buffer
from .codec import Codec

BASIS = ("basis", "mean", "widths")  # a fitted side's arrays that are not per token
STATS = ("loc", "std")  # and, with quant=gauss, each latent's scale


class PlainSide:
    """A side held by an ordinary codec (SVDq's float16 values)."""

    shared = False  # never shared across layers

    def __init__(self, plan: CodecPlan, n_kv_heads: int, head_dim: int):
        self.codec = Codec(plan)
        # Exact-size: the tier is fed whole groups (>= 32 tokens), one copy per group, no slack held.
        self.buffers = {name: Buffer(None) for name in self.codec.units()}

    def append(self, x: mx.array) -> None:
        for name, arr in self.codec.encode(x).items():
            self.buffers[name].append(arr)

    def decoded(self, dtype) -> mx.array:
        return self.codec.decode({n: b.view() for n, b in self.buffers.items()}, dtype)

    def scores(self, q: mx.array) -> mx.array:
        return q @ self.decoded(mx.float32).swapaxes(-1, -2)

    def combine(self, weights: mx.array) -> mx.array:
        return weights @ self.decoded(mx.float32)

    def finish_prompt(self) -> None:
        pass

    def units(self) -> Dict[str, int]:
        return self.codec.units()

    def _live(self) -> Dict[str, Buffer]:
        return self.buffers

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    def arrays(self) -> Dict[str, mx.array]:
        return {n: b.view() for n, b in self.buffers.items() if b.view() is not None}

    def restore(self, arrays: Dict[str, mx.array], count: int) -> Optional[str]:
        for name, per_unit in self.units().items():
            arr = arrays.get(name)
            if count and (arr is None or arr.ndim != 4 or arr.shape[2] * per_unit != count):
                return f"array {name} is missing or does not hold {count} tokens"
            self.buffers[name].set(arr if count else None)
        return None


class LatentSide:
    """A side held as latents on a basis (the `latent` store)."""

    def __init__(self, plan: CodecPlan, n_kv_heads: int, head_dim: int):
        self.store, self.n_kv_heads, self.head_dim = plan.store, n_kv_heads, head_dim
        self.staged = Buffer(None)  # float16, until the basis is fitted
        self.fitted: Dict[str, mx.array] = {}  # basis [G, hg*D, r], mean [G, hg*D], widths [r]
        self.widths: Optional[np.ndarray] = None
        self.buffers: Dict[str, Buffer] = {}
        self.basis_of = None  # in a cross-layer group (xKV): () -> the anchor's fitted basis, once it exists
        self.shared = getattr(self.store, "layers", 1) > 1

    def append(self, x: mx.array) -> None:
        if self.widths is None:
            self.staged.append(x.astype(mx.float16))
            return
        for name, arr in self.store.encode(self._project(x), self.widths, self.fitted).items():
            self.buffers[name].append(mx.contiguous(arr))

    def finish_prompt(self, basis: Optional[Dict[str, mx.array]] = None) -> None:
        """Fit the basis on the staged tokens (or take the group's `basis`), code them, free them.
        Idempotent; with nothing staged yet (a prompt shorter than the window) it waits."""
        x = self.staged.view()
        if self.widths is not None or x is None:
            return
        fitted = basis if basis is not None else self.store.fit(x)
        self._set_basis(fitted)
        self._set_basis({**fitted, **self.store.stats(self._project(x))})  # quant=gauss: latent scales
        self.staged.set(None)
        self.append(x)

    def _set_basis(self, fitted: Dict[str, mx.array]) -> None:
        self.fitted = dict(fitted)  # as given: a group's members hold the anchor's arrays themselves
        self.widths = np.array(fitted["widths"]).astype(np.int64)
        # Exact-size buffers: latents grow one group at a time (a small copy), and attention
        # then reads contiguous arrays, the same live and after loading (identical logits).
        self.buffers = {name: Buffer(None) for name in self.store.units(self.widths)}

    # --- shapes: per kv head views of the group basis -------------------------------
    def _per_head(self):
        """basis as [H, D, r] and mean as [H, 1, D] (a group's heads are consecutive)."""
        basis, mean = self.fitted["basis"].astype(mx.float32), self.fitted["mean"].astype(mx.float32)
        H, D = self.n_kv_heads, self.head_dim
        return basis.reshape(H, D, -1), mean.reshape(H, 1, D)

    def _project(self, x: mx.array) -> mx.array:
        """x [B, H, L, D] -> latents [B, G, L, r]."""
        B, H, L, D = x.shape
        G = self.fitted["basis"].shape[0]
        basis, mean = self._per_head()
        # z_g = sum over the group's heads of (x_h - mean_h) P_h
        z = (x.astype(mx.float32) - mean) @ basis  # [B, H, L, r]
        return z.reshape(B, G, H // G, L, -1).sum(axis=2)

    def latents(self) -> mx.array:
        return self.store.decode({n: b.view() for n, b in self.buffers.items()}, self.widths, self.fitted)

    # --- attention from the latents --------------------------------------------------
    def scores(self, q: mx.array) -> mx.array:
        """q [B, H, R, D] (scaled, float32) -> q·k for every held token [B, H, R, L]."""
        if self.widths is None:
            return q @ self.staged.view().astype(mx.float32).swapaxes(-1, -2)
        B, H, R, D = q.shape
        basis, mean = self._per_head()
        z = self.latents()  # [B, G, L, r]: the latents, never K
        G = z.shape[1]
        qp = (q @ basis).reshape(B, G, (H // G) * R, -1)  # the query projected once per head
        s = (qp @ z.swapaxes(-1, -2)).reshape(B, H, R, -1)
        return s + q @ mean.swapaxes(-1, -2) if self.store.center else s

    def combine(self, weights: mx.array) -> mx.array:
        """weights [B, H, R, L] -> sum of weight·v [B, H, R, D], through the latents."""
        if self.widths is None:
            return weights @ self.staged.view().astype(mx.float32)
        B, H, R, L = weights.shape
        z = self.latents()
        G, r = z.shape[1], z.shape[-1]
        basis, mean = self._per_head()
        mixed = (weights.reshape(B, G, (H // G) * R, L) @ z).reshape(B, H, R, r)
        out = mixed @ basis.swapaxes(-1, -2)
        return out + mx.sum(weights, axis=-1, keepdims=True) * mean if self.store.center else out

    def decoded(self, dtype) -> mx.array:
        """The reference path: K or V rebuilt from the latents [B, H, L, D]."""
        if self.widths is None:
            return self.staged.view().astype(dtype)
        z = self.latents()
        B, G, L, r = z.shape
        basis = self.fitted["basis"].astype(mx.float32)  # [G, hg*D, r]
        x = (z @ basis.swapaxes(-1, -2)) + self.fitted["mean"].astype(mx.float32)[:, None]  # [B, G, L, hg*D]
        H, D = self.n_kv_heads, self.head_dim
        return x.reshape(B, G, L, H // G, D).swapaxes(2, 3).reshape(B, H, L, D).astype(dtype)

    # --- bookkeeping --------------------------------------------------------------
    def units(self) -> Dict[str, int]:
        return {"x": 1} if self.widths is None else self.store.units(self.widths)

    def _live(self) -> Dict[str, Buffer]:
        return {"x": self.staged} if self.widths is None else self.buffers

    def _own(self) -> Dict[str, mx.array]:
        """The fitted arrays this layer holds: a group's basis is held (and saved) by its anchor only."""
        if self.basis_of is None:
            return self.fitted
        return {n: a for n, a in self.fitted.items() if n not in BASIS}

    def arrays(self) -> Dict[str, mx.array]:
        out = {n: b.view() for n, b in self._live().items() if b.view() is not None}
        out.update(self._own())
        return out

    @property
    def nbytes(self) -> int:
        """Allocated buffers (growth slack is real memory) plus the basis this layer holds."""
        return sum(b.nbytes for b in self._live().values()) + sum(a.nbytes for a in self._own().values())

    def restore(self, arrays: Dict[str, mx.array], count: int) -> Optional[str]:
        if self.basis_of is not None and self.basis_of():  # the group's anchor (restored first) holds the basis
            arrays = {**arrays, **{n: self.basis_of()[n] for n in BASIS}}
        if all(name in arrays for name in BASIS):
            self._set_basis({name: arrays[name] for name in BASIS + STATS if name in arrays})
        else:
            self.fitted, self.widths, self.buffers = {}, None, {}
        for name, per_unit in self.units().items():
            arr = arrays.get(name)
            if count and (arr is None or arr.ndim != 4 or arr.shape[2] * per_unit != count):
                return f"array {name} is missing or does not hold {count} tokens"
            self._live()[name].set(arr if count else None)
        return None


class LatentTier:
    """Behind the tier protocol (runtime/tier.py): place, drop, hold, answer a partial."""

    fusable = False
    sixteen_bit = False
    drops = False
    attends = True  # answers its own partial: TieredCache.attend asks it, never decodes it

    def __init__(self, plan: TierPlan, n_kv_heads: int, head_dim: int):
        self.plan, self.route, self.n_kv_heads = plan, plan.route, n_kv_heads
        self.launch_key, self.launch = None, None
        self.sides = {side: (LatentSide if hasattr(codec.store, "tier_kind") else PlainSide)(codec, n_kv_heads, head_dim)
                      for side, codec in (("k", plan.keys), ("v", plan.values))}
        self.start = self.count = 0

    @property
    def end(self) -> int:
        return self.start + self.count

    @property
    def granularity(self) -> int:
        return max(u for s in self.sides.values() for u in s.units().values())

    def append(self, keys: mx.array, values: mx.array, start: int) -> None:
        if self.count == 0:
            self.start = start
        self.sides["k"].append(keys)
        self.sides["v"].append(values)
        self.count += keys.shape[2]

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
        self.link, self.group = link, tuple(layers)
        for name, s in self.sides.items():
            if s.shared and link.layer != link.anchor:
                s.basis_of = lambda name=name: self._member(link.anchor, name).fitted

    def _member(self, layer: int, side: str) -> LatentSide:
        return self.link.cache(layer).tiers[self.link.tier].sides[side]

    def _group_basis(self, side: str) -> Optional[Dict[str, mx.array]]:
        """The group's basis, fitted by the first member to finish (the anchor: mlx-lm runs layers in
        order) on the staged vectors of every member (fan-in); None while nothing is staged."""
        anchor = self._member(self.link.anchor, side)
        if anchor.widths is None:
            for layer in self.group:
                self.link.cache(layer)._settle()  # the window's last spill belongs to the prompt
            staged = [x for x in (self._member(l, side).staged.view() for l in self.group) if x is not None]
            if not staged:
                return None
            anchor.finish_prompt(anchor.store.fit(mx.concatenate(staged, axis=2)))
        return {n: anchor.fitted[n] for n in BASIS}

    def partial(self, queries: mx.array, scale: float, mask=None) -> Partial:
        B, Hq, Lq, D = queries.shape
        # The query heads of a kv head become rows of one matmul, as in partial_attention.
        q = (queries.astype(mx.float32) * scale).reshape(B, self.n_kv_heads, (Hq // self.n_kv_heads) * Lq, D)
        return partial_from_scores(self.sides["k"].scores(q), mask, Lq, self.sides["v"].combine)

    def decoded(self, dtype):
        return self.sides["k"].decoded(dtype), self.sides["v"].decoded(dtype)

    def drop_front(self, n: int) -> None:
        """Sliding-window expiry: the oldest latents leave; the basis stays."""
        for s in self.sides.values():
            for name, per_unit in s.units().items():
                s._live()[name].drop_front(n // per_unit)
        self.start += n
        self.count -= n

    def drop_back(self, n: int) -> None:
        for s in self.sides.values():
            for name, per_unit in s.units().items():
                s._live()[name].drop_back(n // per_unit)
        self.count -= n

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.sides.values())

    def arrays(self) -> Dict[str, mx.array]:
        return {f"{side}.{name}": a for side, s in self.sides.items() for name, a in s.arrays().items()}

    def expected_names(self) -> List[str]:
        return list(self.arrays())

    def restore(self, start: int, count: int, arrays: Dict[str, mx.array]) -> Optional[str]:
        self.start, self.count = start, count
        for side, s in self.sides.items():
            mine = {k[2:]: v for k, v in arrays.items() if k.startswith(f"{side}.")}
            problem = s.restore(mine, count)
            if problem:
                return f"{side}.{problem[len('array '):]}" if problem.startswith("array ") else problem
        return None
