"""The path one decode token takes through veloxquant in one layer: files entered and calls made.

    python -m benchmarks.call_path --recipe kivi --context 300

A random-init Llama (2 layers, 4/2 heads, head dim 64) is prefilled with `--context` tokens
through the attention hook, then one token is decoded under `sys.setprofile`. For the layer
given (`--layer`, default 0) it records every call into a veloxquant module between the layer's
`update_and_fetch` and the end of its attention, and reports: the files entered (in order),
the calls per file, and the re-entries: calls into a file the path had already left (A → B → A,
counted where B called back into A, or a later call went back to a file left before). Of those,
the call-backs: calls into a file that is still on the call stack below the caller (B, called
from A, calls A). mlx-lm enters the cache twice per layer (`update_and_fetch`, then attention
through the hook), so a file both halves use is re-entered without any call-back.
"""

import argparse
import sys
from collections import Counter
from pathlib import Path

import mlx.core as mx

import veloxquant
from veloxquant.bench.e2e import random_model

PACKAGE = str(Path(veloxquant.__file__).parent)


def trace_step(model, caches, token: mx.array, layer: int) -> list:
    """(file, function, caller file) of every veloxquant call made for `layer` in one decode step."""
    target = caches[layer]
    events, state = [], {"on": False, "attend": None}

    def profile(frame, event, arg):
        if event == "return" and frame is state["attend"]:
            state["on"] = False  # this layer's attention is answered
            return
        if event != "call" or not frame.f_code.co_filename.startswith(PACKAGE):
            return
        name, owner = frame.f_code.co_name, frame.f_locals.get("self")
        if owner is target and name == "update_and_fetch":
            state["on"] = True
        if owner is target and name == "attend":
            state["attend"] = frame
        if state["on"]:
            caller = frame.f_back.f_code.co_filename if frame.f_back else ""
            back = _calls_back(frame) if caller != frame.f_code.co_filename else False
            events.append((_rel(frame.f_code.co_filename), name, _rel(caller), back))

    sys.setprofile(profile)
    try:
        out = model(token, cache=caches)
    finally:
        sys.setprofile(None)
    mx.eval(out)
    return events


def _calls_back(frame) -> bool:
    """The called file has a frame below its caller on the stack (within veloxquant)."""
    path, up = frame.f_code.co_filename, frame.f_back.f_back if frame.f_back else None
    while up is not None and up.f_code.co_filename.startswith(PACKAGE):
        if up.f_code.co_filename == path:
            return True
        up = up.f_back
    return False


def _rel(path: str) -> str:
    return path[len(PACKAGE) + 1 :] if path.startswith(PACKAGE) else "(outside)"


def reentries(events: list) -> int:
    """Calls that enter a file the path had entered and then left for another file before."""
    left, count, current = set(), 0, None
    for path, _, caller, _ in events:
        if path != caller and path in left:
            count += 1
        if current is not None and path != current:
            left.add(current)
        current = path
    return count


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="kivi")
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--calls", action="store_true", help="list every call")
    args = ap.parse_args(argv)
    mx.random.seed(0)
    model, _ = random_model("llama", (2, 4, 2, 64, 256, mx.float32, 0, 0))
    caches = veloxquant.make_prompt_cache(model, args.recipe, sets=args.sets)
    prompt = mx.random.randint(0, 256, (1, args.context))
    mx.eval(model(prompt, cache=caches))
    for _ in range(2):  # the prompt ends at the first single token; the second is an ordinary step
        mx.eval(model(mx.array([[1]]), cache=caches))
    events = trace_step(model, caches, mx.array([[2]]), args.layer)
    files = list(dict.fromkeys(p for p, *_ in events))
    per_file = Counter(p for p, *_ in events)
    backs = sum(back for *_, back in events)
    print(f"{args.recipe} {' '.join(args.sets)}: one decode token at {args.context}, layer {args.layer}")
    print("| files | calls | re-entries | call-backs |\n|---|---|---|---|")
    print(f"| {len(files)} | {len(events)} | {reentries(events)} | {backs} |")
    for f in files:
        print(f"  {per_file[f]:3d}  {f}")
    if args.calls:
        for path, name, caller, back in events:
            print(f"    {path}:{name}  <- {caller}{'  (call-back)' if back else ''}")
    veloxquant.uninstall(model)


if __name__ == "__main__":
    main()
