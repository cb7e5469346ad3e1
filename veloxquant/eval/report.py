"""Render eval results (the JSON `veloxquant eval` writes): markdown tables and
a Pareto plot of bytes held per token against perplexity increase.
"""

import json
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from ..errors import VeloxError


def load(paths: Sequence[str]) -> List[Dict]:
    results = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        if not isinstance(data, dict) or "veloxquant_eval" not in data:
            raise VeloxError(f"{p}: not a `veloxquant eval --json` result")
        data.setdefault("source", str(p))
        results.append(data)
    return results


def _f(x, fmt: str, none: str = "–") -> str:
    return none if x is None else format(x, fmt)


def _passkey(r: Dict) -> str:
    pk = r.get("passkey")
    if not pk:
        return "–"
    ok = sum(c["correct"] for c in pk["cells"])
    n = sum(c["trials"] for c in pk["cells"])
    return f"{ok}/{n}"


def _fid(r: Dict) -> str:
    f = r.get("fidelity")
    return "–" if not f else f"{f['mean']:.4f} ({f['min']:.3f} @{f['min_layer']})"


def _delta(r: Dict) -> str:
    d = r.get("delta_ppl_pct")
    return "–" if d is None else f"{d:+.2f}%"


def _kld(r: Dict, key: str, fmt: str) -> str:
    d = r.get("divergence") or {}
    return _f(d.get(key), fmt)


HEADER = (
    "| row | B/token | vs fp16 | PPL | ΔPPL | KLD mean | KLD p99 | top-1 | passkey "
    "| attn cosine mean (min @layer) "
    "| peak MiB (+ over weights) | prefill tok/s | decode tok/s |"
)


def table(result: Dict) -> str:
    lines = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    for r in result["rows"]:
        c = r["cost"]
        peak, extra = c.get("peak_memory_bytes"), c.get("peak_over_start_bytes")
        mib = "–" if peak is None else f"{peak / 2**20:.0f} (+{extra / 2**20:.0f})"
        lines.append(
            f"| {r['name']} | {_f(c['bytes_per_token'], ',.0f')} | {_f(c['ratio'], '.3f')} "
            f"| {_f(r['ppl'], '.3f', 'fails¹' if r.get('error') else '–')} | {_delta(r)} "
            f"| {_kld(r, 'kld_mean', '.5f')} | {_kld(r, 'kld_p99', '.4f')} | {_kld(r, 'top1_agreement', '.3f')} "
            f"| {_passkey(r)} "
            f"| {_fid(r)} "
            f"| {mib} | {_f(c['prefill_tok_s'], '.0f')} "
            f"| {_f(c['decode_tok_s'], '.1f')} |"
        )
    notes = [f"- {r['name']}: {r['error']}" for r in result["rows"] if r.get("error")]
    notes += [
        f"- {r['name']} (fidelity only): {r['fidelity_error']}" for r in result["rows"] if r.get("fidelity_error")
    ]
    if notes:
        lines += ["", "¹ the row could not run on this backend; its error:", ""] + notes
    return "\n".join(lines)


def passkey_grid(result: Dict) -> str:
    rows = [r for r in result["rows"] if r.get("passkey")]
    if not rows:
        return ""
    keys = [(c["length"], c["depth"]) for c in rows[0]["passkey"]["cells"]]
    head = "| row | " + " | ".join(f"{L} @ {d:g}" for L, d in keys) + " |"
    lines = [head, "|" + "---|" * (len(keys) + 1)]
    for r in rows:
        cells = {(c["length"], c["depth"]): c for c in r["passkey"]["cells"]}
        lines.append(
            f"| {r['name']} | "
            + " | ".join(f"{cells[k]['correct']}/{cells[k]['trials']}" if k in cells else "–" for k in keys)
            + " |"
        )
    return "\n".join(lines)


def protocol(result: Dict) -> str:
    p = result["protocol"]
    dtype = str(result["dtype"]).replace("mlx.core.", "")
    device = str(result["device"]).replace("Device(", "").split(",")[0]  # older files: "Device(cpu, 0)"
    return (
        f"model {result.get('model', '?')} ({dtype}, {device}), corpus "
        f"{result.get('corpus', '?')}; perplexity on {p['windows_used']} window(s) of {p['prefix']} prefix "
        f"+ {p['score_tokens']} scored tokens (prefill chunk {p['prefill_chunk']}, scoring chunk "
        f"{p['score_chunk']}); passkey {len(p['passkey_lengths'])} length(s) × "
        f"{len(p['passkey_depths'])} depth(s) × {p['passkey_trials']} trial(s); fidelity on "
        f"{p['fidelity_windows']} window(s); wall {result['wall_s']:.0f} s"
    )


def markdown(results: Sequence[Dict]) -> str:
    parts = ["# Evaluation results\n"]
    if len(results) == 1 and results[0].get("command"):
        parts.append(f"Regenerate:\n\n```sh\n{results[0]['command']}\n```\n\nMetrics and protocol: `docs/eval.md`.\n")
    for res in results:
        if len(results) > 1:
            parts.append(f"### {res.get('model', '?')} — {res['source']}\n")
        parts += [protocol(res) + "\n", table(res) + "\n"]
        grid = passkey_grid(res)
        if grid:
            parts += ["Passkey retrieval by prompt length @ needle depth (correct/trials):\n", grid + "\n"]
    return "\n".join(parts).rstrip("\n") + "\n"


def pareto_front(points: Sequence[Tuple[float, float]]) -> List[int]:
    """Indices of points no other point beats on both axes (lower is better), by x."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best = [], float("inf")
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def plot(results: Sequence[Dict], path: str) -> None:
    """Bytes held per token (x) against ΔPPL % (y, symlog); the Pareto front dashed."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    labels = []
    for k, res in enumerate(results):
        rows = [r for r in res["rows"] if r.get("delta_ppl_pct") is not None and r["cost"]["bytes_per_token"]]
        pts = [(r["cost"]["bytes_per_token"], r["delta_ppl_pct"]) for r in rows]
        color = colors[k % len(colors)]
        models = [r.get("model", "?") for r in results]
        label = (
            None
            if len(results) == 1
            else models[k]
            if models.count(models[k]) == 1
            else f"{models[k]}, run {k + 1} ({res['device'].split(',')[0].replace('Device(', '')})"
        )
        for r, (x, y) in zip(rows, pts):
            marker = "s" if r["kind"] == "mlx-lm" else "o"
            ax.scatter(
                [x],
                [y],
                marker=marker,
                color=color,
                s=42,
                zorder=3,
                facecolors="none" if r["kind"] == "mlx-lm" else color,
            )
            labels.append((r["name"], x, y))
        front = pareto_front(pts)
        ax.plot(
            [pts[i][0] for i in front],
            [pts[i][1] for i in front],
            "--",
            color=color,
            lw=1,
            label=f"Pareto front{' ' + label if label else ''}",
            zorder=2,
        )
    ax.set_yscale("symlog", linthresh=1.0)  # ΔPPL spans 0.1% (8-bit) to 1000% (2-bit)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}%"))
    ax.set_xlabel("KV-cache bytes held per token (all layers, measured)")
    ax.set_ylabel("perplexity increase vs fp16 (symlog)")
    ax.axhline(0, color="grey", lw=0.6)
    ax.autoscale_view()
    _place_labels(ax, labels)
    ax.scatter([], [], marker="o", color="k", label="veloxquant recipe")
    ax.scatter([], [], marker="s", facecolors="none", color="k", label="mlx-lm QuantizedKVCache")
    ax.legend(fontsize=8, loc="best")
    ax.grid(True, which="both", alpha=0.25)
    title = results[0].get("model", "") if len(results) == 1 else "veloxquant eval"
    ax.set_title(f"{title}: cache size vs perplexity", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _place_labels(ax, labels, height: float = 14.0, width: float = 80.0) -> None:
    """Annotate points, nudging a label down while it would overlap one placed
    before (rows at equal sizes, e.g. kivi and kivi_sink, otherwise collide)."""
    placed = []
    for name, x, y in sorted(labels, key=lambda t: -t[2]):
        px, py = ax.transData.transform((x, y))
        dy = 4.0
        while any(abs(px - qx) < width and abs(py + dy - qy) < height for qx, qy in placed):
            dy -= height
        placed.append((px, py + dy))
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, dy * 72 / ax.figure.dpi), fontsize=8)
