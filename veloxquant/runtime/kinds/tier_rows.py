"""A tier's batch rows: what every tier kind does on merge / extend / filter / extract / left padding.

In a batch, axis 0 of every held array is the sequence and a tier's start/count count columns of one
axis the rows share (left-padded to a common end); padding columns are zeros the mask hides.
runtime/batch.py routes mlx-lm's batch methods here; compiler/batching.py says which plans batch.
"""

from typing import Dict, Optional, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import dynamic_roll

from .. import row_index


class TierRows:
    """Mixed into Tier: needs `buffers` ({side: {name: Buffer}}), `codecs`, `start`, `count`, `_views`."""

    def held_arrays(self) -> Dict[Tuple[str, str], mx.array]:
        return {
            (side, name): buf.view()
            for side, bufs in self.buffers.items()
            for name, buf in bufs.items()
            if buf.data is not None
        }

    def map_rows(self, fn) -> None:
        """Every held array replaced by fn(array); the caller keeps start/count true."""
        self._views = {}
        for (side, name), arr in self.held_arrays().items():
            self.buffers[side][name].set(fn(arr))

    def set_rows(self, arrays: Dict[Tuple[str, str], mx.array], start: int, count: int) -> None:
        self._views = {}
        self.start, self.count = start, count
        for side, bufs in self.buffers.items():
            for name, buf in bufs.items():
                buf.set(arrays.get((side, name)) if count else None)

    def rows_padded_front(self, n: int, rows: int, like: Dict[Tuple[str, str], mx.array]):
        """The held arrays with n zero columns before them ([rows, ...] zeros where nothing is held;
        `like`: arrays of the same tier kind giving the other axes and dtype)."""
        units = {(side, name): per for side, c in self.codecs.items() for name, per in c.units().items()}
        out = {}
        for key, ref in like.items():
            arr = self.held_arrays().get(key)
            cols = n // units[key]
            if arr is None:
                out[key] = mx.zeros((rows, ref.shape[1], cols, *ref.shape[3:]), ref.dtype)
            elif cols:
                out[key] = mx.pad(arr, [(0, 0), (0, 0), (cols, 0)] + [(0, 0)] * (arr.ndim - 3))
            else:
                out[key] = arr
        return out

    def keep_rows(self, rows: mx.array) -> None:
        self.map_rows(lambda a: a[rows])

    def roll_rows(self, shifts: mx.array) -> None:
        """Each row's held columns rotated right by its shift (right padding becomes left padding)."""
        self.map_rows(lambda a: dynamic_roll(a, shifts[:, None], axis=2))

    def row(self, i: int, first: int) -> Dict[Tuple[str, str], mx.array]:
        """Row i's arrays from column `first` on, as a one-sequence tier holds them."""
        return {k: mx.contiguous(a[i : i + 1, :, first - self.start :]) for k, a in self.held_arrays().items()}

    # --- ragged rows (runtime/batch_chain.py): every row from column 0, each filling its own count ---
    def _unit_items(self):
        """[(side, name, tokens per column)] of the held arrays (asked several times a step: kept per codecs)."""
        kept = self.__dict__.get("_unit_list")
        if kept is None or kept[0] is not self.codecs:
            items = [(side, name, per) for side, c in self.codecs.items() for name, per in c.units().items()]
            kept = self.__dict__["_unit_list"] = (self.codecs, items)
        return kept[1]

    def ragged_width(self) -> int:
        """Columns (tokens) of the held arrays: the longest row's count."""
        for side, name, per in self._unit_items():
            data = self.buffers[side][name].data
            return 0 if data is None else data.shape[2] * per
        return 0

    def rows_front(self, n: int, dtype) -> Tuple[mx.array, mx.array]:
        """Every row's first n columns, decoded."""
        return self._front("k", n, dtype), self._front("v", n, dtype)

    def ragged_encode_append(
        self, keys: mx.array, values: mx.array, held: np.ndarray, take: np.ndarray, source: Optional[np.ndarray] = None
    ) -> None:
        """Row i gets block columns source_i .. source_i + take_i, coded, after its held_i tokens.
        The block is coded whole, in groups from its column 0: callers give group-aligned columns."""
        source = np.zeros_like(take) if source is None else source
        width = int((held + take).max(initial=0))
        enc = {"k": self.codecs["k"].encode(keys), "v": self.codecs["v"].encode(values)}
        self._views = {}
        # Every row taking the same columns (a decode step): one scatter at each row's own column.
        alike = bool((take == take[0]).all() and (source == source[0]).all())
        items = self._unit_items()
        for per in {per for _, _, per in items} - {1}:  # once per unit size, not per array
            if (held % per).any() or (take % per).any() or (source % per).any():
                raise AssertionError(f"a {per}-token unit split across rows' columns")
        for side, name, per in items:
            buf, new = self.buffers[side][name], enc[side][name]
            if alike and buf.data is not None and buf.data.dtype == new.dtype:
                first, n = int(source[0]) // per, int(take[0]) // per
                buf.set(_scatter_join(buf.data, new, held // per, n, first, width // per))
            else:
                buf.set(_ragged_join(buf.data, new, held // per, take // per, source // per, width // per))

    def ragged_drop_front(self, held: np.ndarray, n: np.ndarray) -> None:
        """Row i forgets its first n_i columns; the rest move to column 0."""
        width = int((held - n).max(initial=0))
        self._views = {}
        for side, name, per in self._unit_items():
            buf = self.buffers[side][name]
            if not width:
                buf.set(None)
                continue
            data, h, m, w = buf.data, held // per, n // per, width // per
            cols, kept = row_index.shared(
                ("drop", h.tobytes(), m.tobytes(), w, data.shape[2], data.ndim),
                lambda: _drop_index(h, m, w, data.shape[2], data.ndim),
            )
            moved = mx.take_along_axis(data, cols, axis=2)
            buf.set(mx.where(kept, moved, mx.zeros((), moved.dtype)))

    def ragged_stack(self, tiers) -> None:
        """One row per one-sequence tier (each holding `count` tokens from its own start)."""
        self._views = {}
        width = max(t.count for t in tiers)
        for side, name, per in self._unit_items():
            arrays = [t.buffers[side][name].view() if t.count else None for t in tiers]
            like = next((a for a in arrays if a is not None), None)
            self.buffers[side][name].set(
                None if like is None else mx.concatenate([_pad_cols(a, like, width // per) for a in arrays], axis=0)
            )

    def ragged_concat(self, other, rows: int, more: int) -> None:
        """`other`'s `more` rows after these `rows`."""
        self._views = {}
        width = max(self.ragged_width(), other.ragged_width())
        for side, name, per in self._unit_items():
            a, b = self.buffers[side][name].data, other.buffers[side][name].data
            like = a if a is not None else b
            if like is not None:
                parts = [_pad_cols(a, like, width // per, rows), _pad_cols(b, like, width // per, more)]
                self.buffers[side][name].set(mx.concatenate(parts, axis=0))

    def ragged_keep(self, rows: mx.array, width: int) -> None:
        """The given rows, cut to `width` columns (the longest kept row)."""
        self._views = {}
        for side, name, per in self._unit_items():
            buf = self.buffers[side][name]
            buf.set(buf.data[rows][:, :, : width // per] if buf.data is not None and width else None)

    def ragged_row(self, i: int, n: int) -> Dict[Tuple[str, str], mx.array]:
        """Row i's first n tokens, as a one-sequence tier holds them."""
        return {
            (side, name): mx.contiguous(self.buffers[side][name].data[i : i + 1, :, : n // per])
            for side, name, per in self._unit_items()
        }


def _drop_index(held: np.ndarray, n: np.ndarray, width: int, held_cols: int, ndim: int):
    """ragged_drop_front's arrays: each kept column's column now, and which columns a row keeps."""
    cols = mx.arange(width)[None] + mx.array(n)[:, None]
    kept = mx.arange(width)[None] < mx.array(held - n)[:, None]
    return row_index.widen(mx.minimum(cols, held_cols - 1), ndim), row_index.widen(kept, ndim)


def _pad_cols(arr, like: mx.array, width: int, rows: Optional[int] = None) -> mx.array:
    """arr cut or zero-padded to `width` columns; None: zeros of like's other axes (`rows` rows)."""
    if arr is None:
        return mx.zeros((rows or 1, like.shape[1], width, *like.shape[3:]), like.dtype)
    if arr.shape[2] == width:
        return arr
    if arr.shape[2] > width:
        return arr[:, :, :width]
    return mx.pad(arr, [(0, 0), (0, 0), (0, width - arr.shape[2])] + [(0, 0)] * (arr.ndim - 3))


def _ragged_join(
    old, new: mx.array, held: np.ndarray, take: np.ndarray, source: np.ndarray, width: int
) -> Optional[mx.array]:
    """Per row: old's first held columns, then new's columns source .. source + take, then zeros."""
    if not width:
        return None
    fresh_cols, kept, filled = row_index.shared(
        ("join", held.tobytes(), take.tobytes(), source.tobytes(), width, new.shape[2], new.ndim),
        lambda: _join_index(held, take, source, width, new.shape[2], new.ndim),
    )
    fresh = mx.take_along_axis(new, fresh_cols, axis=2)
    old = _pad_cols(old, new, width) if old is not None else mx.zeros_like(fresh)
    return mx.where(filled, mx.where(kept, old.astype(fresh.dtype), fresh), mx.zeros((), fresh.dtype))


def _join_index(held: np.ndarray, take: np.ndarray, source: np.ndarray, width: int, new_cols: int, ndim: int):
    """_ragged_join's arrays: each column's source column in new, and where old's / anything's columns lie."""
    cols = mx.arange(width)[None]
    h, t = mx.array(held)[:, None], mx.array(take)[:, None]
    fresh_cols = mx.clip(cols - h + mx.array(source)[:, None], 0, new_cols - 1)
    return row_index.widen(fresh_cols, ndim), row_index.widen(cols < h, ndim), row_index.widen(cols < h + t, ndim)


def _scatter_join(old: mx.array, new: mx.array, held: np.ndarray, take: int, source: int, width: int) -> mx.array:
    """_ragged_join where every row takes new's same `take` columns from `source`: old widened to
    `width`, those columns written at each row's held column (what lies past a row's count is
    already zeros, and every written column is the row's own)."""
    old = _pad_cols(old, old, width)
    idx = row_index.shared(("scatter", held.tobytes(), take, old.ndim), lambda: _scatter_index(held, take, old.ndim))
    return mx.put_along_axis(old, idx, new[:, :, source : source + take], axis=2)


def _scatter_index(held: np.ndarray, take: int, ndim: int) -> mx.array:
    """[B, 1, take, 1, ...] int32: row b's columns held_b .. held_b + take, widened on the host (no graph node)."""
    cols = (held[:, None] + np.arange(take)[None]).astype(np.int32)
    return mx.array(cols.reshape(cols.shape[0], 1, take, *([1] * (ndim - 3))))
