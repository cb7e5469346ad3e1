import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

import veloxquant as vq
from veloxquant.runtime import hook, layer_attention

from conftest import feed, tiny_gemma3, tiny_llama

TOKENS = mx.random.randint(0, 500, (1, 300), key=mx.random.key(7))


def maxdiff(a, b):
    return float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max())


@pytest.mark.parametrize("chunk", [1, 16, 80])
def test_fp16_recipe_matches_mlx_kvcache_exactly_in_float16(chunk):
    model = tiny_llama(mx.float16, layers=2)  # float16 is slow on CPU: keep it small
    tokens = TOKENS[:, :80]
    ref = feed(model, tokens, [KVCache() for _ in model.layers], chunk)
    got = feed(model, tokens, vq.make_prompt_cache(model, "fp16"), chunk)
    assert maxdiff(ref, got) == 0.0


def test_plain_fp16_layers_skip_routing_and_answer_as_the_routed_path(llama_model):
    # The fp16 recipe's layers take the cache's short path (host time); it must equal the general one.
    fast = vq.make_prompt_cache(llama_model, "fp16")
    assert all(c._plain is not None for c in fast)
    for recipe in ("kivi", "streaming_llm", "h2o"):
        assert all(c._plain is None for c in vq.make_prompt_cache(llama_model, recipe))
    a = feed(llama_model, TOKENS, fast, 37)
    routed = vq.make_prompt_cache(llama_model, "fp16")
    for c in routed:
        c._plain, c.route = None, layer_attention.tier_partials  # the routed path
    b = feed(llama_model, TOKENS, routed, 37)
    assert maxdiff(a, b) == 0.0 and [c.offset for c in fast] == [c.offset for c in routed]
    assert all(c.nbytes == r.nbytes for c, r in zip(fast, routed))


def test_plain_fp16_window_layers_decode_as_the_routed_path():
    # Sliding-window fp16 layers decode on the short path too (prefill chunks stay routed):
    # the same logits as the routed path, the same held, and the window's buffer never
    # holds more than window + one step of slots (settled, a window layer holds window - 1).
    model = tiny_gemma3(window=32)
    fast = vq.make_prompt_cache(model, "fp16")
    assert all(c._plain is not None for c in fast) and not all(c._unwindowed for c in fast)
    routed = vq.make_prompt_cache(model, "fp16")
    for c in routed:
        c._plain, c.route = None, layer_attention.tier_partials  # the routed path
    outs = []
    for cache in (fast, routed):
        pre = model(TOKENS[:, :45], cache=cache)
        outs.append(mx.concatenate([pre, feed(model, TOKENS[:, 45:160], cache, 1)], axis=1))
    assert maxdiff(outs[0], outs[1]) == 0.0
    assert [c.size() for c in fast] == [c.size() for c in routed]
    for c in fast:
        if not c._unwindowed:
            buf = c.tiers[0].buffers["k"]["x"]
            assert c.size() == 31 and buf.data.shape[2] <= 32 + buf.step


def test_identity_store_is_exact_in_float32(llama_model, tmp_path):
    recipe = tmp_path / "raw.yaml"
    recipe.write_text("veloxquant: 1\nname: raw\npipeline: identity\n")
    ref = feed(llama_model, TOKENS, [KVCache() for _ in llama_model.layers], 64)
    got = feed(llama_model, TOKENS, vq.make_prompt_cache(llama_model, str(recipe)), 64)
    assert maxdiff(ref, got) == 0.0


@pytest.mark.parametrize("recipe", ["fp16", "kivi", "kivi_sink", "streaming_llm"])
def test_hook_and_decoded_modes_agree(llama_model, recipe):
    # 8-bit: at 2 bits float32 reordering noise can flip a code and blur the comparison.
    sets = {"streaming_llm": ["window=100"], "fp16": []}.get(recipe, ["window=64", "bits=8"])
    hooked = vq.make_prompt_cache(llama_model, recipe, sets)
    a = feed(llama_model, TOKENS, hooked, 50)
    vq.uninstall(llama_model)
    plain = vq.make_prompt_cache(llama_model, recipe, sets, use_hook=False)
    b = feed(llama_model, TOKENS, plain, 50)
    assert hooked[0].attended and not plain[0].attended
    assert maxdiff(a, b) < 1e-3


@pytest.mark.parametrize("chunk", [1, 7, 300])
def test_streaming_llm_matches_mlx_rotating_cache(llama_model, chunk):
    # mlx-lm's RotatingKVCache(keep=4) is StreamingLLM: sinks + a window (+ the new token).
    ref = feed(llama_model, TOKENS, [RotatingKVCache(max_size=4 + 100 + 1, keep=4) for _ in llama_model.layers], 1)
    got = feed(llama_model, TOKENS, vq.make_prompt_cache(llama_model, "streaming_llm", ["window=100"]), chunk)
    assert maxdiff(ref, got) < 5e-3  # ours stores fp16, the reference float32


def test_kivi_sink_with_zero_sinks_is_kivi_bit_for_bit(llama_model):
    a = feed(llama_model, TOKENS, vq.make_prompt_cache(llama_model, "kivi", ["window=64"]), 50)
    b = feed(llama_model, TOKENS, vq.make_prompt_cache(llama_model, "kivi_sink", ["window=64", "sinks=0"]), 50)
    assert maxdiff(a, b) == 0.0


def test_kivi_tiers_hold_what_the_plan_says(llama_model):
    caches = vq.make_prompt_cache(llama_model, "kivi", ["window=64"])
    feed(llama_model, TOKENS, caches, 50)
    recent, rest = caches[0].tiers
    caches[0].nbytes  # settles pending overflow
    assert recent.count <= 64 and recent.count > 64 - 32
    assert rest.count % 32 == 0 and rest.count + recent.count == 300
    assert (rest.start, recent.start) == (0, rest.count)
    codes = rest.buffers["k"]["codes"].view()
    assert codes.dtype == mx.uint32 and codes.shape[-1] == 64 * 2 // 32  # 2-bit codes really packed


def test_gemma3_sliding_layers_keep_window_semantics():
    model = tiny_gemma3(window=32)
    tokens = TOKENS[:, :120]
    ref = feed(model, tokens, model.make_cache(), 1)
    for chunk in (1, 16, 120):
        caches = vq.make_prompt_cache(model, "fp16")
        got = feed(model, tokens, caches, chunk)
        assert maxdiff(ref, got) < 2e-2, chunk  # fp16 storage vs float32 reference
        sliding = [c for c in caches if c.plan.window]
        assert sliding and all(c.size() <= 32 + chunk for c in sliding)


def test_trim_rewinds_the_newest_tokens(llama_model):
    sets = ["window=64", "bits=8"]  # 8-bit: BLAS rounding differs between a 200- and a 190-row prefill
    caches = vq.make_prompt_cache(llama_model, "kivi", sets)
    llama_model(TOKENS[:, :200], cache=caches)
    assert all(c.trim(10) == 10 for c in caches)
    assert caches[0].offset == 190
    again = llama_model(TOKENS[:, 190:200], cache=caches)
    fresh = vq.make_prompt_cache(llama_model, "kivi", sets)
    llama_model(TOKENS[:, :190], cache=fresh)
    expected = llama_model(TOKENS[:, 190:200], cache=fresh)
    # trim settles first (160 quantized, 30 in the window); the fresh cache quantized 128: 8-bit noise apart
    assert sum(t.count for t in caches[0].tiers) == sum(t.count for t in fresh[0].tiers) == 200
    assert maxdiff(again, expected) < 1e-2


def test_trim_cuts_into_a_quantized_group(llama_model):
    caches = vq.make_prompt_cache(llama_model, "kivi", ["window=32"])
    feed(llama_model, TOKENS[:, :100], caches, 100)
    caches[0].nbytes  # settle: 64 tokens quantized in groups of 32, 36 in the window
    assert caches[0].trim(50) == 50  # the window, then half a key group: its older half back in fp16
    assert caches[0].offset == 50
    assert [(t.start, t.count) for t in caches[0].tiers] == [(32, 18), (0, 32)]


_MEMORY_CHECK = """
import gc, sys
import mlx.core as mx
import veloxquant as vq
from conftest import feed, tiny_llama
model = tiny_llama()
mx.eval(model.parameters())
caches = vq.make_prompt_cache(model, "kivi", ["window=64"])
tokens = mx.random.randint(0, 500, (1, 300), key=mx.random.key(7))
mx.eval(feed(model, tokens, caches, 100))
mx.eval([c.state for c in caches])
held = sum(c.nbytes for c in caches)
buffers = [b for c in caches for t in c.tiers for side in t.buffers.values() for b in side.values()]
freed = 0
for buf in buffers:
    mx.synchronize(); gc.collect()
    before = mx.get_active_memory()
    buf.data = None
    gc.collect(); mx.synchronize()
    freed += before - mx.get_active_memory()
print(held, freed, len(buffers))
"""


def test_nbytes_is_the_memory_really_held():
    """Freeing each buffer releases what nbytes said it held (in a fresh process,
    so no other test's arrays are freed alongside)."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(__file__)
    path = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_CHECK],
        capture_output=True,
        text=True,
        cwd=here,
        timeout=300,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert out.returncode == 0, out.stderr
    held, freed, n = map(int, out.stdout.split())
    # Allowance: up to 2 KiB a buffer of MLX bookkeeping freed alongside (small
    # arrays of the graph that built it); a Buffer alone frees exactly its nbytes.
    assert held > 0 and abs(freed - held) <= 0.01 * held + 2048 * n, (held, freed)


def test_hook_install_is_reversible(llama_model):
    import mlx_lm.models.llama as llama_module

    original = llama_module.scaled_dot_product_attention
    assert vq.install(llama_model) >= 1 and hook.installed(llama_model)
    assert vq.install(llama_model) == 0  # idempotent
    vq.uninstall(llama_model)
    assert llama_module.scaled_dot_product_attention is original


def test_caches_are_not_mistaken_for_mlx_quantizable_or_mergeable(llama_model):
    cache = vq.make_prompt_cache(llama_model, "kivi")[0]
    assert not hasattr(cache, "to_quantized")
    assert not hasattr(vq.make_prompt_cache(llama_model, "adakv")[0], "merge")  # a plan that does not batch


def test_uninstalling_the_hook_mid_generation_stays_correct(llama_model):
    """After uninstall the caches go back to returning the full decoded K/V."""
    ref = feed(llama_model, TOKENS[:, :120], [KVCache() for _ in llama_model.layers], 1)
    caches = vq.make_prompt_cache(llama_model, "fp16")
    first = feed(llama_model, TOKENS[:, :60], caches, 1)
    vq.uninstall(llama_model)
    second = feed(llama_model, TOKENS[:, 60:120], caches, 1)
    assert not caches[0]._attend_epoch == vq.runtime.hook.epoch()
    assert maxdiff(mx.concatenate([first, second], axis=1), ref) < 5e-3


def test_merged_tier_attention_matches_the_dense_path(llama_model, monkeypatch):
    """The kernel path (here the kernel contract's MLX reference) merged by log-sum-exp
    with the fp16 window gives the same logits as decoding everything into one SDPA."""
    from veloxquant.kernels import reference
    from veloxquant.runtime import fused

    sets = ["window=32", "bits=8"]
    dense = feed(llama_model, TOKENS[:, :160], vq.make_prompt_cache(llama_model, "kivi_sink", sets), 1)

    def reference_launcher(tier, queries, k_enc, v_enc, scale, hides=False):
        specs = tier.plan.keys.store, tier.plan.values.store

        def run(q, k, v, tail=None, hidden=0):  # the launch's contract: a partial, or the whole answer with dense tiers
            if tail is None:
                return reference.affine_partial_attention(q, k, v, *specs, scale, hidden)
            return reference.attention_with_tail(q, k, v, *specs, scale, tail, hidden)

        return run

    monkeypatch.setattr(fused, "_launcher", reference_launcher)
    merged = feed(llama_model, TOKENS[:, :160], vq.make_prompt_cache(llama_model, "kivi_sink", sets), 1)
    assert maxdiff(dense, merged) < 1e-3


@pytest.mark.parametrize("chunk", [1, 7, 40])
def test_window_smaller_than_a_channel_group_spills_whole_groups(llama_model, chunk):
    """kivi with window=16 and key groups of 32 tokens: the window waits for a whole group."""
    caches = vq.make_prompt_cache(llama_model, "kivi", ["window=16"])
    tokens = mx.array(np.arange(100)[None] % 500)
    logits = feed(llama_model, tokens, caches, chunk)
    recent, rest = caches[0].tiers
    caches[0]._settle()
    assert rest.count % 32 == 0 and rest.count + recent.count == 100
    assert recent.count <= 16 and bool(mx.all(mx.isfinite(logits)).item())
