"""`veloxquant run --batch N`: N sequences of different lengths under one recipe, batched where it batches.

The prompts are the run's prompt cut to N lengths (the whole, then shorter by steps down to half), so the
batch is ragged as a server's is. A recipe that batches (compiler/batching.py) runs them through mlx-lm's
BatchGenerator, one cache per layer holding N rows; any other runs them one after the other, and the
report says why. Per sequence: its tokens and its caches' own bytes (extracted from the batch as it
finished: its real tokens only) against fp16's; aggregate: mlx-lm's prefill and decode tok/s over all
sequences, and the process's peak memory.
"""

import json
import sys
import time
from typing import Dict, List

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.generate import BatchGenerator

from .compiler.batching import refusal
from .run import cache_report, run_inputs
from .runtime import make_prompt_cache, uninstall
from .runtime.cache_list import recipe_caches


def cmd_run_batch(args) -> int:
    if args.batch < 1 or args.save_cache:
        print("veloxquant run --batch: N must be at least 1, and --save-cache takes one sequence", file=sys.stderr)
        return 2
    inputs = run_inputs(args)
    if isinstance(inputs, int):
        return inputs
    recipes, model, tokenizer, tokens = inputs
    for recipe in recipes:
        report = generate_batch(model, tokenizer, tokens, recipe, args)
        print(json.dumps(report) if args.json else format_batch(report) + "\n", flush=True)
    return 0


def ragged_prompts(tokens: List[int], n: int) -> List[List[int]]:
    """n prompts: `tokens`, then shorter by equal steps down to about half of it."""
    step = len(tokens) // (2 * n) if n > 1 else 0
    return [tokens[: max(1, len(tokens) - i * step)] for i in range(n)]


def _sequence(prompt: List[int], generated: int, caches) -> Dict[str, object]:
    r = cache_report(caches)
    return {
        "prompt_tokens": len(prompt),
        "generated_tokens": generated,
        "cache_bytes": r["cache_bytes"],
        "fp16_bytes": r["fp16_bytes"],
        "ratio": r["ratio"],
    }


def generate_batch(model, tokenizer, tokens: List[int], recipe, args) -> Dict[str, object]:
    prompts = ragged_prompts(tokens, args.batch)
    caches = [make_prompt_cache(model, recipe, args.sets, use_hook=not args.no_hook) for _ in prompts]
    why = refusal(recipe_caches(caches[0])[0].plan_root)
    mx.synchronize()
    mx.reset_peak_memory()
    try:
        if why is None:
            seqs, agg = _batched(model, tokenizer, prompts, caches, args.max_tokens)
        else:
            seqs, agg = _serial(model, tokenizer, prompts, caches, args.max_tokens)
    finally:
        uninstall(model)
    return {
        "recipe": recipe.name,
        "fingerprint": recipe_caches(caches[0])[0].fingerprint,
        "batch": len(prompts),
        "mode": "batched" if why is None else "one sequence at a time",
        "reason": why,
        "sequences": seqs,
        **agg,
        "cache_bytes": sum(s["cache_bytes"] for s in seqs),
        "fp16_bytes": sum(s["fp16_bytes"] for s in seqs),
        "peak_memory_bytes": int(mx.get_peak_memory()),
        "device": str(mx.default_device()),
    }


def _batched(model, tokenizer, prompts, caches, max_tokens):
    gen = BatchGenerator(
        model,
        stop_tokens=[[t] for t in tokenizer.eos_token_ids],
        completion_batch_size=len(prompts),
        prefill_batch_size=len(prompts),
    )
    uids = gen.insert(prompts, [max_tokens] * len(prompts), caches=caches)
    counts, finished = dict.fromkeys(uids, 0), {}
    with gen.stats() as stats:
        while responses := gen.next_generated():
            for r in responses:
                counts[r.uid] += r.finish_reason != "stop"
                if r.finish_reason is not None:
                    finished[r.uid] = r.prompt_cache  # extracted from the batch: its own rows only
    gen.close()
    seqs = [_sequence(p, counts[u], finished[u]) for p, u in zip(prompts, uids)]
    return seqs, {"prefill_tok_s": stats.prompt_tps, "decode_tok_s": stats.generation_tps, "wall_s": stats.wall_time}


def _serial(model, tokenizer, prompts, caches, max_tokens):
    seqs, prompt_s, decode_s, t0 = [], 0.0, 0.0, time.perf_counter()
    for prompt, cache in zip(prompts, caches):
        last = None
        for last in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, prompt_cache=cache):
            pass
        n = last.generation_tokens if last else 0
        prompt_s += len(prompt) / last.prompt_tps if last and last.prompt_tps else 0.0
        decode_s += n / last.generation_tps if last and last.generation_tps else 0.0
        seqs.append(_sequence(prompt, n, cache))
    total_p, total_g = sum(len(p) for p in prompts), sum(s["generated_tokens"] for s in seqs)
    return seqs, {
        "prefill_tok_s": total_p / prompt_s if prompt_s else None,
        "decode_tok_s": total_g / decode_s if decode_s else None,
        "wall_s": time.perf_counter() - t0,
    }


def format_batch(r: Dict[str, object]) -> str:
    head = f"recipe {r['recipe']} ({r['fingerprint']}): {r['batch']} sequences, {r['mode']}" + (
        f"\n  ({r['reason']})" if r["reason"] else ""
    )
    lines = [
        head,
        "| sequence | prompt tokens | generated | cache bytes | fp16 bytes | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for i, s in enumerate(r["sequences"]):
        lines.append(
            f"| {i} | {s['prompt_tokens']} | {s['generated_tokens']} | {s['cache_bytes']:,} | "
            f"{s['fp16_bytes']:,} | {s['ratio']:.3f} |"
        )
    ratio = r["cache_bytes"] / r["fp16_bytes"] if r["fp16_bytes"] else 0.0
    fmt = lambda v: "-" if v is None else f"{v:.1f}"
    lines.append(
        f"aggregate: prefill {fmt(r['prefill_tok_s'])} tok/s, decode {fmt(r['decode_tok_s'])} tok/s, "
        f"{r['wall_s']:.2f} s wall; caches {r['cache_bytes']:,} bytes (fp16 {r['fp16_bytes']:,}, "
        f"ratio {ratio:.3f}); peak memory {r['peak_memory_bytes'] / 2**20:.1f} MiB on {r['device']}"
    )
    return "\n".join(lines)
