"""`veloxquant leaderboard`: every built-in on one protocol, one JSON per model.

Rows run one after another in one process, each as an evaluation of that row
beside fp16 (fp16 measured once, first, and its reference distributions
reused), so decode tok/s ÷ fp16 compares rows of the same process. After each
row the file is rewritten (`partial: true` until the last), so an interrupted
run resumes where it stopped. Calibrated recipes are calibrated first when
their artifact is missing; the row records the fit's seconds.
"""

import importlib.metadata
import json
import platform
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from .. import artifacts as artifact
from ..calibration.fit import calibrate
from ..compiler import ModelShape, compile_recipe
from ..compiler.binding import calibrated_stages, key_for
from ..errors import VeloxError
from ..eval.rows import Row, parse_row
from ..eval.run import evaluate
from ..recipe import load_recipe
from ..runtime import uninstall
from . import protocol

SCHEMA = 1
PACKAGES = ("veloxquant", "mlx", "mlx-lm", "numpy")


def versions() -> Dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    found["python"] = platform.python_version()
    return found


def default_path(model_name: str, protocol_name: str) -> Path:
    return Path("results") / f"leaderboard-{model_name}-{protocol_name}.json"


def load_partial(path: Path) -> Optional[Dict]:
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if data.get("veloxquant_leaderboard") != SCHEMA:
        raise VeloxError(f"{path}: not a leaderboard file (schema {SCHEMA}); move it or pass another --out")
    return data


def _needs_fit(model, spec: str, model_name: str) -> bool:
    row = parse_row(spec)
    if row.kind != "recipe":
        return False
    try:
        plan = compile_recipe(load_recipe(row.ref), ModelShape.from_model(model, model_name), row.sets)
    except VeloxError:
        return False  # the row itself reports the error
    return bool(calibrated_stages(plan)) and not artifact.find(key_for(plan, model))


def _calibrate(model, tokenizer, row: Row, model_name: str) -> Optional[Dict]:
    """Fit the row's calibrated stages if their artifact is missing; what the fit took."""
    if row.kind != "recipe":
        return None
    plan = compile_recipe(load_recipe(row.ref), ModelShape.from_model(model, model_name), row.sets)
    if not calibrated_stages(plan):
        return None
    found = artifact.find(key_for(plan, model))
    if found:
        return {"seconds": found.get("seconds"), "fitted_now": False}
    meta = calibrate(plan, model, tokenizer, progress=False, model_name=model_name)
    return {"seconds": meta.get("seconds"), "fitted_now": True}


def _annotate(r: Dict, spec: str, fam: str, setting: str, fp16: Dict, wall: float, calib) -> Dict:
    c = r["cost"]
    base_ppl, base_dec = fp16.get("ppl"), fp16["cost"].get("decode_tok_s")
    r.update(spec=spec, family=fam, setting=setting, wall_s=wall, calibration=calib)
    r["delta_ppl_pct"] = 100 * (r["ppl"] / base_ppl - 1) if base_ppl and r.get("ppl") else None
    r["held_ratio"] = c.get("ratio")  # resident bytes / fp16 bytes at the window's end
    r["bits_per_element"] = 16 * c["ratio"] if c.get("ratio") else None
    dec = c.get("decode_tok_s")
    r["decode_vs_fp16"] = dec / base_dec if dec and base_dec else None
    return r


def run(
    model,
    tokenizer,
    model_name: str,
    text: str,
    corpus: str,
    protocol_name: str,
    out: Path,
    only: List[str] = (),
    limit: Optional[int] = None,
    command: str = "",
    progress: bool = True,
) -> Dict:
    """Measure every leaderboard row not yet in `out`; rewrite `out` after each."""
    if protocol_name not in protocol.PROTOCOLS:
        raise VeloxError(f"--protocol: one of {', '.join(protocol.PROTOCOLS)}, not {protocol_name!r}")
    cfg = protocol.PROTOCOLS[protocol_name]
    wanted = protocol.rows(protocol.context(cfg), only, ModelShape.from_model(model, model_name))
    board = load_partial(out) or {}
    if board and (board.get("model"), board.get("protocol_name")) != (model_name, protocol_name):
        raise VeloxError(
            f"{out}: holds {board.get('model')} / {board.get('protocol_name')}, not "
            f"{model_name} / {protocol_name}; pass another --out"
        )
    done = {r["spec"]: r for r in board.get("rows", [])}
    todo = [w for w in wanted if w[0] not in done]
    # Rows that must fit calibration first go last: a run cut short measures the most rows.
    todo = sorted(todo, key=lambda w: _needs_fit(model, w[0], model_name))[:limit]
    refs: Dict = {}
    fp16_row = parse_row("fp16")
    started = time.perf_counter()
    base = evaluate(model, tokenizer, [fp16_row], text, cfg, progress=False, references=refs)
    fp16 = _annotate(
        base["rows"][0], "fp16", "baseline", "defaults", base["rows"][0], time.perf_counter() - started, None
    )
    board = {
        "veloxquant_leaderboard": SCHEMA,
        "veloxquant_eval": base["veloxquant_eval"],
        "model": model_name,
        "corpus": corpus,
        "command": command,
        "protocol_name": protocol_name,
        "context": protocol.context(cfg),
        "versions": versions(),
        **{k: base[k] for k in ("model_shape", "dtype", "device", "platform", "protocol")},
        "fp16_this_process": fp16,
        # --only measures some rows: the board keeps every other row it holds (a full run, the protocol's)
        "rows": [fp16]
        + ([r for s, r in done.items() if s != "fp16"] if only else [done[s] for s, _, _ in wanted if s in done]),
    }

    def save(partial: bool):
        board["partial"] = partial
        board["wall_s"] = sum(r.get("wall_s") or 0 for r in board["rows"])
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(board, indent=1) + "\n")
        tmp.replace(out)

    for i, (spec, fam, setting) in enumerate(todo):
        if progress:
            print(
                f"[{i + 1}/{len(todo)}] {spec} ({len(board['rows'])}/{len(wanted) + 1} rows in {out})",
                file=sys.stderr,
                flush=True,
            )
        row = parse_row(spec)
        t0 = time.perf_counter()
        try:
            calib = _calibrate(model, tokenizer, row, model_name)
        except VeloxError as e:
            calib = {"error": str(e).splitlines()[0][:200]}
        uninstall(model)
        t1 = time.perf_counter()
        res = evaluate(model, tokenizer, [fp16_row, row], text, cfg, progress=False, only=[spec], references=refs)
        r = _annotate(res["rows"][0], spec, fam, setting, fp16, time.perf_counter() - t1, calib)
        r["calibration_wall_s"] = t1 - t0
        board["rows"].append(r)
        save(partial=True)
    save(partial=len(board["rows"]) < len(wanted) + 1)
    return board
