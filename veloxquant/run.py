"""`veloxquant run`: generate under one or more recipes and report what the cache cost."""

import argparse
import json
import sys
from typing import Dict, List

import mlx.core as mx
from mlx_lm import stream_generate

from .artifacts import by_content
from .compiler import apply_sets
from .compiler.binding import calibrated_stages
from .data import load_text
from .data.sample import sample_prompt
from .models import load_model
from .recipe import load_recipe
from .runtime import make_prompt_cache, uninstall
from .runtime.cache_list import kept_caches, recipe_caches
from .runtime.persist import save_prompt_cache


def fp16_bytes(caches) -> int:
    """What an uncompressed 16-bit cache would hold for the same tokens (no slack)."""
    return sum(c.offset * 2 * c.plan.n_kv_heads * c.plan.head_dim * 2 for c in caches)


def cache_report(caches) -> Dict[str, object]:
    """What the caches hold. A hybrid model's own state caches (ArraysCache) are not compressed: their
    bytes are reported apart (`kept_bytes`), and `compressed_layers` says which layers the recipe runs."""
    everything, caches = caches, recipe_caches(caches)
    kept = kept_caches(everything)
    held = [c.size() for c in caches]
    cache_bytes = sum(c.nbytes for c in caches)
    base = fp16_bytes(caches)
    plan = getattr(caches[0], "plan_root", None) if caches else None
    layout = (
        {}
        if plan is None or plan.shape.trivial_layout
        else {
            "compressed_layers": sorted(m for i in range(plan.shape.n_layers) for m in plan.shape.model_layers(i)),
            "kept_layers": {str(i): type(c).__name__ for i, c in kept},
            "kept_bytes": sum(c.nbytes for _, c in kept),
        }
    )
    return {
        "tokens": caches[0].offset if caches else 0,
        "tokens_held_per_layer": {"min": min(held), "max": max(held)} if held else {},
        "cache_bytes": cache_bytes,
        "fp16_bytes": base,
        "ratio": cache_bytes / base if base else None,
        "attention": "by tiers (hook)" if caches and caches[0].attended else "decoded K/V (no hook)",
        # calibration artifacts are constants shared by the model's caches: beside the cache, not in it
        "calibration_bytes": calibration_bytes(caches),
        **allocated_budgets(caches),
        **layout,
    }


def allocated_budgets(caches) -> Dict[str, object]:
    """Budgets the coordinator chose at the end of the prompt (squeeze, adakv): per layer, per kv head;
    and what a model pass it ran fed (kvzip)."""
    coordinator = getattr(caches[0], "coordinator", None) if caches else None
    chosen = getattr(coordinator, "budgets", None)
    ran = getattr(getattr(coordinator, "model_pass", None), "ran", None)  # a pass the caches ran (KVzip)
    return {**({"budgets": chosen} if chosen else {}), **({"model_pass": ran} if ran else {})}


def calibration_bytes(caches) -> int:
    plan = getattr(caches[0], "plan_root", None) if caches else None
    digests = {s._artifact for _, _, _, s in calibrated_stages(plan)} if plan is not None else set()
    return sum((by_content(d) or {}).get("bytes", 0) for d in digests)


def prompt_tokens(tokenizer, text: str, raw: bool, limit=None) -> List[int]:
    if limit:
        return tokenizer.encode(text)[:limit]
    if not raw and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer.encode(text)


def cmd_run(args) -> int:
    if args.save_cache and len(args.recipes) > 1:
        print("veloxquant run: --save-cache takes one recipe (got several)", file=sys.stderr)
        return 2
    inputs = run_inputs(args)
    if isinstance(inputs, int):
        return inputs
    recipes, model, tokenizer, tokens = inputs
    if args.warmup:  # the same generation untimed: kernel variants follow tier lengths reached while decoding
        quiet = argparse.Namespace(**{**vars(args), "json": True, "save_cache": None})
        for recipe in recipes:
            generate(model, tokenizer, tokens, recipe, quiet)
    reports = []
    for recipe in recipes:
        if len(recipes) > 1 and not args.json:
            print(f"== {recipe.name} ==")
        report = generate(model, tokenizer, tokens, recipe, args)
        reports.append(report)
        if args.json:
            print(json.dumps(report), flush=True)
        else:
            print("\n")
            print(format_report(report) + "\n", flush=True)
    if len(reports) > 1 and not args.json:
        print(side_by_side(reports))
    return 0


def run_inputs(args):
    """The recipes (their --set values checked before the model loads), model, tokenizer and prompt tokens
    of a run; or an exit status."""
    recipes = [load_recipe(r) for r in args.recipes]
    for recipe in recipes:
        apply_sets(recipe, args.sets)  # a bad recipe or --set fails before the model loads
    if args.prompt_file:
        text = sys.stdin.read() if args.prompt_file == "-" else open(args.prompt_file, encoding="utf-8").read()
    elif args.corpus:
        text = load_text(args.corpus)
    elif args.prompt is not None:
        text = args.prompt
    else:  # long enough that a recipe's compressed tiers hold most of the context
        text = sample_prompt()
    model, tokenizer = load_model(args.model)
    tokens = prompt_tokens(tokenizer, text, args.raw_prompt, args.prompt_tokens)
    if args.prompt_tokens and len(tokens) < args.prompt_tokens:  # a shorter run than asked for reads as the asked one
        print(
            f"veloxquant run: --prompt-tokens {args.prompt_tokens}: the prompt has only {len(tokens):,} tokens; "
            "take a longer one (--corpus austen, or --prompt-file)",
            file=sys.stderr,
        )
        return 2
    return recipes, model, tokenizer, tokens


def generate(model, tokenizer, tokens: List[int], recipe, args) -> Dict[str, object]:
    """One generation under `recipe` from `tokens`: the text and what it cost."""
    caches = make_prompt_cache(model, recipe, args.sets, use_hook=not args.no_hook)
    mx.synchronize()
    mx.reset_peak_memory()
    pieces, last = [], None
    try:
        for response in stream_generate(model, tokenizer, tokens, max_tokens=args.max_tokens, prompt_cache=caches):
            pieces.append(response.text)
            last = response
            if not args.json:
                print(response.text, end="", flush=True)
    finally:
        uninstall(model)
    report = {
        "text": "".join(pieces),
        "recipe": recipe.name,
        "fingerprint": recipe_caches(caches)[0].fingerprint,
        "prompt_tokens": len(tokens),
        "generated_tokens": last.generation_tokens if last else 0,
        **cache_report(caches),
        "prefill_tok_s": last.prompt_tps if last else None,
        "decode_tok_s": last.generation_tps if last else None,
        "peak_memory_bytes": int(mx.get_peak_memory()),
        "device": str(mx.default_device()),
    }
    if args.save_cache:
        report["saved_cache_bytes"] = save_prompt_cache(args.save_cache, caches, {"recipe": recipe.name})
    return report


def side_by_side(reports: List[Dict[str, object]]) -> str:
    """The recipes of one run as a markdown table (same model, prompt and device)."""
    r0 = reports[0]
    lines = [
        f"{r0['prompt_tokens']} prompt tokens, {r0['generated_tokens']} generated, on {r0['device']}; "
        "peak memory includes the model's weights",
        "| recipe | cache MiB | vs fp16 | prefill tok/s | decode tok/s | peak MiB |",
        "|---|---|---|---|---|---|",
    ]
    for r in reports:
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
        lines.append(
            f"| {r['recipe']} | {r['cache_bytes'] / 2**20:.1f} | {ratio} | {r['prefill_tok_s']:.1f} | "
            f"{r['decode_tok_s']:.1f} | {r['peak_memory_bytes'] / 2**20:.1f} |"
        )
    return "\n".join(lines)


def format_report(r: Dict[str, object]) -> str:
    ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
    held = r["tokens_held_per_layer"]
    rows = [
        ("recipe", f"{r['recipe']} ({r['fingerprint']})"),
        ("tokens in context", f"{r['tokens']} (held per layer: {held.get('min')}-{held.get('max')})"),
        ("cache bytes", f"{r['cache_bytes']:,}"),
        ("fp16 bytes, same tokens", f"{r['fp16_bytes']:,}"),
        ("ratio", ratio),
        ("attention", r["attention"]),
        ("prefill", f"{r['prefill_tok_s']:.1f} tok/s ({r['prompt_tokens']} tokens)"),
        ("decode", f"{r['decode_tok_s']:.1f} tok/s ({r['generated_tokens']} tokens)"),
        ("peak memory", f"{r['peak_memory_bytes'] / 2**20:.1f} MiB on {r['device']}"),
    ]
    if "saved_cache_bytes" in r:
        rows.append(("saved cache file", f"{r['saved_cache_bytes']:,} bytes"))
    if "compressed_layers" in r:
        kept = ", ".join(f"{i} ({name})" for i, name in r["kept_layers"].items())
        rows.insert(3, ("compressed layers", ", ".join(map(str, r["compressed_layers"]))))
        if r["kept_layers"]:
            rows.insert(4, ("kept as the model made", f"layers {kept}: {r['kept_bytes']:,} bytes, not compressed"))
    if r.get("calibration_bytes"):
        rows.insert(3, ("calibration artifact", f"{r['calibration_bytes']:,} bytes (shared, not in the cache)"))
    text = "\n".join(f"{k:<24} {v}" for k, v in rows)
    if r["ratio"] is not None and r["ratio"] > 0.95 and r["recipe"] != "fp16":
        text += (
            "\nnote: the whole context still fits in this recipe's uncompressed tiers; "
            "try a longer prompt, e.g. --corpus austen --prompt-tokens 2048"
        )
    return text
