"""The GPU decode path on the CPU: kernel tiers answered by the MLX-ops reference
(same contract), the other tiers grouped into one partial, merged exactly; it
must give the logits the dense path gives."""

import mlx.core as mx
import numpy as np
import pytest

from veloxquant.bench.e2e import random_llama
from veloxquant.kernels import cuda, dispatch, reference
from veloxquant.kernels.partials import merge_partials, partial_attention
from veloxquant.runtime import make_prompt_cache, uninstall


@pytest.fixture(scope="module")
def model():
    mx.random.seed(3)
    return random_llama(2, 8, 2, 64, 500, mx.float32)


def _run(model, recipe, tokens, decode, chunk=100):
    caches = make_prompt_cache(model, recipe)
    try:
        outs = [model(tokens[:, s : s + chunk], cache=caches) for s in range(0, tokens.shape[1], chunk)]
        mx.eval(outs)
        for t in range(decode):
            outs.append(model(mx.array([[t + 7]]), cache=caches))
            mx.eval(outs[-1])
        return mx.concatenate(outs, axis=1), caches
    finally:
        uninstall(model)


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """Route affine tiers through the kernel entry point, answered by the reference."""
    monkeypatch.setattr(dispatch, "choice", lambda *a, **k: ("cuda", "reference standing in for the kernel"))

    def launcher(qshape, qdtype, cshape, ks, vs, scale, **kw):
        def run(q, ke, ve, tail=None, hidden=0):
            if tail is None:
                return reference.affine_partial_attention(q, ke, ve, ks, vs, scale, hidden)
            calls.append(len(tail))
            return reference.attention_with_tail(q, ke, ve, ks, vs, scale, tail, hidden)

        return run

    calls = []
    monkeypatch.setattr(cuda, "launcher", launcher)
    return calls  # the tail sizes the kernel's reduce was asked to fold in


def _attention_f64(cache, q, scale):
    """softmax(scale q K^T) V in float64 over the cache's decoded K/V (every token visible to a decode query)."""
    k, v = (np.array(x.astype(mx.float32), dtype=np.float64) for x in cache._fetch())
    qn = np.array(q, dtype=np.float64)
    rep = qn.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = scale * qn @ k.swapaxes(-1, -2)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return (w / w.sum(axis=-1, keepdims=True)) @ v


@pytest.mark.parametrize("recipe", ["kivi", "kivi_sink", "xquant"])
def test_kernel_path_matches_dense_path(model, recipe, fused_on_cpu):
    tokens = mx.random.randint(0, 500, (1, 300), key=mx.random.key(1))
    _, caches = _run(model, recipe, tokens, decode=40)  # crosses several 32-token spills
    assert any(t.fusable and t.count for t in caches[0].tiers)
    # Decode steps fold the 16-bit window (kivi_sink: sinks and window) into the kernel's reduce.
    # xquant: anchor layers' tiers are affine; reuse layers' are read with the anchor's codes.
    assert set(fused_on_cpu) == {2 if recipe == "kivi_sink" else 1}, fused_on_cpu
    # Both paths on the same cache state and queries, each against float64. Comparing the models'
    # logits instead compounds float32 noise across layers, and where it flips a 2-bit code or an fp16
    # rounding the gap is set by the BLAS (9e-4 with MLX's bundled one, under 2e-4 with OpenBLAS).
    scale = 64**-0.5
    for seed, cache in enumerate(caches):
        q = mx.random.normal((1, 8, 1, 64), key=mx.random.key(10 + seed)) * 3
        want = _attention_f64(cache, q, scale)
        fused = np.array(cache.attend(q, scale, observe=False), dtype=np.float64)
        for t in cache.tiers:
            t.launch_key = None  # choose again: the dense path
        dispatch_choice = dispatch.choice
        dispatch.choice = lambda *a, **k: ("reference", "off")
        try:
            dense = np.array(cache.attend(q, scale, observe=False), dtype=np.float64)
        finally:
            dispatch.choice = dispatch_choice
        # float32's rounding of this attention, measured: the dense path's error (floored at a few ulps).
        floor = 8 * np.finfo(np.float32).eps * np.abs(want).max()
        err_dense, err_fused = (np.abs(x - want).max() for x in (dense, fused))
        # Measured: the merged partials err up to 2.7x the dense path (1.6e-6 vs 6e-7), either BLAS.
        assert err_fused <= 8 * max(err_dense, floor), (err_fused, err_dense, floor)


def test_kernel_tiers_hold_exact_buffers(model, fused_on_cpu):
    """A sliced buffer is not row-contiguous: the kernel launch would copy the tier every call."""
    tokens = mx.random.randint(0, 500, (1, 300), key=mx.random.key(2))
    _, caches = _run(model, "kivi", tokens, decode=37)
    tier = next(t for t in caches[0].tiers if t.fusable)
    for bufs in tier.buffers.values():
        for buf in bufs.values():
            assert buf.data.shape[2] == buf.used
    _, plain = _run(model, "fp16", tokens, decode=3)  # per-token appends keep step growth
    buf = plain[0].tiers[0].buffers["k"]["x"]
    assert buf.data.shape[2] > buf.used


def test_merge_keeps_empty_rows_empty():
    o = mx.ones((1, 2, 1, 4))
    empty = (mx.zeros((1, 2, 1, 4)), mx.full((1, 2, 1), -mx.inf))
    out = merge_partials([empty, empty])
    assert not bool(mx.any(mx.isnan(out))) and float(mx.abs(out).max()) == 0
    assert mx.allclose(merge_partials([empty, (o, mx.zeros((1, 2, 1)))]), o)


def test_partial_attention_gqa_rows_match_repeated_heads():
    q = mx.random.normal((1, 6, 3, 16), key=mx.random.key(4))
    k = mx.random.normal((1, 2, 10, 16), key=mx.random.key(5))
    v = mx.random.normal((1, 2, 10, 16), key=mx.random.key(6))
    out, lse = partial_attention(q, k, v, 0.25)
    want = mx.fast.scaled_dot_product_attention(q, mx.repeat(k, 3, axis=1), mx.repeat(v, 3, axis=1), scale=0.25)
    assert float(mx.abs(out - want).max()) < 1e-5
    s = (q @ mx.repeat(k, 3, axis=1).swapaxes(-1, -2)) * 0.25
    assert float(mx.abs(lse - mx.logsumexp(s, axis=-1)).max()) < 1e-5


@pytest.mark.parametrize("recipe,most", [("fp16", 4), ("kivi", 4), ("kivi_sink", 6)])
def test_decode_step_graph_stays_small(model, recipe, most):
    """Each op is a launch (or scheduler node) on the GPU: decode speed follows this count.
    Counted on the CUDA path's graph (kernel and fused SDPA = stand-ins of their launch count).
    In float32 the 16-bit stores add a cast per array (4 of fp16's ops)."""
    from mlx_lm.models.cache import make_prompt_cache as mlx_cache

    from veloxquant.bench.decode_ops import stand_in_for_cuda, step

    with stand_in_for_cuda():
        base, _ = step(model, mlx_cache(model), 200, 1)
        ops, _ = step(model, make_prompt_cache(model, recipe), 200, 40)
        uninstall(model)
    per_layer = (sum(ops.values()) - sum(base.values())) / len(model.layers)
    assert per_layer <= most, ops - base


def test_compiled_merge_is_exact_across_shapes():
    """The merge is compiled shapeless: one trace must serve every shape (checked in sequence)."""
    import numpy as np

    rng = np.random.default_rng(0)
    for shape in [(1, 4, 5, 8), (1, 4, 1, 8), (2, 3, 7, 16), (1, 9, 1, 64), (1, 4, 5, 8)]:
        o1, o2 = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
        l1, l2 = (3 * rng.standard_normal(shape[:3]).astype(np.float32) for _ in range(2))
        w1, w2 = np.exp(l1)[..., None], np.exp(l2)[..., None]
        want = (w1 * o1 + w2 * o2) / (w1 + w2)
        got = merge_partials([(mx.array(o1), mx.array(l1)), (mx.array(o2), mx.array(l2))])
        assert got.shape == shape
        np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(dispatch.backend() != "cuda", reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("recipe,heads,dim", [("kivi", (8, 2), 128), ("kivi_sink", (9, 3), 64)])
@pytest.mark.parametrize("chunk", [100, 300])
def test_cuda_decode_matches_reference_path(recipe, heads, dim, chunk, monkeypatch):
    """Decode with the real kernels (window folded into reduce_tail) against the same
    recipe with kernels off, both on the GPU in float16. chunk=300: the prompt in one block
    (as generate_step feeds it), so the first decode step spills and attends codes encoded
    in the same graph."""
    mx.random.seed(5)
    model = random_llama(2, *heads, dim, 500, mx.float16)
    tokens = mx.random.randint(0, 500, (1, 300), key=mx.random.key(1))
    fused, caches = _run(model, recipe, tokens, decode=40, chunk=chunk)
    assert any(t.launch is not None for t in caches[0].tiers), "no tier took the kernel"
    monkeypatch.setenv("VELOXQUANT_KERNELS", "off")
    ref, _ = _run(model, recipe, tokens, decode=40, chunk=chunk)
    scale = float(mx.abs(ref).max())
    err = float(mx.abs(fused.astype(mx.float32) - ref.astype(mx.float32)).max())
    assert err <= 1e-2 * scale, (err, scale)


@pytest.fixture
def placed_dequant_on_cpu(monkeypatch):
    """The dequant kernel's contract answered by the ops decode: the tier's values at
    [offset, offset + L) of a `length`-token buffer, every other row NaN (never read)."""
    from veloxquant.stages.store import Affine

    placed = []

    class Stand:
        @staticmethod
        def dequant_unsupported(enc, spec, dtype):
            return ""

        @staticmethod
        def dequantize(enc, spec, dtype, length=None, offset=0):
            x = Affine(**dict(zip(("bits", "group", "axis"), reference.spec_fields(spec)))).decode(enc, dtype)
            length = x.shape[2] if length is None else length
            placed.append((offset, x.shape[2], length))
            pad = lambda n: mx.full((*x.shape[:2], n, x.shape[3]), mx.nan, dtype=dtype)
            return mx.concatenate([pad(offset), x, pad(length - offset - x.shape[2])], axis=2)

    monkeypatch.setattr(dispatch, "dequantizer", lambda: Stand)
    return placed


@pytest.mark.parametrize("recipe", ["kivi", "kivi_sink"])
def test_prefill_decodes_tiers_into_one_buffer(model, recipe, placed_dequant_on_cpu):
    """Prefill attends over every tier through SDPA: the coded tier is decoded into
    its place in one buffer and the 16-bit tiers written around it (no concatenated copy)."""
    tokens = mx.random.randint(0, 500, (1, 300), key=mx.random.key(8))
    placed, _ = _run(model, recipe, tokens, decode=3)
    offsets = {o for o, L, n in placed_dequant_on_cpu if n > L}
    assert offsets == ({0} if recipe == "kivi" else {5}), placed_dequant_on_cpu  # kivi_sink: after its 5 sinks
    placed_dequant_on_cpu.clear()
    dispatch.dequantizer = lambda: None  # monkeypatch restores it
    concatenated, _ = _run(model, recipe, tokens, decode=3)
    assert not bool(mx.any(mx.isnan(placed)))
    assert float(mx.abs(placed - concatenated).max()) == 0.0


def test_sliding_layers_leave_expired_tokens_out_by_count(fused_on_cpu, monkeypatch):
    """Gemma-3's sliding layers: expiry drops whole key groups, so up to a group of expired tokens
    stays at the coded tier's front. A decode step hands the kernel their count (`hidden`) instead
    of taking the decoded, masked path, and answers what that path answers."""
    from veloxquant.runtime import fused, layer_attention

    from conftest import tiny_gemma3

    counts = []
    real = fused.kernel_answer

    def counted(tier, queries, scale, encoded=None, hidden=0):
        counts.append(hidden)
        return real(tier, queries, scale, encoded, hidden)

    monkeypatch.setattr(fused, "kernel_answer", counted)
    masked = lambda cache, tier, q, scale, first_q, Lq: tier.answer(q, scale, cache._tier_mask(tier, first_q, Lq))
    model = tiny_gemma3(window=96)
    caches = make_prompt_cache(model, "kivi", ["window=32"])
    tokens = mx.random.randint(0, 500, (1, 200), key=mx.random.key(4))
    try:
        mx.eval([model(tokens[:, s : s + 100], cache=caches) for s in (0, 100)])
        worst = 0.0
        for t in range(40):  # more than a key group expires
            mx.eval(model(mx.array([[t + 3]]), cache=caches))
            for c in (c for c in caches if c.plan.window):
                q = mx.random.normal((1, 2, 1, 64), key=mx.random.key(t)) * 3
                by_count = np.array(c.attend(q, 0.125, observe=False), dtype=np.float64)
                with monkeypatch.context() as m:
                    m.setattr(layer_attention, "masked_answer", masked)
                    by_mask = np.array(c.attend(q, 0.125, observe=False), dtype=np.float64)
                worst = max(worst, np.abs(by_count - by_mask).max() / np.abs(by_mask).max())
    finally:
        uninstall(model)
    assert any(0 < h < 32 for h in counts), counts  # sliding layers took the kernel with a count
    assert set(fused_on_cpu) == {1}  # and folded the fp16 window into its reduce
    assert worst < 1e-4, worst  # float32 rounding apart (measured: 1.7e-5 of the largest output)
