"""ThinK's side of a latent tier: the keys' kept channels, chosen by the prompt's last queries.

A latent side (runtime/kinds/latent_side.py) whose basis is the `think` store's
channel selection (stages/think.py). Until the fit it keeps the squares of the
newest `window` queries of each GQA group ([B, H, group, ≤window, D] float32,
counted in its bytes); the fit reads their mean per head and channel, and they
are freed with the staged float16 keys. Its "basis" is the kept channels'
indices [H, r], read as one-hot columns at each use.
"""

from typing import Dict

import mlx.core as mx

from .latent_side import LatentSide


class ThinkSide(LatentSide):
    def __init__(self, plan, n_kv_heads: int, head_dim: int):
        super().__init__(plan, n_kv_heads, head_dim)
        self.query_window = None

    def observe(self, q: mx.array, n_queries: int = 1) -> None:
        """q [B, H, G·Lq, D]: the scaled queries of this step, rows (query head of the group, position)."""
        if self.widths is not None:
            return
        B, H, R, D = q.shape
        w = self.store.window
        new = mx.square(q.astype(mx.float32).reshape(B, H, R // n_queries, n_queries, D)[:, :, :, -w:])
        old = self.query_window
        if old is not None and new.shape[3] < w:
            new = mx.concatenate([old[:, :, :, -(w - new.shape[3]) :], new], axis=3)
        self.query_window = mx.contiguous(new)
        mx.async_eval(self.query_window)  # not the whole block of queries it was cut from

    def _basis(self) -> mx.array:
        """[H, D, r]: the kept channels' indices [H, r] as one-hot columns (what the latent side projects on)."""
        idx = self.fitted["basis"].astype(mx.int32)
        return (mx.arange(self.head_dim, dtype=mx.int32)[None, :, None] == idx[:, None, :]).astype(mx.float16)

    def _moment(self):
        window, self.query_window = self.query_window, None
        return () if window is None else (mx.mean(window, axis=(0, 2, 3)),)

    def arrays(self) -> Dict[str, mx.array]:
        out = super().arrays()
        if self.query_window is not None:  # until the fit (a saved cache is fitted first)
            out["qwindow"] = self.query_window
        return out
