from .registry import REGISTRY, StageInfo, load_builtin_stages, needs_of, stage

load_builtin_stages()

__all__ = ["REGISTRY", "StageInfo", "needs_of", "stage"]
