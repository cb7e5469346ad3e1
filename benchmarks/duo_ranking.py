"""Does DuoAttention's calibrated head ranking matter? The same share of kv heads kept whole, chosen by
the calibrated gates or by their inverse (the lowest gates), on the CPU protocol's window.

    python -m benchmarks.duo_ranking --shares 0.5,0.25 --json results/duo-ranking-smollm2-cpu.json

SmolLM2-135M (float32), one Austen window of 640 prefix + 128 scored tokens (prefill chunks of 256, scoring
chunks of 32: the leaderboard's CPU protocol). Needs `veloxquant calibrate duo_attention` first.
"""

import argparse
import json
import math
import sys
from pathlib import Path

from veloxquant.data import load_text
from veloxquant.eval.config import EvalConfig
from veloxquant.eval.ppl import window_nll, windows
from veloxquant.models import load_model
from veloxquant.runtime import make_prompt_cache
from veloxquant.stages import duo


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shares", default="0.5,0.25", help="shares of the kv heads kept whole")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cfg = EvalConfig(windows=1, prefix=640, score_tokens=128, prefill_chunk=256, score_chunk=32)
    model, tokenizer = load_model()
    window = windows(tokenizer.encode(load_text("austen")), cfg.windows, cfg.window_len)[0]

    def ppl(recipe, sets=()):
        r = window_nll(
            model,
            lambda: make_prompt_cache(model, recipe, sets),
            window,
            cfg.prefix,
            cfg.prefill_chunk,
            cfg.score_chunk,
        )
        return math.exp(r["nll"] / r["tokens"])

    calibrated = duo.retrieval_heads

    def inverse(digest, share):  # the heads outside the calibrated top (1 - share): the lowest gates
        every, top = calibrated(digest, 1.0), calibrated(digest, 1.0 - share)
        return {slot: tuple(h for h in every[slot] if h not in top[slot]) for slot in every}

    base = ppl("fp16")
    rows = []
    for share in (float(s) for s in args.shares.split(",")):
        sets = [f"retrieval={share}"]
        found = {"retrieval": share, "calibrated_dppl_pct": 100 * (ppl("duo_attention", sets) / base - 1)}
        duo.retrieval_heads = inverse
        try:
            found["inverse_dppl_pct"] = 100 * (ppl("duo_attention", sets) / base - 1)
        finally:
            duo.retrieval_heads = calibrated
        rows.append(found)
        print(found, file=sys.stderr, flush=True)
    out = {
        "command": " ".join(["python -m benchmarks.duo_ranking", *(argv or sys.argv[1:])]),
        "model": "SmolLM2-135M-Instruct",
        "fp16_ppl": base,
        "rows": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
