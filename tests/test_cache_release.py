"""Dropping a model's caches frees their arrays at once, over every built-in recipe (tiny model).

Parts of a cache that point back at their owner (a 16-bit tier's fast path, a saliency tier,
the cross-layer coordinator and its links, an xKV group's shared basis) hold it weakly: with
strong references both ways, a dropped cache kept its arrays until Python's cyclic collector
happened to run (on the H200, a 32k fp16 recipe cache, 1 GiB, outlived its owner into the
next run). Deep copies must then still hold only what they copied.
"""

import copy
import gc

import mlx.core as mx
import pytest

import veloxquant as vq

from conftest import feed
from recipe_sets import RECIPES, SMALL

TOKENS = mx.random.randint(0, 500, (1, 200), key=mx.random.key(5))


def used_caches(model, recipe):
    caches = vq.make_prompt_cache(model, recipe, SMALL.get(recipe, []))
    feed(model, TOKENS[:, :150], caches, 50)
    model(TOKENS[:, 150:151], cache=caches)  # one decode step, as generation does
    return caches


def cycle_garbage() -> list:
    """What the cyclic collector finds unreachable now (nothing is freed: it is kept for the test)."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


@pytest.mark.parametrize("recipe", RECIPES)
def test_dropped_caches_leave_nothing_for_the_cyclic_collector_and_their_copies_live_on(llama_model, recipe):
    caches = used_caches(llama_model, recipe)
    twin, ref = copy.deepcopy(caches), copy.deepcopy(caches)
    gc.collect()
    gc.disable()
    try:
        del caches
        left = [
            type(o).__module__ + "." + type(o).__qualname__
            for o in cycle_garbage()
            if type(o).__module__.startswith("veloxquant") or isinstance(o, mx.array)
        ]
    finally:
        gc.enable()
    assert not left, f"{recipe}: held only by reference cycles after the caches were dropped: {sorted(set(left))}"
    gc.collect()  # the copies must not lean on the dropped original
    more = TOKENS[:, 151:158]
    a = feed(llama_model, more, twin, 1)
    b = feed(llama_model, more, ref, 1)
    assert float(mx.abs(a - b).max()) == 0.0
