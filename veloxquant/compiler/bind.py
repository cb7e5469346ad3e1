"""Binding model facts into positional stages: unrope gets its layer's RoPE settings."""

from typing import Any, List, Tuple

import attrs

from ..errors import RecipeError
from ..recipe.ast import Call
from .shape import ModelShape


def bind_positions(stages: List[Tuple[Call, Any]], side: str, route, layer: int, shape: ModelShape):
    """Positional transforms (unrope) get the layer's RoPE settings; misuse is located."""
    out = []
    for call, inst in stages:
        if getattr(inst, "positional", False):
            if side == "values" and getattr(inst, "keys_only", False):
                raise RecipeError(
                    f"'{call.name}' undoes RoPE, which only keys carry",
                    call.pos,
                    f"put '{call.name}' under 'keys:' (keys: {call.name} | ... values: ...)",
                )
            if getattr(route, "per_head", False):
                raise RecipeError(
                    f"'{call.name}' needs the positions of a contiguous run of tokens, but "
                    f"'{route.stage_name}' keeps different tokens in each head",
                    call.pos,
                )
            rope = shape.ropes[layer] if shape.ropes else "the model shape carries no RoPE settings"
            if isinstance(rope, str):
                raise RecipeError(f"'{call.name}' cannot undo layer {layer}'s RoPE: {rope}", call.pos)
            inst = attrs.evolve(inst, _rope=rope)
        out.append((call, inst))
    return out
