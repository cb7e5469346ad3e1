"""The tokenizer each loaded model came with, remembered for the code that runs the model itself.

`load_model` records it; a model pass a cache runs (KVzip's repeat instruction,
runtime/eviction/model_pass.py) tokenizes its prompt with it. Kept beside the loader so the
models layer needs nothing from the runtime that uses it.
"""

import weakref
from typing import Dict

_TOKENIZERS: Dict[int, tuple] = {}  # id(model) -> (weak model, tokenizer)


def remember_tokenizer(model, tokenizer) -> None:
    """The tokenizer that came with `model` (veloxquant.models.load_model calls this)."""
    ref = weakref.ref(model, lambda _r, key=id(model): _TOKENIZERS.pop(key, None))
    _TOKENIZERS[id(model)] = (ref, tokenizer)


def tokenizer_of(model):
    """The remembered tokenizer of `model`, or None (a model not loaded by load_model)."""
    ref, tokenizer = _TOKENIZERS.get(id(model), (None, None))
    return tokenizer if ref is not None and ref() is model else None
