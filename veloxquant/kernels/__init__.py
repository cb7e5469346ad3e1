"""Fused kernels over veloxquant's codec storage, each with an MLX-ops reference.

`fused_affine_partial(q, k_enc, v_enc, k_spec, v_spec, scale) -> (out, lse)` is
the entry point: it runs the CUDA kernel where it is verified for the backend
and supports the call, and the reference otherwise. Every kernel is a row of the
kernel table (table.py: scope, launcher, verified backends); dispatch.py routes by it
(kernels/CONTRACT.md).
"""

from .dispatch import backend, choice, fused_affine_partial
from .reference import affine_partial_attention as reference_affine_partial
from .table import KERNELS

__all__ = ["KERNELS", "backend", "choice", "fused_affine_partial", "reference_affine_partial"]
