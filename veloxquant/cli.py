"""The `veloxquant` command line."""

import argparse
import os
import sys

from . import recipe_commands
from .bench import registry as bench_registry
from .errors import VeloxError


def _add_recipe_opts(p, model=True):
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a recipe parameter (repeatable)",
    )
    if model:
        p.add_argument("--model", help="mlx-lm model folder (default: SmolLM2-135M-Instruct, converted once)")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="veloxquant", description="KV-cache compression recipes for MLX models")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="generate with a model under one or more recipes and report what the cache cost")
    p.add_argument(
        "recipes",
        nargs="+",
        metavar="recipe",
        help="several: each generates from the same prompt, then one table side by side",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--prompt",
        help="the prompt text (default: a built-in sample of about 1,200 tokens, the "
        "opening chapter of Pride and Prejudice and a question, long enough that compressed tiers "
        "hold most of it)",
    )
    src.add_argument("--prompt-file", help="read the prompt from a file ('-' for stdin)")
    src.add_argument("--corpus", help="prompt from a corpus: 'austen', 'austen:emma' or a text file")
    p.add_argument(
        "--prompt-tokens",
        type=int,
        help="cut the prompt to its first N tokens (implies --raw-prompt); a shorter prompt is an error",
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--raw-prompt", action="store_true", help="do not wrap the prompt in the chat template")
    p.add_argument("--no-hook", action="store_true", help="leave mlx-lm's attention alone (decoded K/V mode)")
    p.add_argument("--save-cache", metavar="PATH", help="save the compressed cache after generation (.safetensors)")
    p.add_argument(
        "--warmup",
        action="store_true",
        help="generate once untimed with each recipe first (GPU: first use compiles kernels)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (one line per recipe) instead of text")
    p.add_argument(
        "--batch",
        type=int,
        metavar="N",
        help="N sequences of different lengths (the prompt cut down "
        "to half): batched where the recipe batches, else one at a time; per-sequence and aggregate figures",
    )
    _add_recipe_opts(p)
    p.add_argument("--vlm", action="store_true", help="--model is an mlx-vlm model (pip install veloxquant[vlm])")
    p.add_argument(
        "--image", action="append", default=[], metavar="FILE", help="--vlm: an image for the prompt (repeatable)"
    )
    p.add_argument(
        "--image-tokens",
        choices=("keep", "evict"),
        default="keep",
        help="--vlm: eviction keeps image tokens on top of its budget, or ranks them as any token",
    )

    p = sub.add_parser("check", help="load and compile recipes; report errors")
    p.add_argument("recipes", nargs="+")
    _add_recipe_opts(p)

    p = sub.add_parser("fmt", help="rewrite recipe files in canonical form")
    p.add_argument("files", nargs="+")
    p.add_argument("--check", action="store_true", help="only report files that would change (exit 1)")

    p = sub.add_parser("explain", help="print the per-layer plan, storage cost and implementations")
    p.add_argument("recipe")
    _add_recipe_opts(p)

    sub.add_parser("list", help="list the built-in recipes")

    p = sub.add_parser("show", help="print a recipe file")
    p.add_argument("recipe")

    from .eval.cli import add_compare_args, add_eval_args  # light: no MLX until a command runs

    add_eval_args(
        sub.add_parser(
            "eval",
            help="measure perplexity, passkey retrieval, attention fidelity and "
            "cost of recipes against fp16 and mlx-lm's quantized cache",
        )
    )
    add_compare_args(sub.add_parser("compare", help="render eval results as a markdown table and a Pareto plot"))

    p = sub.add_parser(
        "diff", help="compare two recipes by their compiled per-layer plans (exit 0 same plan, 1 different, 2 error)"
    )
    p.add_argument("a", metavar="A", help="recipe file, built-in name, or git revision REV:PATH (e.g. HEAD~1:my.yaml)")
    p.add_argument("b", metavar="B", help="the same kinds as A")
    p.add_argument("--model", help="compile for this mlx-lm model folder (default: the SmolLM2-135M shape)")

    p = sub.add_parser("schema", help="print the JSON Schema of recipe files (for editors' YAML language servers)")
    p.add_argument("-o", "--output", metavar="FILE", help="write it to FILE instead of printing it")
    p.add_argument(
        "--stage", metavar="NAME", help="print completion items for a stage's parameters, read from the schema"
    )

    from .tune.cli import add_tune_args

    add_tune_args(
        sub.add_parser(
            "tune",
            help="search recipe parameters and per-layer mixes for the lowest measured "
            "perplexity within a byte budget; writes a recipe file",
        )
    )

    from .calibration.cli import add_calibrate_args

    add_calibrate_args(
        sub.add_parser(
            "calibrate",
            help="fit a recipe's calibrated stages on a model and write "
            "the artifact that run/eval/make_prompt_cache bind to",
        )
    )

    from .serve.cli import add_serve_args

    add_serve_args(
        sub.add_parser(
            "serve",
            help="serve a recipe through mlx-lm's OpenAI-compatible server "
            "(mlx_lm.server); GET /v1/veloxquant/status reports it",
        )
    )

    from .board.cli import add_leaderboard_args, add_recommend_args, add_report_args

    add_recommend_args(
        sub.add_parser(
            "recommend",
            help="the best measured recipe whose bytes fit your context and memory (or ratio) on your model's shape",
        )
    )
    add_leaderboard_args(
        sub.add_parser(
            "leaderboard",
            help="evaluate every built-in (defaults and byte-matched "
            "settings) on one protocol; resumable JSON under results/",
        )
    )
    add_report_args(
        sub.add_parser(
            "report",
            help="a self-contained HTML page (sortable table, Pareto plots) "
            "and the recipe-choosing tables from leaderboard/eval JSON",
        )
    )

    p = sub.add_parser(
        "warmup",
        help="compile a recipe's GPU kernels for a model and context before generating "
        "(fills MLX's on-disk kernel cache; run it at the context you will generate at)",
    )
    p.add_argument("--recipe", required=True)
    p.add_argument("--context", type=int, default=4096, help="prompt tokens (random) to prefill")
    p.add_argument("--decode", type=int, default=256, help="decode steps (cross the window spills)")
    _add_recipe_opts(p)

    p = sub.add_parser(
        "bench", help="benchmarks that print tables (veloxquant bench --list names them)", add_help=False
    )  # --help also lists the benches, imported only then (cmd_bench)
    p.add_argument("what", nargs="?", help="the bench to run; `veloxquant bench NAME --help` shows its options")
    p.add_argument("-h", "--help", action="store_true", help="show this help and the benches, then exit")
    p.add_argument("--list", action="store_true", help="list the benches, with what each measures")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(bench_parser=p)
    return ap


def cmd_bench(args) -> int:
    if args.help or args.list or not args.what:
        if args.help:
            print(args.bench_parser.format_help())
        print("the benches (veloxquant bench NAME --help shows one's options):\n" + bench_registry.listing())
        return 0
    return bench_registry.run(args.what, args.args)


def cmd_tune(args) -> int:
    from .tune.cli import cmd_tune as run_tune

    return run_tune(args)


def cmd_eval(args) -> int:
    from .eval.cli import cmd_eval as run_eval

    return run_eval(args)


def cmd_compare(args) -> int:
    from .eval.cli import cmd_compare as run_compare

    return run_compare(args)


def cmd_calibrate(args) -> int:
    from .calibration.cli import cmd_calibrate as run_calibrate

    return run_calibrate(args)


def cmd_leaderboard(args) -> int:
    from .board.cli import cmd_leaderboard as run_leaderboard

    return run_leaderboard(args)


def cmd_recommend(args) -> int:
    from .board.cli import cmd_recommend as run_recommend

    return run_recommend(args)


def cmd_report(args) -> int:
    from .board.cli import cmd_report as run_report

    return run_report(args)


def main(argv=None) -> int:
    if argv is None:  # a real command line (not a call from Python): OpenBLAS where it helps
        from .blas import maybe_reexec

        maybe_reexec(sys.argv[1:])
    args = _parser().parse_args(argv)
    commands = {
        **{name: getattr(recipe_commands, f"cmd_{name}") for name in recipe_commands.COMMANDS},
        "bench": cmd_bench,
        "tune": cmd_tune,
        "eval": cmd_eval,
        "compare": cmd_compare,
        "calibrate": cmd_calibrate,
        "leaderboard": cmd_leaderboard,
        "report": cmd_report,
        "recommend": cmd_recommend,
    }
    try:
        if args.command == "serve":
            from .serve.cli import cmd_serve

            return cmd_serve(args)
        if args.command == "run" and (args.vlm or args.image):
            from .run_vlm import cmd_run_vlm

            return cmd_run_vlm(args)
        if args.command == "run" and args.batch is not None:
            from .run_batch import cmd_run_batch

            return cmd_run_batch(args)
        if args.command == "run":
            from .run import cmd_run

            return cmd_run(args)
        return commands[args.command](args)
    except VeloxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
        print(f"error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `veloxquant explain kivi | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
