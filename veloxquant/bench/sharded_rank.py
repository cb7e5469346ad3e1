"""What each rank of `veloxquant bench sharded` runs (under mlx.launch): a random-init tiny Llama,
unsharded and sharded over the launch's ranks, the same tokens through each recipe's caches on both;
rank 0 writes the measured differences as JSON.

    mlx.launch --backend ring -n 2 python -m veloxquant.bench.sharded_rank OUT.json DIR [RECIPE ...]
"""

import json
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache as mlx_prompt_cache

from ..errors import VeloxError
from ..runtime import make_prompt_cache
from ..runtime.persist import load_prompt_cache, save_prompt_cache
from .e2e import random_llama

SHAPE = dict(layers=2, heads=8, kv_heads=4, head_dim=64, vocab=256)
PROMPT, DECODE, CHUNK = 96, 8, 32
RECIPES = ["fp16", "kivi[window=16,group=16]", "tova[budget=48]", "adakv[budget=48]"]


def models(group):
    mx.random.seed(0)
    full = random_llama(**SHAPE, dtype=mx.float32)
    part = random_llama(**SHAPE, dtype=mx.float32)
    part.load_weights(list(tree_flatten(full.parameters())))
    part.shard(group)
    mx.eval(part.parameters())
    return full, part


def feed(model, tokens, cache, start, end, chunk):
    outs = []
    for s in range(start, end, chunk):
        out = model(tokens[:, s : min(s + chunk, end)], cache=cache)
        mx.eval(out)
        outs.append(out)
    return mx.concatenate(outs, axis=1)


def run(model, tokens, cache):
    return mx.concatenate(
        [feed(model, tokens, cache, 0, PROMPT, CHUNK), feed(model, tokens, cache, PROMPT, PROMPT + DECODE, 1)], axis=1
    )


def caches_for(model, spec):
    name, _, sets = spec.partition("[")
    return make_prompt_cache(model, name, [x for x in sets.rstrip("]").split(",") if x])


def budgets(caches):
    return [list(t.budgets) for c in caches for t in getattr(c, "tiers", ()) if getattr(t, "budgets", None)]


def main(argv):
    out, where, recipes = Path(argv[0]), Path(argv[1]), argv[2:] or RECIPES
    group = mx.distributed.init()
    rank, world = group.rank(), group.size()
    full, part = models(group)
    tokens = mx.random.randint(0, SHAPE["vocab"], (1, PROMPT + DECODE), key=mx.random.key(1))
    rows = []
    started = time.perf_counter()
    a, b = run(full, tokens, mlx_prompt_cache(full)), run(part, tokens, mlx_prompt_cache(part))
    rows.append(
        {
            "recipe": "mlx-lm KVCache",
            "max_diff": float(mx.max(mx.abs(a - b)).item()),
            "seconds": time.perf_counter() - started,
        }
    )
    for recipe in recipes:
        started = time.perf_counter()
        ref_caches, caches = caches_for(full, recipe), caches_for(part, recipe)
        a, b = run(full, tokens, ref_caches), run(part, tokens, caches)
        per = SHAPE["kv_heads"] // world
        equal = [x[rank * per : (rank + 1) * per] for x in budgets(ref_caches)] == budgets(caches)
        row = {
            "recipe": recipe,
            "max_diff": float(mx.max(mx.abs(a - b)).item()),
            "budgets_equal": equal,
            "seconds": time.perf_counter() - started,
        }
        # saved after the prompt, loaded on the same rank of the same world: continues identically
        caches = caches_for(part, recipe)
        feed(part, tokens, caches, 0, PROMPT, CHUNK)
        path = where / f"{recipe.split('[')[0]}.rank{rank}.safetensors"
        save_prompt_cache(str(path), caches)
        loaded, _ = load_prompt_cache(str(path), model=part)
        live = feed(part, tokens, caches, PROMPT, PROMPT + DECODE, 1)
        again = feed(part, tokens, loaded, PROMPT, PROMPT + DECODE, 1)
        row["reload_diff"] = float(mx.max(mx.abs(live - again)).item())
        group.barrier() if hasattr(group, "barrier") else mx.eval(mx.distributed.all_sum(mx.array(1.0)))
        other = where / f"{recipe.split('[')[0]}.rank{(rank + 1) % world}.safetensors"
        try:
            load_prompt_cache(str(other), model=part)
            row["other_rank"] = "loaded (not refused)"
        except VeloxError as e:
            row["other_rank"] = str(e)
        rows.append(row)
    if rank == 0:
        out.write_text(
            json.dumps({"world": world, "shape": SHAPE, "prompt": PROMPT, "decode": DECODE, "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
