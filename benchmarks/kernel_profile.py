"""`python -m benchmarks.kernel_profile wall|host|ncu SEQS BITS IMPLS`: the attend kernels'
per-call cost split into launches, beside the host floor, and an ncu target.

    wall  32 calls per evaluation, medians of 5 interleaved rounds, microseconds per
          call: fp16 SDPA, each attend kernel with its reduce (IMPL) and alone
          (IMPL-attend), an empty mx.fast.cuda_kernel (also with attend_tc's 12 kB
          header: MLX assembles a kernel's text every call) and a built-in add (the
          floor of one launch). 32/8/128, group 32, 4 K/V copies cycled.
    host  the same methods: microseconds per call of building the graph alone (no evaluation
          inside the clock), medians of 5 rounds of 64 calls.
    ncu   each method three times between cudaProfilerStart/Stop (CUDART names
          libcudart), for `ncu --profile-from-start off ...` (docs/kernels.md).

SEQS e.g. 32768,131072; BITS e.g. 4,2; IMPLS of mma, tc (default mma,tc).
"""

import ctypes
import os
import statistics
import sys
import time

import mlx.core as mx

from veloxquant.bench.timing import timeit
from veloxquant.kernels import cuda, mma, tc, tc_launch
from veloxquant.kernels.source import strip
from veloxquant.stages.store import Affine

Hq, Hkv, D, G = 32, 8, 128, 32


def cycler(fns):
    st = {"i": 0}

    def f():
        st["i"] = (st["i"] + 1) % len(fns)
        return fns[st["i"]]()

    return f


def methods(S: int, bits: int, copies: int, impls) -> dict:
    scale = D**-0.5
    ks, vs = {"bits": bits, "group": G, "axis": "channel"}, {"bits": bits, "group": G, "axis": "token"}
    q = mx.random.normal((1, Hq, 1, D)).astype(mx.float16)
    sets = []
    for _ in range(copies):
        k = mx.random.normal((1, Hkv, S, D)).astype(mx.float16)
        v = mx.random.normal((1, Hkv, S, D)).astype(mx.float16)
        ke, ve = Affine(**ks).encode(k), Affine(**vs).encode(v)
        mx.eval(k, v, ke, ve)
        sets.append((k, v, ke, ve))
    out = {
        "sdpa": cycler(
            [lambda k=k, v=v: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale) for k, v, _, _ in sets]
        )
    }
    shape = (tuple(q.shape), q.dtype, tuple(sets[0][2]["codes"].shape), (bits, G, "channel"), (bits, G, "token"), scale)
    for impl in impls:
        run = cuda.launcher(*shape[:3], ks, vs, scale, impl=impl)
        out[impl] = cycler([lambda ke=ke, ve=ve, run=run: run(q, ke, ve) for _, _, ke, ve in sets])
        if impl == "tc":
            att = tc_launch.partials(*shape)
        else:
            att = mma.mma_partials(*shape)
        out[impl + "-attend"] = cycler(
            [
                lambda ke=ke, ve=ve, att=att: att(
                    [q, ke["codes"], ke["scales"], ke["zeros"], ve["codes"], ve["scales"], ve["zeros"]]
                )
                for _, _, ke, ve in sets
            ]
        )
    return out


def host_us(f, calls: int = 64) -> float:
    """Microseconds per call of building the graph alone (the calls are evaluated after the clock stops)."""
    outs = []
    t = time.perf_counter()
    for _ in range(calls):
        outs.append(f())
    us = (time.perf_counter() - t) / calls * 1e6
    mx.eval(outs)
    return us


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    mode = argv[0]
    seqs = [int(x) for x in (argv[1] if len(argv) > 1 else "32768,131072").split(",")]
    bits_list = [int(x) for x in (argv[2] if len(argv) > 2 else "4").split(",")]
    impls = (argv[3] if len(argv) > 3 else "mma,tc").split(",")
    a, b = mx.ones((16,)), mx.ones((16,))
    mx.eval(a, b)
    empty = mx.fast.cuda_kernel(name="vq_empty", input_names=["a"], output_names=["o"], source="o[0] = a[0];")
    # the same with attend_tc's header: MLX assembles a kernel's whole text on every call
    big = mx.fast.cuda_kernel(
        name="vq_empty_big",
        input_names=["a"],
        output_names=["o"],
        source="o[0] = a[0];",
        header=strip(tc.header(3, True, 1)),
    )
    kw = dict(grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.float32])
    floor = {
        "empty-kernel": lambda: empty(inputs=[a], **kw)[0],
        f"empty-kernel-{len(strip(tc.header(3, True, 1))) // 1000}kB-header": lambda: big(inputs=[a], **kw)[0],
        "add": lambda: a + b,
    }
    print("device", mx.default_device(), mx.__version__)
    rt = ctypes.CDLL(os.environ["CUDART"]) if mode == "ncu" else None
    for S in seqs:
        for bits in bits_list:
            ms = methods(S, bits, 4 if mode == "wall" else 2, impls)
            if mode in ("wall", "host"):
                ms.update(floor)
                res = {n: [] for n in ms}
                for _ in range(5):
                    for n, f in ms.items():
                        res[n].append(timeit(f, 2, 10, 32) if mode == "wall" else host_us(f))
                print(
                    f"{mode} S={S} bits={bits} | "
                    + " | ".join(f"{n} {statistics.median(v):.1f}" for n, v in res.items()),
                    flush=True,
                )
                continue
            for f in ms.values():
                mx.eval(f())
            mx.synchronize()
            rt.cudaProfilerStart()
            for f in ms.values():
                for _ in range(3):
                    mx.eval(f())
                    mx.synchronize()
            rt.cudaProfilerStop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
