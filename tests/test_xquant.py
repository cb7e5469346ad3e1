"""XQuant: cross-layer groups that share the anchor layer's codes through a coordinator."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import trim_prompt_cache

import veloxquant as vq
from veloxquant.compiler import ModelShape, compile_recipe
from veloxquant.compiler.explain import render
from veloxquant.compiler.rebuild import plan_from_json
from veloxquant.errors import CacheFileError, RecipeError
from veloxquant.recipe import load_recipe
from veloxquant.runtime import checksums
from veloxquant.runtime.kinds.reuse_tier import ReuseTier
from veloxquant.runtime.make import caches_for
from veloxquant.runtime.persist import load_prompt_cache, save_prompt_cache
from veloxquant.stages.store import Affine

from conftest import feed, tiny_gemma3

TOKENS = mx.random.randint(0, 500, (1, 300), key=mx.random.key(7))
PAIR = ModelShape.uniform("pair", 2, 3, 64)


def maxdiff(a, b):
    return float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max())


def pair_caches(*sets):
    return caches_for(compile_recipe(load_recipe("xquant"), PAIR, ["window=32", *sets]))


def fill(caches, ks, vs):
    """Feed each layer its K/V in one block, anchor first (as mlx-lm runs layers), then settle."""
    for cache, k, v in zip(caches, ks, vs):
        cache.update_and_fetch(k, v)
    for cache in caches:
        cache.nbytes  # settles: tokens beyond the window move to the shared tier
    return caches


def per_group(store, L, seed):
    """Random (a, b) constant within each quantization group of `store`, broadcast to [1, 3, L, 64]."""
    shape = (1, 3, L // store.group, 1, 64) if store.axis == "channel" else (1, 3, L, 64 // store.group, 1)
    a = mx.random.uniform(0.5, 2.0, shape, key=mx.random.key(seed))
    b = mx.random.normal(shape, key=mx.random.key(seed + 1))
    g = store.group
    full = (1, 3, L // g, g, 64) if store.axis == "channel" else (1, 3, L, 64 // g, g)
    return (mx.broadcast_to(a, full).reshape(1, 3, L, 64), mx.broadcast_to(b, full).reshape(1, 3, L, 64))


def anchor_and_reuse(k, v, relate, *sets):
    """Two layers: anchor K/V, reuse K/V = relate(anchor's, store); returns (caches, reuse K, reuse V)."""
    caches = pair_caches(*sets)
    tier = caches[0].plan.tiers[1]
    k2, v2 = relate(k, tier.keys.store, 10), relate(v, tier.values.store, 20)
    return fill(caches, (k, k2), (v, v2)), k2, v2


def rest_error(cache, k, v):
    tier = cache.tiers[1]
    dk, dv = tier.decoded(mx.float32)
    n = tier.count
    return float(mx.mean((dk - k[:, :, :n]) ** 2) + mx.mean((dv - v[:, :, :n]) ** 2))


# float16-exact, as the fp16 window hands them to the quantized tier
K = mx.random.normal((1, 3, 160, 64), key=mx.random.key(1)).astype(mx.float16).astype(mx.float32)
V = mx.random.normal((1, 3, 160, 64), key=mx.random.key(2)).astype(mx.float16).astype(mx.float32)


# --- what each layer holds ------------------------------------------------------------------


def test_reuse_layer_holds_no_codes(llama_model):
    caches = vq.make_prompt_cache(llama_model, "xquant", ["window=64"])
    feed(llama_model, TOKENS, caches, 50)
    anchor, reuse = caches[0], caches[1]
    held_bytes = anchor.nbytes, reuse.nbytes  # settled
    assert caches[0].coordinator is caches[3].coordinator
    assert isinstance(reuse.tiers[1], ReuseTier) and not isinstance(anchor.tiers[1], ReuseTier)
    held = [b for side in reuse.tiers[1].buffers.values() for b in side.values()]
    assert sorted(reuse.tiers[1].buffers["k"]) == ["scales", "zeros"]
    assert reuse.tiers[1].nbytes == sum(b.data.nbytes for b in held) > 0
    codes = sum(anchor.tiers[1].buffers[s]["codes"].data.nbytes for s in "kv")
    # Same window, same scales and zeros: the reuse layer holds exactly the anchor's bytes minus its codes.
    assert held_bytes[0] - held_bytes[1] == codes > 0
    assert all(a.dtype != mx.uint32 for a in reuse.state)  # no packed code words among its arrays


def test_keys_alone_can_be_shared(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(
        "veloxquant: 1\nname: keys\nextends: xquant\npipeline: |\n  recent($window)\n"
        "  >> keys: xquant(bits=$bits, group=$group, axis=channel, layers=$group_size)\n"
        "     values: affine(bits=$bits, group=$group, axis=token)\n"
    )
    caches = fill(caches_for(compile_recipe(load_recipe(str(path)), PAIR, ["window=32"])), (K, K), (V, V))
    assert sorted(caches[1].tiers[1].buffers["k"]) == ["scales", "zeros"]
    assert "codes" in caches[1].tiers[1].buffers["v"]
    # Same K as the anchor: the least-squares fit to its codes is at least as good as its own min/max.
    assert rest_error(caches[1], K, V) <= rest_error(caches[0], K, V)


def test_reuse_reads_the_anchors_code_buffer():
    caches, _, _ = anchor_and_reuse(K, V, lambda x, s, seed: x)
    link = caches[1].tiers[1].link
    anchor_codes = caches[0].tiers[1].buffers["k"]["codes"].view()
    assert maxdiff(link.codes("k", 0, caches[1].tiers[1].count), anchor_codes) == 0


_MEMORY_CHECK = """
import gc
import mlx.core as mx
import veloxquant as vq
from conftest import feed, tiny_llama
model = tiny_llama()
mx.eval(model.parameters())
tokens = mx.random.randint(0, 500, (1, 300), key=mx.random.key(7))
for recipe in ("fp16", "kivi", "xquant"):  # fp16 first: one-time allocations land there
    gc.collect(); mx.synchronize()
    before = mx.get_active_memory()
    caches = vq.make_prompt_cache(model, recipe, ["window=64"] if recipe != "fp16" else [])
    mx.eval(feed(model, tokens, caches, 100))
    mx.eval([c.state for c in caches])
    gc.collect(); mx.synchronize()
    print(sum(c.nbytes for c in caches), mx.get_active_memory() - before)
    del caches
"""


def test_nbytes_is_the_memory_xquant_caches_really_hold():
    """Active memory grows by what nbytes claims: the reuse layers keep no hidden copy of the codes."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(__file__)
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_CHECK],
        capture_output=True,
        text=True,
        cwd=here,
        timeout=300,
        env={**os.environ, "PYTHONPATH": here},
    )
    assert out.returncode == 0, out.stderr
    (kivi_held, kivi_grew), (xq_held, xq_grew) = [map(int, line.split()) for line in out.stdout.split("\n")[1:3]]
    assert xq_held < kivi_held
    for held, grew in ((kivi_held, kivi_grew), (xq_held, xq_grew)):
        # A hidden copy of the codes in the 2 reuse layers would add 48 KiB here.
        assert abs(grew - held) <= 0.02 * held + 16384, (held, grew)


# --- reconstruction ---------------------------------------------------------------------------


def test_reuse_that_is_an_affine_function_of_the_anchor_codes_is_near_exact():
    def on_codes(x, store, seed):  # a * (the anchor's dequantized values) + b, per quantization group
        a, b = per_group(store, 128, seed)
        deq = Affine(store.bits, store.group, store.axis)
        rest = deq.decode(deq.encode(x[:, :, :128]), mx.float32)
        return mx.concatenate([a * rest + b, x[:, :, 128:]], axis=2)

    caches, k2, v2 = anchor_and_reuse(K, V, on_codes)
    assert caches[1].tiers[1].count == 128
    assert rest_error(caches[1], k2, v2) < 1e-5  # float16 scale/zero rounding only


def test_reuse_of_an_affine_function_of_the_anchor_is_as_good_as_the_anchor():
    def affine(x, store, seed):
        a, b = per_group(store, 160, seed)
        return a * x + b

    caches, k2, v2 = anchor_and_reuse(K, V, affine)
    own = rest_error(caches[0], K, V)
    reuse = rest_error(caches[1], k2, v2)
    # Least squares can only beat (a*scale, a*zero + b); a is at most 2, so errors scale by at most 4.
    assert 0 < reuse <= 4.0 * own * 1.01


def test_residual_bit_reduces_the_drift_error():
    def noisy(x, store, seed):  # correlated with the anchor, plus drift of its own
        return 0.8 * x + 0.3 * mx.random.normal(x.shape, key=mx.random.key(seed))

    errors = []
    for bits in (0, 1):
        caches, k2, v2 = anchor_and_reuse(K, V, noisy, f"residual_bits={bits}")
        errors.append(rest_error(caches[1], k2, v2))
    assert errors[1] < 0.6 * errors[0]


def test_group_size_one_is_kivi_bit_for_bit(llama_model):
    kivi = vq.make_prompt_cache(llama_model, "kivi", ["window=64"])
    xq = vq.make_prompt_cache(llama_model, "xquant", ["window=64", "group_size=1"])
    assert all(c.plan.role == "anchor" for c in xq)
    a = feed(llama_model, TOKENS, kivi, 50)
    b = feed(llama_model, TOKENS, xq, 50)
    assert maxdiff(a, b) == 0.0
    assert [c.nbytes for c in kivi] == [c.nbytes for c in xq]


def test_hook_and_decoded_modes_agree(llama_model):
    sets = ["window=64", "bits=8", "group_size=3"]
    hooked = vq.make_prompt_cache(llama_model, "xquant", sets)
    a = feed(llama_model, TOKENS, hooked, 50)
    vq.uninstall(llama_model)
    plain = vq.make_prompt_cache(llama_model, "xquant", sets, use_hook=False)
    b = feed(llama_model, TOKENS, plain, 50)
    assert hooked[1].attended and not plain[1].attended
    assert maxdiff(a, b) < 1e-3


# --- the plan: groups, fingerprint, explain, refusals -------------------------------------------


def test_plan_names_groups_and_roles():
    plan = compile_recipe(load_recipe("xquant"), ModelShape.uniform("m", 7, 3, 64), ["group_size=3"])
    assert [l.share.layers for l in plan.layers] == [(0, 1, 2)] * 3 + [(3, 4, 5)] * 3 + [(6,)]
    assert [l.role for l in plan.layers[:3]] == ["anchor", "reuse", "reuse"]
    assert plan.to_dict()["layers"][4]["share"] == {"group": 1, "layers": [3, 4, 5], "role": "reuse"}
    rebuilt = plan_from_json(__import__("json").dumps(plan.to_dict()))
    assert rebuilt.fingerprint == plan.fingerprint
    assert [l.share for l in rebuilt.layers] == [l.share for l in plan.layers]
    two = compile_recipe(load_recipe("xquant"), ModelShape.uniform("m", 7, 3, 64), ["group_size=2"])
    assert two.fingerprint != plan.fingerprint


def test_explain_renders_the_groups():
    text = render(compile_recipe(load_recipe("xquant"), PAIR))
    assert "layers 0-1:    group 0, anchor 0, reuse 1" in text
    assert "anchor 3.00, reuse 1.00" in text and "long-context cost: 2.00 bits/elem" in text
    assert "reuse 2.50" in render(compile_recipe(load_recipe("xquant"), PAIR, ["residual_bits=1"]))


def _compile_text(tmp_path, body, shape):
    path = tmp_path / "r.yaml"
    path.write_text("veloxquant: 1\nname: r\n" + body)
    return compile_recipe(load_recipe(str(path)), shape)


def test_sliding_window_layers_are_refused_and_can_be_overridden(tmp_path):
    shape = ModelShape.from_model(tiny_gemma3())
    with pytest.raises(RecipeError, match="sliding window of 32 tokens") as info:
        compile_recipe(load_recipe("xquant"), shape)
    assert info.value.location.line is not None
    plan = _compile_text(tmp_path, "extends: xquant\nlayers:\n  sliding: {pipeline: fp16}\n", shape)
    assert [l.share.layers if l.share else None for l in plan.layers] == [None, (1,), None, (3,)]


def test_mismatched_layers_are_refused(tmp_path):
    with pytest.raises(RecipeError, match="heads differ"):
        compile_recipe(
            load_recipe("xquant"), ModelShape("m", (3, 3, 3, 3), (64, 64, 128, 128), (None,) * 4), ["group_size=3"]
        )
    with pytest.raises(RecipeError, match="tiers differ"):
        compile_recipe(load_recipe("xquant"), PAIR, ["window=linear(from=256, to=64)"])
    with pytest.raises(RecipeError, match="must stand in the last tier"):
        _compile_text(tmp_path, "pipeline: recent(32) | xquant(bits=2, axis=token) >> drop\n", PAIR)


# --- persistence and trim ------------------------------------------------------------------------


def test_save_load_round_trip_relinks_the_coordinator(llama_model, tmp_path):
    caches = vq.make_prompt_cache(llama_model, "xquant", ["window=32", "residual_bits=1"])
    feed(llama_model, TOKENS[:, :150], caches, 50)
    path = tmp_path / "xq.safetensors"
    save_prompt_cache(str(path), caches)
    loaded, _ = load_prompt_cache(str(path), expect_fingerprint=caches[0].fingerprint)
    assert loaded[1].tiers[1].link.coordinator is loaded[0].coordinator is not caches[0].coordinator
    a = llama_model(TOKENS[:, 150:], cache=caches)
    b = llama_model(TOKENS[:, 150:], cache=loaded)
    assert maxdiff(a, b) == 0.0


def test_load_refuses_a_reuse_layer_its_anchor_does_not_cover(llama_model, tmp_path):
    import json

    caches = vq.make_prompt_cache(llama_model, "xquant", ["window=32"])
    feed(llama_model, TOKENS[:, :150], caches, 50)
    path = tmp_path / "xq.safetensors"
    save_prompt_cache(str(path), caches)
    arrays, meta = mx.load(str(path), return_metadata=True)
    layers = json.loads(meta["layers"])
    layers[0]["tiers"][1] = [0, 0]  # the anchor "holds" no codes
    kept = {k: v for k, v in arrays.items() if not k.startswith("0.1.")}
    mx.save_safetensors(str(path), kept, checksums.sign(kept, {**meta, "layers": json.dumps(layers)}))
    with pytest.raises(CacheFileError, match="layer 1 reads layer 0's xquant codes"):
        load_prompt_cache(str(path))


def test_trim_is_refused_once_a_group_shares_codes(llama_model):
    # A reuse layer's tokens are decoded from its anchor's codes: a trim cutting a group in two
    # cannot re-hold them, so xquant refuses any trim (is_trimmable False) once codes are shared.
    caches = vq.make_prompt_cache(llama_model, "xquant", ["window=32"])
    feed(llama_model, TOKENS[:, :20], caches, 20)
    assert trim_prompt_cache(caches, 5) == 5  # all in the fp16 window: an exact rewind
    feed(llama_model, TOKENS[:, 15:150], caches, 50)
    for c in caches:
        c.nbytes  # settle: 128 quantized, 22 in the window
    assert not any(c.is_trimmable() for c in caches)
    assert trim_prompt_cache(caches, 60) == 0 and all(c.trim(60) == 0 for c in caches)
    assert {c.offset for c in caches} == {150} and {c.tiers[1].count for c in caches} == {128}
    feed(llama_model, TOKENS[:, 150:160], caches, 8)  # continues without complaint
