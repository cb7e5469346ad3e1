"""A per-head eviction tier that also selects at decode: RocketKV's stage 2.

After the prompt's one eviction (SnapKV), every held token stays; each decode
step the real query chooses which of them get exact attention (`pick`), as
Hybrid Sparse Attention does: the query's `channels` largest channels (|q|
summed over the GQA group) read per-page max/min key summaries (Quest-style
upper bounds on q.k over a page of `page` held slots) to keep the best pages,
then the same channels of those pages' keys (SparQ-style partial dot
products) keep the `tokens` best tokens. The newest page always competes
first. Only full pages are summarised, when they fill (the newest, partial
page needs no bound), and the summaries are real arrays: in `arrays()` and
`nbytes`.
"""

from typing import Dict, List, Optional, Tuple

import mlx.core as mx

from ..eviction.head_tier import HeadTier
from .protocol import head_kind

SUMMARIES = ("pages.kmax", "pages.kmin")


@head_kind("sparse_decode")
class SparseDecodeTier(HeadTier):
    def __init__(self, plan, window=None):
        super().__init__(plan, window)
        self.summary: Dict[str, Optional[mx.array]] = {name: None for name in SUMMARIES}
        self.summarised = 0  # slots covered by the summaries' full pages

    # --- summaries ------------------------------------------------------
    def _summarise(self) -> None:
        """Summarise the pages filled since the last call. Only full pages are summarised: the newest,
        partial page is always attended to, so it needs no bound (decode refreshes once per page)."""
        page = self.route.page
        p0, p1 = self.summarised // page, self.count // page
        if p1 == p0:
            return
        # Every encoded array counts tokens on axis 2: decode only the pages that changed.
        enc = {n: a[:, :, p0 * page : p1 * page] for n, a in self.encoded("k").items()}
        keys = self.codecs["k"].decode(enc, mx.float32)
        B, H, _, D = keys.shape
        pages = keys.reshape(B, H, p1 - p0, page, D)
        for name, new in (("pages.kmax", mx.max(pages, axis=3)), ("pages.kmin", mx.min(pages, axis=3))):
            old = self.summary[name]
            self.summary[name] = new if old is None or p0 == 0 else mx.concatenate([old[:, :, :p0], new], axis=2)
        self.summarised = p1 * page

    def keep(self, priority: mx.array, offset: int, budget=None) -> None:
        super().keep(priority, offset, budget)
        self.summarised, self.summary = 0, {name: None for name in SUMMARIES}  # slots were re-gathered
        if self.route.tokens:
            self._summarise()

    def append(self, keys: mx.array, values: mx.array, start: int) -> None:
        super().append(keys, values, start)
        if self.decided and self.route.tokens:
            self._summarise()

    def drop_back(self, n: int) -> None:
        super().drop_back(n)
        self.summarised, self.summary = 0, {name: None for name in SUMMARIES}
        if self.decided and self.route.tokens:
            self._summarise()

    # --- stage 2 ----------------------------------------------------------
    def pick(self, queries: mx.array, dtype) -> Optional[Tuple[mx.array, mx.array, mx.array]]:
        """(keys, values, positions) of the `tokens` held tokens each kv head attends to exactly, or
        None (attend to all): before the prompt's decision, or while few tokens are held."""
        route = self.route
        n_pages = -(-2 * route.tokens // route.page) + 1  # twice the tokens, plus the newest page
        if not (self.decided and route.tokens) or self.count <= n_pages * route.page:
            return None
        k, v = self.decoded(dtype)
        B, Hq, _, D = queries.shape
        Hkv = k.shape[1]
        q = queries.astype(mx.float32).reshape(B, Hkv, Hq // Hkv, D)
        r = min(route.channels, D)
        ch = mx.argpartition(-mx.sum(mx.abs(q), axis=2), kth=r - 1, axis=-1)[..., :r]  # [B, Hkv, r]
        qr = mx.take_along_axis(q, ch[:, :, None], axis=-1)  # [B, Hkv, rep, r]

        def channels(x):  # [B, Hkv, n, D] -> [B, Hkv, n, r]
            return mx.take_along_axis(x, ch[:, :, None], axis=-1)

        upper = mx.maximum(
            qr[:, :, :, None] * channels(self.summary["pages.kmax"])[:, :, None],
            qr[:, :, :, None] * channels(self.summary["pages.kmin"])[:, :, None],
        )
        page_score = mx.max(mx.sum(upper, axis=-1), axis=2)  # [B, Hkv, full pages]: best bound over the group
        if self.count % route.page:  # the newest, partial page has no summary: it always competes
            page_score = mx.concatenate([page_score, mx.full((B, Hkv, 1), mx.inf)], axis=2)
        else:
            page_score = mx.where(mx.arange(page_score.shape[2]) == page_score.shape[2] - 1, mx.inf, page_score)
        best = mx.argpartition(-page_score, kth=n_pages - 1, axis=-1)[..., :n_pages]
        slots = (best[..., None] * route.page + mx.arange(route.page)).reshape(B, Hkv, -1)
        valid = slots < self.count  # the newest page may be partly empty
        slots = mx.minimum(slots, self.count - 1)
        kr = channels(mx.take_along_axis(k, slots[..., None], axis=2).astype(mx.float32))
        approx = mx.max(qr @ kr.swapaxes(-1, -2), axis=2)  # [B, Hkv, S]
        approx = mx.where(valid, approx, -mx.inf)
        chosen = mx.take_along_axis(
            slots, mx.argpartition(-approx, kth=route.tokens - 1, axis=-1)[..., : route.tokens], axis=-1
        )
        return tuple(
            mx.take_along_axis(x, chosen.reshape(*chosen.shape, *([1] * (x.ndim - 3))), axis=2)
            for x in (k, v, self.positions)
        )

    # --- bytes and persistence ---------------------------------------------
    @property
    def nbytes(self) -> int:
        return super().nbytes + sum(a.nbytes for a in self.summary.values() if a is not None)

    def arrays(self) -> Dict[str, mx.array]:
        out = super().arrays()
        out.update({name: a for name, a in self.summary.items() if a is not None})
        return out

    def expected_names(self) -> List[str]:
        return super().expected_names()  # summaries are rebuilt from the keys when absent

    def restore(self, start: int, count: int, arrays: Dict[str, mx.array]) -> Optional[str]:
        error = super().restore(start, count, arrays)
        if error is None and self.route.tokens:
            self.summarised, self.summary = 0, {name: None for name in SUMMARIES}
            self._summarise()
        return error
