"""Calibration: stages fitted to a model's own keys/values, stored as hashed artifacts.

A calibrated stage (class attribute `calibrated = True`) declares what it fits
(`fit(samples) -> arrays`, `side`: keys or values) and on what (its `corpus` and
`tokens` parameters, so they are part of the compiled plan). `veloxquant
calibrate` writes one artifact per (model weights, plan, corpus text, fitter
version); `make_prompt_cache` binds the plan to it by that key (never a random
fallback), and the bound stages carry the artifact's content hash, so it enters
the plan fingerprint and a saved cache only loads with its calibration.

Three layers: the artifact store (`veloxquant.artifacts`, below the stages that
read it), binding (`veloxquant.compiler.binding`, part of compiling a plan), and
this package, collecting and fitting, which runs models through the runtime.
"""

from .fit import calibrate

__all__ = ["calibrate"]
