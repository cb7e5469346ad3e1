"""The `veloxquant` command line."""

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

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


def _shape(model_path):
    from .compiler import SMOLLM2_135M, ModelShape

    if not model_path:
        return SMOLLM2_135M
    from .models import load_model

    model, _ = load_model(model_path, lazy=True)
    return ModelShape.from_model(model, Path(model_path).name)


def cmd_check(args) -> int:
    from .compiler import compile_recipe
    from .recipe import load_recipe

    shape, failed = _shape(args.model), 0
    for ref in args.recipes:
        try:
            plan = compile_recipe(load_recipe(ref), shape, args.sets)
            print(f"ok    {ref}  ({plan.recipe}, fingerprint {plan.fingerprint})")
        except VeloxError as e:
            failed += 1
            print(f"error: {e}", file=sys.stderr)
    return 1 if failed else 0


def cmd_fmt(args) -> int:
    from .recipe.fmt import format_file

    changed = 0
    for f in args.files:
        text, differs = format_file(f)
        if differs:
            changed += 1
            if args.check:
                print(f"would reformat {f}")
            else:
                Path(f).write_text(text)
                print(f"reformatted {f}")
    return 1 if (args.check and changed) else 0


def cmd_explain(args) -> int:
    from .compiler import compile_recipe
    from .compiler.explain import render
    from .recipe import load_recipe

    plan = compile_recipe(load_recipe(args.recipe), _shape(args.model), args.sets)
    print(render(plan))
    from .compiler.batching import layouts, refusal

    why = refusal(plan)
    print(
        f"batching: batches ({layouts(plan)}; mlx-lm batch caches: merge/extend/filter/extract; "
        "veloxquant serve batches it)"
        if why is None
        else f"batching: one sequence at a time: {why}"
    )
    from .calibration.explain import calibration_lines
    from .compiler.binding import calibrated_stages

    model = _calibration_model(args.model) if calibrated_stages(plan) else None
    for line in calibration_lines(plan, model, args.model or ""):
        print(line)
    return 0


def _calibration_model(model_path):
    """The model whose weights key a calibration artifact (the default model when none is named)."""
    from .models import load_model
    from .models.default import default_model_path

    return load_model(model_path or default_model_path(), lazy=True)[0]


LIST_CONTEXT = 4096  # the context `list` states held bytes at


def cmd_list(args) -> int:
    from .board.predict import fp16_bytes, held_bytes
    from .compiler import SMOLLM2_135M
    from .recipe import builtin_names, load_recipe

    width = max(80, min(shutil.get_terminal_size((80, 24)).columns, 160))
    print(f"held: bytes held ÷ fp16 at {LIST_CONTEXT} tokens on SmolLM2-135M, from the plan")
    print(f"{'recipe':<18} {'held':>5}  summary")
    base, unknown = fp16_bytes(SMOLLM2_135M, LIST_CONTEXT), False
    for name in builtin_names():
        r = load_recipe(name)
        held = held_bytes(name, (), SMOLLM2_135M, LIST_CONTEXT)
        unknown |= held is None
        shown = "run¹" if held is None else f"{held / base:.3f}"
        summary = r.summary if len(r.summary) <= width - 26 else r.summary[: width - 27] + "…"
        print(f"{name:<18} {shown:>5}  {summary}")
    if unknown:
        print("¹ set at run time (per-prompt basis, shared layers): see `veloxquant run`")
    return 0


def cmd_show(args) -> int:
    from .recipe.load import resolve
    from .recipe.source import read_text  # the same checks as loading: size, encoding

    print(read_text(resolve(args.recipe)), end="")
    return 0


def cmd_bench(args) -> int:
    if args.help or args.list or not args.what:
        if args.help:
            print(args.bench_parser.format_help())
        print("the benches (veloxquant bench NAME --help shows one's options):\n" + bench_registry.listing())
        return 0
    return bench_registry.run(args.what, args.args)


def cmd_diff(args) -> int:
    from .compiler import compile_recipe
    from .compiler.diff import compare
    from .recipe.revision import load_any

    shape = _shape(args.model)
    compiled = [load_any(ref, lambda r: (r, compile_recipe(r, shape))) for ref in (args.a, args.b)]
    d, text = compare([args.a, args.b], compiled)
    print(text)
    return 0 if d.same else 1


def cmd_schema(args) -> int:
    from .compiler.schema import completions, recipe_schema

    schema = recipe_schema()
    if args.stage:
        print("\n".join(completions(schema, args.stage)))
        return 0
    text = json.dumps(schema, indent=1) + "\n"
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        print(text, end="")
    return 0


def cmd_tune(args) -> int:
    from .tune.cli import cmd_tune as run_tune

    return run_tune(args)


def cmd_eval(args) -> int:
    from .eval.cli import cmd_eval as run_eval

    return run_eval(args)


def cmd_compare(args) -> int:
    from .eval.cli import cmd_compare as run_compare

    return run_compare(args)


def cmd_warmup(args) -> int:
    from .models import load_model
    from .runtime.warmup import warmup

    if args.context < 2 or args.decode < 1:
        raise VeloxError(
            f"warmup: --context must be at least 2 and --decode positive (got {args.context}, {args.decode})"
        )
    model, _ = load_model(args.model)
    seen, seconds = warmup(model, args.recipe, args.context, args.decode, args.sets)
    print(
        f"warmed {args.recipe} at {args.context} tokens + {args.decode} steps in {seconds:.1f} s: "
        f"{len(seen)} veloxquant kernel variants launched"
    )
    return 0


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
        "check": cmd_check,
        "fmt": cmd_fmt,
        "explain": cmd_explain,
        "list": cmd_list,
        "show": cmd_show,
        "bench": cmd_bench,
        "diff": cmd_diff,
        "schema": cmd_schema,
        "tune": cmd_tune,
        "eval": cmd_eval,
        "compare": cmd_compare,
    }
    commands["calibrate"] = cmd_calibrate
    commands["warmup"] = cmd_warmup
    commands["leaderboard"] = cmd_leaderboard
    commands["report"] = cmd_report
    commands["recommend"] = cmd_recommend
    try:
        if args.command == "serve":
            from .serve.cli import cmd_serve

            return cmd_serve(args)
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
