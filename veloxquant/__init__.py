"""veloxquant: KV-cache compression for MLX language models, driven by recipes.

caches = veloxquant.make_prompt_cache(model, "kivi")
mlx_lm.generate(model, tokenizer, prompt, prompt_cache=caches)
"""

from importlib import import_module

from .errors import CacheFileError, RecipeError, VeloxError

__version__ = "0.1.0"

# Imported on first use: the runtime pulls in mlx_lm (and its tokenizers), which
# `veloxquant check` / `fmt` / `explain` do not need.
_LAZY = {
    "load_model": "veloxquant.models",
    "load_recipe": "veloxquant.recipe",
    "compile_recipe": "veloxquant.compiler",
    "make_prompt_cache": "veloxquant.runtime",
    "install": "veloxquant.runtime",
    "uninstall": "veloxquant.runtime",
    "save_prompt_cache": "veloxquant.runtime.persist",
    "load_prompt_cache": "veloxquant.runtime.persist",
}

__all__ = ["CacheFileError", "RecipeError", "VeloxError", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'veloxquant' has no attribute {name!r}")
