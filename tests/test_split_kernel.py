"""attend_split (issue 18) off the GPU: its launch geometry, and a numpy
emulation of its index logic -- which tokens every (block, tile, warp, step)
covers, what the cp.async stages copy from global memory, and which bytes
every lane then reads from shared memory. The per-step arithmetic is
attend_mma's (verified on an H200), which reads the same bytes from global
memory; so the emulation checks that each lane of attend_split reads exactly
the bytes attend_mma's lane reads for the same tokens. The emulated formulas
mirror kernels/cuda/affine_attention.cu (section attend_split); keep them in step."""
import numpy as np
import pytest

from veloxquant.kernels import split

KIVI = [((b, g, "channel"), (b, gv, "token")) for b in (2, 4, 8) for g, gv in ((32, 32), (16, 16), (64, 32), (128, 64))]


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("specs", KIVI, ids=lambda s: f"{s[0][0]}b-gk{s[0][1]}-gv{s[1][1]}")
def test_pipeline_fits_shared_memory_and_covers_every_tile(D, specs):
    kspec, vspec = specs
    bps, nst = split.stages_for(D, kspec, vspec, split.blocks_per_sm(D))
    assert bps >= 1 and 2 <= nst <= split.MAX_STAGES
    for B, Hkv, L in ((1, 8, 32768), (1, 3, 32768), (1, 1, 131072), (2, 2, 1056 // 32 * 32), (1, 8, 128)):
        if L % max(16, kspec[1]):
            continue
        p = split.plan(B, 4 * Hkv, 1, D, Hkv, L, "float16", kspec, vspec, 0.1)
        assert p.smem <= split.SMEM_BLOCK_MAX
        assert p.bps * (p.smem + split.static_bytes(D) + 1024) <= split.SMEM_PER_SM
        assert p.ns * B * Hkv <= max(p.bps * split.SM_COUNT, B * Hkv)  # one wave
        tpb = -(-p.ntile // p.ns)  # as the kernel computes it
        starts = [b * tpb for b in range(p.ns)]
        assert all(s < p.ntile for s in starts) and starts[-1] + tpb >= p.ntile  # no idle block, all covered


def test_bank_model_pads_rows_that_lanes_read_on_one_bank():
    # 128/4-bit values: lanes (g, tig) read 8 bytes at row 2*tig, column 8*g; with
    # 64-byte rows four rows of a half-warp share banks (4 wavefronts per half).
    rows = lambda rs: [(2 * (lane % 4)) * rs + (lane // 4) * 8 for lane in range(32)]
    assert split._wavefronts(rows(64), 8) == 8 and split._wavefronts(rows(80), 8) == 2
    assert split.row_strides(128, 4, 4) == (64, 80)  # keys already conflict-free, values padded
    assert split._wavefronts([16 * lane for lane in range(32)], 16) == 4  # contiguous: the ideal


def _encode(rng, B, H, L, D, kspec, vspec):
    (kb, gk, _), (vb, gv, _) = kspec, vspec
    return dict(kc=rng.integers(0, 2**32, (B, H, L, D * kb // 32), dtype=np.uint32),
                ks=rng.standard_normal((B, H, L // gk, D)).astype(np.float16),
                kz=rng.standard_normal((B, H, L // gk, D)).astype(np.float16),
                vc=rng.integers(0, 2**32, (B, H, L, D * vb // 32), dtype=np.uint32),
                vs=rng.standard_normal((B, H, L, D // gv)).astype(np.float16),
                vz=rng.standard_normal((B, H, L, D // gv)).astype(np.float16))


def _emulate(B, Hkv, L, D, kspec, vspec, ns):
    """Run attend_split's index logic for every block; assert each lane's shared-memory
    reads equal attend_mma's global reads; return the 16-token steps each head visited."""
    (kb, gk, _), (vb, gv, _) = kspec, vspec
    g_ = _encode(np.random.default_rng(0), B, Hkv, L, D, kspec, vspec)
    glob = {n: a.reshape(-1).view(np.uint8) for n, a in g_.items()}  # byte views, as the kernel sees them
    NW, tt = split.NW, split.tile_tokens(D)
    SPW = tt // (NW * 16)
    KRB, VRB, KNB, NGV = D * kb // 8, D * vb // 8, D * kb // 32, D // gv
    VNB = (D // 8) * vb // 8
    KGR = tt // gk if tt >= gk else 1
    KRS, VRS = split.row_strides(D, kb, vb)  # padded rows of codes in shared memory
    pad = lambda n: (n + 15) // 16 * 16
    O_KC, O_VC = 0, tt * KRS
    O_KS = O_VC + tt * VRS
    O_KZ = O_KS + pad(KGR * D * 2)
    O_VS = O_KZ + pad(KGR * D * 2)
    O_VZ = O_VS + pad(tt * NGV * 2)
    STAGE = O_VZ + pad(tt * NGV * 2)
    assert STAGE == split.stage_bytes(D, kb, gk, vb, gv)
    _, nst = split.stages_for(D, kspec, vspec, split.blocks_per_sm(D))
    ntile = -(-L // tt)
    tpb = -(-ntile // ns)
    lane = np.arange(32)
    g, tig = lane // 4, lane % 4
    seen = {bh: [] for bh in range(B * Hkv)}

    def take(buf, off, nbytes):  # nbytes from each lane's offset
        return np.stack([buf[o:o + nbytes] for o in off])

    for bh in range(B * Hkv):
        for bx in range(ns):
            i0, i1 = bx * tpb, min(bx * tpb + tpb, ntile)
            smem = np.zeros(nst * STAGE, np.uint8)
            holds = {}

            def stage(it):
                t0, n = it * tt, min(tt, L - it * tt)
                s = (it - i0) % nst
                base = s * STAGE
                for name, dst, src, rb, rs in (("kc", O_KC, (bh * L + t0) * KRB, KRB, KRS),
                                               ("vc", O_VC, (bh * L + t0) * VRB, VRB, VRS)):  # row by row
                    assert dst + n * rs <= {"kc": O_VC, "vc": O_KS}[name]
                    for r in range(n):
                        smem[base + dst + r * rs:base + dst + r * rs + rb] = glob[name][src + r * rb:src + r * rb + rb]
                for name, dst, src, nb in (
                        ("ks", O_KS, (bh * (L // gk) + t0 // gk) * D * 2, -(-n // gk) * D * 2),
                        ("kz", O_KZ, (bh * (L // gk) + t0 // gk) * D * 2, -(-n // gk) * D * 2),
                        ("vs", O_VS, (bh * L + t0) * NGV * 2, n * NGV * 2),
                        ("vz", O_VZ, (bh * L + t0) * NGV * 2, n * NGV * 2)):
                    end = {"ks": O_KZ, "kz": O_VS, "vs": O_VZ, "vz": STAGE}[name]
                    assert dst + nb <= end and src + nb <= glob[name].size, (name, it)
                    smem[base + dst:base + dst + nb] = glob[name][src:src + nb]
                holds[s] = it

            for s in range(nst - 1):
                if i0 + s < i1:
                    stage(i0 + s)
            for it in range(i0, i1):
                if it + nst - 1 < i1:
                    stage(it + nst - 1)  # after the barrier: tile it's stage must survive this
                buf = (it - i0) % nst
                assert holds.get(buf) == it
                t0, n = it * tt, min(tt, L - it * tt)
                sb = smem[buf * STAGE:(buf + 1) * STAGE]
                for warp in range(NW):
                    for sp in range(SPW):
                        T0 = warp * 16 * SPW + sp * 16
                        if T0 >= n:
                            break
                        GT = t0 + T0  # attend_mma's T0 for the same step
                        seen[bh].append(GT // 16)
                        for e in range(2):  # key codes
                            got = take(sb, O_KC + (T0 + g + 8 * e) * KRS + tig * KNB, KNB)
                            want = take(glob["kc"], bh * L * KRB + (GT + g + 8 * e) * KRB + tig * KNB, KNB)
                            assert np.array_equal(got, want)
                        for e in range(4):  # value codes, zeros, scales
                            tl = T0 + 2 * tig + (e & 1) + 8 * (e >> 1)
                            got = take(sb, O_VC + tl * VRS + g * VNB, VNB)
                            want = take(glob["vc"], bh * L * VRB + (GT - T0 + tl) * VRB + g * VNB, VNB)
                            assert np.array_equal(got, want)
                            for gg, ok in ((g, g < NGV), (g + 8, g + 8 < NGV)):
                                for nm, o in (("vz", O_VZ), ("vs", O_VS)):
                                    got = take(sb, o + (tl * NGV + np.minimum(gg, NGV - 1)) * 2, 2)[ok]
                                    want = take(glob[nm], ((bh * L + GT - T0 + tl) * NGV
                                                           + np.minimum(gg, NGV - 1)) * 2, 2)[ok]
                                    assert np.array_equal(got, want)
                        grp = GT // gk  # key scales / zeros rows of the step's group
                        row = grp - t0 // gk
                        assert 0 <= row < KGR
                        got = take(sb, O_KS + (row * D + tig * (D // 4)) * 2, D // 2)
                        want = take(glob["ks"], ((bh * (L // gk) + grp) * D + tig * (D // 4)) * 2, D // 2)
                        assert np.array_equal(got, want)
                        cb = tig * (D // 4) + (g & 1) * (D // 8)
                        got = take(sb, O_KZ + (row * D + cb) * 2, D // 4)
                        want = take(glob["kz"], ((bh * (L // gk) + grp) * D + cb) * 2, D // 4)
                        assert np.array_equal(got, want)
    return seen


@pytest.mark.parametrize("case", [
    (1, 2, 1024, 128, (4, 32, "channel"), (4, 32, "token"), 3),
    (1, 3, 4000 // 32 * 32, 64, (2, 32, "channel"), (2, 32, "token"), 5),
    (2, 1, 640, 256, (8, 64, "channel"), (8, 32, "token"), 3),
    (1, 1, 1056, 128, (2, 16, "channel"), (4, 16, "token"), 4),
    (1, 2, 768, 64, (4, 128, "channel"), (4, 64, "token"), 2),
], ids=lambda c: f"B{c[0]}-H{c[1]}-L{c[2]}-D{c[3]}-{c[4][0]}b-gk{c[4][1]}-ns{c[6]}")
def test_emulated_lanes_read_what_attend_mma_reads(case):
    B, Hkv, L, D, kspec, vspec, ns = case
    tpb = -(-(-(-L // split.tile_tokens(D))) // ns)
    ns = -(-(-(-L // split.tile_tokens(D))) // tpb)  # as plan() settles it
    seen = _emulate(B, Hkv, L, D, kspec, vspec, ns)
    for steps in seen.values():  # every 16-token step of every head, once
        assert sorted(steps) == list(range(L // 16))


def test_tc_is_the_default_where_its_scope_takes_the_call_and_split_nowhere(monkeypatch):
    from veloxquant.kernels import cuda, dispatch
    monkeypatch.delenv("VELOXQUANT_CUDA_IMPL", raising=False)
    kivi, tok = ((4, 32, "channel"), (4, 32, "token")), ((4, 32, "token"), (4, 32, "token"))
    chosen = {(D, L): cuda.default_impl(D, L) for D in (64, 128, 256) for L in (1024, 32768, 131072)}
    assert set(chosen.values()) == ({"tc"} if cuda.TC_VERIFIED else {"mma", "v1"})
    if cuda.TC_VERIFIED:
        assert dispatch.attend_impl(32, 1, 128, 8, 32768, *kivi) == "tc"
        assert dispatch.attend_impl(32, 1, 128, 8, 32768, *tok) == "v1"  # per-token keys: no tensor-core kernel
        assert dispatch.attend_impl(4, 3, 256, 1, 4096, *kivi) == "v1"  # 12 rows at D = 256: tc refuses
        assert dispatch.attend_impl(32, 8, 128, 8, 32768, *kivi) == "v1"  # 32 rows: tc and mma refuse
        assert dispatch.attend_impl(32, 1, 128, 8, 32768, *kivi, hides=True) == "v1"
        assert dispatch.attend_impl(32, 1, 128, 8, 32768, *kivi, impl="tc") == "tc"
        # D = 256: tc by default only where it merges in its own launch (short tiers)
        assert dispatch.attend_impl(4, 1, 256, 1, 2048, *kivi) == "tc"
        assert dispatch.attend_impl(4, 1, 256, 1, 32768, *kivi) == "v1"
        assert dispatch.attend_impl(4, 1, 256, 1, 32768, *kivi, impl="tc") == "tc"
    monkeypatch.setenv("VELOXQUANT_CUDA_IMPL", "split")
    assert cuda.default_impl(64, 4096) == "split"
    assert dispatch.attend_impl(32, 1, 128, 8, 32768, *kivi) == "split"


def test_nvcc_renders_the_split_kernel_as_mlx_would():
    from veloxquant.kernels import nvcc_check
    src = nvcc_check.split_unit(1, 32, 1, 128, 8, 32768, (4, 32, "channel"), (4, 32, "token"))
    assert "__launch_bounds__(VQ_LAUNCH_BOUNDS)" in src and "#define VQ_LAUNCH_BOUNDS 128, 3" in src
    assert "const __grid_constant__ Shape kc_shape" in src and "constexpr int NST = 3;" in src


# Compiled for sm_90 without spills: tests/test_tc_kernel.py (both pipelined kernels).


# ---------------------------------------------------------------- CUDA only
SDPA_CASES = [  # (Hq, Hkv, D, L, bits): the shapes at 32k, KIVI group 32
    (32, 8, 128, 32768, 4), (32, 8, 128, 32768, 2), (9, 3, 64, 32768, 4), (4, 1, 256, 32768, 4),
]


@pytest.mark.parametrize("impl", ["split", "tc"])
@pytest.mark.parametrize("case", SDPA_CASES, ids=lambda c: f"{c[0]}/{c[1]}/{c[2]}-L{c[3]}-{c[4]}b")
@pytest.mark.gpu
@pytest.mark.skipif(__import__("veloxquant.kernels", fromlist=["backend"]).backend() != "cuda",
                    reason="needs MLX's CUDA backend")
def test_split_kernel_is_no_worse_than_fp16_sdpa_over_the_decoded_cache(case, impl):
    """Issue 18's parity bar: against the float32 reference (CPU), attend_split's
    (and attend_tc's) output differs by <= 1e-3 and by no more than fp16 SDPA over the decoded cache."""
    import mlx.core as mx
    from test_kernels import TOL, _record, make, maxerr, on_cpu, spec

    from veloxquant.kernels import cuda
    from veloxquant.kernels.reference import affine_partial_attention as reference
    from veloxquant.stages.store import Affine
    Hq, Hkv, D, L, bits = case
    ks, vs = spec(bits, 32, "channel"), spec(bits, 32, "token")
    q, ke, ve = make(1, Hq, Hkv, 1, D, L, ks, vs, mx.float16)
    scale = D ** -0.5
    want = on_cpu(reference, q, ke, ve, ks, vs, scale)[0]
    got = cuda.affine_partial_attention(q, ke, ve, ks, vs, scale, impl=impl)[0]
    k16, v16 = Affine(**ks).decode(ke, mx.float16), Affine(**vs).decode(ve, mx.float16)
    sdpa = mx.fast.scaled_dot_product_attention(q, k16, v16, scale=scale)
    e_kernel, e_sdpa = maxerr((got,), (want,)), maxerr((sdpa,), (want,))
    _record(f"[{impl} vs sdpa] {Hq}/{Hkv}/{D} L{L} {bits}-bit: kernel {e_kernel:.2e}, fp16 sdpa {e_sdpa:.2e}", e_kernel)
    assert e_kernel <= TOL and e_kernel <= e_sdpa
