"""Model helpers: GGUF -> mlx-lm conversion and the cached default models."""

from .default import default_model_path, gemma3_model_path, load_model
from .errors import ModelError
from .gguf_convert import CONVERTER_VERSION, convert_gguf, open_gguf, read_metadata
from .gguf_tokenizer import build_tokenizer

__all__ = [
    "CONVERTER_VERSION",
    "ModelError",
    "build_tokenizer",
    "convert_gguf",
    "default_model_path",
    "gemma3_model_path",
    "load_model",
    "open_gguf",
    "read_metadata",
]
