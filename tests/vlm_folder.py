"""A random-init tiny Qwen2.5-VL saved as a model folder mlx_vlm.load reads (weights, config, a word-level
tokenizer with Qwen's special tokens and chat template, image processor settings), and generated images:
what the batched and CLI tests of mlx-vlm models run on, with nothing downloaded."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_vlm.utils import get_model_and_args, save_config, save_weights, update_module_configs
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = [
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
WORDS = [f"w{i}" for i in range(290)] + ["user", "assistant", "system"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|> <|image_pad|> <|vision_end|> "
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def words(n: int, seed: int = 0) -> str:
    """A prompt of n words of the tokenizer's vocabulary (one token each)."""
    return " ".join(f"w{(7 * i + 13 * seed) % 280 + 5}" for i in range(n))


def image(path: Path, seed: int, size: int = 56) -> str:
    Image.fromarray((np.random.default_rng(seed).random((size, size, 3)) * 255).astype(np.uint8)).save(path)
    return str(path)


def _tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", additional_special_tokens=SPECIALS
    )
    hf.chat_template = TEMPLATE
    return hf


def qwen2_5_vl_configs(vocab_size: int):
    """(text, vision) configs of the tiny Qwen2.5-VL the tests build: 2 layers, 1 kv head, and a 56x56
    image is 4 image tokens."""
    text = dict(
        model_type="qwen2_5_vl",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        rms_norm_eps=1e-6,
        vocab_size=vocab_size,
        rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]},
    )
    vision = dict(
        model_type="qwen2_5_vl",
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        out_hidden_size=64,
        num_heads=2,
        fullatt_block_indexes=[1],
        window_size=56,
    )
    return text, vision


def qwen2_5_vl_folder(path: Path, dtype=mx.float16) -> Path:
    """A tiny Qwen2.5-VL (2 layers, 1 kv head, a 56x56 image is 4 image tokens) written to `path`."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer()
    tokenizer.save_pretrained(path)
    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in SPECIALS}
    pixels = {"min_pixels": 56 * 56, "max_pixels": 56 * 56, "patch_size": 14, "merge_size": 2}
    (path / "preprocessor_config.json").write_text(json.dumps({**pixels, "temporal_patch_size": 2}))
    text, vision = qwen2_5_vl_configs(vocab_size=320)
    config = dict(
        **text,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=ids["<|im_end|>"],
        text_config=dict(text),
        vision_config=vision,
    )
    arch, _ = get_model_and_args(config)
    built = json.loads(json.dumps(config))
    built["audio_config"] = {}
    mc = update_module_configs(arch.ModelConfig.from_dict(built), arch, built, ["text", "vision", "projector"])
    mx.random.seed(0)
    model = arch.Model(mc)
    model.set_dtype(dtype)
    save_weights(path, model)
    save_config(config, path / "config.json")
    return path
