"""latent(queries=true): the key allocation weighs components by the prompt's queries along them."""

import mlx.core as mx
import numpy as np

import veloxquant as vq
from veloxquant.stages.latent import Latent

from conftest import feed, tiny_llama

TOKENS = mx.random.randint(0, 500, (1, 200), key=mx.random.key(5))


def keys_with_spectrum():
    """Keys whose channel c has standard deviation 8/(c+1): the basis is the channels, by variance."""
    x = mx.random.normal((1, 1, 512, 16), key=mx.random.key(1)) * mx.array(8.0 / (np.arange(16) + 1))
    return x.astype(mx.float32)


def test_a_quiet_direction_the_queries_look_along_gets_the_bits():
    x = keys_with_spectrum()
    store = Latent(budget=24, choices="0,1,2,3,4", center=True, queries=True)
    plain = np.array(store.fit(x)["widths"])
    moment = np.eye(16)[None] * 1e-3
    moment[0, 15, 15] = 100.0  # every query points along the quietest channel
    fitted = store.fit(x, mx.array(moment, dtype=mx.float32))
    basis, widths = np.abs(np.array(fitted["basis"][0].astype(mx.float32))), np.array(fitted["widths"])
    quiet = int(np.argmax(basis[15]))  # the kept component that is channel 15
    assert basis[15, quiet] > 0.9 and widths[quiet] == 4
    assert plain.sum() == widths.sum() <= 24  # the same budget, spent elsewhere
    assert (
        Latent(budget=24, choices="0,1,2,3,4", center=True).fit(x, mx.array(moment))["widths"].tolist()
        == plain.tolist()
    )  # queries=false ignores them


def test_the_tier_gathers_the_prompts_queries_then_frees_them():
    model = tiny_llama()
    caches = vq.make_prompt_cache(model, "kvtc", ["window=32", "sinks=0"])
    feed(model, TOKENS[:, :150], caches, 50)  # the tier holds tokens from the second block on: it sees queries
    side = caches[0].tiers[-1].sides["k"]
    assert side.query_moment is not None and side.query_moment.shape == (3, 64, 64)
    assert "k.qmoment" in caches[0].tiers[-1].arrays()  # counted while held
    caches[0].finish_prompt()
    assert side.query_moment is None and side.widths is not None
    off = vq.make_prompt_cache(model, "kvtc", ["window=32", "sinks=0", "query_weights=false"])
    feed(model, TOKENS[:, :150], off, 50)
    assert off[0].tiers[-1].sides["k"].query_moment is None
