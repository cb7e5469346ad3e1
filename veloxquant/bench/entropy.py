"""Saved-cache sizes of the `cachegen` recipe with and without its entropy stages (real model, real files).

    veloxquant bench entropy --tokens 2048

Prefills the first `--tokens` tokens of Austen through SmolLM2 under the recipe,
saves the prompt cache with veloxquant's save_prompt_cache, and saves the same
recipe again with its entropy stages removed from the plan (codes written
packed) and with only `delta` removed (codes rANS-coded as they are). Every file
is loaded back and checked bit-exact. Prints a markdown table of file sizes in
bytes (the files on disk, metadata included) and of the codes arrays alone.
"""

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import attrs
import mlx.core as mx

from ..compiler.plan import Plan
from ..data.corpus import load_text
from ..errors import VeloxError
from ..models.default import load_model
from ..runtime import make_prompt_cache
from ..runtime.make import caches_for
from ..runtime.persist import load_prompt_cache, save_prompt_cache
from .registry import bench


def keep_entropy(plan: Plan, keep) -> Plan:
    """The plan with only the entropy stages `keep(stage)` accepts (live caches are unchanged)."""

    def codec(c):
        return attrs.evolve(c, entropy=tuple(s for s in c.entropy if keep(s)))

    def tier(t):
        return t if t.drops else attrs.evolve(t, keys=codec(t.keys), values=codec(t.values))

    layers = tuple(attrs.evolve(l, tiers=tuple(tier(t) for t in l.tiers)) for l in plan.layers)
    return attrs.evolve(plan, layers=layers)


def prefill(model, caches, tokens, chunk: int = 512) -> None:
    for s in range(0, len(tokens), chunk):
        model(mx.array(tokens[s : s + chunk])[None], cache=caches)
        mx.eval([c.state for c in caches])


def codes_bytes(path: Path, side: str = "") -> int:
    """Bytes of the codes arrays in a saved file (packed, or the coder's output and tables);
    side "k" or "v" counts only keys' or values' codes."""
    arrays = mx.load(str(path))
    return sum(a.nbytes for k, a in arrays.items() if ".codes" in k and (not side or f".{side}.codes" in k))


def same_arrays(a, b) -> bool:
    return all(
        mx.array_equal(x, tb.arrays()[k]).item()
        for ca, cb in zip(a, b)
        for ta, tb in zip(ca.tiers, cb.tiers)
        for k, x in ta.arrays().items()
    )


@bench("entropy", "saved-cache sizes of cachegen with and without its entropy stages (real model, real files)")
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="veloxquant bench entropy", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048, help="prompt tokens (Austen)")
    ap.add_argument("--recipe", default="cachegen")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="recipe parameter override")
    ap.add_argument("--model", default=None, help="mlx-lm model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--json", default=None, help="also write the rows (and the command) to this JSON file")
    args = ap.parse_args(argv)

    model, tokenizer = load_model(args.model)
    tokens = tokenizer.encode(load_text("austen"))[: args.tokens]
    plan = make_prompt_cache(model, args.recipe, sets=args.set)[0].plan_root  # also installs the hook
    variants = [
        ("packed codes (entropy stages removed)", keep_entropy(plan, lambda s: False)),
        ("rANS, no delta", keep_entropy(plan, lambda s: s.stage_name != "delta")),
        (f"{args.recipe} (as written)", plan),
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, variant) in enumerate(variants):
            caches = caches_for(variant)  # each variant prefilled on its own: nothing shared between files
            prefill(model, caches, tokens)
            path = Path(tmp) / f"{i}.safetensors"
            start = time.perf_counter()
            size = save_prompt_cache(str(path), caches)
            saved = time.perf_counter() - start
            start = time.perf_counter()
            loaded, _ = load_prompt_cache(str(path), expect_fingerprint=variant.fingerprint)
            load_s = time.perf_counter() - start
            rows.append(
                (
                    label,
                    size,
                    codes_bytes(path),
                    codes_bytes(path, "k"),
                    codes_bytes(path, "v"),
                    sum(c.nbytes for c in caches),
                    saved,
                    load_s,
                    same_arrays(caches, loaded),
                )
            )
    base, base_codes, base_k, base_v = rows[0][1:5]
    if not (base_k and base_v):
        raise VeloxError(
            f"--tokens {args.tokens}: {args.recipe} codes no keys or values of so short a prompt "
            "(its fp16 window holds them all); pass more tokens"
        )
    model_name = Path(args.model).name if args.model else "SmolLM2-135M-Instruct"
    sets = f" --set {' --set '.join(args.set)}" if args.set else ""
    print(
        f"recipe {args.recipe}{sets}, model {model_name}, {len(tokens)} Austen tokens, fingerprint {plan.fingerprint}\n"
    )
    print(
        "| saved as | file bytes | vs packed | codes bytes | vs packed | K codes | V codes | live cache bytes "
        "| save s | load s | round trip |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for label, size, codes, k, v, live, saved, load_s, exact in rows:
        print(
            f"| {label} | {size:,} | {size / base:.3f} | {codes:,} | {codes / base_codes:.3f} | "
            f"{k:,} ({k / base_k:.3f}) | {v:,} ({v / base_v:.3f}) | {live:,} | {saved:.2f} | {load_s:.2f} | "
            f"{'bit-exact' if exact else 'DIFFERS'} |"
        )
    if args.json:
        keys = (
            "saved as",
            "file bytes",
            "codes bytes",
            "K codes bytes",
            "V codes bytes",
            "live cache bytes",
            "save s",
            "load s",
            "bit-exact round trip",
        )
        command = "veloxquant bench entropy " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
        Path(args.json).write_text(
            json.dumps(
                {
                    "command": command,
                    "model": model_name,
                    "tokens": len(tokens),
                    "fingerprint": plan.fingerprint,
                    "rows": [dict(zip(keys, (*r[:6], round(r[6], 2), round(r[7], 2), bool(r[8])))) for r in rows],
                },
                indent=1,
            )
            + "\n"
        )
    return 0 if all(r[-1] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
