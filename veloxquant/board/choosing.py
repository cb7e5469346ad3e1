"""docs/choosing.md: the best measured recipes at each size, generated from leaderboard JSON.

A target "~N×" takes every row holding at most 1/N of fp16's bytes (10%
slack, so a byte-matched 1/4 budget with its scores' metadata still counts),
ranked by ΔPPL; "eviction at 1/N" takes eviction rows only. Nothing here is
typed by hand: `veloxquant report --choosing docs/choosing.md
results/leaderboard-*.json` rewrites it, and a test fails if it differs.
"""

import json
from pathlib import Path
from typing import Dict, List, Sequence

from ..errors import VeloxError

TARGETS = ((2, None), (4, None), (6, None), (8, None), (4, "eviction"), (8, "eviction"))
SLACK = 1.10
SHOWN = 3


def load(paths: Sequence[str]) -> List[Dict]:
    boards = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        if not isinstance(data, dict) or "veloxquant_leaderboard" not in data:
            raise VeloxError(f"{p}: not a `veloxquant leaderboard` file")
        data.setdefault("source", str(p))
        boards.append(data)
    return boards


def measured(board: Dict) -> List[Dict]:
    """Rows with a ratio and a ΔPPL (failed rows and the baseline left out)."""
    return [
        r
        for r in board["rows"]
        if r.get("spec") != "fp16" and r.get("held_ratio") and r.get("delta_ppl_pct") is not None
    ]


def best(board: Dict, factor: int, family=None, shown: int = SHOWN) -> List[Dict]:
    fits = [
        r
        for r in measured(board)
        if r["held_ratio"] <= SLACK / factor and (family is None or r.get("family") == family)
    ]
    return sorted(fits, key=lambda r: (r["delta_ppl_pct"], r["held_ratio"]))[:shown]


def _cell(x, fmt):
    return "–" if x is None else format(x, fmt)


def _line(r: Dict) -> str:
    d = r.get("divergence") or {}
    pk = r.get("passkey") or {}
    return (
        f"| `{r['spec']}` | {r['held_ratio']:.3f} | {r['delta_ppl_pct']:+.2f}% "
        f"| {_cell(d.get('kld_mean'), '.4f')} | {_cell(d.get('top1_agreement'), '.3f')} "
        f"| {_cell(pk.get('accuracy'), '.2f')} | {_cell(r.get('decode_vs_fp16'), '.2f')} |"
    )


def table(board: Dict) -> str:
    lines = [
        f"### {board['model']} — protocol `{board['protocol_name']}`, context {board['context']} tokens"
        f"{' (partial: ' + str(len(board['rows'])) + ' rows so far)' if board.get('partial') else ''}",
        "",
        f"From `{board['source']}`; command `{board.get('command', '')}`.",
        "",
    ]
    for factor, family in TARGETS:
        title = f"eviction at 1/{factor}" if family else f"~{factor}× smaller (held ≤ {SLACK / factor:.3f} of fp16)"
        rows = best(board, factor, family)
        lines += [f"**{title}**", ""]
        if not rows:
            lines += ["No measured row fits yet.", ""]
            continue
        lines += (
            [
                "| recipe | held ÷ fp16 | ΔPPL | KLD mean | top-1 | passkey | decode ÷ fp16 |",
                "|---|---|---|---|---|---|---|",
            ]
            + [_line(r) for r in rows]
            + [""]
        )
    return "\n".join(lines)


HEAD = """# Choosing a recipe

The best measured recipes at each size, per model, ranked by perplexity
increase over fp16 (ΔPPL) on the leaderboard's protocol. "held ÷ fp16" is the
resident bytes of the whole cache (codes, scales, fp16 windows, scores,
allocation slack) at the end of a perplexity window over what an fp16 cache of
the same tokens holds; "~N×" admits rows within 10% of 1/N. KLD is the mean
KL(fp16 ‖ recipe) in nats over scored positions, top-1 the fraction of
positions where the recipe's most likely next token is fp16's, decode ÷ fp16
the decode speed against fp16 in the same process. Protocols, columns and
how to rerun: `docs/eval.md` and `veloxquant leaderboard --help`.

For your own model, context and memory, `veloxquant recommend` picks from
the same files; `veloxquant report results/leaderboard-*.json -o report.html`
draws them.

This page is generated (do not edit by hand):

    veloxquant report --choosing docs/choosing.md results/leaderboard-*.json

"""


def render(boards: Sequence[Dict]) -> str:
    return HEAD + "\n".join(table(b) for b in boards).rstrip("\n") + "\n"
