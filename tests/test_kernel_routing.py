"""Which built-ins' decode steps reach the fused kernel, decided by the dispatcher.

On the CPU the dispatcher answers "reference" (tests/test_kernels.py pins that);
here its answer is replaced by "cuda" and the launch by the MLX-ops reference of
the same contract, so the routing of a decode step can be checked without a GPU:
every plain affine tier of these recipes must be answered by the kernel path
(runtime/fused.py), and the tiers it reads should hold exact (row-contiguous)
buffers, else MLX copies the whole tier before every launch.
"""

import mlx.core as mx
import pytest

from veloxquant.bench.e2e import random_llama
from veloxquant.kernels import cuda, dispatch, reference
from veloxquant.runtime import fused, make_prompt_cache, uninstall

AFFINE_BUILTINS = ["kivi", "kivi_sink", "cachegen", "age_tiered", "xquant"]


@pytest.fixture(scope="module")
def model():
    mx.random.seed(5)
    return random_llama(2, 8, 2, 64, 300, mx.float32)


@pytest.fixture
def kernel_on_cpu(monkeypatch):
    """The dispatcher's decision is 'cuda'; the launch answers with the reference."""
    monkeypatch.setattr(dispatch, "choice", lambda *a, **k: ("cuda", "reference standing in for the kernel"))

    def launcher(qshape, qdtype, cshape, ks, vs, scale, **kw):
        def run(q, ke, ve, tail=None, hidden=0):
            if tail is None:
                return reference.affine_partial_attention(q, ke, ve, ks, vs, scale, hidden)
            return reference.attention_with_tail(q, ke, ve, ks, vs, scale, tail, hidden)

        return run

    monkeypatch.setattr(cuda, "launcher", launcher)
    served = []
    real = fused.kernel_answer

    def counted(tier, queries, scale, encoded=None, hidden=0):
        answer = real(tier, queries, scale, encoded, hidden)
        if queries.shape[2] == 1:
            served.append((id(tier), answer is not None))
        return answer

    monkeypatch.setattr(fused, "kernel_answer", counted)
    return served


def _decode(model, recipe, steps=3):
    caches = make_prompt_cache(model, recipe)
    try:
        mx.eval(model(mx.random.randint(0, 300, (1, 400), key=mx.random.key(2)), cache=caches))
        for t in range(steps):
            mx.eval(model(mx.array([[t + 1]]), cache=caches))
    finally:
        uninstall(model)
    return caches


@pytest.mark.parametrize("recipe", AFFINE_BUILTINS)
def test_every_affine_tier_is_served_by_the_kernel_at_decode(model, recipe, kernel_on_cpu):
    caches = _decode(model, recipe)
    coded = {id(t) for c in caches for t in c.tiers if (t.fusable or getattr(t, "kernel_reads", False)) and t.count}
    assert coded, "the recipe should hold affine-coded tokens after 400"
    asked = {tid for tid, _ in kernel_on_cpu}
    assert coded <= asked, "a coded tier was never offered to the kernel at decode"
    assert all(ok for _, ok in kernel_on_cpu), "the dispatcher said cuda but no launch was made"


@pytest.mark.skipif(dispatch.backend() != "cpu", reason="the CPU's route: on CUDA the kernel answers")
def test_cpu_dispatcher_keeps_the_reference(model):
    """Without the stand-in, the CPU never gets a kernel: coded tiers are decoded (the MLX-ops path)."""
    caches = _decode(model, "kivi", steps=1)
    tier = next(t for t in caches[0].tiers if t.fusable)
    q = mx.zeros((1, 8, 1, 64))
    assert fused.kernel_answer(tier, q, 0.125) is None


@pytest.mark.parametrize("recipe", AFFINE_BUILTINS)
def test_kernel_tiers_are_row_contiguous(model, recipe, kernel_on_cpu):
    """A window before a kernel-read tier spills whole chunks (compiler: KERNEL_SPILL), so the tier
    holds exact buffers: per-token spills (cachegen's per-token codes) used to grow it a token per
    step in a step-grown buffer, whose sliced view MLX copied whole before every launch."""
    caches = _decode(model, recipe)
    for c in caches:
        for t in c.tiers:
            if (t.fusable or getattr(t, "kernel_reads", False)) and t.count:
                assert all(b.step is None for bufs in t.buffers.values() for b in bufs.values()), t.plan.name


def test_the_table_routes_each_call_to_its_default_attend_kernel(monkeypatch):
    """attend_tc wherever its scope takes the call (at D = 256 only in one launch), attend_mma
    at D = 128 from MMA_MIN_TOKENS where tc refuses, v1 else; a named kernel where its scope
    takes the call, else v1; v1 alone for a chunk size or a hidden front."""
    from veloxquant.kernels import table

    monkeypatch.delenv("VELOXQUANT_CUDA_IMPL", raising=False)
    kivi, tok = ((4, 32, "channel"), (4, 32, "token")), ((4, 32, "token"), (4, 32, "token"))
    route = lambda B, Hq, Lq, D, Hkv, L, specs, **kw: table.attend_route((B, Hq, Lq, D, Hkv, L), *specs, **kw)
    assert set(table.ATTEND_ORDER) == {k.name for k in table.family("attend")}
    assert all(table.verified(name, "cuda") for name in table.ATTEND_ORDER)
    fused = [k.name for k in table.KERNELS.values() if k.family != "attend-mlx"]  # our own kernel sources
    assert not any(table.verified(name, "cpu") or table.verified(name, "metal") for name in fused)
    # MLX's own kernels (kernels/mlx_affine.py): parity tested on the CPU here, never run on Metal
    assert all(k.verified == {"cpu"} for k in table.family("attend-mlx"))
    assert route(1, 32, 1, 128, 8, 32768, kivi) == "tc"
    assert route(1, 32, 1, 128, 8, 32768, tok) == "v1"  # per-token keys: no tensor-core kernel
    assert route(1, 4, 3, 256, 1, 4096, kivi) == "v1"  # 12 rows at D = 256: tc and mma refuse
    assert route(1, 32, 8, 128, 8, 32768, kivi) == "v1"  # 32 rows: tc and mma refuse
    assert route(1, 32, 1, 128, 8, 32768, kivi, hides=True) == "v1"
    assert route(1, 32, 1, 128, 8, 32768, kivi, chunk=128) == "v1"
    assert route(1, 32, 1, 128, 8, 32768, kivi, impl="tc") == "tc"
    assert route(1, 32, 1, 128, 8, 32768, kivi, impl="mma") == "mma"
    assert route(1, 32, 1, 128, 8, 32768, tok, impl="mma") == "v1"  # outside mma's scope
    assert route(1, 4, 1, 256, 1, 2048, kivi) == "tc"  # D = 256: tc where it merges in its launch
    assert route(1, 4, 1, 256, 1, 32768, kivi) == "v1"
    assert route(1, 4, 1, 256, 1, 32768, kivi, impl="tc") == "tc"
    assert route(1, 32, 3, 128, 8, 32768, kivi) == "tc"  # 12 rows: tc, not mma (<= 4)
    assert route(1, 32, 5, 128, 8, 32768, kivi) == "v1"  # 20 rows: both refuse
    monkeypatch.setitem(table.KERNELS, "tc", table.KERNELS["tc"]._replace(verified=frozenset()))
    assert route(1, 32, 1, 128, 8, 32768, kivi) == "mma"  # tc not verified: mma from 16k at D = 128
    assert route(1, 32, 1, 128, 8, 16383, kivi) == "v1"
    assert route(1, 32, 1, 64, 8, 32768, kivi) == "v1"
    monkeypatch.setenv("VELOXQUANT_CUDA_IMPL", "tc")
    assert route(1, 32, 1, 128, 8, 32768, kivi) == "tc"  # forcing needs no verified flag
    monkeypatch.setenv("VELOXQUANT_CUDA_IMPL", "split")  # retired: names no kernel, the default runs
    assert route(1, 32, 1, 128, 8, 32768, kivi) == "mma"
    with pytest.raises(ValueError, match="no attend kernel 'split'"):
        route(1, 32, 1, 128, 8, 32768, kivi, impl="split")
