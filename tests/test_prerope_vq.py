"""commvq and a2ats: codebooks of pre-RoPE keys, RoPE re-applied in the scores (tiny random models)."""

import mlx.core as mx
import numpy as np
import pytest

import veloxquant as vq
from veloxquant.calibration.fit import calibrate
from veloxquant.kernels.partials import partial_attention
from veloxquant.runtime.code_attention import codes_partial_attention
from veloxquant.runtime.make import plan_for
from veloxquant.runtime.persist import load_prompt_cache, save_prompt_cache
from veloxquant.stages import rope_pairs as rp
from veloxquant.stages.productvq import kmeans
from veloxquant.stages.unrope import rotate

from conftest import feed, tiny_gemma3


class Tokens:
    def encode(self, text):
        return [(ord(c) - 1000) % 500 for c in text]


@pytest.fixture
def recipes(tmp_path, monkeypatch):
    monkeypatch.setenv("VELOXQUANT_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(chr(1000 + int(i)) for i in np.random.default_rng(0).integers(0, 500, 600)))

    def make(name, keys, values="rotation | lloydmax(bits=4)"):
        path = tmp_path / f"{name}.yaml"
        path.write_text(
            f'veloxquant: 1\nname: {name}\npipeline: |\n  keys: unrope | {keys[:-1]}, corpus="{corpus}", '
            f"tokens=256)\n  values: {values}\n"
        )
        return str(path)

    return make


def _calibrated(model, recipe):
    plan = vq.compile_recipe(vq.load_recipe(recipe), vq.compiler.ModelShape.from_model(model))
    calibrate(plan, model, Tokens(), progress=False)
    return plan_for(model, recipe)


def _filled_tier(plan, start=0, n=40, layer=2):
    tier = vq.runtime.kinds.build(plan.layers[layer].tiers[0], plan.layers[layer], False)
    k = mx.random.normal((1, 3, n, 64), key=mx.random.key(0)) * mx.linspace(0.2, 3, 64)
    tier.append(k, k * 0.5, start)
    return tier, k


def _both(tier, q, start, first_q):
    kd, vd = tier.decoded(mx.float32)  # decode-then-attend: codes -> pre-RoPE keys -> RoPE by position
    ref = partial_attention(q, kd, vd, 0.125)
    got = codes_partial_attention(
        q,
        tier.encoded("k"),
        tier.encoded("v"),
        tier.codecs["k"],
        tier.codecs["v"],
        0.125,
        key_start=start,
        first_q=first_q,
    )
    return ref, got


@pytest.mark.parametrize(
    "spec",
    [
        (64, False, 100000.0, 1.0, None),
        (64, True, 10000.0, 0.25, None),
        (64, False, None, 1.0, tuple(float(1.5**i) for i in range(32))),
    ],
)
def test_rope_at_any_positions_equals_the_models_rope(spec):
    x = mx.random.normal((1, 2, 9, 64), key=mx.random.key(3))
    assert float(mx.abs(rotate(x, spec, 1000) - rp.rotate_at(x, spec, mx.arange(1000, 1009))).max()) < 1e-3
    assert float(mx.abs(rp.rotate_at(rp.rotate_at(x, spec, mx.arange(9)), spec, mx.arange(9), True) - x).max()) < 1e-5


def test_commvq_scores_rotate_the_codes_exactly_as_decode_then_attend(llama_model, recipes):
    plan = _calibrated(llama_model, recipes("cvq", "commvq(bits=2, iters=3)"))
    store = plan.layers[2].tiers[0].keys.store
    assert store.stages(64) == 9 and store.bits_per_element(64) == 2.0  # 9 x 12-bit codes + float16 norm = 128 bits
    tier, k = _filled_tier(plan, start=300)
    assert tier.codecs["k"].scores_from_codes and tier.encoded("k")["codes"].shape[-1] == 4
    q = mx.random.normal((1, 9, 2, 64), key=mx.random.key(1))
    ref, got = _both(tier, q, 300, 338)
    assert float(mx.abs(ref[0] - got[0]).max()) < 1e-4 and float(mx.abs(ref[1] - got[1]).max()) < 1e-3
    err = float(mx.sum((tier.decoded(mx.float32)[0] - k) ** 2) / mx.sum(k * k))
    one_bit = _calibrated(llama_model, recipes("cvq1", "commvq(bits=1, iters=3)"))
    err1 = float(mx.sum((_filled_tier(one_bit, start=300)[0].decoded(mx.float32)[0] - k) ** 2) / mx.sum(k * k))
    assert err < err1 < 1.0  # 18 codes beat 8; both beat nothing (relative error of random keys)


def test_commvq_codewords_commute_with_rope(llama_model, recipes):
    """R(n) (c_A + i c_B) == (R(n) c_A) + i (R(n) c_B): rotating the books equals rotating the decoded key."""
    plan = _calibrated(llama_model, recipes("cvq", "commvq(bits=1, iters=2)"))
    store = plan.layers[1].tiers[0].keys.store
    t = store._t()
    spec = store._spec()
    c, s = rp.cos_sin(spec, mx.array([77]))
    rotated = {"re": t["re"] * c - t["im"] * s, "im": t["re"] * s + t["im"] * c}
    enc = store.encode(mx.random.normal((1, 3, 5, 64), key=mx.random.key(4)))
    direct = rp.rotate_at(store.decode(enc, mx.float32), spec, mx.full((5,), 77))  # each key at position 77
    from veloxquant import artifacts as artifact

    slot = (store._artifact, store._slot)
    books = artifact._SLOTS[slot]
    artifact._SLOTS[slot] = rotated
    try:
        via_books = store.decode(enc, mx.float32)
    finally:
        artifact._SLOTS[slot] = books
    assert float(mx.abs(direct - via_books).max()) < 1e-4


def test_a2ats_beta_one_is_plain_vq(llama_model, recipes):
    plan = _calibrated(llama_model, recipes("a1", "qavq(beta=1.0, centroids=16)"))
    store = plan.layers[0].tiers[0].keys.store
    book = np.array(store._t()["codebook"])  # [H, P, C, d]
    x = mx.random.normal((1, 3, 30, 64), key=mx.random.key(5))
    codes = np.array(store._codes(store.encode(x, mx.random.uniform(shape=(3, 64)) * 5), 64))
    pieces = np.array(x).reshape(1, 3, 30, 8, 8)
    dist = ((pieces[:, :, :, :, None, :] - book[None, :, None]) ** 2).sum(-1)  # [1, H, L, P, C]
    assert (codes == dist.argmin(-1)).all()  # nearest centroid, whatever the query energies
    rng = np.random.default_rng(0)
    samples, queries = rng.normal(size=(3, 200, 64)).astype(np.float32), rng.normal(size=(9, 50, 64)).astype(np.float32)
    fitted = store.fit(samples * np.linspace(0.5, 2, 64), queries * np.linspace(3, 0.1, 64))
    plain = kmeans((samples[1] * np.linspace(0.5, 2, 64)).reshape(200, 8, 8)[:, 3].astype(np.float64), 16, seed=8 + 3)
    assert np.allclose(fitted["codebook"][1, 3], plain, atol=1e-5)  # beta=1: plain k-means, the queries unused


def test_a2ats_windowed_rope_reductions(llama_model, recipes):
    exact_plan = _calibrated(llama_model, recipes("aw", "qavq(beta=0.5, centroids=16, window=1000)"))
    tier, _ = _filled_tier(exact_plan, start=100)
    q = mx.random.normal((1, 9, 1, 64), key=mx.random.key(6))
    ref, got = _both(tier, q, 100, 139)  # window >= length: exact RoPE for every key == decode-then-attend
    assert float(mx.abs(ref[0] - got[0]).max()) < 1e-4
    store, codec = tier.codecs["k"].store, tier.codecs["k"]
    spec, enc = store._spec(), tier.encoded("k")
    pre = store.decode(enc, mx.float32)  # pre-RoPE keys
    qpos = mx.array([139] * 3)
    qr = q.reshape(1, 3, 3, 64)
    for window, offset in ((0, 0), (-5, 0), (10, 10)):
        s = mx.array(attrs_evolve(store, window=window).scores_at(qr, enc, spec, 100, qpos))
        far = rp.rotate_at(qr, spec, qpos - offset, inverse=True) @ pre.swapaxes(-1, -2)
        exact = qr @ rotate(pre, spec, 100).swapaxes(-1, -2)
        n = np.arange(100, 140)
        want = np.where((139 - n) < window, np.array(exact), np.array(far))
        assert np.abs(np.array(s) - want).max() < 1e-3, window
    assert codec.scores_from_codes


def attrs_evolve(store, **kw):
    import attrs

    return attrs.evolve(store, **kw)


def test_a2ats_assigns_by_the_queries_it_answered_and_keeps_them(llama_model, recipes, tmp_path):
    recipe = recipes("aq", "qavq(beta=0.0, centroids=16, window=8)")
    _calibrated(llama_model, recipe)
    caches = vq.make_prompt_cache(llama_model, recipe)
    tokens = mx.random.randint(0, 500, (1, 40), key=mx.random.key(7))
    feed(llama_model, tokens, caches, 20)
    tier = caches[1].tiers[0]
    assert type(tier).__name__ == "QueryAwareTier" and tier.side_state["energy"].shape == (3, 64)
    assert tier.nbytes == sum(b.nbytes for bs in tier.buffers.values() for b in bs.values()) + 3 * 64 * 4
    x = mx.random.normal((1, 3, 16, 64), key=mx.random.key(8))
    store = tier.codecs["k"].store
    assert not mx.array_equal(store.encode(x, tier.side_state["energy"])["codes"], store.encode(x)["codes"])
    save_prompt_cache(str(tmp_path / "a.safetensors"), caches)
    loaded, _ = load_prompt_cache(str(tmp_path / "a.safetensors"), model=llama_model)
    nxt = mx.array([[5, 6, 7]])
    assert float(mx.abs(llama_model(nxt, cache=caches) - llama_model(nxt, cache=loaded)).max()) == 0.0


@pytest.mark.parametrize("keys", ["commvq(bits=2, iters=2)", "qavq(centroids=16, window=8)"])
def test_generate_and_save_load_on_llama_and_gemma(llama_model, recipes, tmp_path, keys):
    from mlx_lm.generate import generate_step

    name = keys.split("(")[0]
    recipe = recipes(name, keys)
    for model in (llama_model, tiny_gemma3()):
        _calibrated(model, recipe)
        caches = vq.make_prompt_cache(model, recipe)
        out = [int(t) for t, _ in generate_step(mx.arange(60) % 500, model, prompt_cache=caches, max_tokens=6)]
        assert len(out) == 6
        save_prompt_cache(str(tmp_path / "c.safetensors"), caches)
        loaded, _ = load_prompt_cache(str(tmp_path / "c.safetensors"), model=model)
        nxt = mx.array([[1, 2]])
        assert float(mx.abs(model(nxt, cache=caches) - model(nxt, cache=loaded)).max()) == 0.0
        vq.uninstall()


def test_commvq_m_step_is_the_commutative_least_squares_solution():
    """The constrained M-step (one complex system for all pairs) equals a brute-force real lstsq over
    codewords built as c_A + i c_B."""
    from veloxquant.stages.commvq import _m_step

    rng = np.random.default_rng(0)
    N, P, C = 300, 4, 8
    x = rng.normal(size=(N, P)) + 1j * rng.normal(size=(N, P))
    A, B = rng.integers(0, C, N), rng.integers(0, C, N)
    got = _m_step(x, A, B, C, np.zeros((C, P), complex))
    S = np.zeros((N, C), complex)  # x_n = sum_a S[n, a] c_a with S = e_A + i e_B
    np.add.at(S, (np.arange(N), A), 1)
    np.add.at(S, (np.arange(N), B), 1j)
    real = np.block([[S.real, -S.imag], [S.imag, S.real]])  # complex least squares as a real one
    sol = np.linalg.lstsq(real, np.concatenate([x.real, x.imag]), rcond=None)[0]
    assert np.allclose(got, sol[:C] + 1j * sol[C:], atol=1e-4)
