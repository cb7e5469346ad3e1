"""Binding of kernels/cuda/lut_attention.cu: decode attention from Lloyd-Max codes (issue 18).

A code kernel in the sense of `kernels.dispatch.code_kernel`: for the calls its scope
(`unsupported`) takes it answers `runtime.code_attention.codes_partial_attention`'s contract (a partial
(out f32, lse)) for tiers whose codecs are orthogonal transforms (hadamard),
a `lloydmax` store and at most one `residual(lloydmax(...))` stage, on both
sides. Two launches: `lut_attend` rotates the query rows once (in shared memory),
scores and sums the codes in the rotated domain and writes split-K partials;
`lut_reduce` merges them and rotates each output row back once. Calls it does not take
(masks, more than 4 rows per kv head, other stages, positional keys, tables
that do not fit shared memory) go to that MLX-ops reference (the caller checks the scope),
so the answer never depends on which path ran.
"""

import math
from functools import lru_cache
from typing import Dict, Tuple

import mlx.core as mx
import numpy as np

from ..paths import kernels_dir
from . import variants
from .cuda import sections as affine
from .geometry import SM_COUNT
from .source import split_sections, strip
from .table import Binding

SOURCE = "cuda/lut_attention.cu"
WARPS = 4
BLOCKS_PER_SM = 4  # blocks along the sequence are sized for this many per SM
LUT_SMEM_MAX = 40 * 1024  # the key tables (float4 per channel and level) must fit beside the rest
# Stage chains this kernel is registered for (keys "/" values).
_SIDES = (("lloydmax",), ("lloydmax", "residual"), ("hadamard", "lloydmax"), ("hadamard", "lloydmax", "residual"))
CHAINS = tuple(k + ("/",) + v for k in _SIDES for v in _SIDES)


def _lloydmax(stage) -> bool:
    return getattr(stage, "stage_name", "") == "lloydmax" and 32 % stage.bits == 0


def _chain_unsupported(codec, kernel: str) -> str:
    """Why `kernel` cannot take this codec's stage chain ('' when it can): both Lloyd-Max kernels read the same."""
    if [t.stage_name for t in codec.transforms] not in ([], ["hadamard"]):
        return f"{kernel}: a Hadamard rotation or none"
    if not _lloydmax(codec.store) or len(codec.residuals) > 1 or not all(_lloydmax(r) for r in codec.residuals):
        return f"{kernel}: a lloydmax store and at most one lloydmax residual"
    return ""


def side_unsupported(codec, enc: Dict[str, mx.array], shape: Tuple[int, int, int]) -> str:
    """Why the kernel cannot read this codec's arrays ('' when it can). shape: (B, Hkv, L)."""
    why = _chain_unsupported(codec, "lut kernel")
    if why:
        return why
    for prefix in ("", "r0.")[: 1 + len(codec.residuals)]:
        codes, norms = enc.get(prefix + "codes"), enc.get(prefix + "norms")
        if codes is None or norms is None or codes.dtype != mx.uint32 or norms.dtype != mx.float16:
            return "lut kernel: uint32 codes and float16 norms"
        if codes.shape[:3] != shape or norms.shape != (*shape, 1):
            return "lut kernel: storage shapes"
    return ""


def unsupported(q: mx.array, k_enc, v_enc, k_codec, v_codec, mask=None) -> str:
    """Why this call goes to the MLX-ops reference ('' when the kernel takes it)."""
    if mask is not None:
        return "lut kernel: every held token visible to every query (no mask)"
    if q.ndim != 4 or "codes" not in k_enc or k_enc["codes"].ndim != 4:
        return "lut kernel: 4-D queries and codes"
    B, Hq, Lq, D = q.shape
    _, Hkv, L, _ = k_enc["codes"].shape
    if D % 32 or Hkv == 0 or Hq % Hkv or L == 0:
        return "lut kernel: head_dim a multiple of 32, heads that divide, a non-empty tier"
    if (Hq // Hkv) * Lq > 4:
        return "lut kernel: at most 4 rows (rep x queries) per kv head"
    for codec, enc in ((k_codec, k_enc), (v_codec, v_enc)):
        why = side_unsupported(codec, enc, (B, Hkv, L))
        if why:
            return why
    kb1, kb2, _, _ = _bits(k_codec, v_codec)
    if D * ((1 << kb1) + ((1 << kb2) if kb2 else 0)) * 16 > LUT_SMEM_MAX:
        return "lut kernel: key level tables exceed shared memory"
    return ""


def _bits(k_codec, v_codec) -> Tuple[int, int, int, int]:
    kr, vr = k_codec.residuals, v_codec.residuals
    return (k_codec.store.bits, kr[0].bits if kr else 0, v_codec.store.bits, vr[0].bits if vr else 0)


@lru_cache(maxsize=64)
def _levels(k_stages: tuple, v_stages: tuple, head_dim: int) -> mx.array:
    """[4 * 256] f32: key store, key residual, value store, value residual levels (each stage's
    `levels()`); values / sqrt(D)."""
    table = np.zeros((4, 256), np.float32)
    for row, stage, scale in (
        (0, k_stages[0], 1.0),
        (1, k_stages[1], 1.0),
        (2, v_stages[0], head_dim**-0.5),
        (3, v_stages[1], head_dim**-0.5),
    ):
        if stage is not None:
            lev = np.asarray(stage.levels(), np.float32)
            table[row, : lev.size] = lev * scale
    return mx.array(table.reshape(-1))


@lru_cache(maxsize=None)
def sections() -> Dict[str, str]:
    return split_sections((kernels_dir() / SOURCE).read_text())


@lru_cache(maxsize=None)
def _kernels():
    attend = variants.kernel(
        name="vq_lut_attend",
        input_names=["q", "kc1", "kn1", "kc2", "kn2", "vc1", "vn1", "vc2", "vn2", "lv"],
        output_names=["pm", "pl", "pacc"],
        source=strip(sections()["lut_attend"]),
        header=header(),
    )
    reduce = variants.kernel(
        name="vq_lut_reduce",
        input_names=["pm", "pl", "pacc"],
        output_names=["out", "lse"],
        source=strip(sections()["lut_reduce"]),
        header=header(),
    )
    return attend, reduce


def header() -> str:
    return strip(affine()["header"]) + strip(sections()["lut_header"])


def template(D: int, rows: int, bits: Tuple[int, int, int, int], k_hadamard: bool) -> list:
    kb1, kb2, vb1, vb2 = bits
    return [
        ("D", D),
        ("ROWS", rows),
        ("KB1", kb1),
        ("KB2", kb2),
        ("VB1", vb1),
        ("VB2", vb2),
        ("KH", int(k_hadamard)),
        ("NW", WARPS),
    ]


def splits(B: int, Hkv: int, L: int) -> int:
    """Blocks along the sequence: about BLOCKS_PER_SM per SM in all, each with a run of whole 32-token steps."""
    want = max(1, math.ceil(SM_COUNT * BLOCKS_PER_SM / (B * Hkv)))
    per_block = math.ceil(math.ceil(L / want) / 32) * 32
    return math.ceil(L / per_block)


def partial_attention(
    queries: mx.array, k_enc: Dict[str, mx.array], v_enc: Dict[str, mx.array], k_codec, v_codec, scale: float
):
    """codes_partial_attention's answer, from the kernel (the caller checked `unsupported`)."""
    B, Hq, Lq, D = queries.shape
    _, Hkv, L, _ = k_enc["codes"].shape
    rows = (Hq // Hkv) * Lq
    q = queries.reshape(B, Hkv, rows, D).astype(mx.float32) * (scale * math.log2(math.e) / math.sqrt(D))
    bits = _bits(k_codec, v_codec)
    lv = _levels(
        (k_codec.store, k_codec.residuals[0] if bits[1] else None),
        (v_codec.store, v_codec.residuals[0] if bits[3] else None),
        D,
    )
    kr = "r0." if bits[1] else ""
    vr = "r0." if bits[3] else ""
    ns = splits(B, Hkv, L)
    nrows = B * Hq * Lq
    attend, reduce = _kernels()
    pm, pl, pacc = attend(
        inputs=[
            q,
            k_enc["codes"],
            k_enc["norms"],
            k_enc[kr + "codes"],
            k_enc[kr + "norms"],
            v_enc["codes"],
            v_enc["norms"],
            v_enc[vr + "codes"],
            v_enc[vr + "norms"],
            lv,
        ],
        template=template(D, rows, bits, bool(k_codec.transforms)),
        grid=(ns * 32 * WARPS, B * Hkv, 1),
        threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(nrows, ns), (nrows, ns), (nrows, ns, D)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    return tuple(
        reduce(
            inputs=[pm, pl, pacc],
            template=[("D", D), ("VH", int(bool(v_codec.transforms)))],
            grid=(D * nrows, 1, 1),
            threadgroup=(D, 1, 1),
            output_shapes=[(B, Hq, Lq, D), (B, Hq, Lq)],
            output_dtypes=[mx.float32, mx.float32],
        )
    )


# ---------------------------------------------------------------- encode (section lloyd_encode)
def encode_unsupported(codec) -> str:
    """Why the encode kernel cannot code for this codec ('' when it can)."""
    return _chain_unsupported(codec, "lloyd encode kernel")


@lru_cache(maxsize=None)
def _encoder():
    return variants.kernel(
        name="vq_lloyd_encode",
        input_names=["x", "lv"],
        output_names=["c1", "n1", "c2", "n2"],
        source=strip(sections()["lloyd_encode"]),
        header=header(),
    )


def encode(codec, x: mx.array) -> Dict[str, mx.array]:
    """codec.encode(x)'s arrays for x [B, H, n, D], in one launch (the caller checked encode_unsupported)."""
    B, H, n, D = x.shape
    if D % 32 or D > 1024:  # one block of D threads, whole warps
        return codec.encode_ops(x)
    R = B * H * n
    residual = codec.residuals[0] if codec.residuals else None
    b1, b2 = codec.store.bits, residual.bits if residual else 0
    lv = _levels((codec.store, residual), (None, None), D)
    c1, n1, c2, n2 = _encoder()(
        inputs=[x.reshape(R, D), lv],
        template=[("T", x.dtype), ("D", D), ("B1", b1), ("B2", b2), ("H", int(bool(codec.transforms)))],
        grid=(D * R, 1, 1),
        threadgroup=(D, 1, 1),
        output_shapes=[(R, D * b1 // 32), (R,), (R, max(1, D * b2 // 32)), (R,)],
        output_dtypes=[mx.uint32, mx.float16, mx.uint32, mx.float16],
    )
    enc = {"codes": c1.reshape(B, H, n, -1), "norms": n1.reshape(B, H, n, 1)}
    if residual is not None:
        enc.update({"r0.codes": c2.reshape(B, H, n, -1), "r0.norms": n2.reshape(B, H, n, 1)})
    return enc


BINDINGS = {
    "lut": Binding(unsupported, partial_attention, chains=CHAINS),
    "lloyd_encode": Binding(encode_unsupported, encode),
}
