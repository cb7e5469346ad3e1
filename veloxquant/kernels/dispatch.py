"""Choose the fused kernel or the MLX-ops reference for one tier's attention.

The CUDA kernel is taken only where (1) the default device is a GPU, (2) that
GPU is driven by MLX's CUDA backend, (3) the backend is in VERIFIED_BACKENDS
(filled only after the parity tests passed on real hardware, see
docs/kernels.md), and (4) the call's shapes/specs are ones the kernel supports.
Everything else -- CPU, Metal, odd bit widths, long query blocks -- runs the
reference, which answers the same contract.
"""
import os
from typing import Dict, Optional, Tuple

import mlx.core as mx

from . import reference
from .reference import Spec, spec_fields

# Backends on which kernels/cuda/affine_attention.cu passed tests/test_kernels.py
# (the gpu-marked parity tests) on real hardware: NVIDIA H200, mlx 0.32.4 (CUDA 13),
# 41 passed (both attend kernels), worst max abs error 4.8e-5 vs the float32 CPU
# reference (docs/kernels.md).
VERIFIED_BACKENDS = frozenset({"cuda"})

# VELOXQUANT_KERNELS=off forces the reference (debugging, A/B timing).
_ENV = "VELOXQUANT_KERNELS"


def backend() -> str:
    """'cuda', 'metal' or 'cpu': what runs mx.default_device()."""
    if mx.default_device().type != mx.DeviceType.gpu:
        return "cpu"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and hasattr(cuda, "is_available"):
        try:
            if cuda.is_available():
                return "cuda"
        except Exception:  # a build without the CUDA runtime answers by raising
            pass
    metal = getattr(mx, "metal", None)
    if metal is not None and metal.is_available():
        return "metal"
    return "cpu"


def choice(q: mx.array, k_enc: Dict[str, mx.array], v_enc: Dict[str, mx.array],
           k_spec: Spec, v_spec: Spec, scale: float = 1.0) -> Tuple[str, str]:
    """(implementation, reason): 'cuda' or 'reference', and why (for `explain`)."""
    if os.environ.get(_ENV, "").lower() in ("off", "0", "reference"):
        return "reference", f"{_ENV}=off"
    be = backend()
    if be != "cuda":
        return "reference", f"no fused kernel for the {be} backend"
    if be not in VERIFIED_BACKENDS:
        return "reference", "the CUDA kernel is not verified on this backend"
    if not scale > 0:
        return "reference", "non-positive scale"
    # The answer depends only on shapes, dtypes and specs: decided once per
    # signature (a decode step asks the same question for every layer).
    try:
        key = (q.ndim, tuple(q.shape), q.dtype, spec_fields(k_spec), spec_fields(v_spec),
               *((tuple(e[n].shape), e[n].dtype) for e in (k_enc, v_enc) for n in ("codes", "scales", "zeros")))
    except (KeyError, TypeError, AttributeError):
        key = None
    hit = _CHOICES.get(key) if key is not None else None
    if hit is not None:
        return hit
    from . import cuda  # imported late: only this path needs the kernel source
    why = cuda.unsupported(q, k_enc, v_enc, k_spec, v_spec)
    if why:
        res = ("reference", why)
    else:
        B, Hq, Lq, D = q.shape
        _, Hkv, L, _ = k_enc["codes"].shape
        impl = attend_impl(Hq, Lq, D, Hkv, L, spec_fields(k_spec), spec_fields(v_spec), B=B)
        names = {"v1": "affine_attention.cu, CUDA-core attend", "mma": "affine_attention.cu, tensor-core attend_mma",
                 "split": "affine_attention.cu, pipelined tensor-core attend_split",
                 "tc": "tc_attention.cu, lean tensor-core attend_tc"}
        res = ("cuda", f"fused split-K kernel (kernels/cuda/{names[impl]})")
    if key is not None and len(_CHOICES) < 4096:
        _CHOICES[key] = res
    return res


_CHOICES: Dict[tuple, Tuple[str, str]] = {}


def attend_impl(Hq: int, Lq: int, D: int, Hkv: int, L: int, kspec: tuple, vspec: tuple,
                impl: Optional[str] = None, chunk: int = 0, hides: bool = False, B: int = 1) -> str:
    """The attend kernel a CUDA call runs (`cuda.launcher`, `explain`): `impl` or the default
    (`cuda.default_impl`) where that kernel's scope takes the call, else the fallback
    default (`cuda.fallback_impl`) when attend_tc was the default, else v1 -- always v1 for a
    chunk size or a hidden front, which only it takes."""
    from . import cuda, tc
    which = "v1" if chunk or hides else (impl or cuda.default_impl(D, L))
    chosen = bool(impl or cuda.forced_impl())
    if which == "tc" and (tc.supported(Hq, Lq, D, Hkv, L, kspec, vspec)
                          or not chosen and D > 128 and not tc.folds_call(B, Hq, Lq, D, Hkv, L, kspec, vspec)):
        # D = 256 in two launches measured slower than v1 (Gemma-3's shapes: docs/kernels.md)
        which = "v1" if chosen else cuda.fallback_impl(D, L)
    if which in ("mma", "split") and cuda.mma_supported(Hq, Lq, D, Hkv, L, kspec, vspec):
        which = "v1"  # split has attend_mma's scope
    return which


def fused_affine_partial(q: mx.array, k_enc: Dict[str, mx.array], v_enc: Dict[str, mx.array],
                         k_spec: Spec, v_spec: Spec, scale: float) -> Tuple[mx.array, mx.array]:
    """Partial attention (out [B,Hq,Lq,D] f32, lse [B,Hq,Lq] f32) of q over one
    affine-coded tier, from its codes: the CUDA kernel where verified, else the
    reference."""
    impl, _ = choice(q, k_enc, v_enc, k_spec, v_spec, scale)
    if impl == "cuda":
        from . import cuda
        return cuda.affine_partial_attention(q, k_enc, v_enc, k_spec, v_spec, scale)
    return reference.affine_partial_attention(q, k_enc, v_enc, k_spec, v_spec, scale)


# The dequant kernel (affine codes -> values, for attention through SDPA) passed
# tests/test_kernels.py on an NVIDIA H200 (mlx 0.32.4): see docs/kernels.md.
DEQUANT_VERIFIED = True


def dequantizer():
    """The CUDA dequant binding (module `dequant`: `dequant_unsupported`, then
    `dequantize`), or None off CUDA, when not verified, or with VELOXQUANT_KERNELS=off."""
    if os.environ.get(_ENV, "").lower() in ("off", "0", "reference") or not DEQUANT_VERIFIED:
        return None
    if backend() != "cuda" or "cuda" not in VERIFIED_BACKENDS:
        return None
    from . import dequant
    return dequant


# Fused kernels that attend from a codec's codes (qjl sign products, Lloyd-Max look-ups,
# ...), by the codec's stage chain, e.g. ("rotation", "lloydmax"). A kernel takes
# runtime.code_attention.codes_partial_attention's arguments and returns the same
# partial; it is listed here only after its parity test passed on the backend named.
CODE_KERNELS: Dict[Tuple[str, Tuple[str, ...]], object] = {}


def _register_code_kernels() -> None:
    from . import lut  # Lloyd-Max look-ups (turboquant_rvq), once its parity passed
    if lut.LUT_VERIFIED:
        CODE_KERNELS.update({("cuda", chain): lut.partial_attention for chain in lut.CHAINS})


_register_code_kernels()


def encode_kernel(codec):
    """A verified kernel coding a block for this codec in one launch (`fn(codec, x) -> arrays`), or None."""
    if os.environ.get(_ENV, "").lower() in ("off", "0", "reference") or backend() != "cuda":
        return None
    from . import lut
    return lut.encode if lut.ENCODE_VERIFIED and not lut.encode_unsupported(codec) else None


def code_kernel(tier_plan, q: mx.array, mask=None):
    """A verified fused kernel for attention from this tier's key/value codes, or None (the MLX-ops reference)."""
    if not CODE_KERNELS or os.environ.get(_ENV, "").lower() in ("off", "0", "reference"):
        return None
    chain = tuple(s.stage_name for s in tier_plan.keys.stages) + ("/",) + tuple(
        s.stage_name for s in tier_plan.values.stages)
    return CODE_KERNELS.get((backend(), chain))
