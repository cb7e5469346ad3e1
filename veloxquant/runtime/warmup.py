"""Compile a recipe's kernels before the user's first generation.

MLX builds each custom-kernel variant (kernels/variants.py) and each of its own JIT
kernels with NVRTC at the first evaluation that needs it; which variants a decode step
needs follows the model's shapes, the recipe's specs, the tier lengths (so the context)
and the dense tiers beside a coded one. The only exact way to know them is to run the
same path, so `warmup` does: a cache from the recipe, a random prompt of `context` tokens
through mlx-lm's generate_step, then `decode` steps (by default enough to cross every
window spill of the built-in recipes more than once), then it drops the cache.

Afterwards this process holds every variant built, and MLX's on-disk PTX cache
(MLX_PTX_CACHE_DIR, by default under the temp directory) holds their text, so a later
process only loads them. Variants follow the context: warm up at the context the
generation will run at (a tier crossing 8192 tokens at head_dim 128 changes chunk size).
"""

import time
from typing import Iterable, Set, Tuple, Union

import mlx.core as mx
from mlx_lm.generate import generate_step

from ..kernels import variants
from ..recipe.load import Recipe
from .hook import uninstall
from .make import make_prompt_cache

DECODE_STEPS = 256  # kivi's window (128) plus a group (32) is one spill period; this crosses it more than once


def _vocab(model) -> int:
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", 0) or getattr(getattr(model, "model", None), "vocab_size", 0)
    return int(size) or 1000


def warmup(
    model,
    recipe: Union[str, Recipe] = "fp16",
    context: int = 4096,
    decode: int = DECODE_STEPS,
    sets: Iterable[str] = (),
) -> Tuple[Set[tuple], float]:
    """Run `recipe` once on `model` at `context` tokens and `decode` decode steps, so the
    kernels a generation of that shape needs are compiled. Returns (the kernel variants the
    run launched, seconds). `sets`: recipe parameter overrides (NAME=VALUE), as make_prompt_cache."""
    if context < 2 or decode < 1:
        raise ValueError(f"warmup: context must be at least 2 and decode positive (got {context}, {decode})")
    start = time.perf_counter()
    prompt = mx.random.randint(0, _vocab(model), (context,), key=mx.random.key(0))
    cache = make_prompt_cache(model, recipe, sets)
    try:
        with variants.recording() as seen:
            for _ in generate_step(prompt, model, max_tokens=decode + 1, prompt_cache=cache):
                pass
            mx.synchronize()
    finally:
        uninstall(model)
    return seen, time.perf_counter() - start
