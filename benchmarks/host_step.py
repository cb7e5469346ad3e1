"""The host's share of one decode step, per cache: MLX ops built and Python time.

    python -m benchmarks.host_step --context 2048 --layers 8 --heads 32/8 --head-dim 128
    python -m benchmarks.host_step --arch gemma3 --layers 18 --heads 4/1 --head-dim 256 --hidden 640

Runs on any backend (the CPU included): the graph a decode step builds does
not depend on where it is evaluated. For mlx-lm's KVCache and each recipe,
after a prefill and a warm-up, it counts the primitives of one step's graph
(`mx.export_to_dot`, from the sampled token back to the evaluated arrays) and
times `model(token)` (graph building only, evaluated after each step),
interleaving the caches round by round so machine noise hits them alike.
`--ops-table` adds, per layer, each primitive whose count differs between the caches.
Reported: ops and build µs per step and per layer, and the build time as a
ratio to mlx-lm's KVCache (the fp16 recipe's target: <= 1.0).

`--batch N` steps N sequences together, as mlx-lm's BatchGenerator does: N caches of each kind
prefilled alone with prompts of `--context` minus 7 tokens per row (ragged), merged by the caches'
own `merge` (mlx-lm's KVCache into its BatchKVCache, ours into one cache per layer holding N rows).

    python -m benchmarks.host_step --batch 8 --context 1024 --layers 8 --heads 32/8 --head-dim 128
"""

import argparse
import io
import re
import statistics
import sys
import time
from collections import Counter

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache as mlx_prompt_cache

from veloxquant.bench.e2e import random_model
from veloxquant.eval.feed import prefill
from veloxquant.eval.rows import spec_caches, split_specs


def step_ops(model, cache, y: mx.array) -> Counter:
    """Primitives in one decode step's graph by name (evaluated arrays are its leaves)."""
    out = mx.argmax(model(y, cache=cache)[:, -1:], axis=-1)
    f = io.StringIO()
    mx.export_to_dot(f, out)
    mx.eval(out)
    return Counter(re.findall(r'label ="([^"]+)", shape=rectangle', f.getvalue()))


def python_calls(model, cache, y: mx.array) -> int:
    """Python function calls made while one decode step's graph is built (the model's own included)."""
    calls = [0]

    def count(frame, event, arg):
        if event == "call":
            calls[0] += 1

    sys.setprofile(count)
    try:
        out = model(y, cache=cache)
    finally:
        sys.setprofile(None)
    mx.eval(out)
    return calls[0]


def op_table(ops: dict, layers: int) -> list:
    """Markdown rows: each primitive whose count differs between caches, per layer per step, and the
    Python calls made while building the step (model included; the model's are the same for all).
    (On the CPU, SDPA is built from matmul/softmax ops; on CUDA it is one node, and so is each
    custom kernel launch.)"""
    labels = list(ops)
    rows = ["| primitive per layer | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for name in sorted(set().union(*ops.values())):
        counts = [ops[label][name] for label in labels]
        if len(set(counts)) > 1:
            rows.append(f"| {name} | " + " | ".join(f"{c / layers:g}" for c in counts) + " |")
    total = [sum(v for k, v in ops[label].items() if not k.startswith("(")) for label in labels]
    rows.append("| all primitives | " + " | ".join(f"{t / layers:g}" for t in total) + " |")
    return rows


def build_us(model, cache, y: mx.array, n: int) -> float:
    """Median µs of building one step's graph (each step is evaluated before the next)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        logits = model(y, cache=cache)
        out = mx.argmax(logits[:, -1:], axis=-1)
        times.append(time.perf_counter() - t0)
        mx.eval(out)
    return statistics.median(times) * 1e6


RAGGED = 7  # tokens each batch row's prompt is shorter than the row before it


def prefilled(model, prompt: mx.array, make, batch: int) -> list:
    """One sequence's caches prefilled with the prompt; or `batch` sequences' (row i's prompt 7 x i
    tokens shorter), each prefilled alone, merged per layer by the caches' own merge."""
    alone = []
    for i in range(batch):
        alone.append(make())
        prefill(model, prompt[:, : prompt.shape[1] - RAGGED * i], alone[-1], 2048)
    return alone[0] if batch == 1 else [layer[0].merge(list(layer)) for layer in zip(*alone)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.host_step", description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", default="32/8")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--arch", default="llama", choices=("llama", "gemma3"))
    ap.add_argument("--hidden", type=int, default=0, help="hidden size (default heads x head dim)")
    ap.add_argument("--window", type=int, default=512, help="gemma3: sliding window")
    ap.add_argument("--recipes", default="fp16,kivi")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed per cache and round")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--batch", type=int, default=1, help="sequences stepped together (merged caches)")
    ap.add_argument(
        "--ops-table",
        action="store_true",
        help="also print, per layer, each primitive whose count differs between the caches",
    )
    args = ap.parse_args(argv)
    heads, kv_heads = map(int, args.heads.split("/"))
    mx.random.seed(0)
    model, name = random_model(
        args.arch,
        (args.layers, heads, kv_heads, args.head_dim, args.vocab, getattr(mx, args.dtype), args.hidden),
        args.window,
    )
    prompt = mx.random.randint(0, args.vocab, (1, args.context))
    makers = {"mlx-lm KVCache": lambda: mlx_prompt_cache(model)}
    for r in split_specs(args.recipes):
        makers[r] = lambda r=r: spec_caches(model, r)  # installs the hook (KVCache falls through it)
    rows = {label: prefilled(model, prompt, make, args.batch) for label, make in makers.items()}
    y = mx.ones((args.batch, 1), dtype=mx.int32)
    ops = {}
    for label, cache in rows.items():
        build_us(model, cache, y, 4)  # warm: first-use work
        ops[label] = step_ops(model, cache, y)
        ops[label]["(Python calls)"] = python_calls(model, cache, y)
    samples = {label: [] for label in rows}
    for _ in range(args.rounds):
        for label, cache in rows.items():
            samples[label].append(build_us(model, cache, y, args.steps))
    base = statistics.median(samples["mlx-lm KVCache"])
    print(
        f"{name}: ctx={args.context} batch={args.batch} layers={args.layers} heads={heads}/{kv_heads} "
        f"D={args.head_dim}; "
        f"device {mx.default_device()}; {args.rounds} interleaved rounds x {args.steps} steps, medians"
    )
    print("| cache | ops/step | ops/layer | build µs/step | build µs/layer | range µs/step | vs KVCache |")
    print("|---|---|---|---|---|---|---|")
    for label, s in samples.items():
        med = statistics.median(s)
        n = sum(v for k, v in ops[label].items() if not k.startswith("("))
        print(
            f"| {label} | {n} | {n / args.layers:.1f} | {med:.0f} | {med / args.layers:.1f} "
            f"| {min(s):.0f}–{max(s):.0f} | {med / base:.2f}× |"
        )
    if args.ops_table:
        print("\n" + "\n".join(op_table(ops, args.layers)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
