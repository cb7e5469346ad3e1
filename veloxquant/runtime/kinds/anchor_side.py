"""One side (K or V) of the anchor tier kind (AnchorKV): anchors, (index, coefficient) per token, residuals.

Until the prompt ends the side stages float16 tokens (attended exactly; their
bytes count). At the end the tier (runtime/kinds/anchor_tier.py) gives it each
token's attention mass and a first-order error estimate from the prompt's real
queries; the side picks its anchors, projects every token on one, codes the
residuals the estimate ranks highest (stages/anchor.py), and frees the copy.

Held: anchors [B, H, A, D] float16; idx [B, H, L, 1] uint16 and coeff
[B, H, L, 1] float16 per token; for the tokens with a residual, rpos
[B, H, R, 1] int32 (position, sorted per head) and the affine codes, scales
and zeros. Attention never rebuilds K or V: scores are coeff·(q·anchor) plus
q·residual where one is held; the output sums weights onto the anchors
(scatter-add) and through the residuals. A head's residuals may outlive its
tokens (window expiry, trim drop tokens unevenly over heads): such an entry
stays held (its bytes count) and is masked until every head has lost one.
Tokens arriving after the fit keep both shares: those a projection serves worst become anchors,
the next worst hold a residual (no queries rank them: the projection error does).
"""

from typing import Callable, Dict, Optional

import mlx.core as mx

from ..buffer import Buffer

RESIDUAL = ("rpos", "rcodes", "rscales", "rzeros")
PER_TOKEN = ("idx", "coeff")


def _add_last(target: mx.array, pos: mx.array, vals: mx.array) -> mx.array:
    """target [B, H, R, L] with vals [B, H, R, n] added at positions pos [B, H, 1 or R, n] of the last axis."""
    B, H, R, L = target.shape
    rows = mx.arange(B * H * R, dtype=mx.int32).reshape(B, H, R, 1) * L
    flat = (rows + pos.astype(mx.int32)).reshape(-1)
    return target.reshape(-1).at[flat].add(vals.reshape(-1)).reshape(B, H, R, L)


class AnchorSide:
    shared = False  # never shared across layers

    def __init__(self, plan, n_kv_heads: int, head_dim: int):
        self.store, self.head_dim = plan.store, head_dim
        self.residual = self.store.residual_codec(head_dim)
        self.staged = Buffer(None)
        self.bufs: Dict[str, Buffer] = {}  # empty until the fit
        self.window: Optional[mx.array] = None  # keys: the prompt's last queries [B, H, rep, W, D], until the fit

    @property
    def fitted(self) -> bool:
        return bool(self.bufs)

    @property
    def count(self) -> int:
        return self.bufs["idx"].used if self.fitted else self.staged.used

    def view(self, name: str) -> Optional[mx.array]:
        return self.bufs[name].view() if name in self.bufs else None

    # --- the prompt ----------------------------------------------------------------------
    def observe(self, q: mx.array, Lq: int, keep: int) -> None:
        """Keep the last `keep` query positions (scaled, [B, H, rep*Lq, D]) that attend before the fit."""
        if self.fitted:
            return
        B, H, R, D = q.shape
        q = q.reshape(B, H, R // Lq, Lq, D)
        self.window = q if self.window is None else mx.concatenate([self.window, q], axis=3)
        # a copy: a slice would keep the whole concatenation alive (bytes that nbytes does not count)
        self.window = mx.contiguous(self.window[:, :, :, -keep:]) if self.window.shape[3] > keep else self.window

    def finish_prompt(self, mass: mx.array, impact: Callable[[mx.array], mx.array]) -> None:
        """mass [B, H, L]: attention each staged token got from real queries; impact(residual [B, H, L, D])
        -> [B, H, L]: first-order output error of leaving each token's residual out."""
        x16 = self.staged.view()
        x = x16.astype(mx.float32)
        pos = self.store.choose(x, mass)  # [B, H, A]
        anchors = mx.take_along_axis(x16, pos[..., None], axis=2)
        idx, coeff = self.store.project(x, anchors)
        A = pos.shape[-1]
        # An anchor is its own anchor, coefficient exactly 1: it is attended exactly.
        own = mx.broadcast_to(mx.arange(A, dtype=mx.uint16), pos.shape)
        idx = mx.put_along_axis(idx, pos, own, axis=-1)
        coeff = mx.put_along_axis(coeff, pos, mx.ones(pos.shape, mx.float16), axis=-1)
        r = x - self.store.approx(anchors, idx, coeff)
        B, H, L, _ = x.shape
        self.bufs = {n: Buffer(None) for n in ("anchors",) + PER_TOKEN + RESIDUAL}
        self.bufs["anchors"].set(anchors)
        self.bufs["idx"].set(idx[..., None])
        self.bufs["coeff"].set(coeff[..., None])
        n_res = round(self.store.theta * (L - A))
        if n_res:
            score = mx.put_along_axis(impact(r), pos, mx.full(pos.shape, -mx.inf), axis=-1)
            rpos = mx.sort(mx.argpartition(-score, kth=n_res - 1, axis=-1)[..., :n_res], axis=-1).astype(mx.int32)
            self._set_residuals(rpos, mx.take_along_axis(r, rpos[..., None], axis=2))
        self.staged.set(None)
        self.window = None
        mx.eval([b.view() for b in self.bufs.values() if b.view() is not None])  # a layer's temporaries go now

    def _set_residuals(self, rpos: mx.array, r: mx.array) -> None:
        enc = self.residual.encode(r)
        self.bufs["rpos"].set(rpos[..., None])
        for n in ("codes", "scales", "zeros"):
            self.bufs["r" + n].set(enc[n])

    def append(self, x: mx.array) -> None:
        if not self.fitted:
            self.staged.append(x.astype(mx.float16))
            return
        anchors = self.view("anchors")
        idx, coeff = self.store.project(x, anchors)
        A, n = anchors.shape[2], x.shape[2]
        k = min(n, max(0, self.store.count(self.count + n) - A))
        # Keep the residual share too: theta of the non-anchor tokens, as the fit left it.
        kr = min(n - k, max(0, round(self.store.theta * (self.count + n - A - k)) - self.bufs["rpos"].used))
        if k or kr:
            xf = x.astype(mx.float32)
            lost = mx.sum((xf - self.store.approx(anchors, idx, coeff)) ** 2, axis=-1)
        if k:  # keep the anchor share: the new tokens a projection serves worst become anchors
            sel = mx.sort(mx.argpartition(-lost, kth=k - 1, axis=-1)[..., :k], axis=-1)
            self.bufs["anchors"].append(mx.take_along_axis(x.astype(mx.float16), sel[..., None], axis=2))
            own = mx.broadcast_to(mx.arange(A, A + k, dtype=mx.uint16), sel.shape)
            idx = mx.put_along_axis(idx, sel, own, axis=-1)
            coeff = mx.put_along_axis(coeff, sel, mx.ones(sel.shape, mx.float16), axis=-1)
            lost = mx.put_along_axis(lost, sel, mx.full(sel.shape, -mx.inf), axis=-1)
        if kr:  # the next worst served hold a residual (positions after every held one: rpos stays sorted)
            sel = mx.sort(mx.argpartition(-lost, kth=kr - 1, axis=-1)[..., :kr], axis=-1)
            r = xf - self.store.approx(self.view("anchors"), idx, coeff)
            enc = self.residual.encode(mx.take_along_axis(r, sel[..., None], axis=2))
            self.bufs["rpos"].append((sel + self.count).astype(mx.int32)[..., None])
            for name in ("codes", "scales", "zeros"):
                self.bufs["r" + name].append(enc[name])
        self.bufs["idx"].append(idx[..., None])
        self.bufs["coeff"].append(coeff[..., None])

    # --- attention from what is held -----------------------------------------------------
    def _residuals(self):
        """(positions [B, H, 1, R] clipped into range, live [B, H, 1, R], residuals [B, H, R, D]) or None."""
        rpos = self.view("rpos")
        if rpos is None:
            return None
        p = rpos[..., 0][:, :, None]
        live = (p >= 0) & (p < self.count)
        enc = {n: self.view("r" + n) for n in ("codes", "scales", "zeros")}
        return mx.clip(p, 0, max(self.count - 1, 0)), live, self.residual.decode(enc, mx.float32)

    def scores(self, q: mx.array) -> mx.array:
        """q [B, H, R, D] (scaled, float32) -> q·k for every held token [B, H, R, L]."""
        if not self.fitted:
            return q @ self.staged.view().astype(mx.float32).swapaxes(-1, -2)
        qa = q @ self.view("anchors").astype(mx.float32).swapaxes(-1, -2)  # [B, H, R, A]
        idx = self.view("idx")[..., 0][:, :, None].astype(mx.int32)
        s = mx.take_along_axis(qa, idx, axis=-1) * self.view("coeff")[..., 0][:, :, None].astype(mx.float32)
        res = self._residuals()
        if res is not None:
            p, live, r = res
            s = _add_last(s, p, mx.where(live, q @ r.swapaxes(-1, -2), 0.0))
        return s

    def combine(self, weights: mx.array) -> mx.array:
        """weights [B, H, R, L] -> sum of weight·v [B, H, R, D]: weights gathered onto the anchors."""
        if not self.fitted:
            return weights @ self.staged.view().astype(mx.float32)
        anchors = self.view("anchors").astype(mx.float32)
        B, H, R, L = weights.shape
        wc = weights * self.view("coeff")[..., 0][:, :, None].astype(mx.float32)
        onto = _add_last(
            mx.zeros((B, H, R, anchors.shape[2]), mx.float32),
            mx.broadcast_to(self.view("idx")[..., 0][:, :, None], wc.shape),
            wc,
        )
        out = onto @ anchors
        res = self._residuals()
        if res is not None:
            p, live, r = res
            out = out + mx.where(live, mx.take_along_axis(weights, p, axis=-1), 0.0) @ r
        return out

    def decoded(self, dtype) -> mx.array:
        """The reference path: each token as coeff·anchor (+ its residual) [B, H, L, D]."""
        if not self.fitted:
            return self.staged.view().astype(dtype)
        x = self.store.approx(self.view("anchors"), self.view("idx")[..., 0], self.view("coeff")[..., 0])
        res = self._residuals()
        if res is not None:
            p, live, r = res
            B, H, L, D = x.shape
            rows = (mx.arange(B * H, dtype=mx.int32).reshape(B, H, 1) * L + p[:, :, 0]).reshape(-1)
            x = x.reshape(-1, D).at[rows].add(mx.where(live[:, :, 0, :, None], r, 0.0).reshape(-1, D))
            x = x.reshape(B, H, L, D)
        return x.astype(dtype)

    # --- bookkeeping -----------------------------------------------------------------------
    def units(self) -> Dict[str, int]:
        return {"x": 1}

    def drop(self, n: int, front: bool) -> None:
        """The oldest (front) or newest n tokens leave; anchors stay (they are the dictionary)."""
        if not self.fitted:
            (self.staged.drop_front if front else self.staged.drop_back)(n)
            return
        for name in PER_TOKEN:
            (self.bufs[name].drop_front if front else self.bufs[name].drop_back)(n)
        rpos = self.view("rpos")
        if rpos is None:
            return
        if front:
            rpos = rpos - n
            self.bufs["rpos"].set(rpos)
        gone = (rpos < 0) if front else (rpos >= self.count)
        common = int(mx.min(mx.sum(gone, axis=2)).item())  # lost by every head: sorted, so at one end
        if common:
            for name in RESIDUAL:
                (self.bufs[name].drop_front if front else self.bufs[name].drop_back)(common)
            if not self.bufs["rpos"].used:
                for name in RESIDUAL:
                    self.bufs[name].set(None)

    def arrays(self) -> Dict[str, mx.array]:
        out = {n: b.view() for n, b in self.bufs.items() if b.view() is not None}
        if not self.fitted and self.staged.view() is not None:
            out["x"] = self.staged.view()
        if self.window is not None:  # until the fit (a saved cache is fitted first: never saved)
            out["qwindow"] = self.window
        return out

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays().values())

    def restore(self, arrays: Dict[str, mx.array], count: int) -> Optional[str]:
        self.window = None
        if "anchors" not in arrays:
            self.bufs = {}
            self.staged.set(arrays.get("x") if count else None)
            return None if self.staged.used == count else f"array x does not hold {count} tokens"
        self.bufs = {n: Buffer(None) for n in ("anchors",) + PER_TOKEN + RESIDUAL}
        for name, buf in self.bufs.items():
            buf.set(arrays.get(name))
        self.staged.set(None)
        if any(self.bufs[n].used != count for n in PER_TOKEN):
            return f"array idx or coeff does not hold {count} tokens"
        if len({self.bufs[n].used for n in RESIDUAL}) != 1:
            return "arrays rpos, rcodes, rscales and rzeros do not hold the same residuals"
        return None
