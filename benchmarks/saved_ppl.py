"""Saved-file size of a prompt cache, and perplexity read through the cache loaded back.

    python -m benchmarks.saved_ppl kvtc --tokens 2048 --score 256 --windows 2
    python -m benchmarks.saved_ppl kvtc kvtc:calibrated=true:k_budget=128 --windows 1

Per window of Austen: the first `--tokens` tokens are prefilled (chunks of 512,
as `eval`) under fp16 and under each recipe; each cache is saved with
save_prompt_cache (entropy stages run: the file holds the coder's real output)
and loaded back, and the next `--score` tokens are scored through the loaded
cache (chunks of 32). Prints file bytes, fp16 file bytes / recipe file bytes,
and perplexity through the loaded cache against fp16's. The live cache (the one
that was saved) scores the same tokens too: a difference between the two
columns would be a loss in saving (there is none: `eval`'s one-window figure
differs because it scores other tokens, after a 1,536-token prefix).
"""

import argparse
import math
import tempfile
from pathlib import Path

import mlx.core as mx

from veloxquant.data.corpus import load_text
from veloxquant.eval.feed import prefill, score
from veloxquant.eval.ppl import windows
from veloxquant.models.default import load_model
from veloxquant.runtime.make import make_prompt_cache
from veloxquant.runtime.persist import load_prompt_cache, save_prompt_cache


def saved_then_scored(model, recipe, sets, window, prompt: int, tmp: Path):
    """(file bytes, NLL sum through the live cache, through the loaded one) for one window: prefill,
    save, load back, then score the same tokens through the cache that was saved and the loaded one."""
    caches = make_prompt_cache(model, recipe, sets)
    x = mx.array(window)[None]
    prefill(model, x[:, :prompt], caches, 512)
    path = tmp / f"{Path(recipe).stem}.safetensors"
    size = save_prompt_cache(str(path), caches)
    loaded, _ = load_prompt_cache(str(path), expect_fingerprint=caches[0].fingerprint)
    return size, float(score(model, x, caches, prompt, 32)), float(score(model, x, loaded, prompt, 32))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.saved_ppl", description=__doc__.splitlines()[0])
    ap.add_argument("recipes", nargs="+", help="RECIPE or RECIPE:NAME=VALUE:NAME=VALUE (its own settings)")
    ap.add_argument("--tokens", type=int, default=2048, help="prompt tokens saved")
    ap.add_argument("--score", type=int, default=256, help="tokens scored after loading")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="override for every recipe")
    ap.add_argument("--model", default=None, help="path or alias (smollm2, gemma3)")
    args = ap.parse_args(argv)
    model, tokenizer = load_model(args.model)
    wins = windows(tokenizer.encode(load_text("austen")), args.windows, args.tokens + args.score + 1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in ["fp16", *args.recipes]:
            recipe, *own = spec.split(":")
            sets = [] if spec == "fp16" else [*args.set, *own]
            runs = [saved_then_scored(model, recipe, sets, w, args.tokens, Path(tmp)) for w in wins]
            size = sum(r[0] for r in runs) / len(runs)
            live, ppl = (math.exp(sum(r[i] for r in runs) / (len(runs) * args.score)) for i in (1, 2))
            rows.append((spec, size, ppl, live))
    base_size, base_ppl = rows[0][1:3]
    sets = f" --set {' --set '.join(args.set)}" if args.set else ""
    print(
        f"model {args.model or 'smollm2'}, {len(wins)} window(s) of {args.tokens} saved + {args.score} scored "
        f"Austen tokens{sets}\n"
    )
    print("| recipe | file bytes (mean) | fp16 file / file | PPL through the loaded cache | ΔPPL | PPL live |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for recipe, size, ppl, live in rows:
        print(
            f"| {recipe} | {size:,.0f} | {base_size / size:.2f}x | {ppl:.3f} | {(ppl / base_ppl - 1) * 100:+.2f}% "
            f"| {live:.3f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
