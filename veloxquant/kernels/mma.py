"""Binding of attend_mma (section attend_mma of kernels/cuda/affine_attention.cu), the earlier
tensor-core attend kernel: KIVI's layout (per-channel keys, per-token values), at most 4 rows
(rep * Lq) per kv head. Its partials go through cuda.py's reduce (`cuda.runner`); the `mma` row
of the kernel table (table.py) names this module.
"""

import math
from functools import lru_cache

import mlx.core as mx

from . import variants
from .cuda import Launch, runner, sections
from .geometry import SM_COUNT, float_bits
from .source import strip
from .table import Binding

# attend_mma (section attend_mma): per-channel keys, per-token values, rows = rep * Lq <= 4.
# The default where attend_tc is not, from MMA_MIN_TOKENS at D = 128 (docs/kernels.md).
MMA_MIN_TOKENS = 16384
MMA_WARPS = 4  # warps per attend_mma block
MMA_BLOCKS_PER_SM = 4  # blocks along the sequence are sized for this many per SM (3 fit: 133 registers)


def mma_supported(Hq: int, Lq: int, D: int, Hkv: int, L: int, kspec: tuple, vspec: tuple) -> str:
    """Why attend_mma cannot take a call the kernel family supports ('' when it can)."""
    (_, kg, kax), (_, vg, vax) = kspec, vspec
    if kax != "channel" or vax != "token":
        return "mma kernel: keys per-channel and values per-token only"
    if (Hq // Hkv) * Lq > 4:
        return "mma kernel: at most 4 rows (rep x queries) per kv head"
    if kg % 16 or vg < 16 or L % 16:
        return "mma kernel: groups / tier length"
    return ""


@lru_cache(maxsize=None)
def _mma_kernel():
    return variants.kernel(
        name="vq_affine_attend_mma",
        input_names=["q", "kc", "ks", "kz", "vc", "vs", "vz"],
        output_names=["pm", "pl", "pacc"],
        source=strip(sections()["attend_mma"]),
        header=strip(sections()["mma_header"]),
    )


def mma_prefetch(D: int, kb: int, vb: int) -> int:
    """1 when the next step's codes fit in registers next to the current ones
    (no spills at D=256 otherwise; ptxas -v on sm_90)."""
    kw, vw = D * kb // 128, max(1, D * vb // 256)
    return int(2 * (2 * kw + 4 * vw) + D // 8 + D // 4 <= 140)


@lru_cache(maxsize=1024)
def _launch_mma(qshape: tuple, qdtype, cshape: tuple, kspec: tuple, vspec: tuple, scale: float) -> Launch:
    B, Hq, Lq, D = qshape
    _, Hkv, L, _ = cshape
    (kb, kg, _), (vb, vg, _) = kspec, vspec
    rows = (Hq // Hkv) * Lq
    nstep = L // 16
    want = max(1, math.ceil(SM_COUNT * MMA_BLOCKS_PER_SM / (B * Hkv)))
    ns = max(1, min(nstep, want))
    spb = math.ceil(nstep / ns)
    ns = math.ceil(nstep / spb)  # every block gets at least one step
    nrows = B * Hq * Lq
    f32 = mx.float32
    nt = 32 * MMA_WARPS
    template = [
        ("T", qdtype),
        ("D", D),
        ("ROWS", rows),
        ("BK", kb),
        ("GK", kg),
        ("BV", vb),
        ("GV", vg),
        ("QSCALE", float_bits(scale * math.log2(math.e))),
        ("NW", MMA_WARPS),
        ("PF", mma_prefetch(D, kb, vb)),
    ]
    a_kw = dict(
        template=template,
        grid=(ns * nt, B * Hkv, 1),
        threadgroup=(nt, 1, 1),
        output_shapes=[(nrows, ns), (nrows, ns), (nrows, ns, D)],
        output_dtypes=[f32, f32, f32],
    )
    return Launch(_mma_kernel(), a_kw, scale)


def mma_partials(qshape: tuple, qdtype, cshape: tuple, kspec: tuple, vspec: tuple, scale: float):
    """`attend(codes) -> (pm, pl, pacc)`: attend_mma's launch without the merge (codes = the 7
    inputs), as tc_launch.partials is attend_tc's: what a profile times apart from the merge."""
    la = _launch_mma(qshape, qdtype, cshape, kspec, vspec, scale)
    return lambda codes: la.attend(inputs=codes, **la.a_kw)


def _launch_mma_run(qshape: tuple, qdtype, cshape: tuple, kspec: tuple, vspec: tuple, scale: float, chunk: int = 0):
    return runner(_launch_mma(qshape, qdtype, cshape, kspec, vspec, scale), qshape, qdtype)


def _mma_scope(B: int, Hq: int, Lq: int, D: int, Hkv: int, L: int, kspec: tuple, vspec: tuple) -> str:
    return mma_supported(Hq, Lq, D, Hkv, L, kspec, vspec)


def _mma_prefer(B: int, Hq: int, Lq: int, D: int, Hkv: int, L: int, kspec: tuple, vspec: tuple) -> str:
    return "" if D == 128 and L >= MMA_MIN_TOKENS else f"mma: the default at D = 128 from {MMA_MIN_TOKENS} tokens"


BINDINGS = {"mma": Binding(_mma_scope, _launch_mma_run, _mma_prefer)}
