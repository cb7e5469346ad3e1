"""Every built-in recipe, with parameters small enough that a few hundred tokens
of a tiny model exercise what the recipe does (spills, drops, evictions)."""

from veloxquant.compiler.binding import needs_artifact
from veloxquant.recipe import builtin_names

SMALL = {
    "kivi": ["window=32", "bits=8"],
    "kivi_sink": ["window=32", "bits=8"],
    "streaming_llm": ["window=64"],
    "xquant": ["window=32"],
    "cachegen": ["window=32"],
    "h2o": ["budget=64"],
    "tova": ["budget=64"],
    "snapkv": ["budget=64"],
    "lagquant": ["budget=64", "lag=32"],
    "pyramidkv": ["budget=pyramid(from=96, to=32)"],
}
# Calibrated recipes need an artifact made on the model first: tests/test_calibration.py covers them.
RECIPES = sorted(n for n in builtin_names() if not needs_artifact(n))
# Recipes whose held tokens equal mlx-lm's KVCache's: their outputs can be compared exactly.
EXACT = ("fp16",)
