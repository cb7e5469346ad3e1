"""kernels/partials.py: a long block of queries attends in blocks of query positions (never one
[batch x heads x queries x keys] score array past SCORE_ELEMENTS), with the same answer."""

import mlx.core as mx
import numpy as np
import pytest

from veloxquant.kernels import partials


@pytest.mark.parametrize("mask_shape", [None, (40, 96), (2, 1, 40, 96), (1, 96)])
def test_query_blocks_give_the_unblocked_answer(monkeypatch, mask_shape):
    k0, k1, k2, k3 = mx.random.split(mx.random.key(0), 4)
    q = mx.random.normal((2, 6, 40, 16), key=k0)
    k = mx.random.normal((2, 2, 96, 16), key=k1)
    v = mx.random.normal((2, 2, 96, 16), key=k2)
    mask = None if mask_shape is None else mx.random.uniform(shape=mask_shape, key=k3) > 0.3
    whole = partials.partial_attention(q, k, v, 0.25, mask)
    seen = []
    scores = partials.partial_from_scores

    def counted(s, *a):
        seen.append(s.size)
        return scores(s, *a)

    monkeypatch.setattr(partials, "partial_from_scores", counted)
    monkeypatch.setattr(partials, "SCORE_ELEMENTS", 2 * 6 * 96 * 7)  # 7 query positions a block
    blocked = partials.partial_attention(q, k, v, 0.25, mask)
    assert len(seen) == 6 and max(seen) <= partials.SCORE_ELEMENTS
    for a, b in zip(whole, blocked):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=0, atol=1e-6)


def test_a_biased_partial_and_its_blend_answer_as_the_masked_partial_and_the_merge():
    """A batch's decode step: its window under an additive mask (one LogSumExp) and the blend of two
    partials (a sigmoid of their lse difference) give what the boolean-masked partial and the
    general merge give, rows with few seen columns included."""
    k0, k1, k2, k3, k4, k5 = mx.random.split(mx.random.key(3), 6)
    B, Hq, Hkv, W, D = 4, 8, 2, 24, 16
    q = mx.random.normal((B, Hq, 1, D), key=k0)
    k = mx.random.normal((B, Hkv, W, D), key=k1)
    v = mx.random.normal((B, Hkv, W, D), key=k2)
    filled = np.array([24, 1, 7, 16])
    seen = np.arange(W)[None] < filled[:, None]
    masked = partials.partial_attention(q, k, v, 0.125, mx.array(seen[:, None, None, None, :]))
    bias = mx.array(np.where(seen, 0.0, partials.MASKED).astype(np.float32)[:, None, None, :])
    biased = partials.biased_partial(q, k, v, 0.125, bias)
    for a, b in zip(masked, biased):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-5)
    other = (mx.random.normal((B, Hq, 1, D), key=k3), 4 * mx.random.normal((B, Hq, 1), key=k4))
    empty_rows = mx.where(mx.random.uniform(shape=(B, Hq, 1), key=k5) > 0.7, -mx.inf, other[1])
    for second in (other, (other[0], empty_rows)):  # rows the other partial sees nothing of: lse -inf
        np.testing.assert_allclose(
            np.array(partials.blend_two(biased, second)),
            np.array(partials.merge_partials([biased, second])),
            rtol=1e-5,
            atol=1e-5,
        )
