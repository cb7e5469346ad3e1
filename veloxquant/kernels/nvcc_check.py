"""Compile an attend kernel offline with nvcc, as MLX would build it, without a GPU.

`python -m veloxquant.kernels.nvcc_check --impl v1|tc --shape 32/8/128 --seq 32768 --bits 4`
renders the source the way `mx.fast.cuda_kernel` does (MLX's default header,
our header, the generated `__global__` signature, the template arguments as
constexprs, the body; mlx/backend/cuda/custom_kernel.cpp: build_kernel), with
a small stand-in for MLX's device header (only `Shape` is used), and runs
`nvcc -cubin -arch=sm_90 -Xptxas -v`: compile errors, registers, spills and
static shared memory, before any device time is spent. It does not run anything.
"""

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

from . import lut, tc, tc_launch
from .cuda import _strip, attend_header, sections
from .geometry import plan
from .source import prune, squeeze, strip

_STANDIN = """#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda/std/array>
#include <cooperative_groups.h>
namespace mlx::core::cu {
using Shape = cuda::std::array<int, 8>;
using Strides = cuda::std::array<int64_t, 8>;
}
"""
_CTYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}
_PARTIALS = [("pm", "float"), ("pl", "float"), ("pacc", "float")]


def _attend_inputs(qtype: str) -> list:
    """The attend kernels' inputs (v1 adds `lo`)."""
    return [
        ("q", _CTYPES[qtype]),
        ("kc", "uint32_t"),
        ("ks", "__half"),
        ("kz", "__half"),
        ("vc", "uint32_t"),
        ("vs", "__half"),
        ("vz", "__half"),
    ]


def render(name: str, header: str, body: str, inputs, outputs, template, pruned: bool = True) -> str:
    """The translation unit MLX's build_kernel would hand to NVRTC (inputs: (name, C type));
    the text pruned and squeezed as variants.kernel does (`pruned=False`: whole)."""
    if pruned:
        body = squeeze(body)
        header = squeeze(prune(header, body))
    sig = []
    for n, t in inputs:
        sig.append(f"    const {t}* {n}")
        if f"{n}_shape" in body:
            sig.append(f"    const __grid_constant__ Shape {n}_shape")
        if f"{n}_strides" in body:
            sig.append(f"    const __grid_constant__ Strides {n}_strides")
    sig += [f"    {t}* {n}" for n, t in outputs]
    consts = []
    for n, v in template:
        consts.append(f"  using {n} = {_CTYPES[v]};" if isinstance(v, str) else f"  constexpr int {n} = {v};")
    return (
        _STANDIN
        + header
        + "namespace mlx::core::cu {\nnamespace cg = cooperative_groups;\n"
        + f"__global__ void {name}(\n"
        + ",\n".join(sig)
        + ") {\n"
        + "\n".join(consts)
        + "\n"
        + body
        + "\n}\n} // namespace mlx::core::cu\n"
    )


def tc_unit(
    B, Hq, Lq, D, Hkv, L, kspec, vspec, qtype="float16", fold: int = 1, nx: int = 1, pruned: bool = True
) -> str:
    """attend_tc's translation unit (kernels/cuda/tc_attention.cu + tc_fold.cu) as tc_launch builds it."""
    qd = getattr(mx, qtype)
    p = tc.plan(B, Hq, Lq, D, Hkv, L, qd, kspec, vspec, D**-0.5)
    x = _CTYPES[qtype]
    inputs = (
        _attend_inputs(qtype)
        + ([("work", "int32_t"), ("after", "float")] if fold else [])
        + [(n, x) for n in tc_launch.TAIL[: 2 * nx]]
    )
    outputs = [("out", x if nx else "float"), ("lse", "float")] if fold else _PARTIALS
    body = tc_launch.constants(p.template + (("NX", nx),)) + strip(tc.sections()["attend_tc"])
    return render("custom_kernel_vq_tc", strip(tc.header(p.bps, bool(fold), nx)), body, inputs, outputs, [], pruned)


def v1_unit(B, Hq, Lq, D, Hkv, L, kspec, vspec, qtype="float16", pruned: bool = True) -> str:
    """The CUDA-core attend kernel's translation unit (section attend), as MLX would build it."""
    p = plan(B, Hq, Lq, D, Hkv, L, qtype, kspec, vspec, D**-0.5)
    return render(
        "custom_kernel_vq_affine_attend",
        _strip(attend_header(D)),
        _strip(sections()["attend"]),
        _attend_inputs(qtype) + [("lo", "int32_t")],
        _PARTIALS,
        list(p.template),
        pruned,
    )


def lut_unit(D: int, rows: int, bits=(2, 2, 2, 2), section: str = "lut_attend", pruned: bool = True) -> str:
    """The LUT kernel's translation unit (kernels/cuda/lut_attention.cu), as MLX would build it."""
    if section == "lloyd_encode":
        ins, outs = (
            [("x", "__half"), ("lv", "float")],
            [("c1", "uint32_t"), ("n1", "__half"), ("c2", "uint32_t"), ("n2", "__half")],
        )
        return render(
            "custom_kernel_vq_lloyd_encode",
            lut.header(),
            lut.strip(lut.sections()[section]),
            ins,
            outs,
            [("T", "float16"), ("D", D), ("B1", bits[0]), ("B2", bits[1]), ("H", 1)],
            pruned,
        )
    if section == "lut_reduce":
        ins, outs = [("pm", "float"), ("pl", "float"), ("pacc", "float")], [("out", "float"), ("lse", "float")]
        return render(
            "custom_kernel_vq_lut_reduce",
            lut.header(),
            lut.strip(lut.sections()[section]),
            ins,
            outs,
            [("D", D), ("VH", 1)],
            pruned,
        )
    ins = [
        ("q", "float"),
        ("kc1", "uint32_t"),
        ("kn1", "__half"),
        ("kc2", "uint32_t"),
        ("kn2", "__half"),
        ("vc1", "uint32_t"),
        ("vn1", "__half"),
        ("vc2", "uint32_t"),
        ("vn2", "__half"),
        ("lv", "float"),
    ]
    return render(
        "custom_kernel_vq_lut_attend",
        lut.header(),
        lut.strip(lut.sections()[section]),
        ins,
        _PARTIALS,
        lut.template(D, rows, tuple(bits), True),
        pruned,
    )


def compile_unit(src: str, arch: str = "sm_90") -> str:
    """ptxas's report (raises CalledProcessError with nvcc's output on a compile error)."""
    nvcc = shutil.which("nvcc")
    if not nvcc:
        raise FileNotFoundError("nvcc not on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        cu = Path(tmp) / "k.cu"
        cu.write_text(src)
        r = subprocess.run(
            [nvcc, "-std=c++17", f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-o", str(Path(tmp) / "k.cubin"), str(cu)],
            capture_output=True,
            text=True,
        )
        if r.returncode:
            raise subprocess.CalledProcessError(r.returncode, "nvcc", r.stdout + r.stderr)
        return r.stdout + r.stderr


def ptx(src: str, arch: str = "sm_90") -> str:
    """The unit's PTX without comments, to compare two renderings of one kernel (code
    generation follows the PTX: equal PTX, equal kernels)."""
    with tempfile.TemporaryDirectory() as tmp:
        cu, out = Path(tmp) / "k.cu", Path(tmp) / "k.ptx"
        cu.write_text(src)
        subprocess.run(
            [shutil.which("nvcc") or "nvcc", "-std=c++17", f"-arch={arch}", "-ptx", "-o", str(out), str(cu)],
            check=True,
            capture_output=True,
            text=True,
        )
        text = "".join(line for line in out.read_text().splitlines(keepends=True) if not line.startswith("//"))
        return re.sub(r"_INTERNAL_\w+?_k_cu_[0-9a-f]+", "_INTERNAL_", text)  # per-compile unique names


def main(argv=None) -> int:
    a = argparse.ArgumentParser(prog="python -m veloxquant.kernels.nvcc_check", description=__doc__.splitlines()[0])
    a.add_argument("--shape", default="32/8/128", help="Hq/Hkv/D")
    a.add_argument("--seq", type=int, default=32768)
    a.add_argument("--bits", type=int, default=4)
    a.add_argument("--group", type=int, default=32)
    a.add_argument("--qtype", default="float16", choices=sorted(_CTYPES))
    a.add_argument("--impl", default="tc", choices=("v1", "tc"))
    a.add_argument("--print", action="store_true", help="print the rendered source, do not compile")
    o = a.parse_args(argv)
    Hq, Hkv, D = (int(x) for x in o.shape.split("/"))
    unit = {"v1": v1_unit, "tc": tc_unit}[o.impl]
    src = unit(1, Hq, 1, D, Hkv, o.seq, (o.bits, o.group, "channel"), (o.bits, o.group, "token"), o.qtype)
    if o.print:
        print(src)
        return 0
    try:
        print(compile_unit(src))
    except subprocess.CalledProcessError as e:
        print(e.cmd, "failed:\n", e.output, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
