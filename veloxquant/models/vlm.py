"""mlx-vlm's vision-language models, as veloxquant reads them (pip install veloxquant[vlm]).

An mlx-vlm model (mlx_vlm.load) wraps a vision tower and a `language_model`; mlx-vlm's generate runs the
language model with the prompt cache (`model.language_model(ids, inputs_embeds=..., cache=...)`), so the
caches are the language model's: its layers, its make_cache() (mlx-vlm's KVCache and RotatingKVCache,
read as mlx-lm's are: compiler/layout.py). The prompt's image (and video) placeholder ids, replaced by
the vision tower's embeddings, say where the image tokens sit; they come from the model's config.

Nothing here imports mlx_vlm: the model is read by its attributes.
"""

from typing import Tuple

# Config fields naming the placeholder ids whose positions carry image/video embeddings.
_IMAGE_FIELDS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")


def is_vlm(model) -> bool:
    """An mlx-vlm model: a language model under `language_model` and a vision tower feeding it embeddings."""
    lm = getattr(model, "language_model", None)
    return (
        lm is not None
        and lm is not model
        and hasattr(model, "get_input_embeddings")
        and type(model).__module__.startswith("mlx_vlm.")
    )


def text_model(model):
    """The model whose layers hold the caches: an mlx-vlm model's language model, or `model` itself."""
    return model.language_model if is_vlm(model) else model


def image_token_ids(model) -> Tuple[int, ...]:
    """The placeholder ids of image and video tokens in an mlx-vlm model's config (empty for others)."""
    if not is_vlm(model):
        return ()
    config = getattr(model, "config", None)
    ids = set()
    for field in _IMAGE_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) and value >= 0:
            ids.add(value)
    return tuple(sorted(ids))
