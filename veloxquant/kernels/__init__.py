"""Fused kernels over veloxquant's codec storage, each with an MLX-ops reference.

`fused_affine_partial(q, k_enc, v_enc, k_spec, v_spec, scale) -> (out, lse)` is
the entry point: it runs the CUDA kernel where it is verified for the backend
and supports the call, and the reference otherwise (see dispatch.py and
kernels/CONTRACT.md).
"""
from .dispatch import VERIFIED_BACKENDS, backend, choice, fused_affine_partial
from .reference import affine_partial_attention as reference_affine_partial

__all__ = ["VERIFIED_BACKENDS", "backend", "choice", "fused_affine_partial", "reference_affine_partial"]
