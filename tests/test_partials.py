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
