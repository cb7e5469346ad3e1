"""A growable array along the token axis (axis 2), holding exactly what it says.

Unbounded tiers grow in steps (like mlx-lm's KVCache) so decode does not copy
the whole cache each token; bounded tiers concatenate so nothing is over-held.
A stepped buffer forgets its oldest tokens by moving its start (`lo`): a sliding
window's decode step then writes one token in place, as mlx-lm's RotatingKVCache
does, and the live tokens move to a fresh buffer with `step` free slots when
the end is reached or more than `step` forgotten tokens are held: a window
moves once per `step` tokens and holds at most window + `step` slots.
`nbytes` is the allocated buffer: the memory really held.
"""

from typing import Optional

import mlx.core as mx

# Tokens; growth step of tiers that keep everything they get (slack is real memory). mlx-lm's
# KVCache step: with 64, MLX's CUDA SDPA over the sliced buffer ran 1.6x slower at 32k (docs/kernels.md).
UNBOUNDED_STEP = 256


class Buffer:
    def __init__(self, step: Optional[int] = None):
        self.step = step
        self.data: Optional[mx.array] = None
        self.used = 0  # live tokens: data[:, :, lo:lo + used]
        self.lo = 0

    def view(self) -> Optional[mx.array]:
        if self.data is None or (self.lo == 0 and self.used == self.data.shape[2]):
            return self.data
        return self.data[:, :, self.lo : self.lo + self.used]

    def append(self, x: mx.array) -> None:
        n = x.shape[2]
        if self.step is None:
            # Row-contiguous from the first chunk on (a concatenation is): the fused kernels read a head's
            # rows in place and refuse (NaN) any other layout, and an op's output on the GPU need not be.
            self.data = mx.contiguous(x) if self.data is None else mx.concatenate([self.view(), x], axis=2)
            self.used += n
            return
        # A sliding window (it forgets at its front) moves to a fresh buffer when the end is
        # reached or more than `step` forgotten tokens are held (after a prefill chunk), with
        # `step` free slots: a full window would otherwise move every token.
        if self.data is None or self.lo + self.used + n > self.data.shape[2] or self.lo > self.step:
            capacity = self.used + n + self.step if self.lo else -(-(self.used + n) // self.step) * self.step
            free = mx.zeros((*x.shape[:2], capacity - self.used, *x.shape[3:]), x.dtype)
            # As KVCache grows: the held tokens then zeros, one copy (not zeros for all, then a copy into them).
            self.data = mx.concatenate([self.view(), free], axis=2) if self.used else free
            self.lo = 0
        end = self.lo + self.used
        self.data[:, :, end : end + n] = x
        self.used += n

    def drop_front(self, n: int) -> None:
        self.used -= n
        if self.used == 0:
            self.data, self.lo = None, 0
        elif self.step is None:
            # mx.array copies: a slice would keep the whole old buffer alive.
            self.data = mx.array(self.data[:, :, self.lo + n :])
        else:
            self.lo += n

    def drop_back(self, n: int) -> None:
        self.used -= n
        if self.step is None:
            self.data = mx.array(self.data[:, :, : self.used]) if self.used else None
        elif self.used == 0:
            self.data, self.lo = None, 0

    def set(self, x: Optional[mx.array]) -> None:
        self.data, self.used, self.lo = x, (0 if x is None else x.shape[2]), 0

    @property
    def nbytes(self) -> int:
        return 0 if self.data is None else self.data.nbytes
