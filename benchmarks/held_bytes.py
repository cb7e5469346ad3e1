"""What a cache keeps alive after a chunked feed: `nbytes` against every array reachable from it.

    python -m benchmarks.held_bytes fp16 polarquant qjl --float32

Issue 35's scoring feed: a --prefix-token Austen prompt in chunks of --prefill-chunk, then --tokens more
in chunks of --chunk (a scored continuation), on SmolLM2 (cast to float32 with --float32). Per recipe it
prints `nbytes` and the bytes of every distinct storage reachable from the caches' attributes (mx and
numpy arrays; `reachable_bytes`, the walk tests/test_chunk_invariance.py checks against `nbytes`) after
the prefix and at the end, and the same tokens fed as one block and one decode step.
"""

import argparse
import sys

import mlx.core as mx
import numpy as np

import veloxquant
from veloxquant.data.corpus import austen_text
from veloxquant.models import load_model


def _storage(a):
    """The byte span [start, end) of an evaluated mx array's or a numpy array's storage (a slice shares
    its base's)."""
    if isinstance(a, np.ndarray):
        while isinstance(a.base, np.ndarray):  # a numpy view keeps its whole base alive
            a = a.base
    view = a if isinstance(a, np.ndarray) else np.asarray(memoryview(a))
    if view.size == 0:
        return None
    start = view.__array_interface__["data"][0]
    span = sum((n - 1) * abs(s) for n, s in zip(view.shape, view.strides)) + view.itemsize
    return start, start + span


def reachable_bytes(roots) -> int:
    """Bytes of every distinct storage reachable from the roots' attributes (recursively): mx arrays
    and host (numpy) arrays alike."""
    spans, stack, visited = [], list(roots), set()
    while stack:
        o = stack.pop()
        if isinstance(o, (mx.array, np.ndarray)):
            if isinstance(o, mx.array):
                mx.eval(o)
            s = _storage(o)
            if s is not None:
                spans.append(s)
            continue
        if isinstance(o, (str, bytes, int, float, bool, type(None))) or id(o) in visited:
            continue
        visited.add(id(o))
        if isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(o)
        elif type(o).__module__.startswith("veloxquant"):
            stack.extend(getattr(o, "__dict__", {}).values())
            stack.extend(getattr(o, s) for s in getattr(type(o), "__slots__", ()) if hasattr(o, s))
    total, end = 0, 0
    for a, b in sorted(spans):  # the union of the spans
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _held(caches):
    return sum(c.nbytes for c in caches) / 1e6, reachable_bytes(caches) / 1e6


def _fed(model, recipe, ids, blocks):
    caches, at = veloxquant.make_prompt_cache(model, recipe), 0
    for n in blocks:
        mx.eval(model(ids[:, at : at + n], cache=caches))
        at += n
    return caches


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipes", nargs="*", default=["fp16", "polarquant", "qjl"])
    p.add_argument("--prefix", type=int, default=1536)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--chunk", type=int, default=32)
    p.add_argument("--float32", action="store_true", help="cast the model to float32 (the issue's CPU run)")
    a = p.parse_args(argv)
    model, tok = load_model()
    if a.float32:
        model.set_dtype(mx.float32)
    total = a.prefix + a.tokens
    ids = mx.array(tok.encode(austen_text())[:total])[None]
    print(f"{total} tokens: {a.prefix} in chunks of {a.prefill_chunk}, then {a.tokens} in chunks of {a.chunk}")
    print("| recipe | prefix nbytes MB | reachable | end nbytes MB | reachable | block + 1 nbytes MB | reachable |")
    print("|---|---|---|---|---|---|---|")
    for r in a.recipes:
        caches = _fed(model, r, ids, [a.prefill_chunk] * (a.prefix // a.prefill_chunk))
        prefix = _held(caches)
        at = a.prefix // a.prefill_chunk * a.prefill_chunk
        for s in range(at, total, a.chunk):
            mx.eval(model(ids[:, s : s + a.chunk], cache=caches))
        block = _held(_fed(model, r, ids, [total - 1, 1]))
        cells = " | ".join(f"{x:.2f}" for x in (*prefix, *_held(caches), *block))
        print(f"| {r} | {cells} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
