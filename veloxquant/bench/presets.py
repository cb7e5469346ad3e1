"""A bench model's shapes by name (`--preset`) and its random weights' width (`--weights-bits`): the
options bench e2e, bench serve and the research instruments share, declared and applied in one place."""

import argparse

import mlx.core as mx
import mlx.nn as nn

PRESETS = {"llama3-8b": dict(layers=32, heads="32/8", head_dim=128, hidden=4096, intermediate=14336, vocab=128256)}


def add_preset_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--preset", choices=sorted(PRESETS), help="a model's shapes (overrides the shape options)")
    ap.add_argument(
        "--weights-bits",
        type=int,
        default=16,
        choices=(4, 8, 16),
        help="quantize the random weights (group 64) to this width",
    )


def apply_preset(args: argparse.Namespace) -> argparse.Namespace:
    """args with the preset's shapes (layers, heads, head_dim, hidden, intermediate, vocab) in place of theirs."""
    for k, v in PRESETS.get(args.preset, {}).items():
        setattr(args, k, v)
    return args


def quantized(model, bits: int, name: str):
    """The model with its weights quantized to `bits` (group 64; 16: as is), and its name in a table's title."""
    if bits >= 16:
        return model, name
    nn.quantize(model, group_size=64, bits=bits)
    mx.eval(model.parameters())
    return model, f"{name}, {bits}-bit weights"
