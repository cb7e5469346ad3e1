"""A tier's batch rows: what every tier kind does on merge / extend / filter / extract / left padding.

In a batch, axis 0 of every held array is the sequence and a tier's start/count count columns of one
axis the rows share (left-padded to a common end); padding columns are zeros the mask hides.
runtime/batch.py routes mlx-lm's batch methods here; compiler/batching.py says which plans batch.
"""
from typing import Dict, Tuple

import mlx.core as mx
from mlx_lm.models.cache import dynamic_roll


class TierRows:
    """Mixed into Tier: needs `buffers` ({side: {name: Buffer}}), `codecs`, `start`, `count`, `_views`."""

    def held_arrays(self) -> Dict[Tuple[str, str], mx.array]:
        return {(side, name): buf.view() for side, bufs in self.buffers.items()
                for name, buf in bufs.items() if buf.data is not None}

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
        return {k: mx.contiguous(a[i:i + 1, :, first - self.start:]) for k, a in self.held_arrays().items()}
