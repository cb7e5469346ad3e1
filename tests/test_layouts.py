"""Models whose cache list is not one attention cache per layer: Gemma 4 (KV-shared last layers,
sliding and full attention), hybrids whose non-attention layers keep mlx-lm's ArraysCache (Qwen3-Next,
Qwen3.5, Jamba), and a model whose make_cache was replaced by veloxquant's. Tiny random-init models."""

import copy

import mlx.core as mx
import pytest
from mlx_lm.models import gemma4_text, jamba, qwen3_5, qwen3_next
from mlx_lm.models.cache import ArraysCache, KVCache, can_trim_prompt_cache, trim_prompt_cache

import veloxquant as vq
from veloxquant import cli
from veloxquant.compiler import ModelShape
from veloxquant.errors import CacheFileError, VeloxError
from veloxquant.run import cache_report

TOKENS = mx.random.randint(0, 500, (1, 96), key=mx.random.key(7))
KIVI = ["window=16", "group=16"]  # 96 tokens: most of them in the 2-bit tier


def gemma4(dtype=mx.float32, types=("sliding_attention", "full_attention") * 2, shared=2):
    """4 layers, the last `shared` attending over earlier layers' caches (previous_kvs), window 32."""
    args = gemma4_text.ModelArgs(
        model_type="gemma4_text",
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=2,
        head_dim=32,
        global_head_dim=32,
        num_key_value_heads=1,
        num_kv_shared_layers=shared,
        vocab_size=500,
        vocab_size_per_layer_input=500,
        hidden_size_per_layer_input=8,
        sliding_window=32,
        layer_types=list(types),
    )
    mx.random.seed(2)
    model = gemma4_text.Model(args)
    model.set_dtype(dtype)
    return model


def tiny_qwen3_next():
    args = qwen3_next.ModelArgs(
        model_type="qwen3_next",
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=2,
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_experts=0,
        num_experts_per_tok=0,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=0,
        mlp_only_layers=[0, 1, 2, 3],
        moe_intermediate_size=0,
        rms_norm_eps=1e-6,
        vocab_size=500,
        num_key_value_heads=1,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        max_position_embeddings=4096,
        head_dim=32,
        full_attention_interval=2,
    )
    mx.random.seed(3)
    return qwen3_next.Model(args)


def tiny_qwen3_5():
    text = dict(
        model_type="qwen3_5_text",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=500,
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        head_dim=32,
        full_attention_interval=2,
    )
    mx.random.seed(3)
    return qwen3_5.Model(qwen3_5.ModelArgs(model_type="qwen3_5", text_config=text))


def tiny_jamba():
    args = jamba.ModelArgs(
        model_type="jamba",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        attn_layer_offset=1,
        attn_layer_period=2,
        expert_layer_offset=1,
        expert_layer_period=100,
        mamba_d_conv=4,
        mamba_d_state=8,
        mamba_expand=2,
        num_experts=1,
        num_experts_per_tok=1,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        vocab_size=500,
    )
    mx.random.seed(3)
    return jamba.Model(args)


HYBRIDS = [tiny_qwen3_next, tiny_qwen3_5, tiny_jamba]


def feed(model, cache, split=80):
    """96 tokens fed as 80 + 16, as the issue's reproduction does."""
    return mx.concatenate([model(TOKENS[:, :split], cache=cache), model(TOKENS[:, split:], cache=cache)], axis=1)


def maxdiff(a, b) -> float:
    return float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max())


# --- Gemma 4: KV-shared layers, sliding and full attention ----------------------------------------------


def test_gemma4_layout_follows_its_own_make_cache():
    model = gemma4()
    shape = ModelShape.from_model(model)
    assert shape.n_layers == 2 and shape.windows == (32, None)  # one cache per owner layer, as make_cache
    assert shape.readers == ((0, 2), (1, 3))  # layers 2 and 3 read 0's and 1's (previous_kvs)
    caches = vq.make_prompt_cache(model, "fp16")
    assert len(caches) == len(model.make_cache()) == 2 and [c.lends for c in caches] == [True, True]


def test_gemma4_fp16_equals_mlx_lms_own_caches():
    model = gemma4(mx.float16)  # 16-bit model: mlx-lm's caches hold what the fp16 recipe holds
    reference = feed(model, model.make_cache())
    for use_hook in (True, False):
        got = feed(model, vq.make_prompt_cache(model, "fp16", use_hook=use_hook))
        assert maxdiff(got, reference) < 1e-3, use_hook
        vq.uninstall(model)
    model32 = gemma4()
    # float32 model: fp16 storage against mlx-lm's float32 caches (before: 2.3 off, silently)
    assert maxdiff(feed(model32, vq.make_prompt_cache(model32, "fp16")), feed(model32, model32.make_cache())) < 5e-2


def test_gemma4_lossy_recipes_run_and_shared_layers_read_their_owners_codes():
    model = gemma4()
    reference = feed(model, model.make_cache())
    errors = {}
    for bits in (8, 4, 2):
        caches = vq.make_prompt_cache(model, "kivi", KIVI + [f"bits={bits}"])
        errors[bits] = maxdiff(feed(model, caches), reference)
        assert sum(c.nbytes for c in caches) < cache_report(caches)["fp16_bytes"]
    assert errors[8] < 0.5 and errors[8] < errors[4] < errors[2]  # shared layers read codes, not garbage
    for recipe in ("h2o", "tova", "snapkv", "streaming_llm", "turboquant_rvq"):
        caches = vq.make_prompt_cache(model, recipe, ["budget=48"] if recipe in ("h2o", "tova", "snapkv") else [])
        model(TOKENS[:, :80], cache=caches)
        for t in range(80, 84):
            assert mx.isfinite(model(TOKENS[:, t : t + 1], cache=caches)).all()
    exact = vq.make_prompt_cache(model, "h2o", ["budget=200"])  # keeps everything: fp16's logits
    assert maxdiff(feed(model, exact), feed(model, vq.make_prompt_cache(model, "fp16"))) < 1e-3


def test_gemma4_cross_layer_recipes_pair_only_layers_that_own_caches():
    model = gemma4(types=("full_attention",) * 4)  # layers 2, 3 both read layer 1's cache
    caches = vq.make_prompt_cache(model, "xquant", KIVI)
    assert len(caches) == 2 and caches[0].plan.share.layers == (0, 1)
    assert mx.isfinite(feed(model, caches)).all()
    with pytest.raises(VeloxError, match="sliding window"):  # sliding layers: refused as on Gemma 3
        vq.make_prompt_cache(gemma4(), "xquant")


def _saved_loaded_and_copied(model, tmp_path):
    """kivi caches after 80 tokens, the same loaded back from a file, and a deep copy."""
    caches = vq.make_prompt_cache(model, "kivi", KIVI)
    model(TOKENS[:, :80], cache=caches)
    path = tmp_path / "c.safetensors"
    vq.save_prompt_cache(path, caches)
    loaded, _ = vq.load_prompt_cache(path, model=model)
    return caches, loaded, copy.deepcopy(caches)


def test_gemma4_save_load_trim_and_copy(tmp_path):
    model = gemma4()
    caches, loaded, twin = _saved_loaded_and_copied(model, tmp_path)
    assert twin[0].lends and loaded[0].lends  # copies and loaded caches lend too: shared layers read their tiers
    expected = model(TOKENS[:, 80:], cache=caches)
    assert maxdiff(model(TOKENS[:, 80:], cache=twin), expected) == 0.0
    assert maxdiff(model(TOKENS[:, 80:], cache=loaded), expected) == 0.0
    window = vq.make_prompt_cache(model, "fp16")
    model(TOKENS[:, :90], cache=window)
    assert trim_prompt_cache(window, 10) == 0  # the window has forgotten tokens, as mlx-lm's RotatingKVCache
    model = gemma4(types=("full_attention",) * 4)
    fp16 = vq.make_prompt_cache(model, "fp16")
    model(TOKENS[:, :90], cache=fp16)
    assert trim_prompt_cache(fp16, 10) == 10 and [c.offset for c in fp16] == [80, 80]
    fresh = vq.make_prompt_cache(model, "fp16")
    model(TOKENS[:, :80], cache=fresh)
    # BLAS rounds a 90-row prefill's K/V unlike an 80-row one's, then fp16 storage (test_runtime's trim test too)
    assert maxdiff(model(TOKENS[:, 80:], cache=fp16), model(TOKENS[:, 80:], cache=fresh)) < 5e-3


# --- hybrid models: non-attention layers keep mlx-lm's own caches ---------------------------------------


@pytest.mark.parametrize("make", HYBRIDS)
def test_hybrid_fp16_equals_mlx_lm_and_kivi_compresses_the_attention_layers(make):
    model = make()
    own = model.make_cache()
    reference = feed(model, own)
    caches = vq.make_prompt_cache(model, "fp16")
    assert [type(c).__name__ for c in caches] == ["ArraysCache", "TieredCache", "ArraysCache", "TieredCache"]
    assert maxdiff(feed(model, caches), reference) < 1e-2  # fp16 storage vs mlx-lm's float32 KVCache
    assert [mx.array_equal(a, b).item() for a, b in zip(caches[0].cache, own[0].cache)] == [True, True]
    lossy = vq.make_prompt_cache(model, "kivi", KIVI)
    assert mx.isfinite(feed(model, lossy)).all()
    report = cache_report(lossy)
    assert report["compressed_layers"] == [1, 3] and report["kept_layers"] == {"0": "ArraysCache", "2": "ArraysCache"}
    assert report["cache_bytes"] < report["fp16_bytes"] and report["kept_bytes"] == lossy[0].nbytes + lossy[2].nbytes


@pytest.mark.parametrize("recipe", ["xquant", "xkv"])
def test_hybrid_cross_layer_groups_pair_attention_layers_only(recipe):
    model = tiny_qwen3_next()
    caches = vq.make_prompt_cache(model, recipe, ["window=16"])
    groups = {c.plan.share.layers for c in caches if not isinstance(c, ArraysCache)}
    assert groups == {(0, 1)}  # attention caches 0 and 1: model layers 1 and 3, never a linear-attention layer
    assert [caches[1].plan.share.anchor, caches[3].plan.share.anchor] == [0, 0]
    assert mx.isfinite(feed(model, caches)).all()


@pytest.mark.parametrize("make", HYBRIDS)
def test_hybrid_save_load_copy_and_trim(make, tmp_path):
    model = make()
    caches, loaded, twin = _saved_loaded_and_copied(model, tmp_path)
    assert [type(c) for c in loaded] == [type(c) for c in caches] and isinstance(loaded[0], ArraysCache)
    expected = model(TOKENS[:, 80:], cache=caches)
    assert maxdiff(model(TOKENS[:, 80:], cache=loaded), expected) == 0.0
    assert maxdiff(model(TOKENS[:, 80:], cache=twin), expected) == 0.0
    # mlx-lm's own list is not trimmable (ArraysCache) and neither is the mixed one: nothing changes
    assert not can_trim_prompt_cache(model.make_cache())
    assert trim_prompt_cache(caches, 4) == 0 and caches[1].offset == 96


def test_hybrid_file_refused_for_another_layout(tmp_path):
    caches = vq.make_prompt_cache(tiny_qwen3_next(), "kivi", KIVI)
    path = tmp_path / "c.safetensors"
    vq.save_prompt_cache(path, caches)
    with pytest.raises(CacheFileError, match="cache layout"):
        vq.load_prompt_cache(path, model=gemma4(types=("full_attention",) * 4, shared=0))


def test_hybrid_file_missing_its_kept_state_is_refused(tmp_path):
    caches = vq.make_prompt_cache(tiny_qwen3_next(), "kivi", KIVI)
    path = tmp_path / "c.safetensors"
    vq.save_prompt_cache(path, caches)
    arrays, meta = mx.load(str(path), return_metadata=True)
    mx.save_safetensors(str(tmp_path / "cut.safetensors"), arrays, {k: v for k, v in meta.items() if k != "kept"})
    with pytest.raises(CacheFileError, match="cut.safetensors"):
        vq.load_prompt_cache(tmp_path / "cut.safetensors")


def test_explain_with_a_hybrid_model_shows_which_layers_are_compressed(monkeypatch, capsys):
    model = tiny_qwen3_next()
    monkeypatch.setattr("veloxquant.models.load_model", lambda path, lazy=False: (model, None))
    assert cli.main(["explain", "kivi", "--model", "tiny-qwen3-next"]) == 0
    out = capsys.readouterr().out
    assert "compresses 2 attention caches (model layers 1, 3" in out
    assert "layers 0, 2 keep their own ArraysCache (not compressed)" in out
    assert "layers 0-1 (model layers 1, 3; full" in out


def test_explain_shows_gemma4_shared_layers():
    from veloxquant.compiler import compile_recipe
    from veloxquant.compiler.explain import render
    from veloxquant.recipe import load_recipe

    text = render(compile_recipe(load_recipe("kivi"), ModelShape.from_model(gemma4())))
    assert "KV-shared layers 2 (reads 0's), 3 (reads 1's)" in text and "layer 0 (model layers 0, 2; sliding" in text


@pytest.mark.parametrize("make", [lambda: gemma4(mx.float16), tiny_qwen3_next])
def test_mlx_lm_generate_step_gives_the_same_tokens_with_the_fp16_recipe(make):
    from mlx_lm.generate import generate_step

    model = make()
    model.set_dtype(mx.float16)

    def tokens(caches):
        return [t for t, _ in generate_step(TOKENS[0], model, prompt_cache=caches, max_tokens=8)]

    assert tokens(vq.make_prompt_cache(model, "fp16")) == tokens(None)  # None: mlx-lm's own make_cache


# --- layouts that are refused, never run --------------------------------------------------------------


class _Chunked(KVCache):  # a KVCache subclass with other semantics (llama4's ChunkedKVCache is one)
    pass


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda m: [KVCache(), _Chunked(), KVCache(), KVCache()], "layer 1 of model uses .*_Chunked"),
        (lambda m: [KVCache()] * 5, "5 caches for 4 layers"),
        (lambda m: [KVCache()] * 3, "3 caches for 4 layers, and veloxquant cannot read which cache layer 3"),
        (lambda m: [ArraysCache(2)] * 4, "nothing for a recipe to compress"),
    ],
)
def test_a_cache_list_veloxquant_cannot_read_is_refused(bad, match, monkeypatch):
    from conftest import tiny_llama

    model = tiny_llama()
    monkeypatch.setattr(type(model), "make_cache", bad)  # a model class whose own make_cache says so
    with pytest.raises(VeloxError, match=match):
        vq.make_prompt_cache(model, "fp16")


def test_a_recipe_running_a_model_pass_is_refused_on_these_layouts():
    with pytest.raises(VeloxError, match="recipe 'kvzip' scores tokens by a pass through the model"):
        vq.make_prompt_cache(tiny_qwen3_next(), "kvzip")


def test_gemma4_with_mismatched_wiring_is_refused():
    model = gemma4()
    model.model.previous_kvs[2] = 1  # a sliding layer reading the full-attention layer's cache
    with pytest.raises(VeloxError, match=r"layer 2 of model \(sliding_attention\) attends over layer 1's cache"):
        vq.make_prompt_cache(model, "fp16")


# --- issue 36: model.make_cache replaced by veloxquant's -------------------------------------------------


def test_replaced_make_cache_reads_the_class_layout_instead_of_recursing():
    from conftest import tiny_gemma3

    model = tiny_gemma3(window=32)
    model.make_cache = lambda: vq.make_prompt_cache(model, "kivi", KIVI)
    caches = model.make_cache()  # was: RecursionError inside lark's VisitError
    assert [c.plan.window for c in caches] == [c.plan.window for c in vq.make_prompt_cache(model, "kivi")]
    assert any(c.plan.window == 32 for c in caches)
    hybrid = tiny_qwen3_next()
    hybrid.make_cache = lambda: vq.make_prompt_cache(hybrid, "kivi")
    assert isinstance(hybrid.make_cache()[0], ArraysCache)


def test_make_cache_replaced_on_the_class_is_refused_with_its_location(monkeypatch):
    from conftest import tiny_llama

    model = tiny_llama()
    monkeypatch.setattr(type(model), "make_cache", lambda self: vq.make_prompt_cache(self, "kivi"))
    with pytest.raises(VeloxError, match=r"Model.make_cache \(.*test_layouts.py:\d+\) calls veloxquant"):
        model.make_cache()
