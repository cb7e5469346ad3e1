"""ChunkKV (Liu et al., 2025): tokens compete in chunks of `chunk` contiguous
positions; a chunk's score is the mean of its tokens' accumulated attention
mass (H2O's), so chunks stay or leave together. chunk=1 is H2O, bit for bit.
A head holds only part of a chunk where the budget or an earlier eviction
cut it (the priority ties then break by position inside the argpartition)."""

import mlx.core as mx

from .attention import Mass
from .base import scorer


@scorer("chunk")
class Chunk(Mass):
    def priority(self, tier, offset, weigh):
        scores, pos = tier.scores, tier.positions
        B, H, L = scores.shape
        n = offset // self.route.chunk + 1
        slot = ((mx.arange(B * H, dtype=mx.int32).reshape(B, H, 1) * n) + pos // self.route.chunk).reshape(-1)
        sums = mx.zeros((B * H * n,), mx.float32).at[slot].add(scores.reshape(-1))
        counts = mx.zeros((B * H * n,), mx.float32).at[slot].add(mx.ones((B * H * L,), mx.float32))
        return (sums[slot] / counts[slot]).reshape(B, H, L)
