"""`veloxquant tune MODEL --max-bytes R`: arguments, the report, and the recipe file it writes."""

import shlex
import sys
import time
from pathlib import Path

from ..errors import VeloxError

DEFAULT_FROM = "kivi,kivi_sink,xquant"


def add_tune_args(p) -> None:
    p.add_argument("model", help="mlx-lm model folder, 'gemma3', or 'default' (SmolLM2-135M-Instruct)")
    p.add_argument(
        "--max-bytes",
        type=float,
        required=True,
        metavar="R",
        help="budget: held cache bytes at most R x fp16's, measured at the calibration context",
    )
    p.add_argument(
        "--from",
        dest="bases",
        default=DEFAULT_FROM,
        metavar="A,B,...",
        help=f"built-in recipes whose parameters are searched, and/or 'hybrid': eviction composed with codecs, "
        f"budget, codecs and per-layer widths searched jointly (default {DEFAULT_FROM})",
    )
    p.add_argument(
        "--corpus",
        default="austen",
        help="'austen', 'austen:emma' or a text file; calibration "
        "windows come from its first half, held-out windows from its second (default austen)",
    )
    p.add_argument(
        "--heldout-corpus",
        metavar="TEXT",
        help="held-out windows from this text instead (e.g. austen:persuasion; calibration stays on --corpus)",
    )
    p.add_argument(
        "--objective",
        choices=("kld", "ppl"),
        default="kld",
        help="what the best candidate minimises on calibration: mean KL divergence from fp16's next-token "
        "distributions, or perplexity (default kld)",
    )
    p.add_argument("--seed", type=int, default=0, help="order in which the hybrid space is sampled (default 0)")
    p.add_argument("--prefix", type=int, default=1024, help="tokens prefilled before scoring (default 1024)")
    p.add_argument("--score-tokens", type=int, default=128, help="tokens scored per window (default 128)")
    p.add_argument("--calib-windows", type=int, default=1, help="calibration windows (default 1)")
    p.add_argument("--heldout-windows", type=int, default=2, help="held-out windows (default 2)")
    p.add_argument(
        "--budget-minutes",
        type=float,
        help="stop starting calibration measurements after this long (the held-out confirmation still runs)",
    )
    p.add_argument("-o", "--output", metavar="FILE.yaml", help="write the recipe here (default tuned_<R>.yaml)")
    p.add_argument(
        "--state",
        metavar="FILE.jsonl",
        help="measurements so far, for resuming (default ~/.cache/veloxquant/tune/<model>-<corpus>-<protocol>.jsonl)",
    )
    p.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="measure candidates as Ray tasks (a local Ray instance, or the cluster at ADDRESS)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def cmd_tune(args) -> int:
    from ..compiler import ModelShape
    from ..data import load_text
    from ..data.corpus import cache_root
    from ..recipe.load import resolve
    from .hybrid import NAME as HYBRID
    from .measure import load_cached, slices
    from .search import Search, State, run

    if not 0 < args.max_bytes <= 1:
        raise VeloxError(f"--max-bytes is a fraction of fp16's bytes in (0, 1], got {args.max_bytes}")
    bases = [b.strip() for b in args.bases.split(",") if b.strip()]
    for b in bases:
        if b != HYBRID:
            resolve(b)  # a misspelt recipe fails before the model loads
    started = time.time()
    model_ref = None if args.model == "default" else args.model
    model, tokenizer = load_cached(model_ref)
    sl = slices(
        tokenizer.encode(load_text(args.corpus)),
        args.calib_windows,
        args.heldout_windows,
        args.prefix,
        args.score_tokens,
        tokenizer.encode(load_text(args.heldout_corpus)) if args.heldout_corpus else None,
    )
    model_name = Path(str(model_ref)).name if model_ref else "SmolLM2-135M-Instruct"
    protocol = f"{args.prefix}+{args.score_tokens}x{args.calib_windows}/{args.heldout_windows}"
    state = (
        Path(args.state)
        if args.state
        else (cache_root() / "tune" / f"{model_name}-{Path(args.corpus).name}-{protocol}.jsonl")
    )
    deadline = started + 60 * args.budget_minutes if args.budget_minutes else None
    search = Search(
        model_ref,
        ModelShape.from_model(model),
        sl,
        State(state),
        args.ray,
        deadline,
        progress=not args.no_progress,
        objective=args.objective,
    )
    out = run(search, bases, args.max_bytes, args.seed)
    wall = time.time() - started
    print(report(out, args.max_bytes, search, wall))
    print(f"measurements: {state} (a repeated command resumes from it)", file=sys.stderr)
    if out["best"] is None:
        print(
            f"no candidate from {','.join(bases)} fits {args.max_bytes} of fp16's bytes on the calibration "
            "slice; try a larger --max-bytes or other --from recipes",
            file=sys.stderr,
        )
        return 1
    path = Path(args.output or f"tuned_{args.max_bytes:g}.yaml".replace(".", "_", 1).replace("_yaml", ".yaml"))
    path.write_text(recipe_file(out, args, model_name, path.stem))
    print(f"wrote {path}", file=sys.stderr)
    return 0


def _dppl(r, base) -> str:
    return f"{100 * (r['ppl'] / base['ppl'] - 1):+.2f}%" if r and base else "-"


def report(out, max_ratio, search, wall) -> str:
    entries, best = out["entries"], out["best"]
    fp16 = entries[out["fp16"]]
    lines = [
        f"calibration: {len(search.calib.windows)} window(s) of {search.calib.prefix} + "
        f"{search.context - search.calib.prefix} scored tokens; held-out: {len(search.held.windows)} window(s); "
        f"budget {max_ratio} of fp16's bytes at {search.context} tokens",
        "",
        "Pareto front (calibration; bytes are held / fp16's, measured):",
        "| recipe | bytes vs fp16 | PPL | ΔPPL | KLD | within budget |",
        "|---|---|---|---|---|---|",
    ]
    for e in out["front"]:
        fits = "yes" if e.calib["ratio"] <= max_ratio else "no"
        lines.append(
            f"| {e.label} | {e.calib['ratio']:.3f} | {e.calib['ppl']:.3f} | {_dppl(e.calib, fp16.calib)} | "
            f"{e.calib['kld']:.4f} | {fits} |"
        )
    lines += [
        "",
        f"held-out slice (recipes within {max_ratio} of fp16's bytes on calibration):",
        "| recipe | bytes vs fp16 | PPL | ΔPPL vs fp16 | KLD |",
        "|---|---|---|---|---|",
    ]
    held = sorted((e for e in entries.values() if e.heldout), key=lambda e: e.heldout["ppl"])
    for e in held:
        mark = " (tuned)" if e.text == best else ""
        lines.append(
            f"| {e.label}{mark} | {e.heldout['ratio']:.3f} | {e.heldout['ppl']:.3f} | "
            f"{_dppl(e.heldout, fp16.heldout)} | {e.heldout['kld']:.4f} |"
        )
    rivals = [e for e in held if e.builtin]
    if best is not None:
        mine = entries[best].heldout
        if not rivals:
            lines.append(f"no built-in fits {max_ratio} of fp16's bytes here, so there is none to beat")
        else:
            for what in ("ppl", "kld"):
                top = min(rivals, key=lambda e: e.heldout[what])
                verdict = "beats" if mine[what] < top.heldout[what] else "does NOT beat"
                mine_text, top_text = (
                    (_dppl(mine, fp16.heldout), _dppl(top.heldout, fp16.heldout))
                    if what == "ppl"
                    else (f"{mine['kld']:.4f}", f"{top.heldout['kld']:.4f}")
                )
                lines.append(
                    f"on held-out {'ΔPPL' if what == 'ppl' else 'KLD'} the tuned recipe {verdict} the best "
                    f"built-in within budget ({top.label}): {mine_text} vs {top_text}"
                )
    lines.append(f"wall {wall:.0f} s")
    return "\n".join(lines)


def recipe_file(out, args, model_name, name) -> str:
    e = out["entries"][out["best"]]
    fp16 = out["entries"][out["fp16"]]
    command = (
        " ".join(["veloxquant", *map(shlex.quote, sys.argv[1:])])
        if sys.argv[1:2] == ["tune"]
        else f"veloxquant tune {args.model} --max-bytes {args.max_bytes} --from {args.bases}"
    )
    header = (
        f"Written by `veloxquant tune` for {model_name} at <= {args.max_bytes} of fp16's held bytes.\n"
        f"Measured (held bytes / fp16's at {args.prefix + args.score_tokens} tokens; "
        f"ΔPPL vs fp16, corpus {args.corpus}"
        + (f", held-out on {args.heldout_corpus}" if args.heldout_corpus else "")
        + "):\n"
        f"  calibration: bytes {e.calib['ratio']:.3f}, PPL {e.calib['ppl']:.3f} ({_dppl(e.calib, fp16.calib)}), "
        f"KLD {e.calib['kld']:.4f}\n"
        f"  held-out:    bytes {e.heldout['ratio']:.3f}, PPL {e.heldout['ppl']:.3f} "
        f"({_dppl(e.heldout, fp16.heldout)}), KLD {e.heldout['kld']:.4f}\n"
        f"Command: {command}"
    )
    return out["candidate"].yaml(name, header)
