"""The `think` store (ThinK): per kv head, only the key channels the prompt's last queries use.

At the end of the prompt each kv head ranks its key channels by ThinK's
query-weighted magnitude, mean(q_c²) · mean(k_c²): the queries are the last
`window` prompt queries of the head's GQA group, the keys every staged token.
The `ratio` share of channels with the lowest products is pruned (kvpress's
key_channel_compression_ratio: int(ratio · head_dim) channels); the kept ones
are held, float16 with bits=16, else affine codes per channel and group of
`group` tokens (KIVI's key layout, on the kept channels only). Attention uses
the kept channels of the query: q·k over them alone.

It is a latent store whose basis is a selection, held as the kept channels'
indices (runtime/kinds/latent_tier.py attends in latent space; its ThinK side,
runtime/kinds/think_side.py, keeps the query window and reads the indices as
one-hot columns). The selection is frozen at
the end of the prompt; later tokens keep the same channels. Without queries
(the tier saw none) the keys' magnitude alone ranks. ratio=0 keeps every
channel: float16 latents are the keys themselves.
"""

from functools import lru_cache
from typing import Dict, Optional

import attrs
import mlx.core as mx
import numpy as np

from .latent import FLOAT, Latent, latent_width
from .registry import in_range, stage


@lru_cache(maxsize=None)
def _codec(bits: int, group: int) -> Latent:
    """The latent store whose codes the kept channels use (every channel at `bits`)."""
    return Latent(rank=1, hi_bits=bits, lo_bits=bits, group=group, quant="minmax")


def pruned(head_dim: int, ratio: float) -> int:
    return int(head_dim * ratio)


@stage("think", "store")
@attrs.frozen
class Think:
    """ThinK: prune each kv head's key channels with the lowest query-weighted magnitude at the prompt's end."""

    ratio: float = attrs.field(default=0.5, validator=in_range(0.0, 0.99))
    window: int = attrs.field(default=32, validator=in_range(1, 1 << 16))
    bits: int = attrs.field(default=16, validator=latent_width)
    group: int = attrs.field(default=32, validator=in_range(32, 1 << 16))

    tier_kind = "latent"  # held by runtime/kinds/latent_tier.py ...
    side = "think"  # ... as runtime/kinds/think_side.py
    codes = True
    layers = 1
    heads = 1
    center = False
    quant = "minmax"
    calibrated = False

    def __attrs_post_init__(self):
        if self.group % 32:
            raise ValueError(f"group={self.group} must be a multiple of 32 (codes are packed along tokens)")

    @property
    def token_multiple(self) -> int:
        return self.group

    def check_head_dim(self, head_dim: int) -> str:
        return ""

    def check_heads(self, n_kv_heads: int, head_dim: int) -> str:
        return (
            f"ratio={self.ratio} prunes every channel of a {head_dim}-channel head"
            if pruned(head_dim, self.ratio) >= head_dim
            else ""
        )

    def heads_per_group(self, n_kv_heads: int) -> int:
        return 1

    def bits_per_element(self, head_dim: int) -> float:
        """Bits per key element of the pruned layout (the selection's indices aside)."""
        kept = head_dim - pruned(head_dim, self.ratio)
        return kept * (self.bits if self.bits == FLOAT else self.bits + 32 / self.group) / head_dim

    def fit(self, x: mx.array, query_energy: Optional[mx.array] = None) -> Dict[str, mx.array]:
        """Staged keys x [B, H, L, D], the window's mean q² per head and channel [H, D] (or None) ->
        {"basis" [H, r] the kept channels (uint8/uint16, ascending), "mean" [H, D] zeros, "widths" [r] uint8}."""
        B, H, L, D = x.shape
        energy = np.array(mx.mean(mx.square(x.astype(mx.float32)), axis=(0, 2)), dtype=np.float64)
        if query_energy is not None:
            energy = energy * np.array(query_energy, dtype=np.float64)
        r = D - pruned(D, self.ratio)
        keep = np.sort(np.argsort(-energy, axis=1, kind="stable")[:, :r], axis=1)  # [H, r], channel order
        basis = mx.array(keep.astype(np.uint8 if D <= 256 else np.uint16))
        return {
            "basis": basis,
            "mean": mx.zeros((H, D), mx.float16),
            "widths": mx.array(np.full(r, self.bits, np.uint8)),
        }

    # --- the kept channels <-> codes (the latent store's) --------------------------------
    def stats(self, z: mx.array) -> Dict[str, mx.array]:
        return {}

    def classes(self, widths):
        return _codec(self.bits, self.group).classes(widths)

    def encode(self, z, widths, stats):
        return _codec(self.bits, self.group).encode(z, widths, stats)

    def decode(self, enc, widths, stats):
        return _codec(self.bits, self.group).decode(enc, widths, stats)

    def units(self, widths) -> Dict[str, int]:
        return _codec(self.bits, self.group).units(widths)

    def coded_names(self, names):
        return _codec(self.bits, self.group).coded_names(names)
