"""The runtime: the cache mlx-lm talks to, its tiers, and the attention hook."""

from .cache import TieredCache
from .hook import install, installed, uninstall
from .make import caches_for, make_prompt_cache, plan_for

__all__ = ["TieredCache", "install", "installed", "uninstall", "caches_for", "make_prompt_cache", "plan_for"]
