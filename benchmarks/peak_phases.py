"""Where a recipe's peak memory happens on a long prompt: per prefill chunk, first decode step, decode.

    python -m benchmarks.peak_phases fp16 observed_attention 'h2o[slack=32]' --tokens 8192

Feeds `--tokens` Austen tokens in four equal chunks (each followed by an
evaluation of the caches' state, as mlx-lm's prefill does), then one decode
step (where prompt-time eviction decides) and 16 more. Prints MLX's peak
memory over what was allocated when the caches were made, for each phase
(MiB), and the bytes the caches hold at the end. Each recipe runs twice and
the second run is printed: on CUDA the first run also pays kernel compilation.
"""

import argparse

import mlx.core as mx

from veloxquant.data import load_text
from veloxquant.eval.rows import spec_caches
from veloxquant.models import load_model
from veloxquant.runtime import uninstall

MiB = 2**20
PHASES = ("chunk 1", "chunk 2", "chunk 3", "chunk 4", "first decode", "16 decode")


def phases(model, prompt: mx.array, spec: str):
    caches = spec_caches(model, spec)
    mx.synchronize()
    mx.clear_cache()
    start = mx.get_active_memory()
    cols, chunk = [], prompt.shape[1] // 4

    def phase(run):
        mx.reset_peak_memory()
        out = run()
        mx.synchronize()
        cols.append((mx.get_peak_memory() - start) / MiB)
        return out

    def prefill(i):
        model(prompt[:, i * chunk : (i + 1) * chunk], cache=caches)
        mx.eval([c.state for c in caches])

    def decode(y, steps):
        for _ in range(steps):
            y = mx.argmax(model(y, cache=caches)[:, -1:], axis=-1)
            mx.eval(y)
        return y

    for i in range(4):
        phase(lambda: prefill(i))
    y = phase(lambda: decode(prompt[:, -1:], 1))  # prompt-time eviction decides here
    phase(lambda: decode(y, 16))
    held = sum(c.nbytes for c in caches) / MiB
    uninstall(model)
    caches = None  # frees them before the next run (not `del`: prefill and decode above close over the name)
    mx.clear_cache()
    return cols, held


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.peak_phases", description=__doc__.splitlines()[0])
    ap.add_argument("recipes", nargs="+")
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args(argv)
    model, tokenizer = load_model(args.model, progress=False)
    prompt = mx.array(tokenizer.encode(load_text("austen"))[: args.tokens])[None]
    print(
        f"{prompt.shape[1]}-token prompt in 4 chunks; peak MiB over the start of each recipe; "
        f"device {mx.default_device()}\n"
    )
    print("| recipe | " + " | ".join(PHASES) + " | cache MiB |")
    print("|---" * (len(PHASES) + 2) + "|")
    for spec in args.recipes:
        phases(model, prompt, spec)  # warm: first-use compilation is no phase's cost
        cols, held = phases(model, prompt, spec)
        print(f"| {spec} | " + " | ".join(f"{c:,.0f}" for c in cols) + f" | {held:,.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
