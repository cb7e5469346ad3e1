"""What KVzap is fitted on: each token's hidden state at each layer's attention input, and the score our
own kvzip recipe gives it there (its log, per kv head).

The calibration text is cut into segments of SEGMENT tokens (kvpress trains on texts of 750-1,250
tokens: the repeat pass's softmax, hence the score, depends on the context's length). Each segment
is prefilled through fresh kvzip caches while the attention inputs are recorded
(runtime/eviction/hidden.py's watch); kvzip's repeat pass then scores every token it holds (nothing
is evicted before the prompt ends), and SAMPLED tokens of the segment are kept, as kvpress keeps
500 of each text.
"""

import sys
from typing import Dict, List, Set

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from ..errors import VeloxError
from ..runtime.eviction import model_pass
from ..runtime.eviction.call_watch import CallWatch
from ..runtime.eviction.hidden import attention_modules
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
    watch, heard = CallWatch(), {}
    listening = [False]

    def observe(arg, args, kwargs):
        if listening[0]:
            heard.setdefault(id(arg("cache")), []).append(args[0] if args else arg("x"))

    for module in attention_modules(model):
        watch.install(module, observe)
    try:
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
                hidden = mx.concatenate(heard[id(caches[i])], axis=1)[0].astype(mx.float32)
                scores = mx.log(mx.maximum(tier.scores[0], FLOOR)).T  # [L, H], positions 0.. in order
                got[i]["h"].append(np.array(hidden)[keep])
                got[i]["s"].append(np.array(scores)[keep])
    finally:
        for module in attention_modules(model):
            watch.uninstall(module)
    return {i: {k: np.concatenate(v) for k, v in d.items()} for i, d in got.items()}
