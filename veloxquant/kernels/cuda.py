"""Binding of kernels/cuda/affine_attention.cu through `mx.fast.cuda_kernel`.

Two launches per call: `attend` (one block per split of CH tokens x kv head x
row block, writing per-split max/sum/accumulator) and `reduce` (exact merge of
the splits). See kernels/CONTRACT.md for the contract and the storage format.
"""
import math
import os
import struct
from functools import lru_cache
from typing import Dict, Optional, Tuple

import mlx.core as mx

from ..paths import kernels_dir
from .reference import Spec, spec_fields

SOURCE = "cuda/affine_attention.cu"
C = 16  # channels per lane, fixed by the kernel
MAX_ROWS = 4  # rows (rep heads x queries) held in registers per block
SM_COUNT = 132  # H200; only steers the split size
SMEM_CAP = 100_000  # bytes of dynamic shared memory one block may take

_QTYPES = (mx.float16, mx.bfloat16, mx.float32)


@lru_cache(maxsize=None)
def sections() -> Dict[str, str]:
    """The .cu file split on its '//@@ name' lines: header, attend, reduce."""
    text = (kernels_dir() / SOURCE).read_text()
    parts: Dict[str, str] = {}
    name = None
    for line in text.splitlines(keepends=True):
        if line.startswith("//@@ "):
            name = line[5:].strip()
            parts[name] = ""
        elif name is not None:
            parts[name] += line
    return parts


def unsupported(q: mx.array, k_enc, v_enc, k_spec: Spec, v_spec: Spec) -> str:
    """Why the kernel cannot take this call ('' when it can)."""
    kb, kg, kax = spec_fields(k_spec)
    vb, vg, vax = spec_fields(v_spec)
    if q.ndim != 4 or k_enc["codes"].ndim != 4:
        return "q and codes must be 4-D"
    B, Hq, Lq, D = q.shape
    _, Hkv, L, _ = k_enc["codes"].shape
    if q.dtype not in _QTYPES:
        return f"query dtype {q.dtype}"
    if D not in (64, 128, 256):
        return f"head_dim {D} (kernel: 64, 128, 256)"
    if kb not in (2, 4, 8) or vb not in (2, 4, 8):
        return f"bits {kb}/{vb} (kernel: 2, 4, 8)"
    if Hkv == 0 or Hq % Hkv or L == 0:
        return "heads do not divide or the tier is empty"
    if Lq > 8:
        return f"{Lq} queries (kernel: decode, up to 8)"
    for bits, group, axis, enc in ((kb, kg, kax, k_enc), (vb, vg, vax, v_enc)):
        if group not in (16, 32, 64, 128, 256):
            return f"group {group} (kernel: powers of two 16..256)"
        if axis == "token" and (group > D or D % group):
            return f"token group {group} does not divide head_dim {D}"
        if axis == "channel" and (L % group or group > 256):
            return f"channel group {group} does not divide the tier length {L}"
        if enc["codes"].dtype != mx.uint32 or enc["scales"].dtype != mx.float16 \
                or enc["zeros"].dtype != mx.float16:
            return "storage dtypes (kernel: uint32 codes, float16 scales/zeros)"
        if enc["codes"].shape[:3] != (B, Hkv, L) or enc["codes"].shape[3] != D * bits // 32:
            return "codes shape"
    return ""


def smem_bytes(ch: int, D: int, R: int, kb: int, kg: int, kax: str, vb: int, vg: int, vax: str) -> int:
    """Mirror of the attend kernel's shared-memory layout (static_assert'ed there)."""
    def meta(g, ax):
        halves = (ch // g) * D if ax == "channel" else ch * (D // g)
        return 2 * ((halves * 2 + 15) // 16 * 16)
    stage = ch * D * (kb + vb) // 8 + meta(kg, kax) + meta(vg, vax)
    red = 16 * R * D * 4
    return max(stage, red) + R * D * 4 + ch * R * 4 + 2 * R * 4


def choose_chunk(L: int, blocks_per_split: int, D: int, R: int, kspec, vspec) -> int:
    """Tokens per block: the largest power of two that still gives about four
    resident blocks per SM (long tiers), else the smallest legal one (short tiers)."""
    forced = os.environ.get("VELOXQUANT_CUDA_CHUNK")
    (kb, kg, kax), (vb, vg, vax) = kspec, vspec
    low = max(64, kg if kax == "channel" else 16, vg if vax == "channel" else 16)
    legal = [c for c in (512, 256, 128, 64) if c >= low
             and smem_bytes(c, D, R, kb, kg, kax, vb, vg, vax) <= SMEM_CAP]
    if not legal:
        legal = [low]
    if forced and int(forced) in legal:
        return int(forced)
    for ch in legal[:-1]:
        if blocks_per_split * math.ceil(L / ch) >= 4 * SM_COUNT:
            return ch
    return legal[-1]


@lru_cache(maxsize=None)
def _attend_kernel(smem: int):
    s = sections()
    return mx.fast.cuda_kernel(
        name=f"vq_affine_attend_{smem}",
        input_names=["q", "kc", "ks", "kz", "vc", "vs", "vz"],
        output_names=["pm", "pl", "pacc"],
        source=s["attend"], header=s["header"], shared_memory=smem)


@lru_cache(maxsize=None)
def _reduce_kernel():
    s = sections()
    return mx.fast.cuda_kernel(
        name="vq_affine_reduce", input_names=["pm", "pl", "pacc"], output_names=["out", "lse"],
        source=s["reduce"], header=s["header"])


def _float_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def affine_partial_attention(q: mx.array, k_enc: Dict[str, mx.array], v_enc: Dict[str, mx.array],
                             k_spec: Spec, v_spec: Spec, scale: float,
                             chunk: Optional[int] = None) -> Tuple[mx.array, mx.array]:
    """The fused kernel. Same contract as reference.affine_partial_attention; the
    caller (dispatch) has checked `unsupported(...) == ''`."""
    kb, kg, kax = spec_fields(k_spec)
    vb, vg, vax = spec_fields(v_spec)
    B, Hq, Lq, D = q.shape
    _, Hkv, L, _ = k_enc["codes"].shape
    rows = (Hq // Hkv) * Lq
    R = 1 if rows == 1 else 2 if rows == 2 else MAX_ROWS
    nrb = math.ceil(rows / R)
    bh = B * Hkv
    ch = chunk or choose_chunk(L, bh * nrb, D, R, (kb, kg, kax), (vb, vg, vax))
    ns = math.ceil(L / ch)
    smem = smem_bytes(ch, D, R, kb, kg, kax, vb, vg, vax)
    smem = (smem + 127) // 128 * 128  # fewer distinct kernels

    def flat(a):  # [B, Hkv, X, Y] -> [B*Hkv, X, Y] (free for contiguous arrays)
        return a.reshape(bh, a.shape[2], a.shape[3])

    nrows = bh * rows
    pm, pl, pacc = _attend_kernel(smem)(
        inputs=[q.reshape(bh, rows, D), flat(k_enc["codes"]), flat(k_enc["scales"]), flat(k_enc["zeros"]),
                flat(v_enc["codes"]), flat(v_enc["scales"]), flat(v_enc["zeros"])],
        template=[("T", q.dtype), ("D", D), ("R", R), ("ROWS", rows),
                  ("BK", kb), ("GK", kg), ("KAX", int(kax == "channel")),
                  ("BV", vb), ("GV", vg), ("VAX", int(vax == "channel")),
                  ("CH", ch), ("QSCALE", _float_bits(scale * math.log2(math.e))), ("SMEM", smem)],
        grid=(ns * D, bh, nrb), threadgroup=(D, 1, 1),
        output_shapes=[(nrows, ns), (nrows, ns), (nrows, ns, D)],
        output_dtypes=[mx.float32, mx.float32, mx.float32])
    out, lse = _reduce_kernel()(
        inputs=[pm, pl, pacc], template=[("D", D)],
        grid=(128 * (D // 32), nrows, 1), threadgroup=(128, 1, 1),
        output_shapes=[(nrows, D), (nrows,)], output_dtypes=[mx.float32, mx.float32])
    return out.reshape(B, Hq, Lq, D), lse.reshape(B, Hq, Lq)
