"""Peak memory and decode speed of every eviction recipe on a long real prompt, fp16 interleaved.

    python -m benchmarks.eviction_cost --tokens 8192 --decode 32 --json after.json
    python -m benchmarks.eviction_cost --tokens 8192 --decode 32 --before before.json
    python -m benchmarks.eviction_cost h2o 'h2o[slack=32]' --decode 64 --rounds 5

Feeds `--tokens` corpus tokens (Austen) to the model through mlx-lm's
generate_step (prefill in `--chunk`-token steps, as generate does), then
decodes `--decode` tokens greedily. Per row: MLX's peak memory (absolute, and
over what was allocated when the row started: the weights), decode tok/s, and
the bytes the caches hold. An fp16 row is measured before every
`--fp16-every` recipes (a busy machine drifts), and each recipe's ratios are
against the fp16 row measured nearest before it. `--before` adds the peak and
decode ratios of an earlier run's JSON (the same command on an older checkout).
`--rounds N` measures the whole list N times, interleaved, and reports per
recipe the median of its rows (each ratio taken against the fp16 row just
before it, in its own round): on a GPU whose speed drifts between rows.
Rows are recipe specs as `veloxquant eval` takes them (`h2o[slack=32]`).

Each recipe first runs untimed on a shorter prompt (one prefill step and part of
a second, then a few decoded tokens): on CUDA, MLX compiles a kernel the first
time it meets an op graph, and a 32-token decode that paid its recipe's compiles
measured the compiler, not the cache (`--no-warmup` measures that too).
"""

import argparse
import json
import statistics
import time
from typing import Dict, List

import mlx.core as mx
from mlx_lm.generate import generate_step

from veloxquant.data import load_text
from veloxquant.eval.rows import spec_caches
from veloxquant.models import load_model
from veloxquant.runtime import uninstall

EVICTION = (
    "streaming_llm",
    "h2o",
    "tova",
    "snapkv",
    "pyramidkv",
    "squeezeattention",
    "adakv",
    "nestedkv",
    "cam",
    "observed_attention",
    "knorm",
    "keydiff",
    "expected_attention",
    "qfilters",
    "keyformer",
    "morphkv",
    "chunkkv",
    "curdkv",
    "rocketkv",
    "kvzip",
    "observed_snap",
    "anchorkv",
)


def measure(model, prompt: mx.array, recipe: str, decode: int, chunk: int) -> Dict:
    caches = spec_caches(model, recipe)
    mx.synchronize()
    start_bytes = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    first = None
    for n, _ in enumerate(
        generate_step(prompt, model, max_tokens=decode + 1, prompt_cache=caches, prefill_step_size=chunk)
    ):
        if n == 0:
            mx.synchronize()
            first = time.perf_counter()
    mx.synchronize()
    end = time.perf_counter()
    row = {
        "recipe": recipe,
        "peak": mx.get_peak_memory(),
        "over_start": mx.get_peak_memory() - start_bytes,
        "prefill_tps": prompt.size / (first - t0),
        "decode_tps": decode / (end - first),
        "cache_bytes": sum(c.nbytes for c in caches),
    }
    uninstall(model)
    del caches
    mx.clear_cache()
    return row


def _ratios(rows: List[Dict]) -> Dict[str, Dict]:
    """recipe -> its row with peak and decode ratios against the fp16 row measured nearest before it;
    a recipe measured in several rounds: the median of each figure over its rows."""
    each, base = {}, None
    for r in rows:
        if r["recipe"] == "fp16":
            base = r
            continue
        each.setdefault(r["recipe"], []).append(
            dict(
                r,
                peak_x=r["peak"] / base["peak"],
                over_x=r["over_start"] / base["over_start"],
                decode_x=r["decode_tps"] / base["decode_tps"],
            )
        )
    return {name: _median_row(rs) for name, rs in each.items()}


def _median_row(rows: List[Dict]) -> Dict:
    return {
        k: (statistics.median(r[k] for r in rows) if isinstance(v, (int, float)) else v) for k, v in rows[0].items()
    }


def table(rows: List[Dict], before: List[Dict] = ()) -> str:
    mib = 2**20
    then = _ratios(list(before))
    head = (
        "| row | peak MiB | over weights MiB | peak ÷ fp16 | over ÷ fp16 | decode tok/s | decode ÷ fp16 | cache MiB |"
    )
    extra = " before: peak ÷ fp16 | before: decode ÷ fp16 |" if before else ""
    lines = [head + extra, "|" + "---|" * (head.count("|") - 1 + extra.count("|"))]
    ratios = _ratios(rows)
    if any(r.get("round") for r in rows):  # several rounds: one median row per recipe, fp16's first
        rows = [_median_row([r for r in rows if r["recipe"] == "fp16"]), *ratios.values()]
    for r in rows:
        x = ratios.get(r["recipe"]) if r["recipe"] != "fp16" else None
        cols = [
            r["recipe"],
            f"{r['peak'] / mib:,.0f}",
            f"{r['over_start'] / mib:,.0f}",
            f"{x['peak_x']:.2f}" if x else "1",
            f"{x['over_x']:.2f}" if x else "1",
            f"{r['decode_tps']:.1f}",
            f"{x['decode_x']:.2f}" if x else "1",
            f"{r['cache_bytes'] / mib:,.1f}",
        ]
        if before:
            b = then.get(r["recipe"]) if x else None
            cols += [f"{b['peak_x']:.2f}", f"{b['decode_x']:.2f}"] if b else ["", ""]
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.eviction_cost", description=__doc__.splitlines()[0])
    ap.add_argument("recipes", nargs="*", default=list(EVICTION))
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=2048, help="prefill step (mlx-lm generate's default)")
    ap.add_argument("--fp16-every", type=int, default=1, help="an fp16 row before every N recipes")
    ap.add_argument("--model", default=None)
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="keep only the model's first N layers (a quick CPU diagnostic; say so beside its figures)",
    )
    ap.add_argument("--no-warmup", action="store_true", help="no untimed run of each recipe before its row")
    ap.add_argument("--rounds", type=int, default=1, help="measure the list this many times, interleaved; medians")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--before", default=None, help="an earlier run's --json, shown beside")
    args = ap.parse_args(argv)
    model, tokenizer = load_model(args.model, progress=False)
    if args.layers:
        model.model.layers = model.model.layers[: args.layers]
    ids = tokenizer.encode(load_text("austen"))
    while len(ids) < args.tokens:
        ids = ids + ids
    prompt = mx.array(ids[: args.tokens])
    warm = prompt[: min(args.tokens, args.chunk + 512)]
    measure(model, warm, "fp16", 4, args.chunk)  # warm-up: first-call compilation is no row's cost
    rows = []
    for round_ in range(args.rounds):
        for i, name in enumerate(args.recipes):
            if i % args.fp16_every == 0:
                rows.append(dict(measure(model, prompt, "fp16", args.decode, args.chunk), round=round_))
                print(rows[-1], flush=True)
            if not args.no_warmup and round_ == 0:
                measure(model, warm, name, 4, args.chunk)
            rows.append(dict(measure(model, prompt, name, args.decode, args.chunk), round=round_))
            print(rows[-1], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": str(mx.default_device()), "tokens": args.tokens, "layers": args.layers, "rows": rows},
                f,
                indent=1,
            )
    before = json.load(open(args.before))["rows"] if args.before else ()
    layers = f"; the first {args.layers} layers only" if args.layers else ""
    rounds = f"; medians of {args.rounds} interleaved rounds" if args.rounds > 1 else ""
    print(
        f"\n{args.tokens}-token prompt in {args.chunk}-token steps, then {args.decode} decoded tokens; "
        f"device {mx.default_device()}{layers}{rounds}\n"
    )
    print(table(rows, before))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
