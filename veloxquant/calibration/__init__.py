"""Calibration: stages fitted to a model's own keys/values, stored as hashed artifacts.

A calibrated stage (class attribute `calibrated = True`) declares what it fits
(`fit(samples) -> arrays`, `side`: keys or values) and on what (its `corpus` and
`tokens` parameters, so they are part of the compiled plan). `veloxquant
calibrate` writes one artifact per (model weights, plan, corpus text, fitter
version); `make_prompt_cache` binds the plan to it by that key (never a random
fallback), and the bound stages carry the artifact's content hash, so it enters
the plan fingerprint and a saved cache only loads with its calibration.
"""
from .artifact import CalibrationError
from .binding import bind, calibrated_stages

__all__ = ["CalibrationError", "bind", "calibrated_stages"]
