"""A codec: transform stages then a store stage, for one tensor of one tier."""
from typing import Dict

import mlx.core as mx

from ..compiler.plan import CodecPlan


class Codec:
    def __init__(self, plan: CodecPlan):
        self.plan = plan
        self.store = plan.store
        self.transforms = plan.transforms

    def encode(self, x: mx.array) -> Dict[str, mx.array]:
        for t in self.transforms:
            x = t.forward(x)
        return self.store.encode(x)

    def decode(self, enc: Dict[str, mx.array], dtype) -> mx.array:
        if not self.transforms:
            return self.store.decode(enc, dtype)
        x = self.store.decode(enc, mx.float32)
        for t in reversed(self.transforms):
            x = t.inverse(x)
        return x.astype(dtype)

    def units(self) -> Dict[str, int]:
        return self.store.units()

    @property
    def lossless(self) -> bool:
        return not self.transforms and self.store.stage_name == "identity"
