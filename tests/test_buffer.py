"""runtime/buffer.py: a stepped buffer forgets its front by moving its start; what it holds stays exact."""

import mlx.core as mx
import numpy as np
import pytest

from veloxquant.runtime.buffer import Buffer


def tokens(a, b):
    return mx.arange(a, b, dtype=mx.float32).reshape(1, 1, b - a, 1)


@pytest.mark.parametrize("window", [12, 16])  # 16: a whole number of steps, which moved every token
def test_a_sliding_window_writes_in_place_and_moves_to_a_fresh_buffer_at_the_end(window):
    buf = Buffer(step=8)
    buf.append(tokens(0, window))
    grown = []
    for t in range(window, 60):  # one decode step: forget the oldest, append the newest
        before = buf.data
        buf.drop_front(1)
        buf.append(tokens(t, t + 1))
        grown.append(buf.data is not before and buf.lo == 0)
        assert np.array_equal(np.array(buf.view()).ravel(), np.arange(t + 1 - window, t + 1))
        assert buf.used == window and buf.data.shape[2] <= window + 8  # at most a step of forgotten tokens
    assert 0 < sum(grown) <= -(-(60 - window) // 8)  # a fresh buffer at most once per step of tokens


def test_a_window_after_a_long_chunk_moves_on_its_next_token():
    buf = Buffer(step=8)
    buf.append(tokens(0, 40))  # a prefill chunk, then the window forgets most of it
    buf.drop_front(28)
    buf.append(tokens(40, 41))
    assert buf.lo == 0 and buf.data.shape[2] == 13 + 8
    assert np.array_equal(np.array(buf.view()).ravel(), np.arange(28, 41))


def test_unstepped_buffers_copy_what_stays():
    buf = Buffer(step=None)
    buf.append(tokens(0, 10))
    buf.drop_front(3)
    assert buf.data.shape[2] == buf.used == 7 and np.array(buf.view()).ravel()[0] == 3
    buf.drop_front(7)
    assert buf.data is None and buf.used == 0


def test_an_exact_buffer_holds_its_first_chunk_row_contiguous():
    """The fused kernels read a head's rows in place and give NaN for any other layout: a
    buffer that keeps its first chunk as is must not keep a transposed or sliced view."""
    base = mx.arange(2 * 3 * 8 * 4, dtype=mx.float32).reshape(2, 3, 4, 8)
    for view in (base.swapaxes(2, 3), base.swapaxes(2, 3)[:, :, :5]):
        buf = Buffer(None)
        buf.append(view)
        mx.eval(buf.data)
        B, H, L, D = view.shape
        itemsize = buf.data.itemsize
        assert tuple(s // itemsize for s in memoryview(buf.data).strides) == (H * L * D, L * D, D, 1)
        assert mx.array_equal(buf.view(), view)
