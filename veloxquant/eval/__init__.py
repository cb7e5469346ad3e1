"""Evaluation: perplexity, passkey retrieval, attention fidelity and cost of
recipes side by side with fp16 and mlx-lm's quantized cache; reports and plots.

    veloxquant eval kivi streaming_llm --json results.json
    veloxquant compare results.json --md results.md --png pareto.png
"""

from importlib import import_module

# Imported on first use, so `veloxquant --help` does not load MLX.
_LAZY = {"EvalConfig": "config", "evaluate": "run", "Row": "rows", "expand": "rows", "parse_row": "rows"}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
