"""split: mixed precision by channel, masks per chunk, scores that add exactly."""

import mlx.core as mx
import pytest

import veloxquant as vq
from veloxquant.compiler import SMOLLM2_135M, compile_recipe
from veloxquant.compiler.rebuild import plan_from_dict
from veloxquant.errors import RecipeError
from veloxquant.recipe import load_recipe
from veloxquant.stages.split import Split
from veloxquant.stages.store import Affine, Fp16

from conftest import feed
from conftest import pipeline_recipe as _recipe


def _x(seed=0):
    spread = mx.exp(2 * mx.random.normal((1, 3, 1, 64), key=mx.random.key(seed + 1)))  # a few wide channels
    return mx.random.normal((1, 3, 64, 64), key=mx.random.key(seed)) * spread


def _mse(store, x):
    return float(mx.mean((store.decode(store.encode(x), mx.float32) - x) ** 2))


@pytest.mark.parametrize("by", ["variance", "range"])
def test_split_sends_the_widest_channels_of_each_chunk_to_hi(by):
    x = _x()
    split = Split(hi=Affine(4, 32, "channel"), lo=Affine(2, 32, "channel"), fraction=0.25, by=by)
    enc = split.encode(x)
    assert enc["mask"].shape == (1, 3, 2, 2) and enc["mask"].dtype == mx.uint32  # 64 bits per head and chunk
    assert enc["hi.codes"].shape == (1, 3, 64, 16 * 4 // 32) and enc["lo.codes"].shape == (1, 3, 64, 48 * 2 // 32)
    assert _mse(split, x) < 0.5 * _mse(Affine(2, 32, "channel"), x)
    exact = Split(hi=Fp16(), lo=Fp16(), fraction=0.25, by=by)  # lossless branches: the scatter is exact
    assert float(mx.abs(exact.decode(exact.encode(x), mx.float32) - x.astype(mx.float16)).max()) == 0.0


def test_split_scores_add_exactly_across_branches():
    x = _x(2)
    q = mx.random.normal((1, 3, 1, 64), key=mx.random.key(9))
    split = Split(
        hi=Affine(8, 32, "channel"),
        lo=Affine(2, 32, "channel"),
        by="list",
        channels="0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15",
    )
    enc = split.encode(x)
    assert "mask" not in enc  # a listed split costs no mask
    k = split.decode(enc, mx.float32)
    hi = split.hi.decode({n[3:]: v for n, v in enc.items() if n.startswith("hi.")}, mx.float32)
    lo = split.lo.decode({n[3:]: v for n, v in enc.items() if n.startswith("lo.")}, mx.float32)
    whole = q @ k.swapaxes(-1, -2)
    parts = q[..., :16] @ hi.swapaxes(-1, -2) + q[..., 16:] @ lo.swapaxes(-1, -2)
    assert float(mx.abs(whole - parts).max()) < 1e-6 * float(mx.abs(whole).max())  # float32 summation order


def test_split_bits_and_bytes_are_what_it_holds(llama_model):
    caches = vq.make_prompt_cache(llama_model, "kitty", ["window=128"])
    feed(llama_model, mx.random.randint(0, 500, (1, 256), key=mx.random.key(3)), caches, 64)
    c = caches[0]
    c._settle()
    tier = c.tiers[2]
    assert tier.count == 128  # 251 after the sinks: whole chunks of 32 leave so the window keeps <= 128
    arrays = tier.arrays()
    assert arrays["k.mask"].shape == (1, 3, 4, 2)
    held = sum(a.nbytes for a in arrays.values())
    assert tier.nbytes >= held and c.nbytes == sum(t.nbytes for t in c.tiers)
    plan = compile_recipe(load_recipe("kitty"), SMOLLM2_135M).layers[0].tiers[2].keys
    # 16 channels x (4 + 1) + 48 x (2 + 1) bits, plus a 64-bit mask per 32 tokens, over 64 channels
    assert plan.bits_per_element(64) == pytest.approx((16 * 5 + 48 * 3) / 64 + 64 / (64 * 32))


def test_split_plan_round_trips_through_json():
    plan = compile_recipe(load_recipe("composite"), SMOLLM2_135M)
    again = plan_from_dict(plan.to_dict(), plan.recipe)
    assert again.fingerprint == plan.fingerprint
    assert again.layers[0].tiers[2].keys.store == plan.layers[0].tiers[2].keys.store


def test_split_misuse_is_located(tmp_path):
    with pytest.raises(RecipeError, match="split needs two stores") as e:
        compile_recipe(_recipe(tmp_path, "recent(32)\n>> split(hi=affine(bits=4))"), SMOLLM2_135M)
    assert "r.yaml:5:6" in str(e.value.location)
    with pytest.raises(RecipeError, match="channels must list channels 0..63"):
        compile_recipe(
            _recipe(tmp_path, 'recent(32)\n>> split(hi=fp16, lo=fp16, by=list, channels="3,99")'), SMOLLM2_135M
        )
    with pytest.raises(RecipeError, match="branch gets 56 channels"):
        compile_recipe(
            _recipe(tmp_path, "recent(32)\n>> split(hi=fp16, lo=affine(bits=2, group=8), fraction=0.125)"), SMOLLM2_135M
        )
    with pytest.raises(RecipeError, match="'nuq' fits arrays per tier"):
        compile_recipe(_recipe(tmp_path, "recent(32)\n>> split(hi=nuq(bits=4), lo=fp16)"), SMOLLM2_135M)
    with pytest.raises(RecipeError, match="must be between 0 and 1"):
        compile_recipe(_recipe(tmp_path, "recent(32)\n>> split(hi=fp16, lo=fp16, fraction=1.5)"), SMOLLM2_135M)


def test_split_by_queries_weighs_spread_by_the_queries_channels():
    """by=queries ranks channels by variance x mean q²: a wide channel no query reads
    loses its hi slot to a narrower one the queries weigh heavily."""
    x = _x(4)
    var = mx.var(x[:, :, :32], axis=2)  # first chunk's per-channel variance [1, 3, 64]
    widest = mx.argmax(var, axis=-1)  # per head
    q2 = mx.ones(var.shape)
    q2 = mx.put_along_axis(q2, widest[..., None], mx.zeros((1, 3, 1)), axis=-1)  # no query reads it
    split = Split(hi=Affine(4, 32, "channel"), lo=Affine(2, 32, "channel"), fraction=0.25, by="queries")
    plain = Split(hi=Affine(4, 32, "channel"), lo=Affine(2, 32, "channel"), fraction=0.25, by="variance")
    from veloxquant.kernels.bitpack import unpack

    chosen = unpack(split.encode(x, q2)["mask"], 1, 64)[:, :, 0]
    before = unpack(plain.encode(x)["mask"], 1, 64)[:, :, 0]
    assert mx.all(mx.take_along_axis(before, widest[..., None], axis=-1) == 1).item()
    assert mx.all(mx.take_along_axis(chosen, widest[..., None], axis=-1) == 0).item()
    assert mx.array_equal(unpack(split.encode(x)["mask"], 1, 64), unpack(plain.encode(x)["mask"], 1, 64)).item()


def test_split_by_queries_needs_the_hook_and_runs(llama_model, tmp_path):
    r = _recipe(
        tmp_path,
        "sink(4) >> recent(32)\n>> keys: split(hi=affine(bits=4, group=32, axis=channel), "
        "lo=affine(bits=2, group=32, axis=channel), by=queries)\n   values: affine(bits=2, group=32)",
    )
    assert "attention" in compile_recipe(r, SMOLLM2_135M).layers[0].needs
    plain = compile_recipe(load_recipe("kitty"), SMOLLM2_135M)
    assert "attention" not in plain.layers[0].needs  # by=variance needs no hook
    with pytest.raises(RecipeError, match="needs the attention hook"):
        vq.make_prompt_cache(llama_model, r, use_hook=False)
    caches = vq.make_prompt_cache(llama_model, r)
    out = feed(llama_model, mx.random.randint(0, 500, (1, 160), key=mx.random.key(5)), caches, 32)
    assert mx.all(mx.isfinite(out)).item() and caches[0].tiers[2].count > 0
