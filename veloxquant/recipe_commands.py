"""The commands that read, compile, show and warm recipes: check, fmt, explain, list, show, diff, schema, warmup.

`veloxquant.cli` parses the command line and calls these; each takes the parsed arguments and
returns the exit status."""

import json
import shutil
import sys
from pathlib import Path

from .errors import VeloxError

COMMANDS = ("check", "fmt", "explain", "list", "show", "diff", "schema", "warmup")  # cmd_NAME each


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
