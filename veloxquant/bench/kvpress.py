"""Eviction under NVIDIA kvpress's protocol, on the eval's perplexity windows.

    veloxquant bench kvpress --fractions 0.5,0.75,0.85

Per window (4 x 1,536-token Austen prefix + 256 continuation tokens, the
eval's windows): the prefix is prefilled through the cache, which compresses
it ONCE when the prefix ends, keeping (1 - fraction) x prefix tokens per kv
head; the continuation is then appended uncompressed and scored. Every row is
a recipe run with `budget=` set from the fraction (and `once=true` where the
recipe decides every step by default), so our scorers and kvpress's presses
are compared on the same footing. A head-split row (duo_attention) keeps whole the share of kv
heads that removes the same fraction (the others keep sinks + window), its prefix fed as one
block so that nothing leaves before the prefix ends, and its windows grow by the continuation
(appended uncompressed, as for every row). kvpress's own figures (issue 14: kvpress
0.5.5, transformers 5.2.0, H200, float32, same windows) are printed beside
ours; they are not re-measured here (benchmarks/kvpress_reference.py runs kvpress itself on these windows).
"""

import argparse
import copy
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from ..data import load_text
from ..eval.config import EvalConfig
from ..eval.feed import score, settle
from ..eval.ppl import window_nll, windows
from ..eval.rows import parse_row, spec_caches
from ..models import load_model
from ..recipe import load_recipe
from ..runtime import make_prompt_cache
from ..runtime.eviction import model_pass
from .registry import bench

# kvpress's measured dPPL (%) at fractions 0.5 / 0.75 / 0.85, with our namesake row.
KVPRESS = {
    "ObservedAttention (H2O)": ("observed_attention", (0.98, 2.55, 3.94)),
    "ExpectedAttention": ("expected_attention", (1.25, 3.11, 5.46)),
    "TOVA": ("tova[once=true,shared_heads=true]", (0.89, 3.89, 6.61)),  # kvpress averages over heads
    "KVzip": ("kvzip", (0.97, 4.56, 7.04)),  # ours: uniform per head (kvpress: one ranking over all heads)
    "SnapKV (window 64, pool 5)": ("snapkv[window=64,pool=5]", (1.44, 4.69, 7.70)),
    "StreamingLLM": ("streaming", (2.44, 4.17, 7.72)),
    "KeyDiff": ("keydiff", (3.28, 7.05, 12.28)),
    "Knorm": ("knorm[once=true]", (8.76, 12.49, 15.29)),
}
KVPRESS_FRACTIONS = (0.5, 0.75, 0.85)
EXTRA = [
    "tova[once=true]",
    "observed_attention[recent=64]",
    "observed_attention[pool=5]",
    "h2o[once=true]",
    "curdkv[once=true]",
    "qfilters[once=true]",
    "chunkkv[once=true]",
    "morphkv[once=true]",
    "kvzip[heads=score,alpha=0]",
]
# StreamingLLM at the end of the prompt: sinks plus the newest tokens, then append.
STREAMING = (
    "veloxquant: 1\nname: streaming\npipeline: evict(budget=$budget, sinks=4, score=newest, once=true)\n"
    "params:\n  budget: {default: 256, type: int, doc: tokens kept}\n"
)


def rows_asked(specs: List[str]) -> List[str]:
    if specs:
        return specs
    return [ours for _, (ours, _) in KVPRESS.items() if ours] + EXTRA


def fork(caches, budget: int):
    """A copy of prefilled caches whose eviction tiers will keep `budget` tokens: the prompt is fed
    once per row and window, then decided at each fraction (nothing is evicted before the end)."""
    import attrs

    copies = copy.deepcopy(caches, {id(c.dtype): c.dtype for c in caches})
    for c in copies:
        for t in c.tiers:
            if t.scorer is not None:
                t.route = t.scorer.route = attrs.evolve(t.route, budget=budget)
    return copies


def head_split(spec: str) -> bool:
    """The row splits kv heads rather than tokens (duo: a `retrieval` share of heads kept whole)."""
    row = parse_row(spec)
    return row.kind == "recipe" and "retrieval" in load_recipe(row.ref).params


def retrieval_share(fraction: float, held: int, prefix: int) -> float:
    """The share of kv heads kept whole that removes `fraction` of the prefix when every other head
    keeps `held` tokens (sinks + window): fraction = (1 - share) * (1 - held / prefix)."""
    return max(0.0, 1.0 - fraction / (1.0 - held / prefix))


def measure_heads(model, windows, spec: str, budgets: List[int], cfg) -> List[float]:
    """A head-split row: per fraction, the share of heads kept whole from the streaming heads'
    holding; the prefix goes in as one block, so nothing is dropped before it ends (compressed once),
    and the streaming heads' windows then grow by the continuation (appended uncompressed)."""
    import attrs
    import mlx.core as mx

    caches = spec_caches(model, spec)
    held = sum(t.route.n for t in caches[0].tiers if t.route is not None and t.route.stage_name in ("sink", "recent"))
    nll, n = [0.0] * len(budgets), 0
    for w in windows:
        x = mx.array(w)[None]
        for i, b in enumerate(budgets):
            share = retrieval_share(1 - b / cfg.prefix, held, cfg.prefix)
            mine = spec_caches(model, spec, (f"retrieval={share:.6f}",))
            model(x[:, : cfg.prefix], cache=mine)
            settle(mine)
            for c in mine:  # the continuation is appended uncompressed, as every row's: the windows stop sliding
                for t in c.tiers:
                    if t.route is not None and t.route.stage_name == "recent":
                        t.reroute(attrs.evolve(t.route, n=t.route.n + cfg.score_tokens + 1))
            if not n:  # once: the fraction of the prefix's (token, head) pairs really let go
                kept = sum(len(c.tiers[-1].kept) * c.tiers[-1].count + c.tiers[-1].n_kv_heads * held for c in mine)
                removed = 1 - kept / sum(c.tiers[-1].n_kv_heads * cfg.prefix for c in mine)
                print(
                    f"  {spec} at {1 - b / cfg.prefix:g}: retrieval={share:.4f}, removed {removed:.4f}", file=sys.stderr
                )
            nll[i] += float(score(model, x, mine, cfg.prefix, cfg.score_chunk))
        n += x.shape[1] - 1 - cfg.prefix
    return [math.exp(v / n) for v in nll]


def measure(model, windows, spec: str, budgets: List[int], cfg, where: Path) -> List[float]:
    """PPL of the continuation at each budget, summed over the windows."""
    import mlx.core as mx

    if spec == "streaming":
        path = where / "streaming.yaml"
        path.write_text(STREAMING)
        spec = str(path)
    if head_split(spec):
        return measure_heads(model, windows, spec, budgets, cfg)
    nll, n = [0.0] * len(budgets), 0
    for w in windows:
        x = mx.array(w)[None]
        caches = spec_caches(model, spec, (f"budget={max(budgets)}",))
        for s in range(0, cfg.prefix, cfg.prefill_chunk):  # the prompt, as generate prefills it
            model(x[:, s : min(s + cfg.prefill_chunk, cfg.prefix)], cache=caches)
            settle(caches)
        coordinator = getattr(caches[0], "coordinator", None)
        if coordinator is not None:  # a model pass (kvzip) scores alike at every budget: once, before forking
            model_pass.run(coordinator, ending=False)
        for i, b in enumerate(budgets):
            mine = fork(caches, b)
            for c in mine:
                c.finish_prompt()  # the prefix ends: compress once
            settle(mine)
            nll[i] += float(score(model, x, mine, cfg.prefix, cfg.score_chunk))
        n += x.shape[1] - 1 - cfg.prefix
    return [math.exp(v / n) for v in nll]


@bench("kvpress", "eviction under NVIDIA kvpress's protocol, on the eval's perplexity windows")
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="veloxquant bench kvpress", description=__doc__.split("\n\n")[0])
    ap.add_argument("recipes", nargs="*", help="rows (RECIPE or RECIPE[k=v,...]); default: kvpress's namesakes + ours")
    ap.add_argument("--fractions", default="0.5,0.75,0.85", help="fractions of the prefix removed")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--model", default=None)
    ap.add_argument("--corpus", default="austen")
    ap.add_argument(
        "--dtype",
        default=None,
        help="model dtype (default: float32 on the CPU, float16 on a GPU; kvpress's figures are float32)",
    )
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument(
        "--baseline-ppl",
        type=float,
        default=None,
        help="fp16 PPL on the same windows, from an earlier run of this bench (skips measuring it)",
    )
    args = ap.parse_args(argv)
    cfg = EvalConfig(windows=args.windows)
    fractions = [float(f) for f in args.fractions.split(",")]
    budgets = [int(cfg.prefix * (1 - f)) for f in fractions]
    model, tokenizer = load_model(args.model, args.dtype)
    wins = windows(tokenizer.encode(load_text(args.corpus)), cfg.windows, cfg.window_len)
    started = time.perf_counter()
    base = args.baseline_ppl
    if base is None:
        base_nll = [
            window_nll(
                model, lambda: make_prompt_cache(model, "fp16"), w, cfg.prefix, cfg.prefill_chunk, cfg.score_chunk
            )
            for w in wins
        ]
        base = math.exp(sum(r["nll"] for r in base_nll) / sum(r["tokens"] for r in base_nll))
    print(
        f"fp16 PPL {base:.3f} on {len(wins)} windows of {cfg.prefix} + {cfg.score_tokens} tokens; "
        f"budgets per kv head {budgets}",
        file=sys.stderr,
    )
    ours: Dict[str, List[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for spec in rows_asked(args.recipes):
            ppls = measure(model, wins, spec, budgets, cfg, Path(tmp))
            ours[spec] = [100 * (p / base - 1) for p in ppls]
            print(
                f"  {spec} budgets {budgets}: PPL "
                + ", ".join(f"{p:.3f}" for p in ppls)
                + " ("
                + ", ".join(f"{d:+.2f}%" for d in ours[spec])
                + f") [{time.perf_counter() - started:.0f} s]",
                file=sys.stderr,
                flush=True,
            )
            if args.json:  # after every row, so a long run's finished rows are kept
                Path(args.json).write_text(
                    json.dumps(
                        {
                            "command": " ".join(["veloxquant bench kvpress", *(argv or sys.argv[1:])]),
                            "baseline_ppl": base,
                            "windows": len(wins),
                            "fractions": fractions,
                            "budgets": budgets,
                            "delta_ppl_percent": ours,
                            "kvpress_reference": {k: v[1] for k, v in KVPRESS.items()},
                        },
                        indent=1,
                    )
                    + "\n"
                )
    print(table(ours, fractions, base))
    return 0


def table(ours: Dict[str, List[float]], fractions: List[float], base: float) -> str:
    same = list(fractions) == list(KVPRESS_FRACTIONS)
    head = " | ".join(f"{f:g}" for f in fractions)
    lines = [
        f"fp16 PPL {base:.3f}. dPPL at the fraction of the prefix removed; kvpress rows are issue 14's figures.",
        "",
        f"| row | {head} |",
        "|---|" + "---|" * len(fractions),
    ]
    shown = set()
    if same:
        for press, (mine, theirs) in KVPRESS.items():
            lines.append(f"| kvpress {press} | " + " | ".join(f"{x:+.2f}%" for x in theirs) + " |")
            if mine in ours:
                lines.append(f"| ours {mine} | " + " | ".join(f"{x:+.2f}%" for x in ours[mine]) + " |")
                shown.add(mine)
    for spec, vals in ours.items():
        if spec not in shown:
            lines.append(f"| ours {spec} | " + " | ".join(f"{x:+.2f}%" for x in vals) + " |")
    if same and ours:
        best_k = [min(v[1][i] for v in KVPRESS.values()) for i in range(len(fractions))]
        best_o = [min(v[i] for v in ours.values()) for i in range(len(fractions))]
        lines.append("| **best kvpress** | " + " | ".join(f"{x:+.2f}%" for x in best_k) + " |")
        lines.append("| **best ours** | " + " | ".join(f"{x:+.2f}%" for x in best_o) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
