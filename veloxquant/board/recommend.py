"""`veloxquant recommend`: the best measured recipe whose bytes fit, at your context, on your model's shape.

Bytes come from each candidate's own plan at that context (board/predict.py);
quality from the leaderboard files (ΔPPL, KLD, top-1 and passkey measured on
the model and protocol each file names). Candidates are the rows of the
board measured on the asked model when there is one, else of every board,
and the answer says which model the quality was measured on. `--check` runs
the recommended recipe on the model over the asked context of a corpus and
compares the bytes its caches hold with the prediction.
"""

import re
import time
from typing import Dict, List, Optional, Sequence

import mlx.core as mx

from ..compiler.shape import ModelShape
from ..errors import VeloxError
from ..eval.cost import held_bytes
from ..eval.feed import prefill
from ..eval.rows import parse_row
from ..runtime import uninstall
from . import choosing, predict

CHECK_TOLERANCE = 0.02  # measured bytes within 2% of the prediction

_SIZE = re.compile(r"^\s*(?P<n>\d+(?:\.\d+)?)\s*(?P<unit>[KMGT]i?B?|B)?\s*$", re.I)


def parse_size(text: str) -> int:
    """'1GB', '512MiB', '8G', '1.5e9' -> bytes (decimal K/M/G/T, binary Ki/Mi/Gi/Ti)."""
    m = _SIZE.match(text)
    if not m:
        try:
            return int(float(text))
        except ValueError:
            raise VeloxError(f"--memory: expected a size such as 1GB, 512MiB or 8G, got {text!r}") from None
    unit = (m["unit"] or "B").upper().rstrip("B") or "B"
    scale = {"B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
    return int(float(m["n"]) * scale[unit])


def parse_shape(text: str) -> ModelShape:
    """'32x8x128' (layers x kv heads x head_dim) -> a uniform shape."""
    try:
        layers, heads, dim = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise VeloxError(f"--shape: expected LAYERSxKV_HEADSxHEAD_DIM such as 32x8x128, got {text!r}") from None
    return ModelShape.uniform(f"shape {text}", layers, heads, dim)


def candidates(boards: Sequence[Dict], model: Optional[str]) -> List[Dict]:
    own = [b for b in boards if model and b.get("model") == model]
    rows = []
    for b in own or boards:
        for r in choosing.measured(b):
            rows.append(
                {**r, "measured_on": b["model"], "protocol_name": b.get("protocol_name"), "source": b.get("source")}
            )
    return rows


def recommend(
    boards: Sequence[Dict],
    shape: ModelShape,
    context: int,
    memory: Optional[int] = None,
    ratio: Optional[float] = None,
    max_dppl: Optional[float] = None,
    model: Optional[str] = None,
) -> Dict:
    if (memory is None) == (ratio is None):
        raise VeloxError("recommend: give exactly one of --memory SIZE or --ratio R")
    if context < 1:
        raise VeloxError("--context must be at least 1 token")
    fp16 = predict.fp16_bytes(shape, context)
    budget = memory if memory is not None else ratio * fp16
    scored, unknown, refused = [], [], []
    for r in candidates(boards, model):
        row = parse_row(r["spec"])
        try:
            held = predict.held_bytes(row.ref, row.sets, shape, context) if row.kind == "recipe" else None
        except VeloxError as e:  # the recipe does not compile for this shape (e.g. no RoPE settings to undo)
            refused.append((r["spec"], str(e).splitlines()[0]))
            continue
        if held is None:
            unknown.append(r["spec"])
            continue
        if held <= budget and (max_dppl is None or r["delta_ppl_pct"] <= max_dppl):
            scored.append((r["delta_ppl_pct"], (r.get("divergence") or {}).get("kld_mean") or 0, held, r))
    scored.sort(key=lambda t: t[:3])
    pick = scored[0] if scored else None
    return {
        "context": context,
        "budget_bytes": budget,
        "fp16_bytes": fp16,
        "shape": shape.name,
        "fits": len(scored),
        "unpredicted": unknown,
        "refused": refused,
        "choice": None if pick is None else {**pick[3], "predicted_bytes": pick[2]},
        "runners_up": [{**t[3], "predicted_bytes": t[2]} for t in scored[1:4]],
    }


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def render(answer: Dict, model_arg: Optional[str]) -> str:
    head = (
        f"context {answer['context']:,} tokens on {answer['shape']}: fp16 cache {_gb(answer['fp16_bytes'])}, "
        f"budget {_gb(answer['budget_bytes'])} ({answer['budget_bytes'] / answer['fp16_bytes']:.3f} of fp16)"
    )
    c = answer["choice"]
    if c is None:
        return (
            f"{head}\nno measured recipe fits this budget and quality bound ({len(answer['unpredicted'])} "
            f"rows have no byte accounting at this context).\nTry `veloxquant tune` to search settings "
            f"for this budget, or measure more rows with `veloxquant leaderboard`.\n"
        )
    d = c.get("divergence") or {}
    pk = (c.get("passkey") or {}).get("accuracy")
    model = f" --model {model_arg}" if model_arg else ""
    spec = c["spec"]
    recipe, sets = (spec.split("[")[0], spec[spec.index("[") + 1 : -1].split(",")) if "[" in spec else (spec, [])
    flags = "".join(f" --set {s}" for s in sets)
    lines = [
        head,
        f"recommended: {spec}  ({c['family']}, {c['setting']})",
        f"  held at this context: {_gb(c['predicted_bytes'])} "
        f"({c['predicted_bytes'] / answer['fp16_bytes']:.3f} of fp16; from the recipe's plan)",
        f"  measured on {c['measured_on']} (protocol {c['protocol_name']}): ΔPPL {c['delta_ppl_pct']:+.2f}%, "
        f"KLD {d.get('kld_mean', float('nan')):.4f}, top-1 {d.get('top1_agreement', float('nan')):.3f}"
        + (f", passkey {pk:.2f}" if pk is not None else ""),
        f"  run:   veloxquant run {recipe}{model}{flags}",
        f"  serve: veloxquant serve {recipe}{model}{flags}",
    ]
    if answer["refused"]:
        spec, why = answer["refused"][0]
        more = f" and {len(answer['refused']) - 1} more" if len(answer["refused"]) > 1 else ""
        lines.append(f"  not for this shape: {spec}{more} ({why})")
    if answer["runners_up"]:
        lines.append(
            "  also fit: " + ", ".join(f"{r['spec']} ({r['delta_ppl_pct']:+.2f}%)" for r in answer["runners_up"])
        )
    return "\n".join(lines) + "\n"


def check(model, tokenizer, text: str, answer: Dict, chunk: int = 512) -> Dict:
    """Run the recommended recipe on `model` over `answer["context"]` tokens of `text` (repeated if
    shorter), as a prompt fed in `chunk`-token blocks, and measure what its caches hold."""
    choice = answer["choice"]
    ids = tokenizer.encode(text)
    if not ids:
        raise VeloxError("--check: the corpus has no tokens")
    context = answer["context"]
    tokens = mx.array((ids * (context // len(ids) + 1))[:context])[None]
    row = parse_row(choice["spec"])
    caches = row.make(model)
    start = time.perf_counter()
    try:
        prefill(model, tokens, caches, chunk)
        measured = held_bytes(caches)
    finally:
        uninstall(model)
    ratio = measured / choice["predicted_bytes"]
    return {
        "measured_bytes": measured,
        "ratio": ratio,
        "within": abs(ratio - 1) <= CHECK_TOLERANCE,
        "seconds": time.perf_counter() - start,
    }


def render_check(got: Dict, answer: Dict) -> str:
    verdict = "within" if got["within"] else "OUTSIDE"
    return (
        f"  checked: {answer['choice']['spec']} holds {_gb(got['measured_bytes'])} after {answer['context']:,} "
        f"tokens, {got['ratio']:.4f} of the prediction ({verdict} {CHECK_TOLERANCE:.0%}; {got['seconds']:.0f} s)\n"
    )
