"""One layer's K or V under `slerp` (MiniCache), as the merged tier holds it (merged_tier.py).

By its role in the pair: the anchor stages float16 tokens until the reuse layer merges them
(`merge_front`), then holds the shared directions and its magnitudes; the reuse layer holds its
magnitudes, which tokens stayed unmerged (`flag`) and their float16 vectors (`ret`). Attention
reads the anchor's direction array in place: scores mag·(q·dir), output Σ a·mag·dir.
"""

from typing import Dict, Optional

import mlx.core as mx
import numpy as np

from ...errors import VeloxError
from ..buffer import Buffer
from ..copying import copy_owned

OWN = {None: ("x",), "anchor": ("dir", "mag", "x"), "reuse": ("mag", "flag", "ret")}  # arrays per role
HINT = "feed every layer of the model in order (mlx-lm does) and trim all layers together"


class MergedSide:
    """K or V of one layer under `slerp`: its role's buffers, and attention from them."""

    def __init__(self, plan, n_kv_heads: int, head_dim: int):
        self.store, self.role = plan.store, None
        self._tier, self.name = None, None  # the owning tier, weakly (copying.copy_owned): set by join_group
        self.bufs = {n: Buffer(None) for n in ("dir", "mag", "x", "flag", "ret")}  # x: float16, unmerged yet
        self._idx = None  # positions of the reuse layer's unmerged tokens (host), until the buffers change
        self.pending = 0  # anchor: staged tokens its window expired before the reuse layer merged them

    def __deepcopy__(self, memo):
        return copy_owned(self, memo, "_tier")

    @property
    def tier(self):
        """The MergedTier holding this side."""
        return self._tier()

    def peer(self) -> "MergedSide":
        """The anchor layer's side (for a reuse layer)."""
        return self.tier._anchor().sides[self.name]

    def view(self, name: str) -> Optional[mx.array]:
        return self.bufs[name].view()

    @property
    def merged(self) -> int:
        return self.bufs["mag"].used

    @property
    def staged(self) -> int:
        return self.bufs["x"].used - self.pending

    def _x(self) -> mx.array:
        """The staged float16 tokens still in the window."""
        return self.view("x")[:, :, self.pending :]

    def append(self, x: mx.array) -> None:
        if self.role != "reuse":
            self.bufs["x"].append(x.astype(mx.float16))
            return
        mag, flag, ret = self.peer().merge_front(x)
        self.bufs["mag"].append(mag)
        self.bufs["flag"].append(flag)
        if ret is not None:
            self.bufs["ret"].append(ret)
        self._idx = None

    def merge_front(self, b: mx.array):
        """Anchor: merge its oldest staged tokens with the reuse layer's b; returns the reuse layer's arrays."""
        staged, n = self.view("x"), b.shape[2]
        if staged is None or staged.shape[2] < n:
            raise VeloxError(
                f"a slerp reuse layer got {n} tokens its anchor has not staged "
                f"({0 if staged is None else staged.shape[2]}); {HINT}"
            )
        a = staged[:, :, :n]
        e, ma, mb, distance = self.store.merge(a, b)
        keep = distance > self.store.threshold  # [n]: too far apart to share a direction
        e = mx.where(keep[:, None], a.astype(mx.float32) / mx.maximum(ma, 1e-12), e)  # the anchor stays exact there
        self.bufs["x"].drop_front(n)
        self.bufs["dir"].append(e.astype(mx.float16))
        self.bufs["mag"].append(ma.astype(mx.float16))
        gone, self.pending = min(self.pending, n), self.pending - min(self.pending, n)
        if gone:  # expired here already; the reuse layer drops its part when its own window moves
            self.bufs["dir"].drop_front(gone)
            self.bufs["mag"].drop_front(gone)
        kept = np.flatnonzero(np.array(keep))
        ret = mx.contiguous(b[:, :, mx.array(kept)].astype(mx.float16)) if len(kept) else None
        mb = mx.where(keep[:, None], 0.0, mb)  # unmerged tokens are scored from `ret` alone
        return mb.astype(mx.float16), keep.astype(mx.uint8).reshape(1, 1, n, 1), ret

    # --- attention ---------------------------------------------------------------------
    def _direction(self) -> mx.array:
        """The shared directions of the merged tokens: the anchor's array (a slice for the reuse layer)."""
        if self.role == "anchor":
            return self.view("dir")
        skip = self.tier.start - self.tier._anchor().start  # a sliding pair: the anchor expires first
        return self.peer().view("dir")[:, :, skip : skip + self.merged]

    def _kept(self) -> Optional[mx.array]:
        if self.role != "reuse" or self.bufs["ret"].used == 0:
            return None
        if self._idx is None:
            self._idx = mx.array(np.flatnonzero(np.array(self.view("flag")).ravel()).astype(np.int32))
        return self._idx

    def scores(self, q: mx.array) -> mx.array:
        """q [B, H, R, D] (scaled, float32) -> q·k for every held token [B, H, R, L]."""
        parts = []
        if self.merged:
            s = (q @ self._direction().astype(mx.float32).swapaxes(-1, -2)) * self.view("mag").astype(
                mx.float32
            ).swapaxes(-1, -2)
            idx = self._kept()
            if idx is not None:
                B, H, R, _ = s.shape
                own = q @ self.view("ret").astype(mx.float32).swapaxes(-1, -2)
                s = mx.put_along_axis(s, mx.broadcast_to(idx, (B, H, R, idx.size)), own, axis=-1)
            parts.append(s)
        if self.staged:
            parts.append(q @ self._x().astype(mx.float32).swapaxes(-1, -2))
        return mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]

    def combine(self, weights: mx.array) -> mx.array:
        """weights [B, H, R, L] -> Σ weight·v [B, H, R, D]."""
        L, out = self.merged, 0
        if L:
            w = weights[..., :L]
            out = (w * self.view("mag").astype(mx.float32).swapaxes(-1, -2)) @ self._direction().astype(mx.float32)
            idx = self._kept()
            if idx is not None:
                out = out + mx.take(w, idx, axis=-1) @ self.view("ret").astype(mx.float32)
        if self.staged:
            out = out + weights[..., L:] @ self._x().astype(mx.float32)
        return out

    def decoded(self, dtype) -> mx.array:
        """The reference path: the vectors rebuilt as mag·dir (the unmerged ones as held)."""
        parts = []
        if self.merged:
            x = self.view("mag").astype(mx.float32) * self._direction().astype(mx.float32)
            idx = self._kept()
            if idx is not None:
                ret = self.view("ret").astype(mx.float32)
                x = mx.put_along_axis(x, mx.broadcast_to(idx[:, None], ret.shape), ret, axis=2)
            parts.append(x)
        if self.staged:
            parts.append(self._x().astype(mx.float32))
        return (mx.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]).astype(dtype)

    # --- bookkeeping -----------------------------------------------------------------------
    def drop(self, n: int, front: bool) -> None:
        if not front:
            if self.role is not None and n:
                raise VeloxError(f"the newest tokens of a slerp pair cannot be dropped from one layer; {HINT}")
            self.bufs["x"].drop_back(n)
            return
        # Sliding-window expiry: both layers of a pair drop the same oldest tokens in the same step.
        merged = min(n, self.merged)
        if self.role == "reuse" and merged:
            gone = int(np.array(self.view("flag")[:, :, :merged]).sum())
            if gone:
                self.bufs["ret"].drop_front(gone)
            self._idx = None
        for name in ("dir", "mag", "flag"):
            if self.bufs[name].used:
                self.bufs[name].drop_front(merged)
        if n > merged and self.role == "anchor":
            self.pending += n - merged  # the reuse layer has yet to merge them: they leave with that merge
        elif n > merged:
            self.bufs["x"].drop_front(n - merged)

    def arrays(self) -> Dict[str, mx.array]:
        return {n: self.view(n) for n in OWN[self.role] if self.view(n) is not None}

    @property
    def nbytes(self) -> int:
        return sum(self.bufs[n].nbytes for n in OWN[self.role])

    def restore(self, arrays: Dict[str, mx.array], count: int) -> Optional[str]:
        for name in OWN[self.role]:
            self.bufs[name].set(arrays.get(name))
        self._idx, self.pending = None, 0
        held = self.merged + self.bufs["x"].used
        if held != count or (
            self.role == "reuse"
            and self.bufs["ret"].used != int(np.array(self.view("flag")).sum() if self.merged else 0)
        ):
            return f"array mag/x/ret of a slerp {self.role or 'lone'} layer does not hold {count} tokens"
        return None
