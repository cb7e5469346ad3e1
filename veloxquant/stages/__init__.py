from .registry import REGISTRY, StageInfo, load_builtin_stages, stage

load_builtin_stages()

__all__ = ["REGISTRY", "StageInfo", "stage"]
