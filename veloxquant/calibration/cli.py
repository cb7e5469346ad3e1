"""`veloxquant calibrate RECIPE --model M [--corpus C] [--tokens N]`: fit and write the artifact."""

from pathlib import Path


def add_calibrate_args(p) -> None:
    p.add_argument("recipe")
    p.add_argument("--model", help="mlx-lm model folder or 'gemma3' (default: SmolLM2-135M-Instruct)")
    p.add_argument(
        "--corpus", help="calibration text: sets the recipe's 'corpus' parameter ('austen:emma', 'passkey', a file)"
    )
    p.add_argument("--tokens", type=int, help="calibration tokens: sets the recipe's 'tokens' parameter")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override a recipe parameter (repeatable; use the same values with run/eval)",
    )
    p.add_argument("--force", action="store_true", help="fit again even if the artifact exists")
    p.add_argument("--no-progress", action="store_true")


def cmd_calibrate(args) -> int:
    # Imported when the command runs, not when `veloxquant --help` builds the parser (no cycle here).
    import mlx.core as mx

    from .. import artifacts as artifact
    from ..compiler import ModelShape, compile_recipe
    from ..compiler.binding import calibrated_stages, key_for
    from ..errors import VeloxError
    from ..models import load_model
    from ..models.default import default_model_path, gemma3_model_path
    from ..recipe import load_recipe
    from ..runtime.make import plan_for
    from .fit import calibrate

    recipe = load_recipe(args.recipe)
    sets = list(args.sets)
    for name, value in (("corpus", args.corpus), ("tokens", args.tokens)):
        if value is not None:
            if name not in recipe.params:
                raise VeloxError(f"--{name}: recipe '{recipe.name}' has no '{name}' parameter to set")
            sets.append(f"{name}={value}")
    path = gemma3_model_path() if args.model == "gemma3" else (args.model or default_model_path())
    model, tokenizer = load_model(path, dtype=mx.float32)
    plan = compile_recipe(recipe, ModelShape.from_model(model, Path(str(path)).name), sets)
    if not calibrated_stages(plan):
        print(f"recipe '{recipe.name}' calibrates nothing: it runs as is")
        return 0
    key = key_for(plan, model)
    if artifact.find(key) and not args.force:
        meta = artifact.find(key)
        print(
            f"up to date: {artifact.directory() / (key + '.safetensors')} ({meta['bytes']:,} bytes, "
            f"content {meta['content']})"
        )
        return 0
    meta = calibrate(plan, model, tokenizer, progress=not args.no_progress, model_name=Path(str(path)).name)
    plan_for(model, recipe, sets)  # binds: proves run/eval will find it
    print(
        f"wrote {meta['path']}: {meta['bytes']:,} bytes, {meta['stages']} calibrated stage(s), "
        f"{meta['tokens']} tokens of '{meta['corpus']}' in {meta['seconds']:.1f} s; content {meta['content']}"
    )
    return 0
