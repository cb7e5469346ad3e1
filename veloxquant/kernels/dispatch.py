"""Choose a fused kernel or the MLX-ops reference for one tier, by the kernel table (table.py).

An affine tier's attention takes a CUDA kernel only where (1) the default device is a
GPU, (2) that GPU is driven by MLX's CUDA backend, (3) the kernel family is verified on
that backend (its parity tests passed on real hardware, docs/kernels.md), and (4) the
call's shapes/specs are ones the kernel supports. Where no fused kernel is verified (Metal),
it attends through MLX's own quantized matmul (the attend-mlx row `qmm`, mlx_affine.py) where
that route is the backend's default (table.MLX_ATTEND_BACKENDS, VELOXQUANT_AFFINE_ROUTE) and its
scope takes the call. Everything else -- odd bit widths, long query blocks -- is decoded (the
reference answers the same contract). VELOXQUANT_KERNELS=off forces that everywhere.
"""

from typing import Dict, Optional, Tuple

import mlx.core as mx

from . import mlx_affine, reference
from .reference import Spec, spec_fields
from .table import KERNELS, OFF_ENV, Kernel, attend_route, family, kernels_off, mlx_attend, plugin, verified

# The CUDA bindings (cuda.py, mma.py, tc_launch.py, dequant.py, lut.py with their sources and
# geometry) are reached through their table rows (`plugin`, `Kernel.launch`): imported the first
# time a call on the CUDA backend asks for them, never on a backend that has none verified.


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


def choice(
    q: mx.array,
    k_enc: Dict[str, mx.array],
    v_enc: Dict[str, mx.array],
    k_spec: Spec,
    v_spec: Spec,
    scale: float = 1.0,
    batch_rows: bool = False,
) -> Tuple[str, str]:
    """(implementation, reason): 'cuda', an attend-mlx kernel ('qmm': MLX's own quantized matmul,
    where no fused kernel is verified) or 'reference' (decode), and why (for `explain`).
    `batch_rows`: the call is a ragged batch's rows (table.MLX_ATTEND_ROWS_BACKENDS)."""
    if kernels_off():
        return "reference", f"{OFF_ENV}=off"
    be = backend()
    if not scale > 0:
        return "reference", "non-positive scale"
    if be != "cuda" or not verified("v1", be):
        return _mlx_choice(q, k_enc, v_enc, k_spec, v_spec, be, batch_rows)
    # The answer depends only on shapes, dtypes and specs: decided once per
    # signature (a decode step asks the same question for every layer).
    try:
        key = (
            q.ndim,
            tuple(q.shape),
            q.dtype,
            spec_fields(k_spec),
            spec_fields(v_spec),
            *((tuple(e[n].shape), e[n].dtype) for e in (k_enc, v_enc) for n in ("codes", "scales", "zeros")),
        )
    except (KeyError, TypeError, AttributeError):
        key = None
    hit = _CHOICES.get(key) if key is not None else None
    if hit is not None:
        return hit
    why = plugin("v1").unsupported(q, k_enc, v_enc, k_spec, v_spec)  # v1 takes every call its family does
    if why:
        res = ("reference", why)
    else:
        B, Hq, Lq, D = q.shape
        _, Hkv, L, _ = k_enc["codes"].shape
        impl = attend_route((B, Hq, Lq, D, Hkv, L), spec_fields(k_spec), spec_fields(v_spec))
        res = ("cuda", f"fused split-K kernel (kernels/cuda/{KERNELS[impl].source})")
    if key is not None and len(_CHOICES) < 4096:
        _CHOICES[key] = res
    return res


_CHOICES: Dict[tuple, Tuple[str, str]] = {}


def _mlx_choice(q, k_enc, v_enc, k_spec: Spec, v_spec: Spec, be: str, batch_rows: bool = False) -> Tuple[str, str]:
    """Where no fused kernel of ours is verified: MLX's own kernels (table.mlx_attend), else decode."""
    name = mlx_attend(be, batch_rows)
    if not name:
        return "reference", f"no fused kernel for the {be} backend"
    B, Hq, Lq, D = q.shape
    _, Hkv, L, _ = k_enc["codes"].shape
    why = KERNELS[name].scope(B, Hq, Lq, D, Hkv, L, spec_fields(k_spec), spec_fields(v_spec))
    why = why or mlx_affine.storage_unsupported(k_enc, v_enc)
    return ("reference", why) if why else (name, f"MLX's own kernels ({KERNELS[name].source})")


def cuda_launcher(qshape: tuple, qdtype, cshape: tuple, k_spec: Spec, v_spec: Spec, scale: float, hides: bool = False):
    """The CUDA attend launch (`cuda.launcher`: the attend kernel `table.attend_route` picks) for
    calls of these shapes, `run(q, k_enc, v_enc, tail=None, hidden=0) -> (out, lse)`."""
    return plugin("v1").launcher(qshape, qdtype, cshape, k_spec, v_spec, scale, hides=hides)


def mlx_launcher(name: str, qshape: tuple, qdtype, cshape: tuple, k_spec: Spec, v_spec: Spec, scale: float):
    """The attend-mlx kernel `name`'s `run(q, k_enc, v_enc, tail=None, hidden=0) -> (out, lse)`."""
    return KERNELS[name].launch(qshape, qdtype, cshape, spec_fields(k_spec), spec_fields(v_spec), float(scale))


def fused_affine_partial(
    q: mx.array, k_enc: Dict[str, mx.array], v_enc: Dict[str, mx.array], k_spec: Spec, v_spec: Spec, scale: float
) -> Tuple[mx.array, mx.array]:
    """Partial attention (out [B,Hq,Lq,D] f32, lse [B,Hq,Lq] f32) of q over one
    affine-coded tier, from its codes: the CUDA kernel where verified, else the
    reference."""
    impl, _ = choice(q, k_enc, v_enc, k_spec, v_spec, scale)
    if impl == "cuda":
        return plugin("v1").affine_partial_attention(q, k_enc, v_enc, k_spec, v_spec, scale)
    if impl in KERNELS:
        return mlx_launcher(impl, q.shape, q.dtype, k_enc["codes"].shape, k_spec, v_spec, scale)(q, k_enc, v_enc)
    return reference.affine_partial_attention(q, k_enc, v_enc, k_spec, v_spec, scale)


def dequantizer():
    """The CUDA dequant binding (module `dequant`: `dequant_unsupported`, then
    `dequantize`), or None where it is not verified or with VELOXQUANT_KERNELS=off."""
    return None if kernels_off() or not verified("dequant", backend()) else plugin("dequant")


def encode_kernel(codec):
    """A verified kernel coding a block for this codec in one launch (`fn(codec, x) -> arrays`), or None."""
    if kernels_off():
        return None
    be = backend()
    for kernel in family("encode"):
        if be in kernel.verified and not kernel.scope(codec):
            return kernel.launch
    return None


def code_kernel(tier_plan, q: mx.array, mask=None) -> Optional[Kernel]:
    """A verified fused kernel for attention from this tier's key/value codes, or None (the
    MLX-ops reference): a Kernel whose `scope(q, k_enc, v_enc, k_codec, v_codec, mask)` the
    caller checks before `launch(q, k_enc, v_enc, k_codec, v_codec, scale)`."""
    if kernels_off():
        return None
    chain = (
        tuple(s.stage_name for s in tier_plan.keys.stages)
        + ("/",)
        + tuple(s.stage_name for s in tier_plan.values.stages)
    )
    be = backend()
    for kernel in family("code"):
        if be in kernel.verified and chain in kernel.chains:
            return kernel
    return None
