"""The one-gather latent read (stages/latent_reader.py) equals Latent.decode bit for bit."""

import mlx.core as mx
import numpy as np
import pytest

from veloxquant.stages.latent import Latent
from veloxquant.stages.latent_reader import read, readable

WIDTHS = [
    [4] * 12 + [3] * 36,  # palu's keys: classes in component order
    [8, 1, 3, 6, 2, 4, 4, 3, 1, 2, 6, 8, 3, 2, 1, 1],  # kvtc-like: every width, out of order
    [2] * 8,
    [5, 7, 5, 7],
]


@pytest.mark.parametrize("quant", ["gauss", "minmax"])
@pytest.mark.parametrize("widths", WIDTHS)
def test_read_equals_decode(widths, quant):
    store = Latent(rank=len(widths), quant=quant, group=32)
    w = np.array(widths, np.int64)
    z = mx.random.normal((1, 3, 96, len(w)), key=mx.random.key(len(w))) * mx.linspace(3, 0.5, len(w))
    stats = store.stats(z)
    enc = store.encode(z, w, stats)
    assert readable(w)
    got, want = read(store, enc, w, stats), store.decode(enc, w, stats)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert mx.array_equal(got, want).item()


def test_float16_latents_are_not_readable():
    assert not readable(np.array([16, 4, 4]))


def test_one_reader_serves_every_length():
    """The shift kernel is compiled shapeless: a reader built once reads latents of any length."""
    from veloxquant.stages.latent_reader import LatentReader

    store, w = Latent(rank=8, quant="gauss", group=32), np.array([4, 3, 3, 6, 2, 5, 7, 1])
    reader = LatentReader(store, w)
    for L in (32, 160, 64):
        z = mx.random.normal((2, 1, L, 8), key=mx.random.key(L))
        stats = store.stats(z)
        enc = store.encode(z, w, stats)
        assert mx.array_equal(reader(enc, stats), store.decode(enc, w, stats)).item()
