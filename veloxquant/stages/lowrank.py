"""`lowrank`: a rank-r fit of the store's error per sealed chunk (GEAR's L·R term).

Each chunk of `chunk` tokens of one head leaves an error matrix E [chunk, D];
its truncated SVD keeps E ≈ U_r Σ_r V_r: per token the r coefficients
(U_r Σ_r, float16) and per chunk the r basis rows (V_r, float16). A chunk is
fitted once, when it is sealed (it reaches the tier whole), and never refitted.
Cost r·16/D + r·16/chunk bits per element. `rank=0` holds nothing: the codec
is its store alone, bit for bit.
"""

from typing import Dict

import attrs
import mlx.core as mx

from .registry import in_range, stage


@stage("lowrank", "residual")
@attrs.frozen
class LowRank:
    """Per chunk of `chunk` tokens and head, the rank-r SVD of the store's error (float16 factors)."""

    rank: int = attrs.field(default=2, validator=in_range(0, 64))
    chunk: int = attrs.field(default=64, validator=in_range(1, 1 << 12))

    codes = False
    compilable = False  # the SVD runs on the CPU stream, outside compiled graphs

    @property
    def inner(self):
        return self  # a residual stage that codes the error itself (no inner store)

    @property
    def token_multiple(self) -> int:
        return self.chunk if self.rank else 1

    def units(self) -> Dict[str, int]:
        return {"u": 1, "v": self.chunk} if self.rank else {}

    def bits_per_element(self, head_dim: int) -> float:
        return self.rank * 16 * (1 / head_dim + 1 / self.chunk)

    def check_head_dim(self, head_dim: int) -> str:
        return "" if self.rank <= min(head_dim, self.chunk) else f"rank {self.rank} exceeds min(head_dim, chunk)"

    def encode(self, err: mx.array) -> Dict[str, mx.array]:
        if not self.rank:
            return {}
        B, H, L, D = err.shape
        E = err.astype(mx.float32).reshape(B, H, L // self.chunk, self.chunk, D)
        U, S, Vt = mx.linalg.svd(E, stream=mx.cpu)
        r = self.rank
        u = (U[..., :r] * S[..., None, :r]).reshape(B, H, L, r)
        return {"u": u.astype(mx.float16), "v": Vt[..., :r, :].reshape(B, H, L // self.chunk, r * D).astype(mx.float16)}

    def correct(self, approx: mx.array, enc: Dict[str, mx.array]) -> mx.array:
        if "u" not in enc:
            return approx
        B, H, L, D = approx.shape
        r = self.rank
        u = enc["u"].astype(mx.float32).reshape(B, H, L // self.chunk, self.chunk, r)
        v = enc["v"].astype(mx.float32).reshape(B, H, L // self.chunk, r, D)
        return approx + (u @ v).reshape(B, H, L, D).astype(approx.dtype)
