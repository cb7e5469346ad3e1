"""Scoring a block of queries at a time gives the materialised softmax's output and column
sums (float tolerance), and never holds [heads x queries x keys] at once."""

import mlx.core as mx
import numpy as np
import pytest

from veloxquant.runtime.eviction.scoring import (
    additive,
    attend_blocked,
    attention_weights,
    block_size,
    position_mask,
    received,
)

B, HQ, HKV, D = 1, 6, 2, 16


def _inputs(Lq: int, L: int, seed: int):
    rng = np.random.default_rng(seed)
    q, k, v = (
        mx.array(rng.standard_normal(s).astype(np.float32)) for s in ((B, HQ, Lq, D), (B, HKV, L, D), (B, HKV, L, D))
    )
    # Per-head positions, as after eviction: each head holds its own increasing subset of [0, L + 40).
    pos = np.stack([np.sort(rng.choice(L + 40 - Lq, L - Lq, replace=False)) for _ in range(HKV)])
    pos = np.concatenate([pos, np.broadcast_to(np.arange(L + 40 - Lq, L + 40), (HKV, Lq))], axis=1)
    return q, k, v, mx.array(pos[None].astype(np.int32)), L + 40 - Lq


@pytest.mark.parametrize(
    "Lq, L, block, rows, window",
    [
        (37, 90, 8, 1, None),
        (37, 90, 8, 5, 30),
        (40, 90, 8, 12, None),
        (1, 50, 8, 1, None),
        (16, 60, 16, 3, None),
        (9, 60, 4, 4, 7),
    ],
)
def test_blocked_equals_materialised(Lq, L, block, rows, window):
    q, k, v, kpos, first_q = _inputs(Lq, L, Lq * L)
    w = attention_weights(q, k, 0.25, position_mask(kpos, first_q, Lq, window))
    want_out = (w @ v[:, :, None]).reshape(B, HQ, Lq, D)
    want_total, want_rows = received(w, rows)
    out, total, tail = attend_blocked(
        q, k, v, 0.25, lambda s, n: position_mask(kpos, first_q + s, n, window), block, rows
    )
    np.testing.assert_allclose(np.array(out), np.array(want_out), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(total), np.array(want_total), rtol=1e-5, atol=1e-6)
    assert tail.shape == want_rows.shape
    np.testing.assert_allclose(np.array(tail), np.array(want_rows), rtol=1e-5, atol=1e-6)


def test_one_block_is_bit_identical():
    """Decode and short steps run as one block: exactly the materialised computation."""
    q, k, v, kpos, first_q = _inputs(5, 40, 1)
    w = attention_weights(q, k, 0.25, position_mask(kpos, first_q, 5, None))
    out, total, _ = attend_blocked(q, k, v, 0.25, lambda s, n: position_mask(kpos, first_q + s, n, None), 8)
    want = (w.reshape(B, HKV, -1, w.shape[-1]) @ v).reshape(B, HQ, 5, D)
    assert mx.array_equal(out, want).item()
    assert mx.array_equal(total, received(w)[0]).item()


def test_block_size_bounded_by_bytes():
    assert block_size(9, 8192, 128, 32 * 2**20) == 113  # 32 MiB / (4 B * 9 heads * 8192 keys)
    assert block_size(9, 256, 128, 32 * 2**20) == 128
    assert block_size(64, 10**9, 128, 2**20) == 1


def test_peak_memory_stays_a_block():
    """2048 queries over 2048 keys: the materialised weights would be 6 heads x 2048 x 2048 x 4 B = 96 MiB."""
    q, k, v, kpos, first_q = _inputs(2048, 2048, 3)
    mx.eval(q, k, v, kpos)
    mx.synchronize()
    start = mx.get_active_memory()
    mx.reset_peak_memory()
    out, total, tail = attend_blocked(
        q, k, v, 0.25, lambda s, n: position_mask(kpos, first_q + s, n, None), block_size(HQ, 2048, 128, 2 * 2**20)
    )
    mx.eval(out, total, tail)
    peak = (mx.get_peak_memory() - start) / 2**20
    assert peak < 40, f"blocked scoring peaked at {peak:.0f} MiB"


def test_sync_bytes_changes_nothing_but_when_blocks_are_computed():
    """Evaluating the blocks as they go (prefill's bounded peak) gives the same bits as one lazy graph."""
    q, k, v, kpos, first_q = _inputs(70, 120, 5)
    mask_for = lambda s, n: position_mask(kpos, first_q + s, n, None)  # noqa: E731
    lazy = attend_blocked(q, k, v, 0.25, mask_for, 8, rows=3)
    synced = attend_blocked(q, k, v, 0.25, mask_for, 8, rows=3, sync_bytes=1)  # evaluate after every block
    for a, b in zip(lazy, synced):
        assert mx.array_equal(a, b).item()


def test_additive_mask_is_the_boolean_one_in_sdpa():
    """SDPA gets the additive form (CUDA would broadcast and convert a boolean one in full): same output."""
    rng = np.random.default_rng(2)
    q = mx.array(rng.standard_normal((B, HQ, 12, D)).astype(np.float32))
    k, v = (mx.array(rng.standard_normal((B, HKV, 30, D)).astype(np.float32)) for _ in range(2))
    mask = position_mask(mx.arange(30), 18, 12, 7)  # a sliding window: no string mask says it
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    got = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=additive(mask, q.dtype))
    assert additive(mask, mx.float16).dtype == mx.float16
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-6, atol=1e-7)
