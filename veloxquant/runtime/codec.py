"""A codec: transform stages then a store stage, for one tensor of one tier."""
import re
from functools import lru_cache
from typing import Dict

import mlx.core as mx

from ..compiler.plan import CodecPlan

_RESIDUAL = re.compile(r"r\d+\.")  # names of residual stages' arrays


# Decode appends one token (or one spilled group) per step, always the same shapes:
# those encodes run as one compiled graph (elementwise chains fused), shared by all
# layers with the same codec. Longer blocks (prefill) vary in length: plain ops.
COMPILED_BLOCK = 64


@lru_cache(maxsize=None)
def _compiled_encode(plan: CodecPlan):
    return mx.compile(Codec(plan).encode_ops)


class Codec:
    """encode: transforms, store, then each residual stage codes what is left;
    residual arrays are named r0.codes, r1.norms, ..."""

    def __init__(self, plan: CodecPlan):
        self.plan = plan
        self.store = plan.store
        self.transforms = plan.transforms
        self.residuals = [r.inner for r in plan.residuals]
        # fp16 / identity with nothing around them: encode is at most a cast, nothing to fuse
        self.trivial = not self.transforms and not self.residuals and self.store.stage_name in ("fp16", "identity")

    def __deepcopy__(self, memo):
        return self  # stateless: the plan's stages only (caches deep-copy their tiers, not their codecs)

    def encode(self, x: mx.array) -> Dict[str, mx.array]:
        if x.shape[2] <= COMPILED_BLOCK and not self.trivial:
            return _compiled_encode(self.plan)(x)
        return self.encode_ops(x)

    def encode_ops(self, x: mx.array) -> Dict[str, mx.array]:
        for t in self.transforms:
            x = t.forward(x)
        enc = self.store.encode(x)
        if self.residuals:
            x = x.astype(mx.float32)
            approx = self.store.decode(enc, mx.float32)
            for i, inner in enumerate(self.residuals):
                part = inner.encode(x - approx)
                enc.update({f"r{i}.{k}": v for k, v in part.items()})
                approx = approx + inner.decode(part, mx.float32)
        return enc

    def decode(self, enc: Dict[str, mx.array], dtype) -> mx.array:
        if not self.transforms and not self.residuals:
            return self.store.decode(enc, dtype)
        x = self.store.decode({k: v for k, v in enc.items() if not _RESIDUAL.match(k)}, mx.float32)
        for i, inner in enumerate(self.residuals):
            prefix = f"r{i}."
            x = x + inner.decode({k[len(prefix):]: v for k, v in enc.items() if k.startswith(prefix)}, mx.float32)
        for t in reversed(self.transforms):
            x = t.inverse(x)
        return x.astype(dtype)

    def units(self) -> Dict[str, int]:
        units = dict(self.store.units())
        for i, inner in enumerate(self.residuals):
            units.update({f"r{i}.{k}": v for k, v in inner.units().items()})
        return units

    @property
    def lossless(self) -> bool:
        return not self.transforms and self.store.stage_name == "identity"
