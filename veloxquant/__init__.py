"""veloxquant: KV-cache compression for MLX language models, driven by recipes."""
from .errors import CacheFileError, RecipeError, VeloxError
from .recipe import load_recipe
from .compiler import compile_recipe
from .runtime import install, make_prompt_cache, uninstall

__version__ = "0.1.0"
__all__ = ["CacheFileError", "RecipeError", "VeloxError", "load_recipe", "compile_recipe",
           "install", "make_prompt_cache", "uninstall"]
