"""Launch geometry of the CUDA-core attend kernel (v1): chunk size, shared
memory, grid. Pure arithmetic, mirrored by static_asserts in
kernels/cuda/affine_attention.cu; kernels/cuda.py binds the launches."""

import math
import os
import struct
from functools import lru_cache
from typing import NamedTuple

C = 16  # channels per lane, fixed by the kernel
MAX_ROWS = 4  # rows (rep heads x queries) held in registers per block
SM_COUNT = 132  # H200; only steers the split count
SMEM_CAP = 100_000  # preferred bound on a block's dynamic shared memory
SMEM_MAX = 227 * 1024  # what an sm_90 block may opt into
LONG_TIER = 8192  # tokens from which 256-token chunks pay (D = 128 only, see choose_chunk)
# Tuning knobs for benchmarks (read once): tokens per chunk, resident threads per SM.
_FORCED_CHUNK = int(os.environ.get("VELOXQUANT_CUDA_CHUNK", "0") or 0)
_THREADS_PER_SM = int(os.environ.get("VELOXQUANT_CUDA_THREADS_PER_SM", "384") or 384)


def blocks_per_sm(D: int) -> int:
    """Resident attend blocks per SM we size the grid for; the launch bounds cap
    registers to match (384 threads/SM: 170 per thread, no spills at R=4)."""
    return max(1, _THREADS_PER_SM // D)


def float_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def smem_bytes(ch: int, D: int, R: int, kb: int, kg: int, kax: str, vb: int, vg: int, vax: str) -> int:
    """Mirror of the attend kernel's shared-memory layout (static_assert'ed there):
    two staging buffers, q rows, the chunk's probabilities, max/sum, and the
    per-warp value sums."""

    def meta(g, ax):
        halves = (ch // g) * D if ax == "channel" else ch * (D // g)
        return 2 * ((halves * 2 + 15) // 16 * 16)

    stage = ch * D * (kb + vb) // 8 + meta(kg, kax) + meta(vg, vax)
    return 2 * stage + R * D * 4 + ch * R * 4 + 16 * 4 + (D // 32) * R * D * 4


def choose_chunk(D: int, R: int, kspec, vspec, L: int = 0) -> int:
    """Tokens per chunk: 256 for long tiers at D = 128 (measured faster on the H200
    at 32k/128k), else 128 (8 tokens per team; faster at 9/3/64; both in
    docs/kernels.md); failing that the smallest size that holds whole
    channel groups and fits shared memory; 0 if none."""
    (kb, kg, kax), (vb, vg, vax) = kspec, vspec
    low = max(kg if kax == "channel" else 16, vg if vax == "channel" else 16)
    fits = lambda c, cap: c >= low and smem_bytes(c, D, R, kb, kg, kax, vb, vg, vax) <= cap
    if _FORCED_CHUNK and fits(_FORCED_CHUNK, SMEM_MAX):
        return _FORCED_CHUNK
    if D == 128 and L >= LONG_TIER and fits(256, SMEM_CAP):
        return 256
    for ch in (128, 64, 256):
        if fits(ch, SMEM_CAP):
            return ch
    for ch in (64, 128, 256):
        if fits(ch, SMEM_MAX):
            return ch
    return 0


class Plan(NamedTuple):
    R: int  # rows per block (held in registers)
    nrb: int  # row blocks (grid z)
    ch: int  # tokens per chunk (one partial each)
    nc: int  # chunks: ceil(L / ch)
    ns: int  # blocks along the sequence (grid x); each walks ceil(nc / ns) chunks
    smem: int  # dynamic shared memory bytes
    template: tuple


@lru_cache(maxsize=512)
def plan(
    B: int, Hq: int, Lq: int, D: int, Hkv: int, L: int, qdtype, kspec: tuple, vspec: tuple, scale: float, chunk: int = 0
) -> Plan:
    """Launch geometry: about blocks_per_sm(D) resident blocks per SM, each walking
    several chunks so the next one streams in while the current is used."""
    (kb, kg, kax), (vb, vg, vax) = kspec, vspec
    rows = (Hq // Hkv) * Lq
    R = 1 if rows == 1 else 2 if rows == 2 else MAX_ROWS
    nrb = math.ceil(rows / R)
    ch = chunk or choose_chunk(D, R, kspec, vspec, L)
    chunks = math.ceil(L / ch)
    want = max(1, math.ceil(SM_COUNT * blocks_per_sm(D) / (B * Hkv * nrb)))
    nsub = max(1, math.ceil(chunks / want))
    ns = math.ceil(chunks / nsub)
    smem = (smem_bytes(ch, D, R, kb, kg, kax, vb, vg, vax) + 127) // 128 * 128  # fewer distinct kernels
    template = (
        ("T", qdtype),
        ("D", D),
        ("R", R),
        ("ROWS", rows),
        ("BK", kb),
        ("GK", kg),
        ("KAX", int(kax == "channel")),
        ("BV", vb),
        ("GV", vg),
        ("VAX", int(vax == "channel")),
        ("CH", ch),
        ("QSCALE", float_bits(scale * math.log2(math.e))),
        ("SMEM", smem),
    )
    return Plan(R, nrb, ch, chunks, ns, smem, template)
