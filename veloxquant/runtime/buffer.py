"""A growable array along the token axis (axis 2), holding exactly what it says.

Unbounded tiers grow in steps (like mlx-lm's KVCache) so decode does not copy
the whole cache each token; bounded tiers concatenate so nothing is over-held.
`nbytes` is the allocated buffer: the memory really held.
"""
from typing import Optional

import mlx.core as mx


class Buffer:
    def __init__(self, step: Optional[int] = None):
        self.step = step
        self.data: Optional[mx.array] = None
        self.used = 0

    def view(self) -> Optional[mx.array]:
        if self.data is None or self.used == self.data.shape[2]:
            return self.data
        return self.data[:, :, : self.used]

    def append(self, x: mx.array) -> None:
        n = x.shape[2]
        if self.step is None:
            self.data = x if self.data is None else mx.concatenate([self.view(), x], axis=2)
            self.used += n
            return
        if self.data is None or self.used + n > self.data.shape[2]:
            capacity = -(-(self.used + n) // self.step) * self.step
            grown = mx.zeros((*x.shape[:2], capacity, *x.shape[3:]), x.dtype)
            if self.used:
                grown[:, :, : self.used] = self.view()
            self.data = grown
        self.data[:, :, self.used : self.used + n] = x
        self.used += n

    def drop_front(self, n: int) -> None:
        rest = self.view()[:, :, n:]
        # mx.array copies: a slice would keep the whole old buffer alive.
        self.data = mx.array(rest) if rest.shape[2] else None
        self.used -= n

    def drop_back(self, n: int) -> None:
        self.used -= n
        if self.step is None:
            self.data = mx.array(self.data[:, :, : self.used]) if self.used else None
        elif self.used == 0:
            self.data = None

    def set(self, x: Optional[mx.array]) -> None:
        self.data, self.used = x, (0 if x is None else x.shape[2])

    @property
    def nbytes(self) -> int:
        return 0 if self.data is None else self.data.nbytes
