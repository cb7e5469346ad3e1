"""What KVzap is fitted on: each token's hidden state at each layer's attention input, and the score our
own kvzip recipe gives it there (its log, per kv head).

The calibration text is cut into segments of SEGMENT tokens (kvpress trains on texts of 750-1,250
tokens: the repeat pass's softmax, hence the score, depends on the context's length). Each segment
is prefilled through fresh kvzip caches while the attention inputs are recorded
(runtime/eviction/hidden.py's watch); kvzip's repeat pass then scores every token it holds (nothing
is evicted before the prompt ends), and SAMPLED tokens of the segment are kept, as kvpress keeps
500 of each text (on a sliding-window layer, those of them the layer still holds: its window).
"""

import sys
from typing import Dict, List, Set

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from ..errors import VeloxError
from ..runtime.eviction import model_pass
from ..runtime.eviction.hidden import tapped
from ..runtime.make import make_prompt_cache

SEGMENT = 1024  # tokens per kvzip run
SAMPLED = 512  # tokens of each segment kept (seeded)
CHUNK = 512  # prefill tokens per forward pass
FLOOR = 1e-12  # a score of exactly 0 (never attended) is logged as this


def collect_targets(
    model, tokenizer, ids: List[int], layers: Set[int], progress: bool = True
) -> Dict[int, Dict[str, np.ndarray]]:
    """{layer: {"h": [N, D] hidden states, "s": [N, H] log kvzip scores}} float32."""
    if len(ids) < SEGMENT:
        raise VeloxError(f"kvzap calibrates on segments of {SEGMENT} tokens; {len(ids)} tokens make none")
    rng = np.random.default_rng(0)
    got: Dict[int, Dict[str, list]] = {i: {"h": [], "s": []} for i in layers}
    heard: Dict[int, list] = {}
    listening = [False]

    def record(cache, x):
        if listening[0]:
            heard.setdefault(id(cache), []).append(x)

    with tapped(model, record):
        starts = range(0, len(ids) - SEGMENT + 1, SEGMENT)
        for s in tqdm(starts, desc="calibrate: kvzip scores", unit="segment", file=sys.stderr, disable=not progress):
            x = mx.array(ids[s : s + SEGMENT])[None]
            caches = make_prompt_cache(model, "kvzip", [f"budget={SEGMENT // 2}"], tokenizer=tokenizer)
            heard.clear()
            listening[0] = True
            for p in range(0, SEGMENT, CHUNK):
                model(x[:, p : p + CHUNK], cache=caches)
                mx.eval([c.state for c in caches])
            listening[0] = False
            model_pass.run(caches[0].coordinator, ending=False)
            keep = np.sort(rng.choice(SEGMENT, SAMPLED, replace=False))
            for i in layers:
                tier = caches[i].tiers[0]
                hidden = np.array(mx.concatenate(heard[id(caches[i])], axis=1)[0].astype(mx.float32))
                # [SEGMENT, H] by position; a sliding-window layer holds only its window (the rest stay NaN)
                pos, scores = np.array(tier.positions[0]), np.array(mx.log(mx.maximum(tier.scores[0], FLOOR)))
                dense = np.full((SEGMENT, pos.shape[0]), np.nan, np.float32)
                dense[pos, np.arange(pos.shape[0])[:, None]] = scores
                rows = keep[np.isfinite(dense[keep]).all(axis=1)]
                got[i]["h"].append(hidden[rows])
                got[i]["s"].append(dense[rows])
    return {i: {k: np.concatenate(v) for k, v in d.items()} for i, d in got.items()}
