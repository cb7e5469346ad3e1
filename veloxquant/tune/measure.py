"""One measurement of a recipe on a slice of text: perplexity and the bytes its cache really held.

A slice is a few windows of `prefix + score_tokens + 1` tokens. Each window is
prefilled through fresh caches, its continuation scored (eval/ppl.py) and its
next-token distributions compared with fp16's (KL divergence, eval/divergence.py;
fp16's computed once per process), and the cache's held bytes (`nbytes` of its
arrays) compared with fp16's for the same tokens. Plain data in, plain data out: the same function runs in this process
or as a Ray task (a worker loads the model once and keeps it).
"""

import math
from typing import Dict, List, Optional, Sequence

import attrs

from ..compiler import ModelShape
from ..eval.cost import fp16_bytes
from ..eval.divergence import Tracker, reference
from ..eval.ppl import window_nll, windows
from ..pool import load_cached
from ..recipe import load_recipe
from ..runtime import make_prompt_cache, uninstall


@attrs.frozen
class Slice:
    name: str  # "calibration" or "held-out"
    windows: tuple  # tuples of token ids
    prefix: int
    prefill_chunk: int = 512
    score_chunk: int = 32


# (id(model), slice) -> (model, fp16's log-probs per window): one fp16 pass per process and slice. The
# model is kept beside them so that an id reused by another model after this one is freed never matches.
_REFERENCES: Dict[tuple, tuple] = {}


def _references(model, sl: Slice) -> list:
    key = (id(model), sl)
    if key not in _REFERENCES or _REFERENCES[key][0] is not model:
        fp16 = load_recipe("fp16")
        refs = [
            reference(
                model, lambda: make_prompt_cache(model, fp16), list(w), sl.prefix, sl.prefill_chunk, sl.score_chunk
            )
            for w in sl.windows
        ]
        _REFERENCES[key] = (model, refs)
    return _REFERENCES[key][1]


def measure(model, recipe_text: str, sl: Slice, base_dir: Optional[str] = None) -> Dict[str, float]:
    """{nll, tokens, ppl, kld, cache_bytes, fp16_bytes, ratio} of a recipe (its YAML text) on a slice;
    kld is the mean KL divergence of its next-token distributions from fp16's at every scored position."""
    recipe = recipe_from_text(recipe_text, base_dir)
    shape = ModelShape.from_model(model)
    nll = tokens = held = base = 0
    tracker = Tracker()
    try:
        for w, ref in zip(sl.windows, _references(model, sl)):
            r = window_nll(
                model,
                lambda: make_prompt_cache(model, recipe),
                list(w),
                sl.prefix,
                sl.prefill_chunk,
                sl.score_chunk,
                observe=tracker.observer(ref),
            )
            nll, tokens = nll + r["nll"], tokens + r["tokens"]
            held, base = held + r["cache_bytes"], base + fp16_bytes(shape, r["context"])
    finally:
        uninstall(model)
    return {
        "nll": nll,
        "tokens": tokens,
        "ppl": math.exp(nll / tokens),
        "kld": tracker.summary()["kld_mean"],
        "cache_bytes": held,
        "fp16_bytes": base,
        "ratio": held / base,
    }


def recipe_from_text(text: str, base_dir: Optional[str] = None):
    """Load a recipe from YAML text (written to a temporary file: `extends` resolves from base_dir)."""
    import os
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".yaml", dir=base_dir)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return load_recipe(path)
    finally:
        os.unlink(path)


def measure_task(model_ref: Optional[str], recipe_text: str, sl: Slice) -> Dict[str, float]:
    """`measure` with the model loaded (once per process) from its reference: a Ray task body."""
    model, _ = load_cached(model_ref)
    return measure(model, recipe_text, sl)


def slices(
    tokens: Sequence[int],
    calib_windows: int,
    heldout_windows: int,
    prefix: int,
    score_tokens: int,
    heldout_tokens: Optional[Sequence[int]] = None,
) -> List[Slice]:
    """Calibration windows from the first half of the corpus, held-out windows from the second,
    or from all of `heldout_tokens` (another text) when given."""
    half = len(tokens) // 2
    held = tokens[half:] if heldout_tokens is None else heldout_tokens
    length = prefix + score_tokens + 1
    return [
        Slice("calibration", tuple(map(tuple, windows(tokens[:half], calib_windows, length))), prefix),
        Slice("held-out", tuple(map(tuple, windows(held, heldout_windows, length))), prefix),
    ]
