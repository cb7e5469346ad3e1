"""`veloxquant bench e2e --batch N`: one row's measurement with N sequences decoded together
through mlx-lm's BatchGenerator, each with its own caches (veloxquant's batch into one cache per
layer holding N rows, runtime/batch.py; mlx-lm's KVCache into its BatchKVCache)."""

from typing import Callable, List

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

PREFILL_BATCH = 1  # prompts prefilled one at a time (8 x 32k at once does not fit an H200), decoded together


def measure_batch(model, prompt: mx.array, make: Callable[[], List], n: int, decode: int):
    """(prefill tok/s, decode tok/s, peak bytes, cache bytes) over all `n` sequences: mlx-lm's own
    aggregate rates (BatchGenerator.stats), the process's peak, and the finished caches' bytes
    (each sequence's caches as extracted from the batch: its own rows)."""
    prompts = [prompt.tolist()] * n
    caches = [make() for _ in range(n)]
    mx.synchronize()
    mx.reset_peak_memory()
    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=n, prefill_batch_size=PREFILL_BATCH)
    try:
        uids = gen.insert(prompts, [decode] * n, caches=caches)
        finished = {}
        with gen.stats() as stats:
            while responses := gen.next_generated():
                finished.update({r.uid: r.prompt_cache for r in responses if r.finish_reason is not None})
    finally:
        gen.close()
    mx.synchronize()
    cache_bytes = sum(c.nbytes for u in uids for c in finished.get(u) or ())
    return stats.prompt_tps, stats.generation_tps, mx.get_peak_memory(), cache_bytes
