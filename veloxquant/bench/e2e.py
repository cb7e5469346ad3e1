"""End-to-end generation under recipes on a random-init Llama or Gemma 3 (no weights needed).

    veloxquant bench e2e --context 32768 --layers 8 --heads 32/8 --head-dim 128 --recipes fp16,kivi
    veloxquant bench e2e --arch gemma3 --context 8192 --layers 18 --heads 4/1 --head-dim 256 \
        --hidden 640 --intermediate 2048 --vocab 262144 --window 512   # Gemma-3-270M's shapes

Prefills `--context` random tokens through mlx-lm's generate_step (2048-token
chunks), then decodes `--decode` tokens; prints prefill and decode tok/s, peak
memory and cache bytes for mlx-lm's KVCache and each recipe, in one run.
With `--repeat N` every row runs N times, interleaved (a busy machine drifts
between rows; each round starts at the next row), and the table gives each row's
median with its range (peak: the highest), and the median over rounds of its
decode tok/s divided by KVCache's in the same round (drift between rounds cancels).
A recipe written `kivi@tc` runs with that CUDA attend kernel (VELOXQUANT_CUDA_IMPL
while the row runs), `kivi@qmm` / `kivi@decode` with its affine tiers attending through MLX's
quantized matmul / decoded (VELOXQUANT_AFFINE_ROUTE): A/B rows of one recipe in one process.

    python -m veloxquant.bench.e2e --preset llama3-8b --weights-bits 4 --context 32768 --recipes fp16,kivi

`--batch N` decodes N copies of the prompt together through mlx-lm's BatchGenerator (prefilled one
at a time: e2e_batch.PREFILL_BATCH), each with its own caches (runtime/batch.py merges veloxquant's
into one per layer). Decode is timed once all N sequences are in the decode batch (`--decode` steps
of N rows each); rates are aggregate over the N sequences, as mlx-lm's stats give them, peak memory
is the process's, cache MiB all N's.

`--preset llama3-8b` takes Llama-3-8B's shapes; `--weights-bits 4` (or 8) quantizes the random
weights (nn.quantize, group 64) as users run them. The "first use" column is each row's first run
in this process (rows in order: KVCache, then the recipes), before any warm run: on CUDA it pays
for every kernel variant that row is the first to need. `--warmup` runs runtime.warmup for each
recipe first (what `veloxquant warmup` does), so that column shows first use after a warm-up.
"""

import argparse
import contextlib
import os
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models import gemma3_text, llama
from mlx_lm.models.cache import make_prompt_cache as mlx_prompt_cache

from ..eval.rows import parse_row, spec_caches, split_specs
from ..kernels import table as kernel_table
from ..runtime import uninstall
from ..runtime.warmup import warmup
from .e2e_batch import measure_batch
from .presets import add_preset_args, apply_preset, quantized
from .registry import bench

# Model shapes by name: layers, heads/kv heads, head_dim, hidden, intermediate, vocab.


def random_llama(
    layers: int, heads: int, kv_heads: int, head_dim: int, vocab: int, dtype, hidden: int = 0, intermediate: int = 0
) -> llama.Model:
    hidden = hidden or heads * head_dim
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=intermediate or hidden * 2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        head_dim=head_dim,
    )
    return _ready(llama.Model(args), dtype)


def random_gemma3(
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    vocab: int,
    dtype,
    hidden: int = 0,
    intermediate: int = 0,
    window: int = 512,
    pattern: int = 6,
) -> gemma3_text.Model:
    """Gemma 3's text model: every `pattern`-th layer global, the others sliding over `window` tokens."""
    hidden = hidden or heads * head_dim
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=intermediate or hidden * 2,
        num_attention_heads=heads,
        head_dim=head_dim,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        sliding_window=window,
        sliding_window_pattern=pattern,
    )
    return _ready(gemma3_text.Model(args), dtype)


def random_model(arch: str, shape: tuple, window: int = 512, pattern: int = 6):
    """(model, its name in a table's title): random_llama, or random_gemma3 for arch "gemma3"."""
    if arch == "gemma3":
        return (
            random_gemma3(*shape, window=window, pattern=pattern),
            f"random Gemma 3 (window {window}, every {pattern}th layer global)",
        )
    return random_llama(*shape), "random Llama"


def _ready(model, dtype):
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def measure(model, prompt: mx.array, cache, decode: int):
    mx.synchronize()
    mx.reset_peak_memory()
    start = time.perf_counter()
    first = None
    for n, _ in enumerate(generate_step(prompt, model, max_tokens=decode + 1, prompt_cache=cache)):
        if n == 0:
            first = time.perf_counter()
    mx.synchronize()
    end = time.perf_counter()
    cache_bytes = sum(c.nbytes for c in cache)
    return prompt.size / (first - start), decode / (end - first), mx.get_peak_memory(), cache_bytes


_IMPL_ENV = kernel_table.IMPL_ENV
_ROUTES = ("decode", *(k.name for k in kernel_table.family("attend-mlx")))  # VELOXQUANT_AFFINE_ROUTE's values


@contextlib.contextmanager
def _impl(label: str):
    """While a row `recipe@impl` runs: VELOXQUANT_CUDA_IMPL = impl, or for an affine route
    VELOXQUANT_AFFINE_ROUTE = impl; a row without `@` runs under the environment as it was."""
    impl = label.split("@")[1] if "@" in label else None
    env = kernel_table.ROUTE_ENV if impl in _ROUTES else _IMPL_ENV
    saved = os.environ.get(env)
    if impl is not None:
        os.environ[env] = impl
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = saved


@bench("e2e", "end-to-end generation speed and memory under recipes on a random-init Llama or Gemma 3")
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="veloxquant bench e2e", description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", default="32/8", help="query heads / kv heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--arch", default="llama", choices=("llama", "gemma3"))
    ap.add_argument("--hidden", type=int, default=0, help="model width (default heads x head_dim)")
    ap.add_argument("--intermediate", type=int, default=0, help="MLP width (default 2 x hidden)")
    ap.add_argument("--window", type=int, default=512, help="gemma3: sliding layers' window")
    ap.add_argument("--sliding-pattern", type=int, default=6, help="gemma3: every n-th layer is global")
    ap.add_argument("--recipes", default="fp16,kivi", help="comma-separated row specs: kivi, kivi[bits=2], kivi@tc")
    ap.add_argument("--repeat", type=int, default=1, help="runs per row, interleaved; the table shows medians")
    add_preset_args(ap)
    ap.add_argument("--warmup", action="store_true", help="runtime.warmup each recipe before its first-use row")
    ap.add_argument(
        "--batch", type=int, default=1, help="sequences decoded together through mlx-lm's BatchGenerator (aggregate)"
    )
    args = apply_preset(ap.parse_args(argv))
    heads, kv_heads = map(int, args.heads.split("/"))
    mx.random.seed(0)
    shape = (
        args.layers,
        heads,
        kv_heads,
        args.head_dim,
        args.vocab,
        getattr(mx, args.dtype),
        args.hidden,
        args.intermediate,
    )
    model, name = random_model(args.arch, shape, args.window, args.sliding_pattern)
    model, name = quantized(model, args.weights_bits, name)
    prompt = mx.random.randint(0, args.vocab, (args.context,))
    print(
        f"{name}: {args.layers} layers, {heads}/{kv_heads} heads, D={args.head_dim}, {args.dtype}, "
        f"context {args.context}, decode {args.decode}, device {mx.default_device()}"
        + (f"; batch {args.batch} (aggregate tok/s, BatchGenerator)" if args.batch > 1 else "")
    )
    head = (
        "| cache | prefill tok/s | decode tok/s | decode vs KVCache, same round | first-use decode tok/s "
        "| first use ÷ warm | peak memory GiB | cache MiB |"
    )
    rows = [("mlx-lm KVCache", lambda: mlx_prompt_cache(model))]
    rows += [(r, lambda r=r: spec_caches(model, r.split("@")[0])) for r in split_specs(args.recipes)]

    def run(label, make):
        with _impl(label):
            try:
                if args.batch > 1:
                    got = measure_batch(model, prompt, make, args.batch, args.decode)
                else:
                    got = measure(model, prompt, make(), args.decode)
            except RuntimeError as e:
                if not out_of_memory(e):
                    raise
                # A row the device cannot hold is that row's result: the others still run.
                mx.clear_cache()
                print(f"  {label}: out of device memory ({str(e).splitlines()[0][:120]})", file=sys.stderr, flush=True)
                return None
            finally:
                uninstall(model)
        # Each run as it ends, on stderr: a long run cut short keeps what it measured.
        print(
            f"  {label}: prefill {got[0]:,.0f} tok/s, decode {got[1]:,.1f} tok/s, "
            f"peak {got[2] / 2**30:.2f} GiB, cache {got[3] / 2**20:,.1f} MiB",
            file=sys.stderr,
            flush=True,
        )
        return got

    warmed = {}
    if args.warmup:
        for label, _ in rows[1:]:
            with _impl(label):
                row = parse_row(label.split("@")[0])
                warmed[label] = warmup(model, row.ref, args.context, args.decode, row.sets)[1]
        print("warm-up seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in warmed.items()))
    print(head)
    print("|---|---|---|---|---|---|---|---|")
    # First use: kernel variants follow the tier length (CUDA compiles each once), so the
    # warm rounds come after a first run of every row at this context.
    first = {label: run(label, make) for label, make in rows}
    runs = {label: [] for label, _ in rows}
    for i in range(args.repeat):
        # Each round starts at another row: no row always follows the same one (allocator, clocks).
        for label, make in rows[i % len(rows) :] + rows[: i % len(rows)]:
            runs[label].append(run(label, make))
    base = runs["mlx-lm KVCache"]
    for label, got in runs.items():
        if first[label] is None or None in got:
            print(f"| {label} | out of memory | – | – | – | – | – | – |", flush=True)
            continue
        pre, dec = (statistics.median(r[i] for r in got) for i in range(2))
        peak = max(r[2] for r in got)
        spread = f" ({min(r[1] for r in got):,.1f}–{max(r[1] for r in got):,.1f})" if len(got) > 1 else ""
        # Same round: drift cancels (no ratio where the baseline did not fit).
        ratios = [r[1] / b[1] for r, b in zip(got, base) if b is not None]
        paired = f"{statistics.median(ratios):.3f}×" if ratios else "–"
        cold = first[label][1]
        print(
            f"| {label} | {pre:,.0f} | {dec:,.1f}{spread} | {paired} | {cold:,.1f} | {cold / dec:.3f}× "
            f"| {peak / 2**30:.2f} "
            f"| {got[0][3] / 2**20:,.1f} |",
            flush=True,
        )
    return 0


def out_of_memory(error: Exception) -> bool:
    """MLX's allocation failures (CUDA's cudaMalloc*, Metal's) read 'out of memory' / 'Insufficient Memory'."""
    text = str(error).lower()
    return "out of memory" in text or "insufficient memory" in text


if __name__ == "__main__":
    raise SystemExit(main())
