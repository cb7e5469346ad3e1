"""`python -m benchmarks.launch_cost`: what one `mx.fast.cuda_kernel` call costs the host,
by feature, on an empty kernel (CUDA backend only).

Rows: a one-input kernel; 13 inputs; 13 inputs whose shapes and strides the text reads
(`ensure_row_contiguous=False`); 5 outputs; 16 template arguments; 12 kB and 26 kB of header
text (MLX rebuilds the kernel's text on every call and hashes it at evaluation); all of
them; and a built-in add. Columns: `host` = microseconds per call building the graph alone
(kernel_profile.host_us), `wall` = per call with 32 calls per evaluation (bench.timing.timeit);
medians of 5 interleaved rounds. attend_tc's binding (kernels/tc_launch.py) was shaped by it.
"""

import statistics

import mlx.core as mx

from benchmarks.kernel_profile import host_us
from veloxquant.bench.timing import timeit


def empty_kernel(name: str, n_in: int, n_out: int, strides: bool, n_template: int, header_bytes: int):
    """A call of a kernel that reads one float: `n_in` inputs (shapes and strides read when
    `strides`), `n_out` outputs, `n_template` template arguments, `header_bytes` of unused helpers."""
    a = mx.ones((16,))
    names = [f"i{k}" for k in range(n_in)]
    reads = "".join(f" + i{k}_shape[0] + (float)i{k}_strides[0]" for k in range(n_in)) if strides else ""
    helper = "__device__ inline float vq_pad{k}(float x) {{ return x * {k}.0f + 1.0f; /* {pad} */ }}\n"
    header = "".join(helper.format(k=k, pad="y" * 40) for k in range(header_bytes // 100))
    kernel = mx.fast.cuda_kernel(
        name=name,
        input_names=names,
        output_names=[f"o{j}" for j in range(n_out)],
        source=f"if (threadIdx.x == 0) {{ o0[0] = i0[0]{reads}; }}\n",
        header=header,
        ensure_row_contiguous=not strides,
    )
    kw = dict(grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(1,)] * n_out, output_dtypes=[mx.float32] * n_out)
    if n_template:
        kw["template"] = [(f"T{j}", j) for j in range(n_template)]
    return lambda: kernel(inputs=[a] * n_in, **kw)[0]


def main() -> int:
    a = mx.ones((16,))
    cases = {
        "one input": empty_kernel("vq_lc_base", 1, 1, False, 0, 0),
        "13 inputs": empty_kernel("vq_lc_13in", 13, 1, False, 0, 0),
        "13 inputs, strides read": empty_kernel("vq_lc_13s", 13, 1, True, 0, 0),
        "5 outputs": empty_kernel("vq_lc_5out", 1, 5, False, 0, 0),
        "16 template arguments": empty_kernel("vq_lc_16t", 1, 1, False, 16, 0),
        "12 kB of text": empty_kernel("vq_lc_12k", 1, 1, False, 0, 12000),
        "26 kB of text": empty_kernel("vq_lc_26k", 1, 1, False, 0, 26000),
        "all of the above": empty_kernel("vq_lc_all", 13, 5, True, 16, 26000),
        "built-in add": lambda: a + a,
    }
    for f in cases.values():
        mx.eval(f())
    res = {n: ([], []) for n in cases}
    for _ in range(5):
        for n, f in cases.items():
            res[n][0].append(host_us(f))
            res[n][1].append(timeit(f, 2, 10, 32))
    print(f"device {mx.default_device()}, mlx {mx.__version__}\n\n| call | host µs | wall µs |\n|---|---|---|")
    for n, (h, w) in res.items():
        print(f"| {n} | {statistics.median(h):.1f} | {statistics.median(w):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
