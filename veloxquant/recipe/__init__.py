"""The recipe front end: YAML + the pipeline language -> Recipe."""

from .load import Recipe, builtin_names, load_recipe

__all__ = ["Recipe", "builtin_names", "load_recipe"]
