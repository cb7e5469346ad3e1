"""AnchorKV: the anchor store (stages/anchor.py) and its tier kind (runtime/kinds/anchor_side.py, anchor_tier.py)."""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

import veloxquant
from veloxquant.kernels.partials import partial_attention
from veloxquant.runtime.kinds.anchor_side import AnchorSide
from veloxquant.stages.anchor import Anchor
from veloxquant.stages.store import Affine

from conftest import pipeline_recipe, tiny_gemma3, tiny_llama

B, H, D = 1, 3, 64


def tokens(n, seed=0, dtype=mx.float16):
    rng = np.random.default_rng(seed)
    return mx.array(rng.standard_normal((B, H, n, D)).astype(np.float32)).astype(dtype)


def fitted_side(x, mass=None, impact=None, **params):
    side = AnchorSide(SimpleNamespace(store=Anchor(**params)), H, D)
    side.append(x)
    n = x.shape[2]
    side.finish_prompt(mx.ones((B, H, n)) if mass is None else mass, impact or (lambda r: mx.sum(r * r, axis=-1)))
    return side


def test_every_token_an_anchor_is_float16_exactly_before_and_after_the_prompt():
    x, later = tokens(100), tokens(20, seed=1)
    side = fitted_side(x, anchors=1.0, theta=1.0)
    side.append(later)
    want = mx.concatenate([x, later], axis=2)
    assert side.view("rpos") is None  # no token left to hold a residual
    assert mx.array_equal(side.decoded(mx.float16), want).item()
    q = tokens(5, seed=2, dtype=mx.float32)
    assert mx.array_equal(side.scores(q), q @ want.astype(mx.float32).swapaxes(-1, -2)).item()


def test_theta_one_is_the_affine_residual_codec_on_every_other_token():
    x = tokens(96)
    store = Anchor(anchors=0.25, theta=1.0, bits=4)
    side = fitted_side(x, anchors=0.25, theta=1.0, bits=4)
    anchors, idx, coeff = side.view("anchors"), side.view("idx")[..., 0], side.view("coeff")[..., 0]
    base = store.approx(anchors, idx, coeff)
    codec = Affine(bits=4, group=D, axis="token")
    want = base + codec.decode(codec.encode(x.astype(mx.float32) - base), mx.float32)
    got = side.decoded(mx.float32)
    is_anchor = np.array(coeff == 1) & np.array(mx.all(base == x.astype(mx.float32), axis=-1))
    assert is_anchor.sum() == B * H * store.count(96)  # anchors: exact, no residual
    np.testing.assert_array_equal(np.array(got)[is_anchor], np.array(x.astype(mx.float32))[is_anchor])
    np.testing.assert_allclose(np.array(got)[~is_anchor], np.array(want)[~is_anchor], atol=1e-5)
    assert side.view("rpos").shape[2] == 96 - store.count(96)


def test_theta_zero_holds_anchors_index_and_coefficient_only():
    side = fitted_side(tokens(200), anchors=0.125, theta=0.0)
    A = Anchor(anchors=0.125).count(200)
    assert set(side.arrays()) == {"anchors", "idx", "coeff"}
    assert side.nbytes == B * H * (A * D * 2 + 200 * (2 + 2))  # float16 anchors, uint16 index, float16 coeff


def test_attention_from_held_arrays_matches_the_decoded_reference():
    x = tokens(160)
    side = fitted_side(x, anchors=0.1, theta=0.3)
    side.drop(7, True)  # heads lose residuals unevenly: masked entries must not leak
    side.drop(5, False)
    q = tokens(6, seed=3, dtype=mx.float32)
    ref = side.decoded(mx.float32)
    assert mx.allclose(side.scores(q), q @ ref.swapaxes(-1, -2), atol=1e-4).item()
    w = mx.softmax(q @ ref.swapaxes(-1, -2), axis=-1)
    assert mx.allclose(side.combine(w), w @ ref, atol=1e-4).item()


def test_dropping_tokens_keeps_each_residual_on_its_token():
    side = fitted_side(tokens(128), anchors=0.1, theta=0.5)
    before = side.decoded(mx.float32)
    side.drop(9, True)
    assert mx.array_equal(side.decoded(mx.float32), before[:, :, 9:]).item()
    side.drop(4, False)
    assert mx.array_equal(side.decoded(mx.float32), before[:, :, 9:-4]).item()


def test_residuals_go_where_the_estimate_is_largest():
    impact = mx.zeros((B, H, 64)).at[:, :, mx.array([3, 40, 41])].add(1.0)
    side = fitted_side(tokens(64), anchors=1 / 64, theta=3 / 63, impact=lambda r: impact + 0 * r[..., 0])
    assert np.array(side.view("rpos"))[..., 0].tolist() == [[[3, 40, 41]] * H]


def test_anchors_include_the_heaviest_hitters():
    mass = mx.array(np.random.default_rng(5).random((B, H, 80)).astype(np.float32))
    mass = mass.at[:, :, 17].add(10.0)
    pos = Anchor(anchors=0.1).choose(tokens(80).astype(mx.float32), mass)
    assert bool(mx.all(mx.any(pos == 17, axis=-1)).item())


def exact_partial(keys, values, q):
    return partial_attention(q, keys, values, 1.0)[0]


def test_ranking_on_real_queries_beats_the_reverse_ranking():
    # The first-order estimate picks which keys get a residual; choosing by it must give a smaller output
    # error on the queries that ranked than choosing the tokens it ranks lowest.
    from veloxquant.runtime.kinds.anchor_tier import AnchorTier

    rng = np.random.default_rng(7)
    keys = mx.array((rng.standard_normal((B, H, 300, D)) * 0.3).astype(np.float16))
    values = tokens(300, seed=8)
    q = mx.array(rng.standard_normal((B, 3 * H, 32, D)).astype(np.float32))
    errors = {}
    for flip in (False, True):
        tier = AnchorTier(
            SimpleNamespace(
                route=None,
                keys=SimpleNamespace(store=Anchor(anchors=0.05, theta=0.2)),
                values=SimpleNamespace(store=Anchor(anchors=1.0)),
            ),
            H,
            D,
        )
        tier.append(keys, values, 0)
        tier.partial(q, 1.0)  # the queries attend before the end of the prompt: they are observed
        if flip:
            side = tier.sides["k"]
            real = side.finish_prompt
            side.finish_prompt = lambda mass, rank: real(mass, lambda r: -rank(r))
        tier.finish_prompt()
        out = tier.partial(q, 1.0)[0]
        errors[flip] = float(mx.mean((out - exact_partial(keys, values, q)) ** 2).item())
    assert errors[False] < 0.8 * errors[True], errors


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_runs_saves_and_loads_on_a_model(tmp_path, make):
    model = make()
    recipe = pipeline_recipe(
        tmp_path, "recent(16)\n>> keys: anchor(anchors=0.2, theta=0.3)\n   values: anchor(anchors=0.2, theta=0.3)", "a"
    )
    caches = veloxquant.make_prompt_cache(model, recipe)
    toks = mx.array(np.random.default_rng(4).integers(0, 500, (1, 90)))
    model(toks[:, :80], cache=caches)
    logits = model(toks[:, 80:81], cache=caches)  # the prompt's end: the anchors are fitted
    assert bool(mx.all(mx.isfinite(logits)).item())
    path = str(tmp_path / "c.safetensors")
    veloxquant.save_prompt_cache(path, caches)
    loaded, _ = veloxquant.load_prompt_cache(path)
    a, b = model(toks[:, 81:82], cache=caches), model(toks[:, 81:82], cache=loaded)
    assert mx.array_equal(a, b).item()
    assert sum(c.nbytes for c in loaded) == sum(c.nbytes for c in caches)


def test_a_long_chunk_is_answered_in_query_blocks_with_the_same_result(monkeypatch):
    from veloxquant.runtime.kinds import anchor_tier
    from veloxquant.runtime.kinds.anchor_tier import AnchorTier

    plan = SimpleNamespace(
        route=None,
        keys=SimpleNamespace(store=Anchor(anchors=0.2, theta=0.3)),
        values=SimpleNamespace(store=Anchor(anchors=0.2, theta=0.3)),
    )
    tier = AnchorTier(plan, H, D)
    tier.append(tokens(120), tokens(120, seed=1), 0)
    q = tokens(40, seed=2, dtype=mx.float32).reshape(B, H, 40, D)
    q = mx.concatenate([q, q, q], axis=1)  # 9 query heads
    mask = mx.array(np.random.default_rng(3).random((40, 120)) > 0.3)
    for fit in (False, True):
        whole = tier.partial(q, 0.125, mask)
        monkeypatch.setattr(anchor_tier, "QUERY_BLOCK", 7)
        blocked = tier.partial(q, 0.125, mask)
        monkeypatch.setattr(anchor_tier, "QUERY_BLOCK", 256)
        assert mx.allclose(whole[0], blocked[0], atol=1e-5).item() and mx.allclose(whole[1], blocked[1]).item()
        tier.finish_prompt()
