"""Logits of every built-in recipe on the default model, as a fixed record to compare against.

    python tests/builtin_logits.py write    # record (run before a refactor)
    python tests/builtin_logits.py write NAME ...   # re-record these recipes only (a change meant to move them)
    python tests/builtin_logits.py check    # compare against the record

A record holds for one OpenBLAS kernel family (float32 sums differ between families: ~2e-3 in
SmolLM2's logits, more once a code flips), so there is one file per family under
tests/data/builtin_logits/, named by `veloxquant.blas.openblas_core()`; both commands run with
OpenBLAS preloaded and on one thread, as the tests do.

Each recipe at its defaults: a 400-token Austen prompt in one prefill, then 4 greedy decode steps
through mlx-lm's ``generate_step``. Recorded per step: the chosen token, the log-sum-exp, and the
logits at 64 fixed token ids and at the step's 8 largest. Calibrated recipes whose artifact is not in
the cache directory are recorded as skipped.
"""

import hashlib
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from veloxquant import blas

RECORDS = Path(__file__).parent / "data" / "builtin_logits"
PROMPT_TOKENS, STEPS = 400, 4
PROBE_IDS = np.random.default_rng(0).choice(49152, size=64, replace=False).tolist()


def builtin_names() -> list[str]:
    return sorted(p.stem for p in (Path(__file__).parents[1] / "recipes").glob("*.yaml"))


def recipe_logits(model, prompt_ids, name) -> dict:
    from mlx_lm.generate import generate_step

    import veloxquant as vq
    from veloxquant.artifacts import CalibrationError

    try:
        caches = vq.make_prompt_cache(model, name)
    except CalibrationError as e:
        return {"skipped": str(e).splitlines()[0]}
    steps = []
    for (token, logprobs), _ in zip(generate_step(mx.array(prompt_ids), model, prompt_cache=caches), range(STEPS)):
        logits = np.array(logprobs.astype(mx.float32))  # log-softmax: logits minus their log-sum-exp
        top = np.argsort(-logits)[:8].tolist()
        steps.append(
            {
                "token": int(token),
                "probe": logits[PROBE_IDS].tolist(),
                "top_ids": top,
                "top": logits[top].tolist(),
                "sha256": hashlib.sha256(logits.tobytes()).hexdigest(),
            }
        )
    vq.uninstall(model)
    return {"steps": steps}


def record_path():
    """This machine's record file (None without OpenBLAS: the bundled BLAS has no record)."""
    core = blas.openblas_core()
    return None if core is None else RECORDS / f"{core}.json"


def load():
    from veloxquant.data import load_text
    from veloxquant.models import load_model

    model, tokenizer = load_model()
    return model, tokenizer.encode(load_text("austen"))[:PROMPT_TOKENS]


def main(argv) -> int:
    blas.maybe_reexec(["record"])
    blas.pin_threads(1)
    path = record_path()
    if path is None:
        print("OpenBLAS is not loaded (apt-get install libopenblas0-pthread): records are per OpenBLAS kernel family")
        return 2
    model, ids = load()
    if argv[:1] == ["write"]:
        names = argv[1:] or builtin_names()
        unknown = sorted(set(names) - set(builtin_names()))
        if unknown:
            print(f"not built-in recipes: {', '.join(unknown)}")
            return 2
        record = json.loads(path.read_text())["recipes"] if argv[1:] and path.exists() else {}
        record.update({name: recipe_logits(model, ids, name) for name in names})
        path.write_text(
            json.dumps(
                {
                    "command": "python tests/builtin_logits.py write",
                    "openblas_core": path.stem,
                    "prompt_tokens": PROMPT_TOKENS,
                    "recipes": dict(sorted(record.items())),
                },
                indent=0,
            )
            + "\n"
        )
        print(f"wrote {path}: {sum('steps' in r for r in record.values())} recipes")
        return 0
    record = json.loads(path.read_text())["recipes"]
    bad = []
    for name in builtin_names():
        got, want = recipe_logits(model, ids, name), record.get(name, {})
        if "steps" in got and "steps" in want:
            same = all(g["sha256"] == w["sha256"] for g, w in zip(got["steps"], want["steps"]))
            print(f"{name}: {'identical' if same else 'DIFFERENT'}")
            bad += [] if same else [name]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
