"""DuoAttention (recipes/duo_attention.yaml, stages/duo.py, runtime/kinds/head_subset.py): the gate
optimisation, calibration into an artifact, retrieval heads holding everything and streaming heads
sinks + window (bytes and attention), the same cache however tokens arrive, save/load, refusals."""

import mlx.core as mx
import numpy as np
import pytest

import veloxquant as vq
from veloxquant.bench import kvpress
from veloxquant.board.predict import held_bytes
from veloxquant.calibration.fit import calibrate
from veloxquant.compiler import ModelShape, compile_recipe
from veloxquant.compiler.batching import layer_layout, refusal
from veloxquant.errors import VeloxError
from veloxquant.recipe import load_recipe
from veloxquant.stages.duo import gate_loss, optimise_gates, retrieval_heads

import test_chunk_invariance as invariance
from conftest import tiny_llama

SINKS, WINDOW = 2, 16


class Tokens:
    def encode(self, text):
        return [(ord(c) - 1000) % 500 for c in text]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=2)


@pytest.fixture(scope="module")
def recipe(model, tmp_path_factory):
    """duo_attention at small sinks and window, calibrated on the tiny model (random text): its file,
    with VELOXQUANT_CACHE pointing at the artifact for the module's tests; and the artifact's metadata."""
    tmp = tmp_path_factory.mktemp("duo")
    corpus = tmp / "corpus.txt"
    corpus.write_text("".join(chr(1000 + int(i)) for i in np.random.default_rng(0).integers(0, 500, 700)))
    path = tmp / "duo_small.yaml"
    path.write_text(
        "veloxquant: 1\nname: duo_small\nextends: duo_attention\n"
        f"params: {{sinks: {SINKS}, window: {WINDOW}, tokens: 512, corpus: '{corpus}'}}\n"
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VELOXQUANT_CACHE", str(tmp / "cache"))
        plan = compile_recipe(load_recipe(str(path)), ModelShape.from_model(model))
        yield str(path), calibrate(plan, model, Tokens(), progress=False)


def test_gates_minimise_the_objective():
    """Uncoupled heads: the optimum is 1 - l1 / (2 g_h), clipped; a coupled G: no worse than any corner."""
    diag = np.diag([0.0, 0.004, 0.05, 1.0])
    a = optimise_gates(diag, l1=0.02, steps=3000)
    np.testing.assert_allclose(a, np.clip(1 - 0.02 / (2 * np.diag(diag).clip(1e-12)), 0, 1), atol=2e-3)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 5))
    gram = x @ x.T / 50
    a = optimise_gates(gram, l1=0.05, steps=3000)
    corners = [np.array([(c >> i) & 1 for i in range(5)], float) for c in range(32)]
    assert gate_loss(gram, a, 0.05) <= min(gate_loss(gram, c, 0.05) for c in corners) + 1e-6
    assert ((a >= 0) & (a <= 1)).all()


def test_calibration_writes_gates_and_ranks_heads(recipe):
    _, meta = recipe
    assert meta["bytes"] > 0 and meta["stages"] == 2
    kept = retrieval_heads(meta["content"], 0.5)
    assert sorted(kept) == ["0.2.route", "1.2.route"]
    assert sum(len(h) for h in kept.values()) == 3  # round(0.5 * 6)
    assert sum(len(h) for h in retrieval_heads(meta["content"], 1.0).values()) == 6


def _caches(model, recipe, extra=()):
    return vq.make_prompt_cache(model, recipe[0], sets=list(extra))


def test_streaming_heads_hold_sinks_and_window(model, recipe):
    ids = mx.random.randint(0, 500, (1, 300), key=mx.random.key(1))
    caches = _caches(model, recipe)
    mx.eval(model(ids, cache=caches))
    model(ids[:, :1], cache=caches)  # one decode step settles the prompt
    for c in caches:
        sink, recent, duo = c.tiers
        kept = len(duo.kept)
        assert (sink.count, recent.count) == (SINKS, WINDOW + 1)
        assert duo.count == (301 - sink.count - recent.count if kept else 0)  # a layer of streaming heads: none
        if kept:
            assert duo.buffers["k"]["x"].view().shape[1] == kept  # only the retrieval heads' rows
        held = sum(b.nbytes for bufs in duo.buffers.values() for b in bufs.values())
        index = duo.kept_index.nbytes if duo.kept_index is not None else 0
        assert duo.nbytes == held + index + sum(a.nbytes for p in duo._maps.values() for a in p)
    # retrieval=0: every head streams, the duo tiers hold nothing
    none = _caches(model, recipe, ["retrieval=0"])
    mx.eval(model(ids, cache=none))
    assert all(c.tiers[2].count == 0 for c in none)
    assert sum(c.nbytes for c in none) < sum(c.nbytes for c in caches)


def test_attention_is_per_head(model, recipe):
    """A decode query's output: retrieval heads attend over every token, streaming heads over sinks + window."""
    caches = _caches(model, recipe, ["retrieval=0.34"])  # 2 of the 6 heads kept whole
    c = next(c for c in caches if 0 < len(c.tiers[2].kept) < 3)  # a layer with both kinds of head
    H, N, D, rep = 3, 120, 64, 3
    k, v = (mx.random.normal((1, H, N, D), key=mx.random.key(s)).astype(mx.float16) for s in (2, 3))
    c.update_and_fetch(k, v)
    c.attend(mx.random.normal((1, H * rep, N, D), key=mx.random.key(4)).astype(mx.float16), D**-0.5)
    k1, v1 = (mx.random.normal((1, H, 1, D), key=mx.random.key(s)).astype(mx.float16) for s in (5, 6))
    q1 = mx.random.normal((1, H * rep, 1, D), key=mx.random.key(7)).astype(mx.float16)
    c.update_and_fetch(k1, v1)
    got = np.array(c.attend(q1, D**-0.5).astype(mx.float32))[0, :, 0]
    K = np.array(mx.concatenate([k, k1], axis=2).astype(mx.float32))[0]
    V = np.array(mx.concatenate([v, v1], axis=2).astype(mx.float32))[0]
    pos = np.arange(N + 1)
    kept = c.tiers[2].kept
    for j in range(H * rep):
        h = j // rep
        see = np.ones(N + 1, bool) if h in kept else (pos < SINKS) | (pos >= N - WINDOW)
        s = (np.array(q1[0, j, 0].astype(mx.float32)) * D**-0.5) @ K[h].T
        w = np.exp(np.where(see, s, -np.inf) - s[see].max())
        np.testing.assert_allclose(got[j], (w / w.sum()) @ V[h], atol=3e-3)


def test_all_heads_retrieved_is_full_attention(model, recipe):
    ids = mx.random.randint(0, 500, (1, 200), key=mx.random.key(8))
    full = model(ids, cache=vq.make_prompt_cache(model, "fp16"))
    fed = []
    caches = _caches(model, recipe, ["retrieval=1"])
    for s in range(0, 200, 50):  # chunks: later ones attend over the duo tier
        fed.append(model(ids[:, s : s + 50], cache=caches))
    np.testing.assert_allclose(np.array(mx.concatenate(fed, axis=1)), np.array(full), atol=2e-3)


def test_same_tokens_same_cache(model, recipe):
    invariance.check(model, recipe[0], invariance.FEED)


def test_save_load_continues(model, recipe, tmp_path):
    ids = mx.random.randint(0, 500, (1, 150), key=mx.random.key(9))
    caches = _caches(model, recipe)
    mx.eval(model(ids, cache=caches))
    vq.save_prompt_cache(str(tmp_path / "duo.safetensors"), caches)
    loaded, _ = vq.load_prompt_cache(str(tmp_path / "duo.safetensors"), expect_fingerprint=caches[0].fingerprint)
    step = ids[:, -1:]
    np.testing.assert_array_equal(np.array(model(step, cache=loaded)), np.array(model(step, cache=caches)))
    assert [c.tiers[2].count for c in loaded] == [c.tiers[2].count for c in caches]


def test_refusals(model, recipe):
    caches = _caches(model, recipe)
    assert layer_layout(caches[0].plan) is None  # batches refuse, saying why
    assert "duo route holds tokens in a tier kind of its own" in refusal(caches[0].plan_root)
    assert not hasattr(caches[0], "merge")  # mlx-lm's server serves it one sequence at a time
    with pytest.raises(VeloxError, match="does not batch: layer 0: its duo route"):
        caches[0].merge([caches[0], _caches(model, recipe)[0]])
    vq.uninstall(model)
    with pytest.raises(VeloxError):
        model(mx.array([[1, 2, 3]]), cache=caches)  # without the hook the heads cannot be told apart


def test_kvpress_rows_remove_the_fraction_by_heads():
    """bench kvpress: the share of heads kept whole that removes a fraction of the prefix, streaming heads
    holding sinks + window; token rows (and the bench's own streaming row) are not head splits."""
    for fraction in (0.5, 0.75, 0.85):
        share = kvpress.retrieval_share(fraction, 68, 1536)
        assert (1 - share) * (1 - 68 / 1536) == pytest.approx(fraction)
    assert kvpress.retrieval_share(0.99, 68, 1536) == 0.0  # past what streaming every head removes
    assert kvpress.head_split("duo_attention[window=32]") and not kvpress.head_split("h2o")


def test_recommend_predicts_the_held_bytes(model, recipe):
    """board/predict.py: the duo tier at the retrieval share of the heads (3 of 6 here), 256-token steps."""
    ids = mx.random.randint(0, 500, (1, 300), key=mx.random.key(11))
    caches = _caches(model, recipe)
    mx.eval(model(ids, cache=caches))
    measured = sum(c.nbytes for c in caches)
    predicted = held_bytes(recipe[0], [], ModelShape.from_model(model), 300)
    assert predicted == pytest.approx(measured, rel=0.02)
