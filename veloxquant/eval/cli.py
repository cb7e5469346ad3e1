"""`veloxquant eval` and `veloxquant compare`: argument parsing and the two commands."""

import json
import sys
import time
from pathlib import Path

from ..errors import VeloxError

# Small enough for a smoke run in about a minute on 2 CPU cores; 512 tokens of context,
# so the scored window is mostly past kivi's 128-token fp16 window (a multiple of 256:
# mlx-lm's allocation step).
QUICK = {
    "windows": 1,
    "prefix": 448,
    "score_tokens": 64,
    "prefill_chunk": 128,
    "score_chunk": 32,
    "fidelity_windows": 1,
    "passkey_lengths": (512,),
    "passkey_depths": (0.5,),
    "passkey_trials": 1,
}


def add_eval_args(p) -> None:
    d = _defaults()
    p.add_argument(
        "recipes",
        nargs="+",
        metavar="RECIPE",
        help="built-in name, YAML path, NAME[k=v,...] to set parameters, or 'all' (every built-in)",
    )
    p.add_argument("--model", help="mlx-lm model folder or 'gemma3' (default: SmolLM2-135M-Instruct)")
    p.add_argument("--corpus", default="austen", help="'austen', 'austen:emma' or a text file (default: austen)")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a parameter in every recipe row (repeatable)",
    )
    p.add_argument(
        "--mlx-bits",
        help="mlx-lm QuantizedKVCache baseline rows at these bit widths ('' for none; default 8,4,3,2, with --quick 4)",
    )
    p.add_argument("--json", metavar="OUT", help="write the results as JSON (input of `veloxquant compare`)")
    p.add_argument("--md", metavar="OUT", help="also write the markdown table to a file")
    p.add_argument("--png", metavar="OUT", help="also write the Pareto plot (bytes/token vs ΔPPL)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run (under a minute on 2 CPU cores): 1 short "
        "window, 1 passkey prompt, mlx-lm at 4 bits only (explicit limits below still apply)",
    )
    g = p.add_argument_group("limits")
    g.add_argument("--windows", type=int, help=f"perplexity windows (default {d.windows})")
    g.add_argument("--prefix", type=int, help=f"tokens prefilled before scoring (default {d.prefix})")
    g.add_argument("--score-tokens", type=int, help=f"tokens scored per window (default {d.score_tokens})")
    g.add_argument("--prefill-chunk", type=int, help=f"prefill step in tokens (default {d.prefill_chunk})")
    g.add_argument(
        "--score-chunk",
        type=int,
        help=f"continuation fed this many tokens at a time; 1 = exact token-by-token decode (default {d.score_chunk})",
    )
    g.add_argument(
        "--fidelity-windows", type=int, help=f"windows for attention fidelity (default {d.fidelity_windows})"
    )
    g.add_argument(
        "--passkey-lengths",
        help="comma-separated prompt lengths in tokens "
        f"(default {','.join(map(str, d.passkey_lengths))}; '' skips passkey)",
    )
    g.add_argument(
        "--passkey-depths",
        help=f"comma-separated needle depths in [0, 1] (default {','.join(map(str, d.passkey_depths))})",
    )
    g.add_argument("--passkey-trials", type=int, help=f"prompts per length and depth (default {d.passkey_trials})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="run each row as a Ray task, on a local "
        "Ray instance or the cluster at ADDRESS (GPU rows ask for a GPU); results equal a serial run's",
    )


def add_compare_args(p) -> None:
    p.add_argument("results", nargs="+", metavar="RESULTS.json", help="files written by `veloxquant eval --json`")
    p.add_argument("--md", metavar="OUT.md", help="write the markdown here (default: print it)")
    p.add_argument("--png", metavar="OUT.png", help="write the Pareto plot (bytes/token vs ΔPPL) here")


def _defaults():
    from .config import EvalConfig

    return EvalConfig()


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def _csv(text, cast):
    try:
        return tuple(cast(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise VeloxError(f"expected a comma-separated list of {cast.__name__}s, got {text!r}") from None


def config(args):
    from .config import EvalConfig

    values = dict(QUICK) if args.quick else {}
    for name in (
        "windows",
        "prefix",
        "score_tokens",
        "prefill_chunk",
        "score_chunk",
        "fidelity_windows",
        "passkey_trials",
    ):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    if args.passkey_lengths is not None:
        values["passkey_lengths"] = _csv(args.passkey_lengths, int)
    if args.passkey_depths is not None:
        values["passkey_depths"] = _csv(args.passkey_depths, float)
    cfg = EvalConfig(**values)
    if min(cfg.prefix, cfg.score_tokens, cfg.prefill_chunk, cfg.score_chunk) < 1:
        raise VeloxError("--prefix, --score-tokens, --prefill-chunk and --score-chunk must be at least 1")
    if any(not 0 <= d <= 1 for d in cfg.passkey_depths):
        raise VeloxError("--passkey-depths must lie in [0, 1]")
    return cfg


def cmd_eval(args) -> int:
    from ..data import load_text
    from ..models import load_model
    from . import report
    from .rows import expand
    from .run import evaluate

    cfg = config(args)
    bits = args.mlx_bits if args.mlx_bits is not None else "4" if args.quick else "8,4,3,2"
    rows = expand(args.recipes, _csv(bits, int), args.sets)  # bad recipes fail before the model loads
    started = time.perf_counter()
    text = load_text(args.corpus)
    if getattr(args, "ray", None) is None:  # Ray tasks load the model in their workers
        model, tokenizer = load_model(args.model)
    name = args.model or "SmolLM2-135M-Instruct"
    meta = {
        "model": Path(name).name if Path(name).exists() else name,
        "corpus": args.corpus,
        "command": " ".join(["veloxquant", *map(_quote, sys.argv[1:])]) if sys.argv[1:2] == ["eval"] else None,
    }
    if getattr(args, "ray", None) is not None:
        from .distributed import evaluate_distributed

        result = evaluate_distributed(args.model, rows, text, cfg, meta, args.ray, progress=not args.no_progress)
    else:
        # Rows measured so far survive an interrupted run: OUT.partial.json after each row.
        partial = (
            (
                lambda done: Path(args.json + ".partial.json").write_text(
                    json.dumps({"partial": True, **meta, "rows": done}, indent=1) + "\n"
                )
            )
            if args.json
            else None
        )
        result = evaluate(model, tokenizer, rows, text, cfg, meta, progress=not args.no_progress, on_row=partial)
    result["total_wall_s"] = time.perf_counter() - started  # with model and corpus loading
    md = report.markdown([result])
    print(md, end="")
    if args.md:
        Path(args.md).write_text(md)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        Path(args.json + ".partial.json").unlink(missing_ok=True)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.png:
        report.plot([result], args.png)
        print(f"wrote {args.png}", file=sys.stderr)
    return 0


def cmd_compare(args) -> int:
    from . import report

    results = report.load(args.results)
    md = report.markdown(results)
    if args.md:
        Path(args.md).write_text(md)
        print(f"wrote {args.md}", file=sys.stderr)
    else:
        print(md, end="")
    if args.png:
        report.plot(results, args.png)
        print(f"wrote {args.png}", file=sys.stderr)
    return 0
