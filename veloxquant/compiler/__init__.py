"""The compiler: Recipe + model shape -> one LayerPlan per layer."""

from .lower import apply_sets, compile_recipe
from .plan import CodecPlan, LayerPlan, Plan, TierPlan
from .shape import SMOLLM2_135M, ModelShape

__all__ = ["apply_sets", "compile_recipe", "CodecPlan", "LayerPlan", "Plan", "TierPlan", "ModelShape", "SMOLLM2_135M"]
