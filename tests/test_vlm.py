"""mlx-vlm models (pip install veloxquant[vlm]): tiny random-init Qwen2.5-VL, Gemma-3 and LLaVA with a
generated image, run through mlx-vlm's own generation loop (generate_step, which mlx_vlm.generate drives)
with prompt_cache=veloxquant.make_prompt_cache(model, recipe)."""

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm")
from mlx_vlm.generate.ar import generate_step  # noqa: E402
from mlx_vlm.utils import get_model_and_args, update_module_configs  # noqa: E402
from PIL import Image  # noqa: E402  (mlx-vlm depends on Pillow)
from transformers import CLIPImageProcessorPil, Gemma3ImageProcessorPil, Qwen2VLImageProcessorPil  # noqa: E402
from vlm_folder import qwen2_5_vl_configs  # noqa: E402

import veloxquant as vq  # noqa: E402
from veloxquant.errors import VeloxError  # noqa: E402
from veloxquant.runtime.eviction import protected  # noqa: E402

IMAGE = Image.fromarray((np.random.default_rng(0).random((56, 56, 3)) * 255).astype(np.uint8))
TEXT = list(range(10, 400))  # 390 text tokens after the image


def build(config):
    arch, _ = get_model_and_args(config)
    config.setdefault("vision_config", {})
    config.setdefault("audio_config", {})
    mc = update_module_configs(arch.ModelConfig.from_dict(config), arch, config, ["text", "vision", "projector"])
    mx.random.seed(0)
    model = arch.Model(mc)
    model.set_dtype(mx.float16)  # 16-bit model: mlx-vlm's caches hold what the fp16 recipe holds
    return model


def qwen2_5_vl():
    text, vision = qwen2_5_vl_configs(vocab_size=500)
    model = build(
        dict(
            **text,
            image_token_id=400,
            video_token_id=401,
            vision_start_token_id=402,
            vision_end_token_id=403,
            text_config=dict(text),
            vision_config=vision,
        )
    )
    o = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56)(images=[IMAGE], return_tensors="np")
    n = int(np.prod(o["image_grid_thw"][0])) // 4
    ids = [1, 2, 402] + [400] * n + [403] + TEXT
    return model, ids, 400, mx.array(o["pixel_values"]), {"image_grid_thw": mx.array(o["image_grid_thw"])}


def gemma3():
    model = build(
        dict(
            model_type="gemma3",
            image_token_index=450,
            vocab_size=500,
            text_config=dict(
                model_type="gemma3_text",
                hidden_size=64,
                num_hidden_layers=4,
                intermediate_size=128,
                num_attention_heads=2,
                head_dim=32,
                num_key_value_heads=1,
                vocab_size=500,
                sliding_window=32,
                sliding_window_pattern=2,
                mm_tokens_per_image=4,
                query_pre_attn_scalar=32,
            ),
            vision_config=dict(
                model_type="siglip_vision_model",
                num_hidden_layers=1,
                hidden_size=32,
                intermediate_size=64,
                num_attention_heads=2,
                patch_size=14,
                image_size=56,
            ),
        )
    )
    pv = Gemma3ImageProcessorPil(size={"height": 56, "width": 56})(images=[IMAGE], return_tensors="np")["pixel_values"]
    return model, [2, 5] + [450] * 4 + TEXT, 450, mx.array(pv), {}


def llava():
    model = build(
        dict(
            model_type="llava",
            image_token_index=450,
            vocab_size=500,
            text_config=dict(
                model_type="llama",
                hidden_size=64,
                num_hidden_layers=2,
                intermediate_size=128,
                num_attention_heads=2,
                num_key_value_heads=1,
                vocab_size=500,
            ),
            vision_config=dict(
                model_type="clip_vision_model",
                num_hidden_layers=2,
                hidden_size=32,
                intermediate_size=64,
                num_attention_heads=2,
                image_size=56,
                patch_size=14,
                projection_dim=32,
            ),
        )
    )
    pv = CLIPImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})(
        images=[IMAGE], return_tensors="np"
    )["pixel_values"]
    return model, [1, 5] + [450] * 16 + TEXT, 450, mx.array(pv), {}


MODELS = [qwen2_5_vl, gemma3, llava]
_BUILT = {}


def model_of(make):
    if make not in _BUILT:
        _BUILT[make] = make()
    return _BUILT[make]


def generate(model, ids, pixels, extra, cache, n=6):
    lm = model.language_model
    if hasattr(lm, "_position_ids"):  # mlx-vlm's generate resets Qwen's multimodal RoPE state per prompt too
        lm._position_ids = lm._rope_deltas = None
    steps = generate_step(
        mx.array([ids]),
        model,
        pixels.astype(mx.float16),
        mx.ones((1, len(ids)), mx.int32),
        prompt_cache=cache,
        max_tokens=n,
        temperature=0.0,
        prefill_step_size=64,
        **extra,
    )
    out = [s for s, _ in zip(steps, range(n))]
    return [t for t, _ in out], mx.stack([lp for _, lp in out])


@pytest.fixture(autouse=True)
def _unhook():
    yield
    vq.uninstall()


@pytest.mark.parametrize("make", MODELS, ids=lambda m: m.__name__)
def test_fp16_equals_mlx_vlms_own_cache(make):
    model, ids, _, pixels, extra = model_of(make)
    tokens, logits = generate(model, ids, pixels, extra, None)
    caches = vq.make_prompt_cache(model, "fp16")
    assert len(caches) == len(model.language_model.layers)
    got, got_logits = generate(model, ids, pixels, extra, caches)
    assert got == tokens
    assert float(mx.abs(got_logits - logits).max()) == 0.0
    assert caches[0].offset == len(ids) + 6  # generate_step computes one token ahead


@pytest.mark.parametrize("make", MODELS, ids=lambda m: m.__name__)
@pytest.mark.parametrize(
    "recipe,sets",
    [
        ("kivi", ["window=16", "group=16"]),
        ("h2o", ["budget=32"]),
        ("snapkv", ["budget=32", "window=8"]),
        ("turboquant_rvq", []),
    ],
)
def test_lossy_recipes_hold_fewer_bytes_and_keep_image_tokens(make, recipe, sets):
    model, ids, image_id, pixels, extra = model_of(make)
    fp16 = vq.make_prompt_cache(model, "fp16")
    generate(model, ids, pixels, extra, fp16)
    caches = vq.make_prompt_cache(model, recipe, sets)
    tokens, _ = generate(model, ids, pixels, extra, caches)
    assert len(tokens) == 6
    assert sum(c.nbytes for c in caches) < sum(c.nbytes for c in fp16)
    runs = protected.of(caches)
    n_image = ids.count(image_id)
    if recipe in ("h2o", "snapkv"):
        assert (
            runs is not None
            and runs.count == n_image
            and runs.runs == [(ids.index(image_id), ids.index(image_id) + n_image)]
        )
        for c in caches:
            for t in c.tiers:
                if t.per_head:  # every head of every layer still holds every image token it can see
                    seen = runs.held(c.offset, t.window)
                    kept = mx.sum(runs.mask(t.positions), axis=-1)
                    assert kept.tolist() == [[seen] * kept.shape[1]], (c.offset, t.window)


@pytest.mark.parametrize("make", [qwen2_5_vl], ids=lambda m: m.__name__)
def test_images_evict_lets_them_go_and_bad_option_is_refused(make):
    model, ids, image_id, pixels, extra = model_of(make)
    caches = vq.make_prompt_cache(model, "h2o", ["budget=8"], images="evict")
    generate(model, ids, pixels, extra, caches)
    assert protected.of(caches) is None
    with pytest.raises(VeloxError, match="images="):
        vq.make_prompt_cache(model, "h2o", images="sometimes")
