"""What one decode step costs the host: graph ops per layer and graph-build time.

    veloxquant bench decode-ops --recipes fp16,kivi,kivi_sink --as-cuda

On a GPU every op is a kernel launch or at least a scheduler node, so at short
contexts decode speed follows this count, not the bytes read. Every step is counted: the
table gives the median step and the heaviest (a window's spill into its coded tier). The graph of
`model(token)` is exported (mx.export_to_dot) and its primitives counted, for
mlx-lm's KVCache and each recipe, on a random-init Llama or Gemma 3 (`--arch gemma3`: sliding-window
layers; no weights needed).
`--as-cuda` counts the graph the CUDA backend would build, on any machine: the
fused kernel's entry point is answered by a stand-in: two ops (Sin, Depends) where
the kernel's reduce folds in the dense tiers, four (AsType, Sin, Depends, Sum)
where it returns a partial, for the kernel's two launches; the binding's own host
time is not included. The Lloyd-Max kernels (kernels/lut.py: attention, encode)
run their real bindings with each launch answered by one Depends node (plus a
Full constant per output).
"""

import argparse
import collections
import contextlib
import os
import re
import tempfile
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache as mlx_prompt_cache

from ..eval.feed import prefill
from ..kernels import cuda, dispatch, lut
from ..kernels import table as kernel_table
from ..runtime import make_prompt_cache, uninstall
from .e2e import random_model
from .registry import bench

_OP = re.compile(r'label ="([^"]+)", shape=rectangle')


def count_ops(out: mx.array) -> collections.Counter:
    """Primitives in the (unevaluated) graph behind `out`."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "g.dot")
        mx.export_to_dot(path, out)
        return collections.Counter(_OP.findall(open(path).read()))


@contextlib.contextmanager
def stand_in_for_cuda():
    """Route affine tiers through the kernel entry point, answered by a stand-in of
    two or four primitives for the kernel's two launches (module docstring), and
    count fused SDPA as the one op it is on CUDA. The numbers it returns are
    meaningless; only the graph around it is counted."""

    def stand_in(q, ke, ve, tail=None, hidden=0):
        # Depends keeps the inputs' producers (e.g. the window's append) in the graph.
        deps = [*ke.values(), *ve.values(), *(x for kv in tail or () for x in kv)]
        if tail:
            return mx.depends(mx.sin(q), deps)  # attend + reduce_tail: two launches, two ops
        out = mx.depends(mx.sin(q.astype(mx.float32)), deps)
        return out, mx.sum(out, axis=-1)

    def fused_sdpa(q, k, v, scale=None, mask=None, sinks=None):
        return mx.depends(q, [k, v])  # one op, as on CUDA; the CPU splits SDPA into matmuls + softmax

    def launch(inputs, output_shapes, output_dtypes, **_):
        return mx.depends([mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)], list(inputs))

    lut_row = kernel_table.KERNELS["lut"]
    saved = (
        dispatch.choice,
        cuda.launcher,
        mx.fast.scaled_dot_product_attention,
        lut._kernels,
        lut._encoder,
        dispatch.encode_kernel,
    )
    dispatch.choice = lambda *a, **k: ("cuda", "stand-in for the kernel")
    cuda.launcher = lambda *a, **k: stand_in
    mx.fast.scaled_dot_product_attention = fused_sdpa
    lut._kernels, lut._encoder = lambda: (launch, launch), lambda: launch
    dispatch.encode_kernel = lambda codec: None if lut.encode_unsupported(codec) else lut.encode
    kernel_table.register(lut_row._replace(verified=lut_row.verified | {dispatch.backend()}))
    try:
        yield
    finally:
        (
            dispatch.choice,
            cuda.launcher,
            mx.fast.scaled_dot_product_attention,
            lut._kernels,
            lut._encoder,
            dispatch.encode_kernel,
        ) = saved
        kernel_table.register(lut_row)


def step(model, cache, context: int, steps: int, every: bool = False):
    """Prefill `context` tokens, then time building `steps` one-token graphs: the last step's
    op counts (with `every`, each step's, in order) and the mean build time."""
    prefill(model, mx.random.randint(0, 1000, (1, context), key=mx.random.key(0)), cache, 512)
    build, counted = 0.0, []
    for i in range(steps):
        t = time.perf_counter()
        out = model(mx.array([[i + 1]]), cache=cache)
        build += time.perf_counter() - t
        if every or i == steps - 1:
            counted.append(count_ops(out))
        mx.eval(out)
    return (counted if every else counted[-1]), build / steps


@bench("decode-ops", "what one decode step costs the host: graph ops per layer and graph-build time")
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="veloxquant bench decode-ops", description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default="fp16,kivi,kivi_sink,streaming_llm,turboquant_rvq,cachegen")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", default="9/3", help="query heads / kv heads (SmolLM2's by default)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=40, help="decode steps timed (crossing spills)")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--as-cuda", action="store_true", help="count the CUDA backend's graph (see above)")
    ap.add_argument(
        "--arch",
        default="llama",
        choices=("llama", "gemma3"),
        help="gemma3: every 6th layer global, the others sliding over --window tokens",
    )
    ap.add_argument("--window", type=int, default=512)
    args = ap.parse_args(argv)
    with stand_in_for_cuda() if args.as_cuda else contextlib.nullcontext():
        table(args)
    return 0


def table(args) -> None:
    heads, kv_heads = map(int, args.heads.split("/"))
    mx.random.seed(0)
    shape = (args.layers, heads, kv_heads, args.head_dim, 1000, getattr(mx, args.dtype))
    model, name = random_model(args.arch, shape, args.window)
    print(
        f"{name}: {args.layers} layers, {heads}/{kv_heads} heads, D={args.head_dim}, {args.dtype}; "
        f"context {args.context}, {args.steps} decode steps; device {mx.default_device()}"
        + ("; graph of the CUDA path" if args.as_cuda else "")
    )
    print(
        "| cache | ops per step (median) | ops per layer over KVCache: median step | heaviest step "
        "| host build ms per step | most frequent extra ops (median step) |"
    )
    print("|---|---|---|---|---|---|")
    base, _ = step(model, mlx_prompt_cache(model), args.context, 2)
    rows = [("mlx-lm KVCache", lambda: mlx_prompt_cache(model))]
    rows += [(r, lambda r=r: make_prompt_cache(model, r)) for r in args.recipes.split(",") if r]
    for label, make in rows:
        counted, build = step(model, make(), args.context, args.steps, every=True)
        uninstall(model)
        # The median step (a window's spill, every `chunk` steps, is the heaviest one)
        ops = sorted(counted, key=lambda c: sum(c.values()))[len(counted) // 2]
        over = lambda c: (sum(c.values()) - sum(base.values())) / args.layers  # noqa: E731
        common = ", ".join(f"{k[:40]} {v}" for k, v in (ops - base).most_common(4))
        print(
            f"| {label} | {sum(ops.values())} | {over(ops):+.1f} | {max(map(over, counted)):+.1f} | {build * 1e3:.2f} "
            f"| {common} |",
            flush=True,
        )


if __name__ == "__main__":
    raise SystemExit(main())
