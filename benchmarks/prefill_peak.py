"""Peak memory of prefilling a prompt into each recipe's caches (SmolLM2, Austen).

    python -m benchmarks.prefill_peak fp16 h2o tova snapkv --tokens 2048 --chunk 512

Prefills `--tokens` corpus tokens in chunks the way generate does (the cache
settles after every chunk), then one decode step; prints the peak of MLX's
allocator over what was held before, and the bytes the caches hold after.

`--sync-layers` evaluates each layer's prefill attention before the next layer
is built. On MLX's CUDA backend the host runs ahead of the device and the
temporaries of several layers are alive at once; this shows how much of the
peak that is (a diagnostic: it costs prefill speed).
"""

import argparse
from contextlib import contextmanager

import mlx.core as mx

from veloxquant.data import load_text
from veloxquant.eval.feed import prefill
from veloxquant.models import load_model
from veloxquant.runtime import make_prompt_cache, uninstall
from veloxquant.runtime.cache import TieredCache


@contextmanager
def layers_synced(on: bool):
    """TieredCache.attend evaluates its output for prompt blocks (more than one query)."""
    attend = TieredCache.attend

    def synced(self, queries, *a, **k):
        out = attend(self, queries, *a, **k)
        if queries.shape[2] > 1:
            mx.eval(out)
        return out

    TieredCache.attend = synced if on else attend
    try:
        yield
    finally:
        TieredCache.attend = attend


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.prefill_peak", description=__doc__.splitlines()[0])
    ap.add_argument("recipes", nargs="+")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--model", default=None)
    ap.add_argument("--sync-layers", action="store_true", help="evaluate each layer's prefill attention at once")
    args = ap.parse_args(argv)
    model, tokenizer = load_model(args.model, progress=False)
    x = mx.array(tokenizer.encode(load_text("austen"))[: args.tokens])[None]
    print(
        f"{x.shape[1]} tokens in chunks of {args.chunk}, then one decode step; device {mx.default_device()}"
        + ("; each layer's prefill attention evaluated before the next" if args.sync_layers else "")
    )
    print("| recipe | peak MiB over start | held MiB after |")
    print("|---|---|---|")
    for name in args.recipes:
        caches = make_prompt_cache(model, name)
        mx.synchronize()
        start = mx.get_active_memory()
        mx.reset_peak_memory()
        with layers_synced(args.sync_layers):
            prefill(model, x, caches, args.chunk)
            mx.eval(model(mx.array([[5]]), cache=caches))
        peak = (mx.get_peak_memory() - start) / 2**20
        print(f"| {name} | {peak:,.0f} | {sum(c.nbytes for c in caches) / 2**20:,.1f} |", flush=True)
        uninstall(model)
        del caches
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
