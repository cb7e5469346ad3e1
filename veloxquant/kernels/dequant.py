"""Binding of the `dequant` section of kernels/cuda/affine_attention.cu: affine codes
to 16-bit (or float32) values in one launch, for attention through SDPA (prefill)
and for tiers no attend kernel reads. Contract: kernels/CONTRACT.md."""

from functools import lru_cache
from typing import Dict, Optional

import mlx.core as mx

from . import variants
from .cuda import _QTYPES, _strip, sections
from .reference import Spec, spec_fields
from .table import Binding


@lru_cache(maxsize=None)
def _dequant_kernel():
    s = sections()
    return variants.kernel(
        name="vq_affine_dequant",
        input_names=["codes", "scales", "zeros", "at"],
        output_names=["out"],
        source=_strip(s["dequant"]),
        header=_strip(s["header"]),
    )


def dequant_unsupported(enc: Dict[str, mx.array], spec: Spec, dtype) -> str:
    """Why the dequant kernel cannot decode this tier ('' when it can)."""
    bits, group, axis = spec_fields(spec)
    codes = enc["codes"]
    if bits not in (2, 4, 8) or dtype not in _QTYPES or codes.ndim != 4 or codes.dtype != mx.uint32:
        return "dequant: bits 2/4/8, 4-D uint32 codes, float output"
    if enc["scales"].dtype != mx.float16 or enc["zeros"].dtype != mx.float16:
        return "dequant: float16 scales and zeros"
    D, L = codes.shape[3] * 32 // bits, codes.shape[2]
    if (D % group if axis == "token" else L % group) or codes.size == 0:
        return "dequant: groups must tile the tier"
    return ""


def dequantize(enc: Dict[str, mx.array], spec: Spec, dtype, length: Optional[int] = None, offset: int = 0) -> mx.array:
    """Affine.decode(enc, dtype) in one launch (no float32 copies of the tier).

    With `length`, the output holds `length` tokens and the tier's lie at
    [offset, offset + L); the rest is left for the caller to fill (mx.slice_update,
    in place), so a layer's tiers meet in one buffer without a concatenated copy."""
    bits, group, axis = spec_fields(spec)
    B, H, L, W = enc["codes"].shape
    D = W * 32 // bits
    length = L if length is None else length
    if not 0 <= offset <= length - L:
        raise ValueError(f"dequantize: {L} tokens do not fit at {offset} of {length}")
    template = [("T", dtype), ("BITS", bits), ("G", group), ("AX", int(axis == "channel")), ("D", D)]
    at = mx.array([length, offset], dtype=mx.int32)
    return _dequant_kernel()(
        inputs=[enc["codes"], enc["scales"], enc["zeros"], at],
        template=template,
        grid=(B * H * L * W, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(B, H, length, D)],
        output_dtypes=[dtype],
    )[0]


BINDINGS = {"dequant": Binding(dequant_unsupported, dequantize)}
