"""`veloxquant bench e2e --batch N`: one row's measurement with N sequences decoded together
through mlx-lm's BatchGenerator, each with its own caches (veloxquant's batch into one cache per
layer holding N rows, runtime/batch.py; mlx-lm's KVCache into its BatchKVCache).

BatchGenerator prefills the prompts one at a time while the sequences already prefilled decode
between the prefill chunks, so its decode rate over a whole run mixes prefill into the decode
steps, and with short generations the first sequences finish before the last one joins. The
decode rate here is taken only once all N sequences are in the decode batch: every step of it
decodes N rows."""

from typing import Callable, List

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

PREFILL_BATCH = 1  # prompts prefilled one at a time (8 x 32k at once does not fit an H200), decoded together
UNBOUNDED = 1 << 30  # no sequence finishes on its own: the measurement removes them all after `decode` steps


def measure_batch(model, prompt: mx.array, make: Callable[[], List], n: int, decode: int):
    """(prefill tok/s, decode tok/s, peak bytes, cache bytes) over all `n` sequences.

    Prefill: mlx-lm's prompt rate (BatchGenerator.stats) until every sequence decodes. Decode:
    mlx-lm's generation rate over `decode` steps that each decode all `n` rows. Peak: the
    process's. Cache bytes: each sequence's caches as extracted from the batch (its own rows)."""
    prompts = [prompt.tolist()] * n
    caches = [make() for _ in range(n)]
    mx.synchronize()
    mx.reset_peak_memory()
    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=n, prefill_batch_size=PREFILL_BATCH)
    try:
        uids = gen.insert(prompts, [UNBOUNDED] * n, caches=caches)
        decoding = set()
        with gen.stats() as filling:
            while len(decoding) < n:  # until the last prompt is prefilled and joins the decode batch
                decoding.update(r.uid for r in gen.next()[1])
        with gen.stats() as stats:
            for _ in range(decode):
                if len(gen.next_generated()) != n:
                    raise RuntimeError("a sequence left the decode batch during the measurement")
        held = gen.remove(uids, return_prompt_caches=True)
    finally:
        gen.close()
    mx.synchronize()
    cache_bytes = sum(c.nbytes for cache, _ in held.values() for c in cache)
    return filling.prompt_tps, stats.generation_tps, mx.get_peak_memory(), cache_bytes
