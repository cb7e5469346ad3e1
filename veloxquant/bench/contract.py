"""Every recipe through the user's path on a real model: check, explain, mlx_lm.generate, save/load, bytes.

    veloxquant bench contract --model gemma3 skvq kitty zipcache
    veloxquant bench contract --model gemma3 all --prompt 700

The unit tests run mlx-lm's cache contract on SmolLM2 (tests/test_mlx_contract.py) and on
small random models; this prints the same checks as a table for any model and recipe list,
the evidence that a recipe "checks, explains, runs in mlx_lm.generate, saves and loads and
holds what it claims" on e.g. Gemma-3-270M (sliding-window layers, one kv head, head_dim 256),
whose weights are too slow to load in every test. Per recipe, on the first `--prompt` tokens
of Austen (default 700: past Gemma's 512-token sliding window and every default budget):

- check/explain: the recipe compiles against this model's shape and `explain` renders;
- generate: `mlx_lm.generate` (stream_generate) produces `--tokens` tokens through the caches;
- save/load: the prefilled caches are saved with save_prompt_cache, loaded back, and the next
  step's logits through the loaded caches equal the live caches' (exactly);
- bytes: nbytes ≥ the arrays in `state` (what is saved) and the state is not empty.

A failure prints its error in the row and the exit status is 1; nothing is skipped silently
(a calibrated recipe without its artifact fails with the message telling how to make it).
"""

import argparse
import tempfile
from pathlib import Path

import mlx.core as mx

from ..compiler import ModelShape, compile_recipe
from ..compiler.explain import render
from ..data.corpus import load_text
from ..errors import VeloxError
from ..models.default import load_model
from ..recipe import builtin_names, load_recipe
from ..runtime.make import make_prompt_cache
from ..runtime.persist import load_prompt_cache, save_prompt_cache
from .registry import bench


def one_recipe(model, tokenizer, name, prompt, gen_tokens, tmp: Path):
    """A row for one recipe: {'check', 'generate', 'save/load', 'bytes', 'ok'}; raises VeloxError."""
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    plan = compile_recipe(load_recipe(name), ModelShape.from_model(model, "model"))
    render(plan)
    row = {"check": f"ok ({plan.fingerprint[:8]})"}
    caches = make_prompt_cache(model, name, tokenizer=tokenizer)
    text = "".join(
        r.text
        for r in stream_generate(
            model, tokenizer, prompt, max_tokens=gen_tokens, sampler=make_sampler(0.0), prompt_cache=caches
        )
    )
    row["generate"] = f"{gen_tokens} tokens: {text[:24]!r}"
    caches = make_prompt_cache(model, name, tokenizer=tokenizer)
    model(prompt[None, :-1], cache=caches)
    mx.eval([c.state for c in caches])
    path = tmp / f"{Path(name).stem}.safetensors"
    size = save_prompt_cache(str(path), caches)
    loaded, _ = load_prompt_cache(str(path), model=model)
    last = prompt[None, -1:]
    same = mx.array_equal(model(last, cache=caches), model(last, cache=loaded))
    row["save/load"] = f"{'identical' if same else 'DIFFERS'} ({size:,} B file)"
    saved = sum(a.nbytes for c in caches for a in c.state)
    held = sum(c.nbytes for c in caches)
    counted = 0 < saved <= held
    row["bytes"] = f"{held:,} held, {saved:,} in state" + ("" if counted else " WRONG")
    row["ok"] = bool(same and counted)
    return row


@bench("contract", "every recipe through the user's path on a real model: check, explain, generate, save/load, bytes")
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="veloxquant bench contract", description=__doc__.splitlines()[0])
    ap.add_argument("recipes", nargs="+", help="built-in names or YAML paths; 'all' = every built-in")
    ap.add_argument("--model", default=None, help="path or alias (smollm2, gemma3)")
    ap.add_argument("--prompt", type=int, default=700, help="prompt tokens (Austen)")
    ap.add_argument("--tokens", type=int, default=8, help="tokens generated through mlx_lm")
    args = ap.parse_args(argv)
    model, tokenizer = load_model(args.model)
    names = builtin_names() if args.recipes == ["all"] else args.recipes
    prompt = mx.array(tokenizer.encode(load_text("austen"))[: args.prompt])
    print(
        f"model {args.model or 'smollm2'}, prompt {args.prompt} Austen tokens, "
        f"{args.tokens} generated, device {mx.default_device()}\n"
    )
    print("| recipe | check/explain | mlx_lm.generate | save/load (next logits) | bytes |")
    print("| --- | --- | --- | --- | --- |")
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            try:
                row = one_recipe(model, tokenizer, name, prompt, args.tokens, Path(tmp))
            except VeloxError as e:
                row = {"check": f"error: {str(e).splitlines()[0][:160]}", "ok": False}
            failed += not row["ok"]
            print(
                f"| {name} | {row['check']} | {row.get('generate', '')} | {row.get('save/load', '')} "
                f"| {row.get('bytes', '')} |",
                flush=True,
            )
    print(f"\n{len(names) - failed} of {len(names)} recipes pass")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
