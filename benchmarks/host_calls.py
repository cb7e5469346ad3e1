"""What one attention call costs the host: graph build and encode, per call.

    python -m benchmarks.host_calls --seq 32768

A decode step on MLX's CUDA backend is host-bound when the host's work per
token (Python building the graph, then MLX encoding its launches) exceeds the
device's. This times, per call: building it (no evaluation), and encoding it
(`mx.async_eval` of 8 calls, as a decode step's layers), for fp16 SDPA, MLX's
floor (an empty custom kernel, `x + 1`) and veloxquant's launches (attend +
reduce, attend + reduce_tail). Kernel rows need the CUDA backend.
"""

import argparse
import time

import mlx.core as mx

from veloxquant.kernels import cuda
from veloxquant.kernels.dispatch import backend
from veloxquant.stages.store import Affine


def timed(fn, n: int = 300) -> tuple:
    """(build µs, encode µs) per call, the best of 5 rounds of n calls (8 per evaluation)."""
    for _ in range(10):
        mx.eval([fn() for _ in range(8)])
    build = encode = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        build = min(build, (time.perf_counter() - t0) / n * 1e6)
        spent = 0.0
        for _ in range(n // 8):
            outs = [fn() for _ in range(8)]
            t1 = time.perf_counter()
            mx.async_eval(outs)
            spent += time.perf_counter() - t1
            mx.eval(outs)
        encode = min(encode, spent / (n // 8 * 8) * 1e6)
    return build, encode


def calls(S: int, window: int) -> dict:
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.float16)
    k = mx.random.normal((1, 8, S, 128)).astype(mx.float16)
    tk = k[:, :, :window]
    mx.eval(q, k, tk)
    out = {"fp16 SDPA": lambda: mx.fast.scaled_dot_product_attention(q, k, k, scale=0.1), "x + 1": lambda: q + 1}
    if backend() != "cuda":
        return out
    ks, vs = {"bits": 2, "group": 32, "axis": "channel"}, {"bits": 2, "group": 32, "axis": "token"}
    ke, ve = Affine(**ks).encode(k), Affine(**vs).encode(k)
    mx.eval(ke, ve)
    run = cuda.launcher(tuple(q.shape), q.dtype, tuple(ke["codes"].shape), ks, vs, 128**-0.5)
    empty = mx.fast.cuda_kernel(name="vq_empty", input_names=["a"], output_names=["o"], source="o[0] = a[0];")
    out["empty custom kernel"] = lambda: empty(
        inputs=[q], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.float16]
    )[0]
    out["attend + reduce (2-bit)"] = lambda: run(q, ke, ve)[0]
    out["attend + reduce_tail (2-bit)"] = lambda: run(q, ke, ve, [(tk, tk)])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.host_calls", description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=32768, help="tokens of K/V (32 q heads, 8 kv heads, D=128)")
    ap.add_argument("--window", type=int, default=128, help="dense tokens reduce_tail attends over")
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args(argv)
    print(
        f"device {mx.default_device()}, mlx {mx.__version__}; 32/8 heads, D=128, {args.seq} tokens; "
        f"best of 5 rounds of {args.calls} calls" + ("" if backend() == "cuda" else "; kernel rows need CUDA")
    )
    print("| call | build µs | encode µs |")
    print("|---|---|---|")
    for name, fn in calls(args.seq, args.window).items():
        build, encode = timed(fn, args.calls)
        print(f"| {name} | {build:.1f} | {encode:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
