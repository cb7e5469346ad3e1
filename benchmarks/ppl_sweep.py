"""Quick perplexity and held-bytes ratio of recipe variants, on a few of `eval`'s windows.

    python -m benchmarks.ppl_sweep fp16 kvtc kvtc:k_budget=160:v_budget=208 --windows 1

A variant is RECIPE[:NAME=VALUE...]. Each is scored as `veloxquant eval` scores
perplexity (same windows, 1536 prefix tokens prefilled in chunks of 512, 256
continuation tokens fed 32 at a time), on the first `--windows` windows only:
a cheap way to place parameters before one full evaluation. Prints perplexity
and the cache's held bytes over fp16's for the same tokens.
"""

import argparse
import math
import time

from veloxquant.compiler import ModelShape
from veloxquant.data.corpus import load_text
from veloxquant.eval.config import EvalConfig
from veloxquant.eval.cost import fp16_bytes
from veloxquant.eval.ppl import window_nll, windows
from veloxquant.models.default import load_model
from veloxquant.runtime.make import make_prompt_cache


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ppl_sweep", description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+", help="RECIPE or RECIPE:NAME=VALUE:NAME=VALUE")
    ap.add_argument("--windows", type=int, default=1)
    ap.add_argument("--model", default=None, help="path or alias (smollm2, gemma3)")
    args = ap.parse_args(argv)
    model, tokenizer = load_model(args.model)
    c = EvalConfig()
    wins = windows(tokenizer.encode(load_text("austen")), c.windows, c.window_len)[: args.windows]
    shape = ModelShape.from_model(model)
    print(f"{len(wins)} window(s) of {c.prefix} prefix + {c.score_tokens} scored Austen tokens\n")
    print("| variant | PPL | held / fp16 | s |")
    print("| --- | ---: | ---: | ---: |")
    for spec in args.variants:
        name, *sets = spec.split(":")
        start, nll, n = time.perf_counter(), 0.0, 0
        for w in wins:
            r = window_nll(
                model, lambda: make_prompt_cache(model, name, sets), w, c.prefix, c.prefill_chunk, c.score_chunk
            )
            nll, n = nll + r["nll"], n + r["tokens"]
        ratio = r["cache_bytes"] / fp16_bytes(shape, r["context"])
        print(f"| {spec} | {math.exp(nll / n):.3f} | {ratio:.3f} | {time.perf_counter() - start:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
