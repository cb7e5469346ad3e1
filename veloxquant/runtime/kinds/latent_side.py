"""The two kinds of side (K or V) a latent tier holds: latents on a basis, or an ordinary codec.

Both answer the same three questions for the tier's partial: scores(q), combine(weights)
and decoded (the reference path), and hold, restore and count their own arrays.
"""

from typing import Dict, Optional

import mlx.core as mx
import numpy as np

from ...compiler.plan import CodecPlan
from ...stages.latent_reader import LatentReader, readable
from ..buffer import Buffer
from ..codec import Codec
from .protocol import KindBase

BASIS = ("basis", "mean", "widths")  # a fitted side's arrays that are not per token
STATS = ("loc", "std", "keep")  # with quant=gauss each latent's scale; calibrated, the axes kept


class SidesHeld(KindBase):
    """A tier whose arrays are held per side (`self.sides`: "k", "v" -> a side object with
    append, nbytes, arrays() and restore()): appending to both sides, its bytes, its arrays
    named "side.name", and restoring them from a saved file. Shared by the latent and merged tier kinds."""

    def append(self, keys: mx.array, values: mx.array, start: int) -> None:
        if self.count == 0:
            self.start = start
        self.sides["k"].append(keys)
        self.sides["v"].append(values)
        self.count += keys.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.sides.values())

    def arrays(self) -> Dict[str, mx.array]:
        return {f"{side}.{name}": a for side, s in self.sides.items() for name, a in s.arrays().items()}

    def expected_names(self):
        return list(self.arrays())

    def restore(self, start: int, count: int, arrays: Dict[str, mx.array]) -> Optional[str]:
        self.start, self.count = start, count
        for side, s in self.sides.items():
            problem = s.restore({k[2:]: v for k, v in arrays.items() if k.startswith(f"{side}.")}, count)
            if problem:
                return f"{side}.{problem[len('array ') :]}" if problem.startswith("array ") else problem
        return None


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
        self.widths: Optional[np.ndarray] = None  # on the host too (shapes are read from it), in nbytes
        self.buffers: Dict[str, Buffer] = {}
        self._keep = None  # calibrated: the artifact's axes this cache keeps (int32)
        self._reader = None  # reads the latents back at every attention (stages/latent_reader.py)
        self.basis_of = None  # in a cross-layer group (xKV): () -> the anchor's fitted basis, once it exists
        self.shared = getattr(self.store, "layers", 1) > 1
        self.query_moment = None  # keys with queries=true: Σ qᵀq [H, D, D] of the prompt's queries, until the fit

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
        fitted = basis if basis is not None else self.store.fit(x, *self._moment())
        self._set_basis(fitted)
        self._set_basis({**fitted, **self.store.stats(self._project(x))})  # quant=gauss: latent scales
        self.staged.set(None)
        self.append(x)

    def observe(self, q: mx.array, n_queries: int = 1) -> None:
        """Queries q [B, H, R, D] (R = group x n_queries) that attend before the fit: their second moment weighs
        the allocation."""
        if not getattr(self.store, "queries", False) or self.widths is not None:
            return
        H, D = q.shape[1], q.shape[-1]
        qh = q.astype(mx.float32).swapaxes(0, 1).reshape(H, -1, D)
        moment = qh.swapaxes(-1, -2) @ qh
        self.query_moment = moment if self.query_moment is None else self.query_moment + moment

    def _moment(self):
        moment, self.query_moment = self.query_moment, None  # freed with the fp16 copy
        return () if moment is None else (moment,)

    def _set_basis(self, fitted: Dict[str, mx.array]) -> None:
        # As given (a group's members hold the anchor's arrays themselves); a calibrated basis is not
        # held: its kept axes are gathered from the artifact (held once per process) when attending.
        self.fitted = {n: a for n, a in fitted.items() if not (n == "basis" and "keep" in fitted)}
        self._keep = fitted["keep"].astype(mx.int32) if "keep" in fitted else None
        self.widths = np.array(fitted["widths"]).astype(np.int64)
        self._reader = LatentReader(self.store, self.widths) if readable(self.widths) else None
        # Exact-size buffers: latents grow one group at a time (a small copy), and attention
        # then reads contiguous arrays, the same live and after loading (identical logits).
        self.buffers = {name: Buffer(None) for name in self.store.units(self.widths)}

    # --- shapes: per kv head views of the group basis -------------------------------
    def _basis(self) -> mx.array:
        """[G, hg*D, r]: the fitted basis, or the calibrated axes this cache keeps (gathered, not held)."""
        return self.fitted["basis"] if self._keep is None else self.store.axes()[:, :, self._keep]

    def _per_head(self):
        """basis as [H, D, r] and mean as [H, 1, D] (a group's heads are consecutive); the mean is None
        when uncentred (it is zero, and nothing reads it then)."""
        H, D = self.n_kv_heads, self.head_dim
        basis = self._basis().astype(mx.float32).reshape(H, D, -1)
        return basis, self.fitted["mean"].astype(mx.float32).reshape(H, 1, D) if self.store.center else None

    def _project(self, x: mx.array) -> mx.array:
        """x [B, H, L, D] -> latents [B, G, L, r]."""
        B, H, L, D = x.shape
        G = self.fitted["mean"].shape[0]
        basis, mean = self._per_head()
        # z_g = sum over the group's heads of (x_h - mean_h) P_h
        z = (x.astype(mx.float32) - mean if mean is not None else x.astype(mx.float32)) @ basis  # [B, H, L, r]
        return z.reshape(B, G, H // G, L, -1).sum(axis=2)

    def latents(self) -> mx.array:
        """[B, G, L, r] float32, read at every attention: one gather for all widths where it applies."""
        enc = {n: b.view() for n, b in self.buffers.items()}
        if self._reader is not None:
            return self._reader(enc, self.fitted)
        return self.store.decode(enc, self.widths, self.fitted)

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
        basis = self._basis().astype(mx.float32)  # [G, hg*D, r]
        x = (z @ basis.swapaxes(-1, -2)) + self.fitted["mean"].astype(mx.float32)[:, None]  # [B, G, L, hg*D]
        H, D = self.n_kv_heads, self.head_dim
        return x.reshape(B, G, L, H // G, D).swapaxes(2, 3).reshape(B, H, L, D).astype(dtype)

    # --- bookkeeping --------------------------------------------------------------
    def units(self) -> Dict[str, int]:
        return {"x": 1} if self.widths is None else self.store.units(self.widths)

    def _live(self) -> Dict[str, Buffer]:
        return {"x": self.staged} if self.widths is None else self.buffers

    def _own(self) -> Dict[str, mx.array]:
        """The fitted arrays this layer saves: a group's basis is held (and saved) by its anchor only;
        a calibrated basis is the artifact's (the cache holds and saves which of its axes it keeps)."""
        if self.basis_of is not None:
            return {n: a for n, a in self.fitted.items() if n not in BASIS}
        return self.fitted

    def arrays(self) -> Dict[str, mx.array]:
        out = {n: b.view() for n, b in self._live().items() if b.view() is not None}
        out.update(self._own())
        if self.query_moment is not None:  # until the fit (a saved cache is fitted first: never saved)
            out["qmoment"] = self.query_moment
        return out

    @property
    def nbytes(self) -> int:
        """Allocated buffers (growth slack is real memory) plus the basis this layer holds (and, until
        the fit, the queries' second moment) plus the host copy of the widths; a calibrated basis is the
        artifact's, not the cache's."""
        host = self.widths.nbytes if self.widths is not None else 0
        return (
            sum(a.nbytes for a in self.arrays().values())
            + sum(b.nbytes - b.view().nbytes for b in self._live().values() if b.view() is not None)
            + host
        )

    def restore(self, arrays: Dict[str, mx.array], count: int) -> Optional[str]:
        if self.basis_of is not None and self.basis_of():  # the group's anchor (restored first) holds the basis
            arrays = {**arrays, **{n: self.basis_of()[n] for n in BASIS}}
        if getattr(self.store, "calibrated", False) and "keep" in arrays:  # the artifact's axes it kept
            keep, n = arrays["keep"], self.store.axes().shape[-1]
            if keep.ndim != 1 or keep.shape[0] != arrays.get("widths", keep).shape[0] or int(mx.max(keep)) >= n:
                return f"array keep does not name kept axes among the artifact's {n} (one per width)"
            arrays = {**arrays, "basis": mx.contiguous(self.store.axes()[:, :, keep.astype(mx.int32)])}
        if all(name in arrays for name in BASIS):
            self._set_basis({name: arrays[name] for name in BASIS + STATS if name in arrays})
        else:
            self.fitted, self.widths, self.buffers, self._keep, self._reader = {}, None, {}, None, None
        for name, per_unit in self.units().items():
            arr = arrays.get(name)
            if count and (arr is None or arr.ndim != 4 or arr.shape[2] * per_unit != count):
                return f"array {name} is missing or does not hold {count} tokens"
            self._live()[name].set(arr if count else None)
        return None
