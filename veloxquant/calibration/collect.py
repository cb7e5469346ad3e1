"""The keys and values a model writes to its cache over a calibration text (post-RoPE, as the cache sees them)."""

import sys
from typing import Dict, List, Set

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from ..artifacts import QUERY_STRIDE
from ..runtime.make import make_prompt_cache

CHUNK = 512  # tokens per forward pass


def collect(model, ids: List[int], layers: Set[int], progress: bool = True) -> Dict[int, Dict[str, np.ndarray]]:
    """{layer: {"k": [H, N, D], "v": [H, N, D], "q": [Hq, N/4, D]}} float32: keys and values read
    after each chunk (sliding-window layers forget old tokens, so each chunk's own tokens are
    taken as it arrives), and the real queries the model attends with (post-RoPE)."""
    caches = make_prompt_cache(model, "fp16")
    got: Dict[int, Dict[str, list]] = {i: {"k": [], "v": [], "q": []} for i in layers}
    for i in layers:
        caches[i].attend = _recording(caches[i].attend, got[i]["q"])
    x = mx.array(ids)[None]
    for s in tqdm(
        range(0, x.shape[1], CHUNK), desc="calibrate: model pass", unit="chunk", file=sys.stderr, disable=not progress
    ):
        e = min(s + CHUNK, x.shape[1])
        model(x[:, s:e], cache=caches)
        for i in layers:
            k, v = caches[i].tiers[0].decoded(mx.float32)
            for side, arr in (("k", k), ("v", v)):
                got[i][side].append(np.array(arr[0, :, -(e - s) :, :]))
    return {i: {side: np.concatenate(parts, axis=1) for side, parts in d.items()} for i, d in got.items()}


def _recording(attend, into: list):
    """The cache's attend, keeping a copy of every QUERY_STRIDE-th query it answers."""

    def wrapped(queries, scale, mask=None, sinks=None, observe=True):
        into.append(np.array(queries[0, :, ::QUERY_STRIDE].astype(mx.float32)))
        return attend(queries, scale, mask, sinks, observe)

    return wrapped
