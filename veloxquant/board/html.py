"""`veloxquant report RESULTS.json... -o report.html`: one self-contained static page.

The rows of leaderboard or eval JSON files become one table (sortable by any
column, filtered by family, model, held ÷ fp16 range and name) and two Pareto
plots, held bytes against ΔPPL and against KLD, drawn as inline SVG by the
page's own script (html_page.js, inlined): no server, no network, no CDN.
Each row carries its recipe's text.
"""

import html
import json
from pathlib import Path
from typing import Dict, List, Sequence

from ..errors import VeloxError
from ..recipe.load import resolve
from ..recipe.source import read_text

SCRIPT = Path(__file__).with_name("html_page.js")


def load(paths: Sequence[str]) -> List[Dict]:
    results = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        if not isinstance(data, dict) or not ("veloxquant_leaderboard" in data or "veloxquant_eval" in data):
            raise VeloxError(f"{p}: neither a `veloxquant leaderboard` nor a `veloxquant eval --json` file")
        results.append(data)
    return results


def _recipe_text(r: Dict) -> str:
    if r.get("kind") != "recipe":
        return f"mlx-lm QuantizedKVCache(bits={r.get('bits')}, group_size={r.get('group')})"
    try:
        text = read_text(resolve(r["ref"]))
    except (VeloxError, OSError):
        text = f"(recipe {r['ref']} not found here)\n"
    sets = r.get("sets") or []
    return text + (f"# with {', '.join(sets)}\n" if sets else "")


def flatten(results: Sequence[Dict]) -> List[Dict]:
    """One dict per row with the columns the page shows."""
    out = []
    for res in results:
        for r in res["rows"]:
            c, d, pk = r.get("cost") or {}, r.get("divergence") or {}, r.get("passkey") or {}
            calib = r.get("calibration") or {}
            peak = c.get("peak_memory_bytes")
            ratio = r.get("held_ratio", c.get("ratio"))
            out.append(
                {
                    "model": res.get("model", "?"),
                    "name": r.get("spec", r["name"]),
                    "family": r.get("family", "baseline" if r["name"] == "fp16" else r.get("kind", "?")),
                    "setting": r.get("setting", ""),
                    "ratio": ratio,
                    "bits": 16 * ratio if ratio else None,
                    "dppl": r.get("delta_ppl_pct"),
                    "kld": d.get("kld_mean"),
                    "kld99": d.get("kld_p99"),
                    "top1": d.get("top1_agreement"),
                    "passkey": pk.get("accuracy"),
                    "decode": r.get("decode_vs_fp16"),
                    "peak": peak / 2**20 if peak else None,
                    "calib": calib.get("seconds"),
                    "wall": r.get("wall_s"),
                    "error": r.get("error"),
                    "recipe": _recipe_text(r),
                }
            )
    return out


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>veloxquant report</title>
<style>
body {{ font: 13px system-ui, sans-serif; margin: 1.5em; }}
table {{ border-collapse: collapse; }} th, td {{ border: 1px solid #ccc; padding: 2px 6px; text-align: right; }}
th {{ cursor: pointer; background: #f3f3f3; position: sticky; top: 0; }} td:nth-child(-n+4) {{ text-align: left; }}
pre {{ text-align: left; font-size: 11px; max-width: 60em; white-space: pre-wrap; }}
.plots svg {{ border: 1px solid #ddd; margin-right: 1em; }} .filters > * {{ margin-right: 1em; }}
</style></head><body>
<h1>veloxquant report</h1>
<p>{sources}</p>
<div class="plots"><svg id="plot-ppl" width="520" height="340"></svg><svg id="plot-kld"
width="520" height="340"></svg></div>
<p>Hover a point for its recipe; the dashed line joins the rows no other row beats on both axes
(green: eviction, blue: the rest).</p>
<div class="filters">
<label>family <select id="family"><option value="">all</option></select></label>
<label>model <select id="model"><option value="">all</option></select></label>
<label>held ÷ fp16 from <input id="rmin" size="5"> to <input id="rmax" size="5"></label>
<label>name <input id="text" size="14"></label> <span id="count"></span>
</div>
<pre id="errors"></pre>
<table id="board"><thead><tr></tr></thead><tbody></tbody></table>
<script type="application/json" id="data">{data}</script>
<script>{script}</script>
</body></html>
"""


def render(results: Sequence[Dict], sources: Sequence[str]) -> str:
    data = json.dumps(flatten(results)).replace("</", "<\\/")  # never closes the script element
    names = ", ".join(f"<code>{html.escape(str(s))}</code>" for s in sources)
    return PAGE.format(sources=f"From {names}.", data=data, script=SCRIPT.read_text())
