"""`veloxquant eval ... --ray [ADDRESS]`: one evaluation split into Ray tasks, one per row.

Task 0 measures the fp16 baseline; task i measures row i, with fp16 driving
its fidelity pass exactly as in a serial run (evaluate(..., only=[row])). Each
row's perplexity, passkey answers, fidelity and held bytes depend only on the
row, the model and the fixed windows and prompts, so the merged result equals
a serial run's; wall times, tok/s and peak memory are per task.
"""

import time
from typing import Dict, List, Optional, Sequence

from ..pool import load_cached, run_all
from .rows import Row
from .run import evaluate


def evaluate_task(model_ref: Optional[str], rows: Sequence[Row], only: str, text: str, cfg, meta) -> Dict:
    model, tokenizer = load_cached(model_ref)
    return evaluate(model, tokenizer, list(rows), text, cfg, meta, progress=False, only=[only])


def evaluate_distributed(
    model_ref: Optional[str], rows: List[Row], text: str, cfg, meta: Dict, ray: str = "", progress: bool = True
) -> Dict:
    import sys

    from tqdm import tqdm

    started = time.perf_counter()
    calls = [(model_ref, [rows[0]], rows[0].name, text, cfg, meta)]
    calls += [(model_ref, [rows[0], row], row.name, text, cfg, meta) for row in rows[1:]]
    results: Dict[int, Dict] = {}
    with tqdm(total=len(calls), desc="eval (ray tasks)", unit="row", file=sys.stderr, disable=not progress) as bar:
        for i, result in run_all(evaluate_task, calls, ray):
            results[i] = result
            bar.update(1)
    merged = dict(results[0])
    merged["rows"] = [results[i]["rows"][0] for i in range(len(calls))]
    base = merged["rows"][0]["ppl"]
    for r in merged["rows"]:
        r["delta_ppl_pct"] = 100 * (r["ppl"] / base - 1) if base and r["ppl"] else None
    merged["wall_s"] = time.perf_counter() - started
    merged["ray"] = {"tasks": len(calls), "task_wall_s": [results[i]["wall_s"] for i in range(len(calls))]}
    return merged
