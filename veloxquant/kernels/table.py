"""The kernel table: every fused kernel by name, the calls it takes, how it launches, and
the backends it is verified on.

Each row names the module that binds it (its `BINDINGS[name]`: scope, launcher, preference,
chains); `dispatch` routes by this table and the compiler asks it what is verified. A kernel
lists a backend in `verified` only after its parity tests passed there on real hardware
(docs/kernels.md, "Parity on the H200"); everywhere else the MLX-ops reference answers.
"""

import os
from functools import lru_cache
from importlib import import_module
from types import ModuleType
from typing import Callable, Dict, NamedTuple, Optional, Tuple

OFF_ENV = "VELOXQUANT_KERNELS"  # =off (or 0, reference): every call runs the reference
IMPL_ENV = "VELOXQUANT_CUDA_IMPL"  # names the attend kernel every CUDA call asks for first
# =qmm: affine tiers no fused kernel takes attend through MLX's own quantized matmul (the
# "attend-mlx" row) on any backend; =decode: they are decoded and attended (the MLX-ops path).
ROUTE_ENV = "VELOXQUANT_AFFINE_ROUTE"


def _anywhere(*_) -> str:
    return ""


class Binding(NamedTuple):
    """What a kernel's module supplies for its row (the module's `BINDINGS[name]`)."""

    scope: Callable[..., str]  # why it cannot take a call ('' when it can); arguments per family
    launch: Callable  # the binding: attend (qshape, qdtype, cshape, kspec, vspec, scale, chunk) -> run
    prefer: Callable[..., str] = _anywhere  # attend: why it is not the default for a call its scope takes
    chains: Tuple[tuple, ...] = ()  # code and encode kernels: the stage chains (keys "/" values) they read


class Kernel(NamedTuple):
    name: str
    family: str  # "attend" (affine partial), "dequant", "code" (attention from codes), "encode"
    source: str  # where it lives, for `explain`
    verified: frozenset  # backends its parity tests passed on
    module: str  # the module binding it: imported the first time the row's binding is asked for

    @property
    def binding(self) -> Binding:
        return bound(self.module, self.name)

    @property
    def scope(self) -> Callable[..., str]:
        return self.binding.scope

    @property
    def launch(self) -> Callable:
        return self.binding.launch

    @property
    def prefer(self) -> Callable[..., str]:
        return self.binding.prefer

    @property
    def chains(self) -> Tuple[tuple, ...]:
        return self.binding.chains


@lru_cache(maxsize=None)
def bound(module: str, name: str) -> Binding:
    """Kernel `name`'s binding in `module`. The table is a registry of backend-specific plugins:
    a row's module (its kernel source, geometry, launches) is imported here on first use, so a
    backend that never asks for a CUDA row never loads the CUDA bindings. This is a registry
    resolving a backend-specific plugin by the path its row names, not a function-level import
    dodging a cycle: the binding modules import this one statically, never the reverse."""
    return _module(module).BINDINGS[name]


def plugin(name: str) -> ModuleType:
    """The module binding kernel `name` (imported on first use, as `bound`)."""
    return _module(KERNELS[name].module)


@lru_cache(maxsize=None)
def _module(path: str) -> ModuleType:
    return import_module(path)  # once per module: a decode step asks for its kernels every layer


_CUDA = frozenset({"cuda"})
# Order is the order `family` answers in (the first attend-mlx row is that family's default).
KERNELS: Dict[str, Kernel] = {
    k.name: k
    for k in (
        # Verified: tests/test_kernels.py's gpu parity cases passed on an NVIDIA H200 (docs/kernels.md).
        Kernel("v1", "attend", "affine_attention.cu, CUDA-core attend", _CUDA, "veloxquant.kernels.cuda"),
        Kernel("mma", "attend", "affine_attention.cu, tensor-core attend_mma", _CUDA, "veloxquant.kernels.mma"),
        Kernel("dequant", "dequant", "affine_attention.cu, dequant", _CUDA, "veloxquant.kernels.dequant"),
        # Verified: tests/test_lut_kernel.py's gpu parity cases passed on an NVIDIA H200 (docs/kernels.md).
        Kernel("lut", "code", "lut_attention.cu, lut_attend", _CUDA, "veloxquant.kernels.lut"),
        Kernel("lloyd_encode", "encode", "lut_attention.cu, lloyd_encode", _CUDA, "veloxquant.kernels.lut"),
        # Built from MLX's own primitives, so it runs wherever MLX does; verified (parity with the
        # decode path, tests/test_mlx_affine.py) on CPU only: nothing here ran on Metal (docs/kernels.md).
        Kernel(
            "qmm",
            "attend-mlx",
            "mlx_affine.py, mx.quantized_matmul",
            frozenset({"cpu"}),
            "veloxquant.kernels.mlx_affine",
        ),
        # Verified: tests/test_tc_kernel.py's gpu parity cases passed on an NVIDIA H200 (docs/kernels.md).
        Kernel("tc", "attend", "tc_attention.cu, lean tensor-core attend_tc", _CUDA, "veloxquant.kernels.tc_launch"),
    )
}
# The attend default: the first kernel here verified on the backend whose scope and
# preference take the call (measurements behind the order: docs/kernels.md). v1 takes
# every call the family does (`cuda.unsupported`), and alone a chunk size or a hidden front.
ATTEND_ORDER = ("tc", "mma", "v1")
# Backends where affine tiers that no verified fused kernel takes attend through MLX's own
# kernels by default (the "attend-mlx" family, kernels/mlx_affine.py): Metal, where none of our
# kernels runs. Not the CPU: it moves the recorded CPU logits, and end to end it did not pay there
# (docs/kernels.md, "Metal: MLX's own kernels").
MLX_ATTEND_BACKENDS = frozenset({"metal"})
# A ragged batch's rows (runtime/chain_attention.py) take MLX's kernels on the CPU too: decoding every
# row's tier each step measured slower there (docs/serving.md, "On this CPU"); no recorded logits are a batch's.
MLX_ATTEND_ROWS_BACKENDS = frozenset({"metal", "cpu"})


def register(kernel: Kernel) -> Kernel:
    """Put `kernel` in the table in place of its name's row (a bench marking a kernel verified on its backend)."""
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


def mlx_attend(backend: str, batch_rows: bool = False) -> str:
    """The attend-mlx kernel affine tiers take on `backend` where no fused kernel does ('' = decode);
    `batch_rows`: for a ragged batch's rows (MLX_ATTEND_ROWS_BACKENDS)."""
    forced = os.environ.get(ROUTE_ENV, "").lower()
    rows = family("attend-mlx")
    if forced == "decode" or not rows:
        return ""
    named = next((k.name for k in rows if k.name == forced), "")
    default = MLX_ATTEND_ROWS_BACKENDS if batch_rows else MLX_ATTEND_BACKENDS
    return named or (rows[0].name if backend in default else "")


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
