"""attend_tc (issue 18) off the GPU: its scope, launch geometry (shared memory,
one wave, every 32-token stage walked by exactly one warp), and -- where nvcc
is installed -- that it compiles for sm_90 without spills. Its parity runs on
the H200 (tests/test_kernels.py, impl "tc")."""
import re

import pytest

from veloxquant.kernels import tc

SPECS = [((b, g, "channel"), (b, gv, "token")) for b in (2, 4, 8) for g, gv in ((32, 32), (16, 16), (64, 32), (128, 64))]


def _stages_walked(L: int, ns: int) -> list:
    """The kernel's partition (blocks of spb stages, NW warps of spw each), stage indices in walk order."""
    nst = -(-L // tc.ST)
    spb = -(-nst // ns)
    out = []
    for bx in range(ns):
        b0, b1 = bx * spb, min(bx * spb + spb, nst)
        spw = -(-(b1 - b0) // tc.NW) if b1 > b0 else 0
        for w in range(tc.NW):
            s0 = min(b0 + w * spw, b1)
            out += range(s0, min(s0 + spw, b1))
    return out


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("specs", SPECS, ids=lambda s: f"{s[0][0]}b-gk{s[0][1]}-gv{s[1][1]}")
def test_plan_fits_shared_memory_one_wave_and_covers_every_stage(D, specs):
    kspec, vspec = specs
    for B, Hq, Lq, Hkv, L in ((1, 32, 1, 8, 32768), (1, 9, 1, 3, 32768), (1, 4, 2, 1, 131072), (2, 8, 1, 2, 1040),
                              (1, 32, 4, 8, 128)):
        rows = Hq // Hkv * Lq
        if L % kspec[1] or tc.supported(Hq, Lq, D, Hkv, L, kspec, vspec):
            continue
        for qdtype in ("float16", "float32"):  # float32 queries also hold their fp16 remainders
            p = tc.plan(B, Hq, Lq, D, Hkv, L, qdtype, kspec, vspec, 0.1)
            static = tc.static_bytes(D, rows, qdtype)
            assert 2 <= p.nst <= 4 and p.smem + static <= tc.SMEM_BLOCK_MAX
            assert p.bps * (p.smem + static + 1024) <= tc.SMEM_PER_SM
            assert p.smem >= tc.NW * p.nst * tc.stage_bytes(D, kspec[0], kspec[1], vspec[0], vspec[1])
            assert p.ns * B * Hkv <= max(p.bps * 132, B * Hkv)  # one wave
            assert sorted(_stages_walked(L, p.ns)) == list(range(-(-L // tc.ST)))  # each stage once


def test_scope_names_what_it_refuses():
    kivi = ((4, 32, "channel"), (4, 32, "token"))
    assert tc.supported(32, 1, 128, 8, 4096, *kivi) == ""
    assert tc.supported(32, 4, 128, 8, 4096, *kivi) == ""  # 16 rows: both mma row halves
    assert "rows" in tc.supported(32, 5, 128, 8, 4096, *kivi)
    assert "rows" in tc.supported(4, 3, 256, 1, 4096, *kivi)  # > 8 rows at D = 256 would spill
    assert "per-channel" in tc.supported(32, 1, 128, 8, 4096, (4, 32, "token"), (4, 32, "token"))
    assert "tier length" in tc.supported(32, 1, 128, 8, 4104, *kivi)


def test_nvcc_renders_the_tc_kernel_as_mlx_would():
    from veloxquant.kernels import nvcc_check
    src = nvcc_check.tc_unit(1, 32, 1, 128, 8, 32768, (4, 32, "channel"), (4, 32, "token"))
    assert "#define VQ_LAUNCH_BOUNDS 128, 3" in src and "constexpr int NST = 3;" in src
    assert "const __grid_constant__ Shape kc_shape" in src and "vq_warp_rows" in src


@pytest.mark.slow
@pytest.mark.skipif(not __import__("shutil").which("nvcc"), reason="needs nvcc")
@pytest.mark.parametrize("unit,shape,Lq,bits,qtype", [
    ("tc", "32/8/128", 1, 4, "float16"), ("tc", "32/8/128", 4, 4, "float16"), ("tc", "9/3/64", 3, 2, "float32"),
    ("tc", "4/1/256", 1, 8, "bfloat16"), ("split", "32/8/128", 1, 4, "float16"), ("split", "9/3/64", 1, 2, "float32"),
    ("split", "4/1/256", 1, 4, "float16"), ("split", "4/1/256", 1, 8, "bfloat16")])
def test_pipelined_kernels_compile_for_sm90_without_spills(unit, shape, Lq, bits, qtype):
    from veloxquant.kernels import nvcc_check
    Hq, Hkv, D = (int(x) for x in shape.split("/"))
    render = nvcc_check.tc_unit if unit == "tc" else nvcc_check.split_unit
    report = nvcc_check.compile_unit(render(1, Hq, Lq, D, Hkv, 32768, (bits, 32, "channel"), (bits, 32, "token"), qtype))
    assert " 0 bytes spill stores" in report
    if unit == "tc":  # the plan's shared-memory budget counts what ptxas allocates statically
        static = int(re.search(r"(\d+) bytes smem", report).group(1))
        assert static <= tc.static_bytes(D, Hq // Hkv * Lq, qtype)
