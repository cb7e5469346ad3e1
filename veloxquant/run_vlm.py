"""`veloxquant run RECIPE --vlm --model M --image FILE`: recipes on an mlx-vlm model, prompted with images.

mlx-vlm loads the model (mlx_vlm.load: a folder or a hub id) and generates with its own generate, handed
the recipe's caches (veloxquant.make_prompt_cache(model, recipe): its language model's, models/vlm.py).
The report is `run`'s (run.cache_report: bytes held, fp16 bytes of the same tokens, ratio), plus the image
tokens of the prompt and how many of them the eviction tiers keep on top of their budget
(runtime/eviction/protected.py; `--image-tokens evict` ranks them as any other token). Its options are
`run`'s (cli.py); those that read an mlx-lm model or its tokenizer (--batch, --corpus, ...) are refused.
"""

import json
from typing import Dict

import mlx.core as mx
import numpy as np

from .compiler import apply_sets
from .errors import VeloxError
from .models.vlm import image_token_ids, is_vlm
from .recipe import load_recipe
from .run import cache_report, format_report, side_by_side
from .runtime import make_prompt_cache, uninstall
from .runtime.cache_list import recipe_caches
from .runtime.eviction import protected
from .runtime.persist import save_prompt_cache

DEFAULT_PROMPT = "Describe the image."
UNSUPPORTED = ("batch", "corpus", "prompt_tokens", "raw_prompt", "no_hook", "warmup")


def cmd_run_vlm(args) -> int:
    if not args.vlm:
        raise VeloxError("--image: the model must be an mlx-vlm model; add --vlm (and --model)")
    given = [f"--{n.replace('_', '-')}" for n in UNSUPPORTED if getattr(args, n, None)]
    if given:
        raise VeloxError(f"--vlm: {', '.join(given)} not supported with an mlx-vlm model")
    if not args.model:
        raise VeloxError("--vlm needs --model: an mlx-vlm model folder or hub id")
    if args.save_cache and len(args.recipes) > 1:
        raise VeloxError("--save-cache takes one recipe (got several)")
    recipes = [load_recipe(r) for r in args.recipes]
    for recipe in recipes:
        apply_sets(recipe, args.sets)  # a bad recipe or --set fails before the model loads
    for path in args.image:
        open(path, "rb").close()  # a missing image fails before the model loads
    try:
        import mlx_vlm
    except ImportError as e:
        raise VeloxError("--vlm needs mlx-vlm: pip install veloxquant[vlm]") from e
    model, processor = mlx_vlm.load(args.model)
    if not is_vlm(model):
        raise VeloxError(f"--model {args.model}: mlx-vlm loaded no vision-language model from it")
    text = open(args.prompt_file, encoding="utf-8").read() if args.prompt_file else args.prompt or DEFAULT_PROMPT
    prompt = mlx_vlm.apply_chat_template(processor, model.config, text, num_images=len(args.image))
    reports = []
    for recipe in recipes:
        report = _generate(mlx_vlm, model, processor, prompt, recipe, args)
        reports.append(report)
        print(json.dumps(report) if args.json else "\n\n" + format_report(report) + _images_line(report), flush=True)
    if len(reports) > 1 and not args.json:
        print(side_by_side(reports))
    return 0


def _generate(mlx_vlm, model, processor, prompt: str, recipe, args) -> Dict[str, object]:
    caches = make_prompt_cache(model, recipe, args.sets, images=args.image_tokens)
    mx.synchronize()
    mx.reset_peak_memory()
    try:
        result = mlx_vlm.generate(
            model,
            processor,
            prompt,
            image=args.image or None,
            max_tokens=args.max_tokens,
            temperature=0.0,
            prompt_cache=caches,
            verbose=False,
        )
    finally:
        uninstall(model)
    if not args.json:
        print(result.text, end="", flush=True)
    runs = protected.of(caches)
    report = {
        "text": result.text,
        "recipe": recipe.name,
        "model": args.model,
        "fingerprint": recipe_caches(caches)[0].fingerprint,
        "prompt_tokens": result.prompt_tokens,
        "image_tokens": _image_tokens(mlx_vlm, model, processor, prompt, args.image),
        "image_tokens_kept_by_eviction": runs.count if runs is not None else None,
        "generated_tokens": result.generation_tokens,
        **cache_report(caches),
        "prefill_tok_s": result.prompt_tps,
        "decode_tok_s": result.generation_tps,
        "peak_memory_bytes": int(mx.get_peak_memory()),
        "device": str(mx.default_device()),
    }
    if args.save_cache:
        report["saved_cache_bytes"] = save_prompt_cache(args.save_cache, caches, {"recipe": recipe.name})
    return report


def _image_tokens(mlx_vlm, model, processor, prompt: str, images) -> int:
    """The prompt's image placeholder tokens, as mlx-vlm's processor expands them for these images."""
    if not images:
        return 0
    ids = mlx_vlm.utils.prepare_inputs(processor, images=images, prompts=prompt)["input_ids"]
    return int(np.isin(np.array(ids), image_token_ids(model)).sum())


def _images_line(r: Dict[str, object]) -> str:
    kept = r["image_tokens_kept_by_eviction"]
    line = f"\n{'image tokens':<24} {r['image_tokens']} in the prompt"
    return line + (f", {kept} kept on top of the eviction budget" if kept is not None else "")
