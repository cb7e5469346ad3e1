"""Geometry and binding of `attend_tc` (kernels/cuda/tc_attention.cu), the lean
tensor-core decode kernel (issue 18).

attend_mma's scope (per-channel keys, per-token values) with up to 16 rows
(rep * Lq) per kv head: values and probabilities as single fp16 operands, q*s as
an exact fp16 hi + lo, scores laid out as the value mma's operand, and each warp
streaming its own run of 32-token stages through NST shared-memory buffers.
One launch per call where the merge is small enough (`folds`): the dense tail's
blocks and the reduce run in the attend launch (kernels/cuda/tc_fold.cu); else
partials and the reduce / reduce_tail launch as attend_mma's. Arithmetic here;
the launches in tc_launch.py.
"""

import math
import os
from functools import lru_cache
from typing import NamedTuple

from ..paths import kernels_dir
from .cuda import sections as affine
from .geometry import SM_COUNT, float_bits
from .source import split_sections

NW = 4  # warps per block
ST = 32  # tokens per stage
SMEM_PER_SM = 228 * 1024  # sm_90 (a block also reserves 1 KiB)
SMEM_BLOCK_MAX = 227 * 1024
MAX_ROWS = 16
# Resident blocks per SM the grid is sized for (the launch bounds' minimum): 3 at
# D <= 128 with <= 8 rows, else 2 (16 rows at D = 128 spill 116 bytes under 3's
# register cap; ptxas -v). VELOXQUANT_TC_BLOCKS_PER_SM overrides (benchmarks).
_BLOCKS_PER_SM = int(os.environ.get("VELOXQUANT_TC_BLOCKS_PER_SM", "0") or 0)
_STAGES = int(os.environ.get("VELOXQUANT_TC_STAGES", "0") or 0)
TAIL_TOKENS = 32  # dense tail tokens per tail block (the kernel's warp width)
TAIL_BLOCKS_MAX = 16  # 512 tail tokens: tail.TAIL_MAX
# The head's last block merges rows x blocks partials of D floats: one SM reading them
# all through L2. Above this many bytes per head, the merge is its own launch (the reduce,
# one block per row and 32 channels). VELOXQUANT_TC_FOLD=0 / 1 forces (benchmarks).
FOLD_MAX_BYTES = 256 * 1024
COUNTERS = 4096  # kv heads (B * Hkv) one folded launch can count
_FOLD = os.environ.get("VELOXQUANT_TC_FOLD", "")


def blocks_per_sm(D: int, rows: int) -> int:
    return _BLOCKS_PER_SM or (2 if D > 128 or rows > 8 else 3)


def supported(Hq: int, Lq: int, D: int, Hkv: int, L: int, kspec: tuple, vspec: tuple) -> str:
    """Why attend_tc cannot take a call the kernel family supports ('' when it can)."""
    (_, kg, kax), (_, vg, vax) = kspec, vspec
    if kax != "channel" or vax != "token":
        return "tc kernel: keys per-channel and values per-token only"
    rows = (Hq // Hkv) * Lq
    if rows > MAX_ROWS or (D > 128 and rows > 8):
        return f"tc kernel: {rows} rows (rep x queries) per kv head"
    if kg % 16 or vg < 8 or L % 16:
        return "tc kernel: groups / tier length"
    return ""


def _wavefronts(addrs, width: int) -> int:
    """Shared-memory wavefronts of one warp-wide load of `width` bytes per lane at
    these byte addresses: requests of 16 / 8 / <= 4 bytes are served 8 / 16 / 32 lanes
    at a time, and each phase costs as many wavefronts as its busiest bank has distinct words."""
    per_phase = 8 if width >= 16 else 16 if width == 8 else 32
    total = 0
    for p in range(0, 32, per_phase):
        banks: dict = {}
        for a in addrs[p : p + per_phase]:
            for w in range(a // 4, (a + width - 1) // 4 + 1):
                banks.setdefault(w % 32, set()).add(w)
        total += max(len(v) for v in banks.values())
    return total


@lru_cache(maxsize=None)
def row_strides(D: int, kb: int, vb: int):
    """(KRS, VRS): shared-memory row strides of key and value codes, bytes. The
    kernel's lanes read key rows g, g+8 at column tig and value rows 2tig(+1, +8)
    at column g (the mma fragments); the padding (0..48 bytes) with the fewest
    wavefronts for those reads, the smallest on ties."""
    lanes = range(32)
    knb, vnb = D * kb // 32, (D // 8) * vb // 8
    krb, vrb = D * kb // 8, D * vb // 8

    def cost_k(rs):  # a 32-byte lane block is two 16-byte loads
        return sum(
            _wavefronts([(l // 4 + 8 * e) * rs + (l % 4) * knb + 16 * h for l in lanes], min(knb, 16))
            for e in range(2)
            for h in range(max(1, knb // 16))
        )

    def cost_v(rs):
        return sum(
            _wavefronts([(2 * (l % 4) + (e & 1) + 8 * (e >> 1)) * rs + (l // 4) * vnb for l in lanes], min(vnb, 16))
            for e in range(4)
        )

    return (
        min((krb + p for p in (0, 16, 32, 48)), key=lambda rs: (cost_k(rs), rs)),
        min((vrb + p for p in (0, 16, 32, 48)), key=lambda rs: (cost_v(rs), rs)),
    )


def stage_bytes(D: int, kb: int, gk: int, vb: int, gv: int) -> int:
    """One warp's stage (mirrors the kernel's O_* offsets): ST tokens' key and value
    codes (rows KRS / VRS apart), the key scale rows they use, their value scales."""
    krs, vrs = row_strides(D, kb, vb)
    kg_rows = ST // gk if ST >= gk else 1
    return (ST * (krs + vrs) + 2 * kg_rows * D * 2 + 2 * ST * (D // gv) * 2 + 15) // 16 * 16


def merge_bytes(D: int, rows: int) -> int:
    """The warps' partials at the end, written over the drained stages."""
    return NW * (16 if rows > 8 else 8) * D * 4


def tail_bytes(D: int, rows: int) -> int:
    """A tail block's shared memory (tc_fold.cu, vq_tail_partial): q rows, a padded token tile, probabilities."""
    return (rows * D + TAIL_TOKENS * (D + 1) + rows * TAIL_TOKENS) * 4


def fold_bytes(rows: int, ns: int) -> int:
    """The merging block's weights (one float per row and partial, tail blocks included),
    then its thread groups' float4 sums (at most one per thread)."""
    return (rows * (ns + TAIL_BLOCKS_MAX) + 3) // 4 * 16 + NW * 32 * 16


def folds(B: int, Hkv: int, rows: int, D: int, ns: int) -> bool:
    """Whether calls of this plan merge in the attend launch (module docstring)."""
    if _FOLD in ("0", "1"):
        return _FOLD == "1" and B * Hkv <= COUNTERS
    return B * Hkv <= COUNTERS and rows * ns * D * 4 <= FOLD_MAX_BYTES


def static_bytes(D: int, rows: int, qdtype) -> int:
    """The kernel's static shared memory: each lane's q pairs (s_q), their float remainders
    (s_qr: only float32 queries read them; ptxas drops them otherwise, nvcc_check --qtype;
    docs/kernels.md), the warps' max / sum (s_m, s_l), the fold's flag (16)."""
    q_arrays = 2 if str(qdtype).endswith("float32") else 1
    return q_arrays * 32 * (D // 8) * (2 if rows > 8 else 1) * 4 + 2 * NW * 16 * 4 + 16


class TcPlan(NamedTuple):
    bps: int
    nst: int
    smem: int
    ns: int  # code blocks along the sequence
    template: tuple  # the kernel's constants but NX (tc_launch writes them into its text)


def folds_call(B: int, Hq: int, Lq: int, D: int, Hkv: int, L: int, kspec: tuple, vspec: tuple) -> bool:
    """`folds` for a call the kernel takes, with its plan (float16 queries)."""
    p = plan(B, Hq, Lq, D, Hkv, L, "float16", kspec, vspec, 1.0)
    return folds(B, Hkv, (Hq // Hkv) * Lq, D, p.ns)


def end_bytes(D: int, rows: int, ns: int) -> int:
    """What the stages' memory holds after the loop: partials, a tail tile, or merge weights."""
    return max(merge_bytes(D, rows), tail_bytes(D, rows), fold_bytes(rows, ns))


def stages_for(D: int, rows: int, kspec: tuple, vspec: tuple, bps: int, qdtype="float16", ns: int = 0):
    """(blocks per SM, stages): up to 4 stages per warp for `bps` blocks per SM; fewer
    blocks when not even two fit."""
    (kb, gk, _), (vb, gv, _) = kspec, vspec
    st = stage_bytes(D, kb, gk, vb, gv)
    for b in range(max(1, bps), 0, -1):
        room = min(SMEM_BLOCK_MAX, SMEM_PER_SM // b - 1024) - static_bytes(D, rows, qdtype)
        nst = min(_STAGES or 4, room // (NW * st))
        if nst >= 2 and end_bytes(D, rows, ns or SM_COUNT * b) <= room:
            return b, nst
    return 0, 0


@lru_cache(maxsize=512)
def plan(
    B: int, Hq: int, Lq: int, D: int, Hkv: int, L: int, qdtype, kspec: tuple, vspec: tuple, scale: float
) -> TcPlan:
    """One wave of about bps blocks per SM over B*Hkv heads; each block a run of
    consecutive stages, split between its warps."""
    (kb, gk, _), (vb, gv, _) = kspec, vspec
    rows = (Hq // Hkv) * Lq
    bps, nst = stages_for(D, rows, kspec, vspec, blocks_per_sm(D, rows), qdtype)
    if not nst:
        raise ValueError(f"attend_tc: no pipeline fits shared memory (D={D}, specs {kspec} {vspec})")
    nstage = math.ceil(L / ST)
    ns = max(1, min(math.ceil(nstage / 2), SM_COUNT * bps // (B * Hkv)))  # >= 2 stages per block
    ns = math.ceil(nstage / math.ceil(nstage / ns))
    smem = (max(NW * nst * stage_bytes(D, kb, gk, vb, gv), end_bytes(D, rows, ns)) + 127) // 128 * 128
    krs, vrs = row_strides(D, kb, vb)
    template = (
        ("T", qdtype),
        ("D", D),
        ("ROWS", rows),
        ("LQ", Lq),
        ("BK", kb),
        ("GK", gk),
        ("BV", vb),
        ("GV", gv),
        ("QSCALE", float_bits(scale * math.log2(math.e))),
        ("NW", NW),
        ("NST", nst),
        ("KRS", krs),
        ("VRS", vrs),
    )
    return TcPlan(bps, nst, smem, ns, template)


@lru_cache(maxsize=None)
def sections() -> dict:
    """tc_attention.cu's sections and tc_fold.cu's."""
    d = kernels_dir() / "cuda"
    return {**split_sections((d / "tc_attention.cu").read_text()), **split_sections((d / "tc_fold.cu").read_text())}


def header(bps: int, fold: bool = False, nx: int = 0) -> str:
    """Launch bounds (see affine_attention.cu's header), the variant's switches, the
    affine helpers and mma helpers, ours."""
    return (
        f"#define VQ_LAUNCH_BOUNDS {NW * 32}, {bps}\n#define VQ_FOLD {int(fold)}\n#define VQ_NX {nx}\n"
        f"#define VQ_COUNTERS {COUNTERS}\n"
        + affine()["header"]
        + affine()["mma_header"]
        + sections()["tc_header"]
        + (sections()["tc_tail_header"] if nx else "")
        + (sections()["tc_fold_header"] if fold else "")
    )
