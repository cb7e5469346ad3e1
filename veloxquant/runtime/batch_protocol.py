"""mlx-lm's batch protocol on TieredCache (BatchKVCache's method names), each routed to its batch layout
(runtime/batch.py). One-sequence caches have `merge` (absent where the plan refuses to batch) and `to_batch`;
batches have `extend` and `filter` too, which a one-sequence cache lacks as mlx-lm's KVCache does: mlx-vlm's
BatchGenerator then merges it into a batch of one before a batch joins it.
"""

from typing import Optional

from . import batch_chain as chain
from . import batch_left, layer_attention
from .batch import CHAIN, HEADS, PLAIN, Layout, Rows, attend, check, merge
from .batch import _blank as blank
from .eviction import batch_heads as heads


class _Merge:
    """`merge`: on the class, merge(caches) (mlx-vlm calls type(cache).merge([cache])); on a cache, the same,
    or no attribute (BatchRefused, an AttributeError) where its plan refuses: mlx-lm tests hasattr."""

    def __get__(self, cache, owner=None):
        if cache is not None:
            check(cache)
        return merge


class BatchProtocol:
    """mlx-lm's batch methods on TieredCache (BatchKVCache's names), each routed to the functions above."""

    _rows: Optional[Rows] = None
    lead = shift = protected = None  # left padding to come, the block's (batch_left.py); image tokens kept

    @property
    def rows(self) -> Optional[Rows]:
        """The batch's rows; None: the cache holds one sequence."""
        return self._rows

    @rows.setter
    def rows(self, rows) -> None:
        self._rows = rows  # a batch answers attention by its rows, a single sequence by its tiers' route
        self.route = attend if rows is not None else layer_attention.route_for(self)

    merge = _Merge()

    def _batch(self, name: str):
        """A batch's own method; a one-sequence cache has none (mlx-vlm merges it first, as its KVCache)."""
        if self.rows is None:
            raise AttributeError(f"{name}: a one-sequence cache joins a batch through merge([cache])")
        return getattr(self._layout(), name)

    def _layout(self) -> Layout:
        return HEADS if heads.is_heads(self) else CHAIN if chain.is_chain(self) else PLAIN

    @property
    def extend(self):
        """extend(other): another batch's rows after this one's."""
        extend = self._batch("extend")  # asked now: a one-sequence cache has none
        return lambda other: extend(self, other)

    @property
    def filter(self):
        """filter(rows): only those rows stay."""
        keep = self._batch("filter")
        return lambda batch_indices: keep(self, list(batch_indices))

    def extract(self, idx: int):
        return self._layout().extract(self, idx, blank)

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        self._layout().prepare(self, left_padding, lengths, right_padding)

    def finalize(self) -> None:
        self._layout().finalize(self)

    def to_batch(self, left_padding):  # mlx-vlm's BatchGenerator: an empty batch, rows left-padded
        return batch_left.to_batch(self, left_padding, merge, blank)
