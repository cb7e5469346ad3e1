"""Geometry and binding of `attend_split` (kernels/cuda/affine_attention.cu),
the split-K decode kernel built for bandwidth (issue 18).

Same scope and arithmetic as attend_mma (per-channel keys, per-token values,
rows = rep * Lq <= 4, tensor cores), but every block streams its run of
TT-token tiles through NST shared-memory stages with 16-byte cp.async, so
NST - 1 tiles per block are in flight while one is used. The grid is sized to
fill the GPU in one wave at every shape (D = 64 included): about
`blocks_per_sm` resident blocks on each of SM_COUNT SMs. Partials go to the
existing reduce / reduce_tail launch. Pure arithmetic here except `kernel`.
"""
import math
import os
from functools import lru_cache
from typing import NamedTuple

from .geometry import SM_COUNT, float_bits

NW = 4  # warps per block
SMEM_PER_SM = 228 * 1024  # sm_90: shared memory of one SM (a block also reserves 1 KiB)
SMEM_BLOCK_MAX = 227 * 1024  # what one sm_90 block may opt into
MAX_STAGES = 4
# Resident blocks per SM the plan aims for: 3 (registers capped at 168 by the launch
# bounds; no spills at D <= 128), 2 at D = 256 (at 3 it spills 64 bytes at 4 bits;
# ptxas -v, nvcc_check). Tuning knob for benchmarks (read once).
_BLOCKS_PER_SM = int(os.environ.get("VELOXQUANT_SPLIT_BLOCKS_PER_SM", "0") or 0)


def blocks_per_sm(D: int) -> int:
    return _BLOCKS_PER_SM or (2 if D > 128 else 3)


def _pad16(n: int) -> int:
    return (n + 15) // 16 * 16


def tile_tokens(D: int) -> int:
    """Tokens per tile: 16 per warp step, 2 steps per warp (1 at D = 256, whose tiles are twice as wide)."""
    return NW * 16 * (2 if D <= 128 else 1)


def _wavefronts(addrs, width: int) -> int:
    """Shared-memory wavefronts of one warp-wide load of `width` bytes per lane at
    these byte addresses: requests of 16 / 8 / <= 4 bytes are served 8 / 16 / 32 lanes
    at a time, and each phase costs as many wavefronts as its busiest bank has distinct words."""
    per_phase = 8 if width >= 16 else 16 if width == 8 else 32
    total = 0
    for p in range(0, 32, per_phase):
        banks: dict = {}
        for a in addrs[p:p + per_phase]:
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
        return sum(_wavefronts([(l // 4 + 8 * e) * rs + (l % 4) * knb + 16 * h for l in lanes], min(knb, 16))
                   for e in range(2) for h in range(max(1, knb // 16)))

    def cost_v(rs):
        return sum(_wavefronts([(2 * (l % 4) + (e & 1) + 8 * (e >> 1)) * rs + (l // 4) * vnb for l in lanes],
                               min(vnb, 16)) for e in range(4))
    return (min((krb + p for p in (0, 16, 32, 48)), key=lambda rs: (cost_k(rs), rs)),
            min((vrb + p for p in (0, 16, 32, 48)), key=lambda rs: (cost_v(rs), rs)))


def stage_bytes(D: int, kb: int, gk: int, vb: int, gv: int) -> int:
    """One pipeline stage (mirrors the kernel's O_* offsets, static_assert'ed there):
    key and value codes of a tile (rows `row_strides` apart), key scales/zeros of
    its key groups, value scales/zeros of its tokens."""
    tt = tile_tokens(D)
    kgr = tt // gk if tt >= gk else 1
    krs, vrs = row_strides(D, kb, vb)
    return tt * (krs + vrs) + 2 * _pad16(kgr * D * 2) + 2 * _pad16(tt * (D // gv) * 2)


def final_bytes(D: int) -> int:
    """The warps' partials, written over the drained stages at the end."""
    return NW * 4 * D * 4 + NW * 4 * 16 * 4 + 2 * NW * 4 * 4


def static_bytes(D: int) -> int:
    """The kernel's static shared memory: q rows and their fp16 hi/lo pairs."""
    return 4 * D * 4 + 2 * 4 * 4 * (D // 8) * 4


class SplitPlan(NamedTuple):
    bps: int       # resident blocks per SM aimed for (the launch bounds' minimum)
    nst: int       # pipeline stages
    smem: int      # dynamic shared memory bytes
    ntile: int     # tiles of the tier: ceil(L / TT)
    ns: int        # blocks along the sequence (grid x); each walks ceil(ntile / ns) tiles
    template: tuple


def stages_for(D: int, kspec: tuple, vspec: tuple, bps: int):
    """(blocks per SM, stages): as many stages (2..MAX_STAGES) as `bps` blocks leave
    room for; fewer blocks per SM when not even two stages fit."""
    (kb, gk, _), (vb, gv, _) = kspec, vspec
    st = stage_bytes(D, kb, gk, vb, gv)
    for b in range(max(1, bps), 0, -1):
        room = min(SMEM_BLOCK_MAX, SMEM_PER_SM // b - 1024) - static_bytes(D)
        nst = min(MAX_STAGES, room // st)
        if nst >= 2 and max(nst * st, final_bytes(D)) <= room:
            return b, nst
    return 0, 0


@lru_cache(maxsize=512)
def plan(B: int, Hq: int, Lq: int, D: int, Hkv: int, L: int, qdtype, kspec: tuple, vspec: tuple,
         scale: float) -> SplitPlan:
    """Launch geometry: one wave of about bps blocks per SM over B*Hkv heads, each
    block a run of consecutive tiles (no block without one)."""
    (kb, gk, _), (vb, gv, _) = kspec, vspec
    bps, nst = stages_for(D, kspec, vspec, blocks_per_sm(D))
    if not nst:
        raise ValueError(f"attend_split: no pipeline fits shared memory (D={D}, specs {kspec} {vspec})")
    smem = (max(nst * stage_bytes(D, kb, gk, vb, gv), final_bytes(D)) + 127) // 128 * 128
    tt = tile_tokens(D)
    ntile = math.ceil(L / tt)
    ns = max(1, min(ntile, SM_COUNT * bps // (B * Hkv)))
    tpb = math.ceil(ntile / ns)
    ns = math.ceil(ntile / tpb)
    template = (("T", qdtype), ("D", D), ("ROWS", (Hq // Hkv) * Lq), ("BK", kb), ("GK", gk), ("BV", vb),
                ("GV", gv), ("QSCALE", float_bits(scale * math.log2(math.e))), ("NW", NW),
                ("SPW", tt // (NW * 16)), ("NST", nst), *zip(("KRS", "VRS"), row_strides(D, kb, vb)),
                ("SMEM", smem))
    return SplitPlan(bps, nst, smem, ntile, ns, template)


def header(sections: dict, bps: int) -> str:
    """Launch bounds (see the .cu file's header), the shared helpers, the mma helpers, its own."""
    return (f"#define VQ_LAUNCH_BOUNDS {NW * 32}, {bps}\n" + sections["header"] + sections["mma_header"]
            + sections["split_header"])


@lru_cache(maxsize=None)
def kernel(smem: int, bps: int):
    """The bound kernel (one per shared-memory size and launch bounds: the bounds are not a template argument)."""
    import mlx.core as mx

    from .cuda import _strip, sections
    return mx.fast.cuda_kernel(
        name=f"vq_affine_attend_split_{smem}_{bps}", input_names=["q", "kc", "ks", "kz", "vc", "vs", "vz"],
        output_names=["pm", "pl", "pacc"], source=_strip(sections()["attend_split"]),
        header=_strip(header(sections(), bps)), shared_memory=smem)


def partials_kw(qshape: tuple, hkv: int, ns: int, threads: int, template=()) -> dict:
    """Keyword arguments of an attend launch writing one partial per block along the
    sequence (pm, pl [rows, ns], pacc [rows, ns, D]): grid (ns blocks, B*Hkv); template
    arguments only when given (attend_tc writes its constants into its text)."""
    import mlx.core as mx
    B, Hq, Lq, D = qshape
    nrows, f32 = B * Hq * Lq, mx.float32
    kw = dict(grid=(ns * threads, B * hkv, 1), threadgroup=(threads, 1, 1),
              output_shapes=[(nrows, ns), (nrows, ns), (nrows, ns, D)], output_dtypes=[f32, f32, f32])
    if template:
        kw["template"] = list(template)
    return kw


@lru_cache(maxsize=1024)
def launch_kw(qshape: tuple, qdtype, cshape: tuple, kspec: tuple, vspec: tuple, scale: float):
    """(kernel, keyword arguments) of the attend launch, prepared once per signature
    (callers pass them on, never change them); the reduce follows as for attend_mma."""
    B, Hq, Lq, D = qshape
    _, Hkv, L, _ = cshape
    p = plan(B, Hq, Lq, D, Hkv, L, qdtype, kspec, vspec, scale)
    return kernel(p.smem, p.bps), partials_kw(qshape, Hkv, p.ns, NW * 32, p.template)
