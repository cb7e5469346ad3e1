"""Long generation: memory and decode speed over tens of thousands of tokens.

    veloxquant bench long-generation --tokens 20000 --recipes identity,streaming_llm,h2o,tova,snapkv,kivi

A random-init Llama (no weights needed) generates `--tokens` tokens greedily
after a short prompt, through mlx-lm's generate_step, under mlx-lm's KVCache and
each recipe. Per window of `--window` tokens it records decode tok/s, the
cache's bytes (`nbytes`: arrays really held) and MLX's active memory; the table
gives the first and the last window. Bounded recipes must hold flat bytes; exact
recipes (`identity`: float32 K/V as the model computes them) must generate
mlx-lm's KVCache's tokens, checked over the whole run.
"""

import argparse
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache as mlx_prompt_cache

from ..runtime import make_prompt_cache, uninstall
from .e2e import random_llama
from .registry import bench

EXACT = {"identity": "veloxquant: 1\nname: identity\nsummary: float K/V as computed\npipeline: identity\n"}


def _recipe(name: str, folder: Path) -> str:
    if name not in EXACT:
        return name
    path = folder / f"{name}.yaml"
    path.write_text(EXACT[name])
    return str(path)


def generate(model, prompt: mx.array, cache, tokens: int, window: int) -> Dict:
    """Tokens generated and per-window (tok/s, cache bytes, active memory)."""
    out: List[int] = []
    windows = []
    mx.synchronize()
    start = time.perf_counter()
    for n, (tok, _) in enumerate(generate_step(prompt, model, max_tokens=tokens, prompt_cache=cache), 1):
        out.append(int(tok))
        if n % window == 0:
            mx.synchronize()
            now = time.perf_counter()
            windows.append((window / (now - start), sum(c.nbytes for c in cache), mx.get_active_memory()))
            start = time.perf_counter()  # the nbytes sum above is not decode time
    return {"tokens": out, "windows": windows}


@bench("long-generation", "memory and decode speed over tens of thousands of generated tokens")
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="veloxquant bench long-generation", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--window", type=int, default=1000)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", default="4/2", help="query heads / kv heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--recipes", default="identity,streaming_llm,h2o,tova,snapkv,kivi")
    args = ap.parse_args(argv)
    heads, kv_heads = map(int, args.heads.split("/"))
    mx.random.seed(0)
    model = random_llama(args.layers, heads, kv_heads, args.head_dim, args.vocab, getattr(mx, args.dtype))
    prompt = mx.random.randint(0, args.vocab, (args.prompt,), key=mx.random.key(1))
    folder = Path(tempfile.mkdtemp())
    rows = {"mlx-lm KVCache": generate(model, prompt, mlx_prompt_cache(model), args.tokens, args.window)}
    for name in args.recipes.split(","):
        rows[name] = generate(model, prompt, make_prompt_cache(model, _recipe(name, folder)), args.tokens, args.window)
        uninstall(model)
    ref = rows["mlx-lm KVCache"]["tokens"]
    print(
        f"{args.tokens} tokens after a {args.prompt}-token prompt; random Llama {args.layers} layers, heads "
        f"{args.heads}, head_dim {args.head_dim}, {args.dtype}; windows of {args.window} tokens\n"
    )
    print(
        "| cache | tok/s first | tok/s last | cache MB first | cache MB last | active MB first | active MB last "
        "| tokens equal to KVCache |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, row in rows.items():
        (s0, b0, a0), (s1, b1, a1) = row["windows"][0], row["windows"][-1]
        same = next((i for i, (a, b) in enumerate(zip(row["tokens"], ref)) if a != b), None)
        equal = "all" if same is None else f"first {same}"
        print(
            f"| {name} | {s0:.0f} | {s1:.0f} | {b0 / 2**20:.2f} | {b1 / 2**20:.2f} | {a0 / 2**20:.1f} | "
            f"{a1 / 2**20:.1f} | {equal} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
