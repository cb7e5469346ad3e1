"""A latent-tier side under `amc`: each token's latents kept at its saliency tier's rank and precision.

The basis (all components, by variance) and the routing thresholds are fitted
at the end of the prompt, like any latent side's basis (stages/amc.py). Each
tier's tokens are held in their own arrays (axis 2 counts that tier's tokens),
plus one uint8 per token naming its tier (on the device, and again on the host to re-sort without a
device sync; both in nbytes). Attention stays in latent space:
per tier, the projected query's first rank_c components score that tier's
latents, and the weighted latents go back through the first rank_c basis
columns; the scores are put back in position order with one gather, so masks
and the merge with the other tiers see one ordinary partial.
"""

from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from ..buffer import Buffer
from .latent_side import BASIS, LatentSide

FITTED = BASIS + ("thresholds",)


class AmcSide(LatentSide):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._order: Optional[Tuple[mx.array, mx.array]] = None  # held from an attention to the next append
        self._at = np.zeros(0, np.uint8)

    def _set_basis(self, fitted: Dict[str, mx.array]) -> None:
        self.fitted = dict(fitted)
        self.widths = np.array(fitted["widths"]).astype(np.int64)
        self.layout = self.store.tiers(fitted["basis"].shape[1])  # (name, rank, bits) per tier
        self.buffers = {f"{name}.{n}": Buffer(None) for name, _, bits in self.layout for n in self.store.names(bits)}
        self.buffers["tier"] = Buffer(None)
        self._order = None
        self._at = np.zeros(0, np.uint8)  # the tier ids on the host too: no device sync to re-sort them

    def finish_prompt(self, basis=None) -> None:
        x = self.staged.view()
        if self.widths is not None or x is None:
            return
        self._set_basis({**self.store.fit(x), "thresholds": self.store.thresholds(x)})
        self.staged.set(None)
        self.append(x)

    def append(self, x: mx.array) -> None:
        if self.widths is None:
            self.staged.append(x.astype(mx.float16))
            return
        tier = self.store.route(x, self.fitted["thresholds"])
        z = self._project(x)
        at = np.array(tier).astype(np.uint8)
        for t, (name, rank, bits) in enumerate(self.layout):
            idx = np.flatnonzero(at == t)
            if len(idx):
                for n, arr in self.store.encode(z[:, :, mx.array(idx), :rank], bits).items():
                    self.buffers[f"{name}.{n}"].append(mx.contiguous(arr))
        self.buffers["tier"].append(tier.reshape(1, 1, -1, 1))
        self._at = np.concatenate([self._at, at.ravel()])
        self._order = None

    # --- the tiers' latents, and the way back to position order ---------------------------
    def _routing(self) -> Tuple[mx.array, mx.array]:
        """(order: positions grouped by tier, inverse: each position's place in that order)."""
        if self._order is None:
            order = np.argsort(self._at, kind="stable")
            self._order = (mx.array(order.astype(np.int32)), mx.array(np.argsort(order).astype(np.int32)))
        return self._order

    def _tiers(self) -> List[Tuple[int, mx.array]]:
        """(rank, latents [B, G, n, rank]) of each tier holding tokens, High first."""
        out = []
        for name, rank, bits in self.layout:
            enc = {n: self.buffers[f"{name}.{n}"].view() for n in self.store.names(bits)}
            if enc[self.store.names(bits)[0]] is not None:
                out.append((rank, self.store.decode(enc, rank, bits)))
        return out

    # --- attention from the latents --------------------------------------------------------
    def scores(self, q: mx.array) -> mx.array:
        if self.widths is None:
            return super().scores(q)
        B, H, R, D = q.shape
        basis, mean = self._per_head()
        G = self.fitted["basis"].shape[0]
        qp = (q @ basis).reshape(B, G, (H // G) * R, -1)  # the query projected once
        s = mx.concatenate([qp[..., :rank] @ z.swapaxes(-1, -2) for rank, z in self._tiers()], axis=-1)
        s = mx.take(s, self._routing()[1], axis=-1).reshape(B, H, R, -1)
        return s + q @ mean.swapaxes(-1, -2) if self.store.center else s

    def combine(self, weights: mx.array) -> mx.array:
        if self.widths is None:
            return super().combine(weights)
        B, H, R, L = weights.shape
        basis, mean = self._per_head()
        G = self.fitted["basis"].shape[0]
        w = mx.take(weights.reshape(B, G, (H // G) * R, L), self._routing()[0], axis=-1)
        out, start = 0, 0
        for rank, z in self._tiers():
            mixed = (w[..., start : start + z.shape[2]] @ z).reshape(B, H, R, rank)
            out = out + mixed @ basis[:, :, :rank].swapaxes(-1, -2)
            start += z.shape[2]
        return out + mx.sum(weights, axis=-1, keepdims=True) * mean if self.store.center else out

    def decoded(self, dtype) -> mx.array:
        """The reference path: each tier's vectors rebuilt from its rank_c components, in position order."""
        if self.widths is None:
            return super().decoded(dtype)
        basis = self.fitted["basis"].astype(mx.float32)  # [G, hg*D, r]
        x = mx.concatenate([z @ basis[:, :, :rank].swapaxes(-1, -2) for rank, z in self._tiers()], axis=2)
        x = mx.take(x, self._routing()[1], axis=2) + self.fitted["mean"].astype(mx.float32)[:, None]
        B, G, L, _ = x.shape
        H, D = self.n_kv_heads, self.head_dim
        return x.reshape(B, G, L, H // G, D).swapaxes(2, 3).reshape(B, H, L, D).astype(dtype)

    # --- bookkeeping -----------------------------------------------------------------------
    def units(self) -> Dict[str, int]:
        return {"x": 1} if self.widths is None else {"tier": 1}

    @property
    def nbytes(self) -> int:
        """The latent side's bytes, the host's tier ids (one uint8 per token), plus the position order
        (two int32 per token) while it is held: built at an attention, it lives until the next append or
        drop (the next step's spill)."""
        order = sum(a.nbytes for a in self._order) if self._order is not None else 0
        return super().nbytes + self._at.nbytes + order

    def drop(self, n: int, front: bool) -> None:
        """The oldest (front) or newest n tokens leave: each tier loses its own among them."""
        if self.widths is None:
            (self.staged.drop_front if front else self.staged.drop_back)(n)
            return
        at = self._at
        gone = at[:n] if front else at[len(at) - n :]
        for t, (name, _, bits) in enumerate(self.layout):
            k = int((gone == t).sum())
            for b in (self.buffers[f"{name}.{m}"] for m in self.store.names(bits)):
                if k:
                    (b.drop_front if front else b.drop_back)(k)
        (self.buffers["tier"].drop_front if front else self.buffers["tier"].drop_back)(n)
        self._at = (at[n:] if front else at[: len(at) - n]).copy()  # a view would keep the dropped ids alive
        self._order = None

    def restore(self, arrays: Dict[str, mx.array], count: int) -> Optional[str]:
        if all(name in arrays for name in FITTED):
            self._set_basis({name: arrays[name] for name in FITTED})
        else:
            self.fitted, self.widths, self.buffers = {}, None, {}
        for name in self._live():
            self._live()[name].set(arrays.get(name))
        if self.widths is None:
            held = self.staged.used
        else:
            at = np.array(self.buffers["tier"].view()).ravel() if self.buffers["tier"].used else np.zeros(0)
            self._at, held = at.astype(np.uint8), len(at)
            for t, (name, _, bits) in enumerate(self.layout):
                if any(self.buffers[f"{name}.{m}"].used != int((at == t).sum()) for m in self.store.names(bits)):
                    return f"array {name}.* does not hold the {int((at == t).sum())} tokens routed to {name}"
        return None if held == count else f"array tier does not hold {count} tokens"
