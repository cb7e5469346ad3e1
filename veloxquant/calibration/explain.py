"""`explain` lines for calibrated stages: what they fit, on what, and their artifact."""

from collections import Counter
from typing import List

from .. import artifacts as artifact
from ..compiler.binding import calibrated_stages, key_for, settings
from ..compiler.plan import Plan


def calibration_lines(plan: Plan, model=None, model_label: str = "") -> List[str]:
    sites = calibrated_stages(plan)
    if not sites:
        return []
    cfg = settings(plan)
    kinds = Counter((s.stage_name, side[0]) for _, _, side, s in sites)
    on = {"k": "keys", "v": "values", "r": "a route"}  # "r": a route's fit (kvzap's scores, duo's gates)
    shown = ", ".join(f"{name} on {on[side]} x{n}" for (name, side), n in kinds.items())
    lines = [
        "",
        f"calibrated stages: {shown} (per layer and kv head), fitted on {cfg['tokens']} tokens of '{cfg['corpus']}'",
    ]
    if model is None:
        lines.append("    artifact: depends on the model's weights; pass --model to look it up")
        return lines
    key = key_for(plan, model)
    meta = artifact.find(key)
    path = artifact.directory() / f"{key}.safetensors"
    if meta is None:
        lines.append(
            f"    artifact: MISSING ({path}); make it with: veloxquant calibrate {plan.recipe}"
            f"{' --model ' + model_label if model_label else ''}"
        )
    else:
        lines.append(
            f"    artifact: {path}, {meta['bytes']:,} bytes (held once per process, not in the cache's "
            f"bytes), content {meta['content']}, fitted in {meta['seconds']} s"
        )
    return lines
