"""Kernel text per launch (kernels/source.prune, variants.kernel): MLX rebuilds and hashes a
custom kernel's whole text at each launch, so a kernel carries only the header declarations
its body uses. The pruned text must compile to the same code: nvcc's PTX of the pruned and
the whole rendering are compared where nvcc is installed (no GPU needed)."""

import shutil

import pytest

from veloxquant.kernels import cuda, nvcc_check, source, tc, variants

KS, VS = (2, 32, "channel"), (2, 32, "token")


def test_prune_drops_unused_declarations_and_keeps_what_is_reached():
    header = (
        "#define VQ_X 1\ntemplate <int N>\n__device__ int vq_a(int x) {\nreturn vq_b(x) + N;\n}\n"
        "__device__ int vq_b(int x) { return x; }\n__device__ int vq_unused(int x) {\nreturn x;\n}\n"
        "struct vq_s { int a; };\nunion vq_u { int a; float b; };\n"
    )
    got = source.prune(header, "y[0] = vq_a<2>(VQ_X);")
    assert "vq_a" in got and "vq_b(int x)" in got and "#define VQ_X 1" in got
    assert "vq_unused" not in got and "vq_s" not in got and "vq_u" not in got


def test_squeeze_keeps_tokens_apart_and_strings_whole():
    got = source.squeeze('a = b - -c;\nx = y < <z;\nasm("mov.u32 %0, %1;\\n" : "=r"(r));\n#define X (1)\nint *p = q;\n')
    assert got == 'a=b- -c;\nx=y< <z;\nasm("mov.u32 %0, %1;\\n":"=r"(r));\n#define X (1)\nint*p=q;\n'


def test_every_kernel_text_is_smaller_after_pruning():
    whole = source.strip(tc.header(2, True, 1))
    k = variants.kernel(
        name="t", input_names=["q"], output_names=["o"], source=source.strip(tc.sections()["attend_tc"]), header=whole
    )
    assert k.text_bytes < len(whole) + len(k.spec["source"])
    assert cuda._reduce_kernel().text_bytes < len(source.strip(cuda.sections()["header"])) + len(
        source.strip(cuda.sections()["reduce"])
    )


@pytest.mark.skipif(not shutil.which("nvcc"), reason="needs nvcc (no GPU)")
@pytest.mark.parametrize("unit", ["tc fold 1 tail", "tc partials", "v1", "lut attend"])
def test_pruned_text_compiles_to_the_same_ptx(unit):
    make = {
        "tc fold 1 tail": lambda p: nvcc_check.tc_unit(1, 32, 1, 128, 8, 32768, KS, VS, pruned=p),
        "tc partials": lambda p: nvcc_check.tc_unit(1, 9, 1, 64, 3, 4096, KS, VS, fold=0, nx=0, pruned=p),
        "v1": lambda p: nvcc_check.v1_unit(1, 32, 1, 128, 8, 32768, KS, VS, pruned=p),
        "lut attend": lambda p: nvcc_check.lut_unit(64, 3, pruned=p),
    }[unit]
    whole, pruned = make(False), make(True)
    assert len(pruned) <= len(whole)
    assert nvcc_check.ptx(pruned) == nvcc_check.ptx(whole)
