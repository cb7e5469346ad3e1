"""The kernel table: every fused kernel by name, the calls it takes, how it launches, and
the backends it is verified on.

Each kernel module registers its kernels here when imported (`veloxquant.kernels` imports
them all); `dispatch` routes by this table and the compiler asks it what is verified. A kernel
lists a backend in `verified` only after its parity tests passed there on real hardware
(docs/kernels.md, "Parity on the H200"); everywhere else the MLX-ops reference answers.
"""

import os
from typing import Callable, Dict, NamedTuple, Optional, Tuple

OFF_ENV = "VELOXQUANT_KERNELS"  # =off (or 0, reference): every call runs the reference
IMPL_ENV = "VELOXQUANT_CUDA_IMPL"  # names the attend kernel every CUDA call asks for first
# =qmm: affine tiers no fused kernel takes attend through MLX's own quantized matmul (the
# "attend-mlx" row) on any backend; =decode: they are decoded and attended (the MLX-ops path).
ROUTE_ENV = "VELOXQUANT_AFFINE_ROUTE"


def _anywhere(*_) -> str:
    return ""


class Kernel(NamedTuple):
    name: str
    family: str  # "attend" (affine partial), "dequant", "code" (attention from codes), "encode"
    source: str  # where it lives, for `explain`
    verified: frozenset  # backends its parity tests passed on
    scope: Callable[..., str]  # why it cannot take a call ('' when it can); arguments per family
    launch: Callable  # the binding: attend (qshape, qdtype, cshape, kspec, vspec, scale, chunk) -> run
    prefer: Callable[..., str] = _anywhere  # attend: why it is not the default for a call its scope takes
    chains: Tuple[tuple, ...] = ()  # code and encode kernels: the stage chains (keys "/" values) they read


KERNELS: Dict[str, Kernel] = {}
# The attend default: the first kernel here verified on the backend whose scope and
# preference take the call (measurements behind the order: docs/kernels.md). v1 takes
# every call the family does (`cuda.unsupported`), and alone a chunk size or a hidden front.
ATTEND_ORDER = ("tc", "mma", "v1")
# Backends where affine tiers that no verified fused kernel takes attend through MLX's own
# kernels by default (the "attend-mlx" family, kernels/mlx_affine.py): Metal, where none of our
# kernels runs. Not the CPU: it moves the recorded CPU logits, and end to end it did not pay there
# (docs/kernels.md, "Metal: MLX's own kernels").
MLX_ATTEND_BACKENDS = frozenset({"metal"})


def register(kernel: Kernel) -> Kernel:
    KERNELS[kernel.name] = kernel
    return kernel


def kernels_off() -> bool:
    return os.environ.get(OFF_ENV, "").lower() in ("off", "0", "reference")


def verified(name: str, backend: str) -> bool:
    """Whether kernel `name` passed its parity tests on `backend`."""
    kernel = KERNELS.get(name)
    return kernel is not None and backend in kernel.verified


def family(name: str) -> Tuple[Kernel, ...]:
    return tuple(k for k in KERNELS.values() if k.family == name)


def mlx_attend(backend: str) -> str:
    """The attend-mlx kernel affine tiers take on `backend` where no fused kernel does ('' = decode)."""
    forced = os.environ.get(ROUTE_ENV, "").lower()
    rows = family("attend-mlx")
    if forced == "decode" or not rows:
        return ""
    named = next((k.name for k in rows if k.name == forced), "")
    return named or (rows[0].name if backend in MLX_ATTEND_BACKENDS else "")


def forced_attend() -> str:
    """The attend kernel VELOXQUANT_CUDA_IMPL names ('' when it names none)."""
    forced = os.environ.get(IMPL_ENV, "").lower()
    return forced if forced in KERNELS and KERNELS[forced].family == "attend" else ""


def attend_route(
    shape: tuple,
    kspec: tuple,
    vspec: tuple,
    impl: Optional[str] = None,
    chunk: int = 0,
    hides: bool = False,
    backend: str = "cuda",
) -> str:
    """The attend kernel a call the family takes runs. shape: (B, Hq, Lq, D, Hkv, L). A named
    kernel (`impl`, else VELOXQUANT_CUDA_IMPL) where its scope takes the call, else v1; unnamed,
    the first of ATTEND_ORDER verified on `backend` whose scope and preference take it."""
    if chunk or hides:
        return "v1"
    args = (*shape, kspec, vspec)
    named = impl or forced_attend()
    if named:
        if named not in KERNELS or KERNELS[named].family != "attend":
            raise ValueError(f"no attend kernel {named!r} (kernels: {', '.join(k.name for k in family('attend'))})")
        return "v1" if KERNELS[named].scope(*args) else named
    for name in ATTEND_ORDER:
        kernel = KERNELS[name]
        if backend in kernel.verified and not kernel.scope(*args) and not kernel.prefer(*args):
            return name
    return "v1"
