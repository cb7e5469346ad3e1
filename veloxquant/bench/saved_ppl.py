"""Saved-file size of a prompt cache, and perplexity read through the cache loaded back.

    python -m veloxquant.bench.saved_ppl kvtc --tokens 2048 --score 256 --windows 2

Per window of Austen: the first `--tokens` tokens are prefilled (chunks of 512,
as `eval`) under fp16 and under each recipe; each cache is saved with
save_prompt_cache (entropy stages run: the file holds the coder's real output)
and loaded back, and the next `--score` tokens are scored through the loaded
cache (chunks of 32). Prints file bytes, fp16 file bytes / recipe file bytes,
and perplexity through the loaded cache against fp16's.
"""
import argparse
import math
import tempfile
from pathlib import Path

import mlx.core as mx

from ..eval.feed import prefill, score
from ..eval.ppl import windows
from ..runtime.make import make_prompt_cache
from ..runtime.persist import load_prompt_cache, save_prompt_cache


def saved_then_scored(model, recipe, sets, window, prompt: int, tmp: Path):
    """(file bytes, NLL sum) for one window: prefill, save, load back, score through the loaded cache."""
    caches = make_prompt_cache(model, recipe, sets)
    x = mx.array(window)[None]
    prefill(model, x[:, :prompt], caches, 512)
    path = tmp / f"{recipe}.safetensors"
    size = save_prompt_cache(str(path), caches)
    loaded, _ = load_prompt_cache(str(path), expect_fingerprint=caches[0].fingerprint)
    return size, float(score(model, x, loaded, prompt, 32))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m veloxquant.bench.saved_ppl", description=__doc__.splitlines()[0])
    ap.add_argument("recipes", nargs="+")
    ap.add_argument("--tokens", type=int, default=2048, help="prompt tokens saved")
    ap.add_argument("--score", type=int, default=256, help="tokens scored after loading")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="override for every recipe")
    ap.add_argument("--model", default=None, help="path or alias (smollm2, gemma3)")
    args = ap.parse_args(argv)
    from ..data.corpus import load_text
    from ..models.default import load_model
    model, tokenizer = load_model(args.model)
    wins = windows(tokenizer.encode(load_text("austen")), args.windows, args.tokens + args.score + 1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in ["fp16", *args.recipes]:
            sets = [] if recipe == "fp16" else args.set
            runs = [saved_then_scored(model, recipe, sets, w, args.tokens, Path(tmp)) for w in wins]
            size = sum(s for s, _ in runs) / len(runs)
            ppl = math.exp(sum(n for _, n in runs) / (len(runs) * args.score))
            rows.append((recipe, size, ppl))
    base_size, base_ppl = rows[0][1:]
    sets = f" --set {' --set '.join(args.set)}" if args.set else ""
    print(f"model {args.model or 'smollm2'}, {len(wins)} window(s) of {args.tokens} saved + {args.score} scored "
          f"Austen tokens{sets}\n")
    print("| recipe | file bytes (mean) | fp16 file / file | PPL through the loaded cache | ΔPPL |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for recipe, size, ppl in rows:
        print(f"| {recipe} | {size:,.0f} | {base_size / size:.2f}x | {ppl:.3f} | {(ppl / base_ppl - 1) * 100:+.2f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
