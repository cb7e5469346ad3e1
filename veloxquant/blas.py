"""Linux CPU speed by default: run on the system's OpenBLAS instead of MLX's bundled BLAS.

MLX's Linux CPU wheel (mlx-cpu) ships the reference BLAS, whose float32 matmul
is many times slower than OpenBLAS. Where a system OpenBLAS is installed, the
`veloxquant` command re-executes itself once with it in LD_PRELOAD (the
dynamic linker only reads LD_PRELOAD at start), so MLX's `cblas_sgemm` calls
resolve to OpenBLAS. VELOXQUANT_NO_OPENBLAS=1 turns this off; where OpenBLAS
is missing, one line says how to get it.
"""

import ctypes.util
import importlib.metadata
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

OFF = "VELOXQUANT_NO_OPENBLAS"
DONE = "VELOXQUANT_OPENBLAS_PRELOADED"  # set in the re-executed process: never loop
# Commands that compute nothing heavy: not worth a second process start.
LIGHT = {"check", "fmt", "explain", "list", "show", "diff", "schema", "compare", "-h", "--help"}
CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",  # Debian, Ubuntu
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",  # Fedora, RHEL (pthread build)
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",  # Arch, Alpine
)
HINT = (
    "note: MLX is using its bundled reference BLAS, which is slow on CPUs; install OpenBLAS "
    "(Debian/Ubuntu: sudo apt-get install libopenblas0-pthread) and veloxquant uses it automatically "
    f"({OFF}=1 hides this)"
)


def system_openblas() -> Optional[str]:
    for path in CANDIDATES:
        if Path(path).is_file():
            return path
    name = ctypes.util.find_library("openblas")  # e.g. 'libopenblas.so.0', found through ld.so.cache
    return name or None


def bundled_blas() -> Optional[Path]:
    """MLX's own BLAS library (mlx-cpu wheels vendor it under mlx_cpu.libs/), without importing MLX."""
    try:
        dist = importlib.metadata.distribution("mlx-cpu")
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.parts[0] == "mlx_cpu.libs" and f.name.startswith("libblas"):
            return Path(dist.locate_file(f))
    return None


def preload_env(env, library: str) -> dict:
    current = env.get("LD_PRELOAD", "")
    return {**env, "LD_PRELOAD": f"{library}:{current}" if current else library, DONE: "1"}


def should_reexec(command: Optional[str], env=os.environ) -> Optional[str]:
    """The OpenBLAS library to preload before running `command`, or None."""
    if not sys.platform.startswith("linux") or env.get(OFF) or env.get(DONE):
        return None
    if command in LIGHT or "openblas" in env.get("LD_PRELOAD", ""):
        return None
    if bundled_blas() is None:  # MLX does not use its reference BLAS here (e.g. another build)
        return None
    library = system_openblas()
    if library is None:
        print(HINT, file=sys.stderr)
    return library


def maybe_reexec(argv: Sequence[str]) -> None:
    """Start this same command again with OpenBLAS preloaded, where that helps (see the module doc)."""
    library = should_reexec(argv[0]) if argv else None
    if library is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    args = [sys.executable, *sys.orig_argv[1:]]  # keeps `-m veloxquant.cli` or the script path
    try:
        os.execve(sys.executable, args, preload_env(os.environ, library))
    except OSError:  # could not start it again: carry on, only slower
        return


def pin_threads(n: int) -> bool:
    """Run OpenBLAS's matmuls on `n` threads in this process (and, through the environment, in processes
    it starts). float32 sums are split differently for different thread counts, so results recorded
    to 1e-5 hold only for one count; the tests pin 1 (each pytest-xdist worker then takes one core).
    False where OpenBLAS is not loaded."""
    os.environ["OPENBLAS_NUM_THREADS"] = str(n)
    try:
        setter = ctypes.CDLL(None).openblas_set_num_threads
    except (AttributeError, OSError):
        return False
    setter(ctypes.c_int(n))
    return True


def openblas_core() -> Optional[str]:
    """The kernel family OpenBLAS picked for this CPU ("Haswell", "SkylakeX", "Cooperlake", ...), or None
    where OpenBLAS is not loaded. Different families sum float32 products in different orders, so
    results recorded to 1e-5 hold only within one (OpenBLAS's Zen target runs the Haswell kernels)."""
    try:
        corename = ctypes.CDLL(None).openblas_get_corename
    except (AttributeError, OSError):
        return None
    corename.restype = ctypes.c_char_p
    core = corename().decode()
    return {"Zen": "Haswell"}.get(core, core)
