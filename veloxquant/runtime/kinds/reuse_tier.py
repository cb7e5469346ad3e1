"""The tier of a reuse layer in a cross-layer group (XQuant).

It holds only its own arrays (per-group scale and zero, and the optional
residual); the integer codes it is decoded from are read, packed and uncopied,
from the anchor layer's tier through the coordinator, by range of positions.
"""

from typing import Dict, Tuple

import mlx.core as mx

from ...compiler.groups import shares
from ...compiler.plan import CodecPlan, TierPlan
from ...kernels.bitpack import unpack
from .. import code_attention, fused
from ..buffer import Buffer
from ..copying import copy_sharing
from .tier import UNBOUNDED_STEP, Tier


class ReuseCodec:
    """Transforms, then the xquant store in its reuse role: fit to / decode from the anchor's codes."""

    residuals = ()  # the store codes its own drift

    def __init__(self, plan: CodecPlan, link, side: str):
        self.plan, self.store, self.transforms = plan, plan.store, plan.transforms
        # link.codes(side, start, end): the anchor's packed codes. An attribute, not a closure,
        # so a deep copy of the caches re-points it at the copied anchor.
        self.link, self.side = link, side

    def __deepcopy__(self, memo):
        return copy_sharing(self, memo, shared=("plan", "store", "transforms"))

    def codes_of(self, start: int, end: int) -> mx.array:
        return self.link.codes(self.side, start, end)

    def units(self) -> Dict[str, int]:
        return self.store.reuse_units()

    def _codes(self, start: int, end: int, head_dim: int) -> mx.array:
        return unpack(self.codes_of(start, end), self.store.bits, head_dim).astype(mx.float32)

    def encode(self, x: mx.array, start: int) -> Dict[str, mx.array]:
        for t in self.transforms:
            x = t.forward(x)
        return self.store.fit(x, self._codes(start, start + x.shape[2], x.shape[-1]))

    def decode(self, enc: Dict[str, mx.array], dtype, start: int, end: int, head_dim: int) -> mx.array:
        x = self.store.rebuild(enc, self._codes(start, end, head_dim), mx.float32 if self.transforms else dtype)
        for t in reversed(self.transforms):
            x = t.inverse(x)
        return x.astype(dtype)


class ReuseTier(Tier):
    fusable = False  # its own arrays are not a whole affine encoding: see answer()

    def __init__(self, plan: TierPlan, link, head_dim: int):
        super().__init__(plan)
        self._fusable = False  # no dequant kernel: decoding goes through ReuseCodec
        self.link, self.head_dim = link, head_dim  # link: coordinator.Link, the way to the anchor's codes
        for side, codec in (("k", plan.keys), ("v", plan.values)):
            if shares(codec):
                self.codecs[side] = ReuseCodec(codec, link, side)
                # The last tier is unbounded (checked by the compiler): grow in steps, like Tier; exactly
                # where the kernel reads the arrays (whole chunks arrive, compiler.lower.KERNEL_SPILL).
                exact = plan.plain_affine and not codec.store.residual_bits
                step = lambda u: None if exact else max(1, UNBOUNDED_STEP // u)
                self.buffers[side] = {
                    name: Buffer(step(per_unit)) for name, per_unit in self.codecs[side].units().items()
                }
        self.codes_attend = code_attention.applies(self, 1)  # asked again: the codecs changed
        # Without a residual, value = anchor code x own scale + own zero: exactly an affine encoding
        # whose codes are the anchor's, which the fused kernel reads as they are (no copy).
        self.kernel_reads = plan.plain_affine and all(
            isinstance(c, ReuseCodec) and not c.store.residual_bits for c in self.codecs.values()
        )

    def answer(self, queries: mx.array, scale: float, mask=None, hidden: int = 0):
        if mask is None and self.kernel_reads:
            found = fused.kernel_answer(self, queries, scale, self._kernel_encoded, hidden)
            if found is not None:
                return found
        return super().answer(queries, scale, mask, hidden)

    def _kernel_encoded(self, side: str) -> Dict[str, mx.array]:
        own = self.encoded(side)
        return {
            "codes": self.codecs[side].codes_of(self.start, self.end),
            "scales": own["scales"],
            "zeros": own["zeros"],
        }

    def append(self, keys: mx.array, values: mx.array, start: int) -> None:
        if self.count == 0:
            self.start = start
        self._views = {}
        for side, x in (("k", keys), ("v", values)):
            codec = self.codecs[side]
            enc = codec.encode(x, start) if isinstance(codec, ReuseCodec) else codec.encode(x)
            for name, arr in enc.items():
                self.buffers[side][name].append(arr)
        self.count += keys.shape[2]

    def decoded(self, dtype) -> Tuple[mx.array, mx.array]:
        out = []
        for side in ("k", "v"):
            codec, enc = self.codecs[side], self.encoded(side)
            if isinstance(codec, ReuseCodec):
                out.append(codec.decode(enc, dtype, self.start, self.end, self.head_dim))
            else:
                out.append(codec.decode(enc, dtype))
        return tuple(out)

    def drop_back(self, n: int) -> None:
        self.link.check_trim(self.end - n, self.end)  # refuse to drift from the anchor's codes
        super().drop_back(n)
