"""`groupmean(group)`: each channel's mean over a group of tokens, as a store.

Keys share a large common component (a per-channel bias). Scores shift by
<q, mean> for every key of the group alike, but a codec that scales its codes
by the vector's norm spends its precision on that shared part. Stored as a
store and followed by `residual(...)`, the residual stage codes only what
varies (RaBitQ's centroid, NSNQuant's channel mean): `groupmean(64) |
residual(rabitq)`. Costs 16/group bits per element (one float16 row per group).
"""

from typing import Dict

import attrs
import mlx.core as mx

from .registry import in_range, stage


@stage("groupmean", "store")
@attrs.frozen
class GroupMean:
    """Per-channel mean of each group of `group` tokens (float16); residual stages code the rest."""

    group: int = attrs.field(default=64, validator=in_range(2, 4096))

    codes = False

    @property
    def token_multiple(self) -> int:
        return self.group

    def units(self) -> Dict[str, int]:
        return {"mean": self.group}

    def bits_per_element(self, head_dim: int) -> float:
        return 16 / self.group

    def check_head_dim(self, head_dim: int) -> str:
        return ""

    def encode(self, x: mx.array) -> Dict[str, mx.array]:
        B, H, L, D = x.shape
        groups = x.astype(mx.float32).reshape(B, H, L // self.group, self.group, D)
        return {"mean": mx.mean(groups, axis=3).astype(mx.float16)}

    def decode(self, enc: Dict[str, mx.array], dtype) -> mx.array:
        mean = enc["mean"]
        return mx.repeat(mean, self.group, axis=2).astype(dtype)

    def scores(self, q: mx.array, enc: Dict[str, mx.array]) -> mx.array:
        """<q, mean> once per group, repeated over the group's tokens."""
        per_group = q @ enc["mean"].astype(mx.float32).swapaxes(-1, -2)
        return mx.repeat(per_group, self.group, axis=-1)
