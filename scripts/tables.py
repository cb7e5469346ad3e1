"""Regenerate the measured tables in docs/ from the JSON in results/.

A table in a doc is a block

    <!-- table: results/A.json [results/B.json ...] -->
    ...generated...
    <!-- /table -->

whose body this script writes from the named files: a `veloxquant eval --json` result renders as
`veloxquant compare --md` does (protocol line, table, passkey grid; the command that made it); any
other JSON with a `rows` list renders as a table of its rows' fields, under its `command`. A block

    <!-- printed: results/A.json :: KEY -->

renders the output a session recorded under KEY (a bench's printed table) as it was printed; a
`<!-- kvpress: results/A.json -->` block renders `veloxquant bench kvpress --json`'s ΔPPL by fraction,
kvpress's published rows beside ours. A block

    <!-- kvpress-reference: results/A.json :: results/B.json [results/C.json ...] -->

renders kvpress's own presses as `benchmarks/kvpress_reference.py` measured them (A), each followed by our
namesake row (A's `namesakes`) from `bench kvpress --json` files B, C... (a later file's row wins), with
ours − kvpress in points at each fraction and whether ours is within 0.2 points or better everywhere. A block

    <!-- ranks: results/A.json [results/B.json ...] :: results/C.json [results/D.json ...] -->

compares two corpora: the rows of the `eval --json` files before `::` (one corpus; rows matched by
name, each ΔPPL against its own file's fp16) with the same rows in the files after it (a second
corpus), grouped by held bytes at the issue's points (≤ 0.25, 0.20, 0.125, 0.083, 0.0625 of fp16's),
each point's rows ordered by ΔPPL on the first corpus with their rank on the second, and Spearman's
rank correlation (of ΔPPL, and of mean KL divergence vs fp16) over all the rows both corpora measured.

    python scripts/tables.py           # rewrite the blocks in docs/*.md and README.md
    python scripts/tables.py --check   # exit 1, naming the docs whose tables differ from results/
"""

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Dict, List

from veloxquant.eval import report

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(
    r"(<!-- (?P<kind>table|printed|kvpress-reference|kvpress|ranks): (?P<spec>[^>]+?) -->\n)"
    r"(?P<body>.*?)(<!-- /table -->)",
    re.S,
)


def _cell(x) -> str:
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:,.4f}".rstrip("0").rstrip(".") if abs(x) < 1000 else f"{x:,.0f}"
    if isinstance(x, int):
        return f"{x:,}"
    return str(x)


def rows_table(data: Dict, source: str) -> str:
    rows: List[Dict] = data["rows"]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = [
        f"`{source}`" + (f", made by `{data['command']}`" if data.get("command") else "") + ":",
        "",
        "| " + " | ".join(keys) + " |",
        "|" + "---|" * len(keys),
    ]
    lines += ["| " + " | ".join(_cell(r.get(k, "–")) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def render(paths: List[str], root: Path = ROOT) -> str:
    datas = [(p, json.loads((root / p).read_text())) for p in paths]
    if all(isinstance(d, dict) and "veloxquant_eval" in d for _, d in datas):
        results = [dict(d, source=p) for p, d in datas]
        parts = []
        for res in results:
            if len(results) > 1:
                parts.append(f"`{res['source']}`:\n")
            if res.get("command"):
                parts.append(f"```sh\n{res['command']}\n```\n")
            parts += [report.protocol(res) + "\n", report.table(res) + "\n"]
            grid = report.passkey_grid(res)
            if grid:
                parts += ["Passkey retrieval by prompt length @ needle depth (correct/trials):\n", grid + "\n"]
        return "\n".join(parts)
    return "\n".join(rows_table(d, p) for p, d in datas)


def printed(spec: str, root: Path = ROOT) -> str:
    path, key = (x.strip() for x in spec.split("::", 1))
    text = json.loads((root / path).read_text())[key]
    if isinstance(text, list):
        text = "\n".join(text)
    lines = [x for x in str(text).strip("\n").splitlines()]
    tabular = [x for x in lines if x.startswith("|")]
    notes = [x for x in lines if not x.startswith("|") and x.strip()]
    out = [f"`{path}`, key `{key}`:", ""]
    if notes:
        out += ["```", *notes, "```", ""]
    return "\n".join(out + tabular) + "\n"


def _pct(x) -> str:
    return "–" if x is None else f"{x:+.2f}%"


def kvpress(spec: str, root: Path = ROOT) -> str:
    path = spec.strip()
    data = json.loads((root / path).read_text())
    fractions = data["fractions"]
    rows = [(f"kvpress {k}", v) for k, v in data["kvpress_reference"].items()]
    rows += [(f"ours {k}", v) for k, v in data["delta_ppl_percent"].items()]
    best = [
        (label, [min(v[i] for v in data[key].values()) for i in range(len(fractions))])
        for label, key in (("**best kvpress**", "kvpress_reference"), ("**best ours**", "delta_ppl_percent"))
    ]
    lines = [
        f"`{path}` (baseline PPL {data['baseline_ppl']:.3f}, {data['windows']} windows; {data['machine']}); "
        "ΔPPL at the fraction of the prefix removed:",
        "",
        "| row | " + " | ".join(str(f) for f in fractions) + " |",
        "|---|" + "---|" * len(fractions),
    ]
    lines += [f"| {name} | " + " | ".join(_pct(x) for x in vals) + " |" for name, vals in rows + best]
    return "\n".join(lines) + "\n"


def kvpress_reference(spec: str, root: Path = ROOT, slack: float = 0.2) -> str:
    first, rest = (x.split() for x in spec.split("::", 1))
    ref = json.loads((root / first[0]).read_text())
    ours: Dict[str, List] = {}
    for p in rest:
        ours.update(json.loads((root / p).read_text())["delta_ppl_percent"])
    fractions, v = ref["fractions"], ref["versions"]
    lines = [
        f"`{first[0]}` (kvpress {v['kvpress']}, torch {v['torch']}, transformers {v['transformers']}; "
        f"{ref['dtype']} on the {ref['device']}; baseline PPL {ref['baseline_ppl']:.3f}, {ref['windows']} windows); "
        f"ours from {', '.join(f'`{p}`' for p in rest)}. ΔPPL at the fraction of the prefix removed; "
        f"gap = ours − kvpress in points; a gap ≤ +{slack:g} at every fraction both measured is within or better:",
        "",
        "| row | " + " | ".join(str(f) for f in fractions) + f" | gap (points) | within {slack:g} or better |",
        "|---|" + "---|" * (len(fractions) + 2),
    ]
    for press, theirs in ref["delta_ppl_percent"].items():
        lines.append(f"| kvpress {press} | " + " | ".join(_pct(x) for x in theirs) + " | | |")
        names = ref["namesakes"].get(press) or []
        for name in [names] if isinstance(names, str) else names:  # one of ours, or several configurations
            mine = ours.get(name)
            if mine is None:
                continue
            gaps = [None if a is None or b is None else a - b for a, b in zip(mine, theirs)]
            known = [g for g in gaps if g is not None]
            verdict = "–" if not known else "yes" if max(known) <= slack else "no"
            cells = [_pct(x) for x in mine] + [" / ".join("–" if g is None else f"{g:+.2f}" for g in gaps), verdict]
            lines.append(f"| ours {name} | " + " | ".join(cells) + " |")
    lines += ["", *(f"- kvpress {k} could not run here: {e}" for k, e in ref.get("errors", {}).items())]
    return "\n".join(lines).rstrip("\n") + "\n"


POINTS = (0.0625, 0.083, 0.125, 0.20, 0.25)  # held / fp16 bytes: the frontier issue's points


def _dppl(paths: List[str], root: Path) -> Dict[str, tuple]:
    """{row name: (held / fp16, ΔPPL %, mean KLD)} over eval files, ΔPPL against each file's own fp16."""
    out = {}
    for p in paths:
        rows = json.loads((root / p).read_text())["rows"]
        fp16 = next(r["ppl"] for r in rows if r["name"] == "fp16")
        out.update(
            {
                r["name"]: (r["cost"]["ratio"], 100 * (r["ppl"] / fp16 - 1), r["divergence"]["kld_mean"])
                for r in rows
                if r["name"] != "fp16"
            }
        )
    return out


def _ranks(values: List[float]) -> List[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    for r, i in enumerate(order):
        out[i] = float(r)
    return out


def spearman(a: List[float], b: List[float]) -> float:
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def ranks(spec: str, root: Path = ROOT) -> str:
    first, second = (x.split() for x in spec.split("::", 1))
    a, b = _dppl(first, root), _dppl(second, root)
    names = [n for n in a if n in b]
    point = {n: next((f"≤ {p:g}" for p in POINTS if a[n][0] <= p + 5e-4), "> 0.25") for n in names}
    lines = [
        f"First corpus: {', '.join(f'`{p}`' for p in first)}; second: {', '.join(f'`{p}`' for p in second)}. "
        "Rows at each point ordered by ΔPPL on the first corpus; rank = place within the point.",
        "",
        "| point | row | held ÷ fp16 | ΔPPL first | ΔPPL second | KLD first | KLD second | rank first | rank second |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    agree = []
    for label in [f"≤ {p:g}" for p in POINTS] + ["> 0.25"]:
        group = sorted((n for n in names if point[n] == label), key=lambda n: a[n][1])
        second_order = sorted(group, key=lambda n: b[n][1])
        if len(group) > 1:
            agree.append(group == second_order)
        for i, n in enumerate(group):
            cells = [label, n, f"{a[n][0]:.3f}", f"{a[n][1]:+.2f}%", f"{b[n][1]:+.2f}%", f"{a[n][2]:.4f}"]
            cells += [f"{b[n][2]:.4f}", i + 1]
            lines.append("| " + " | ".join(map(str, cells + [second_order.index(n) + 1])) + " |")
    rho, rho_kld = (spearman([a[n][k] for n in names], [b[n][k] for n in names]) for k in (1, 2))
    lines += [
        "",
        f"Spearman's ρ over all {len(names)} rows: {rho:.3f} on ΔPPL, {rho_kld:.3f} on mean KLD; "
        "the ΔPPL order within a point agrees at "
        f"{sum(agree)} of the {len(agree)} points with two rows or more.",
    ]
    return "\n".join(lines) + "\n"


def _body(m, root: Path) -> str:
    if m.group("kind") == "ranks":
        return ranks(m.group("spec"), root)
    if m.group("kind") == "printed":
        return printed(m.group("spec"), root)
    if m.group("kind") == "kvpress-reference":
        return kvpress_reference(m.group("spec"), root)
    if m.group("kind") == "kvpress":
        return kvpress(m.group("spec"), root)
    return render(m.group("spec").split(), root)


def regenerate(text: str, root: Path = ROOT) -> str:
    return BLOCK.sub(lambda m: m.group(1) + _body(m, root) + m.group(5), text)


def docs(root: Path = ROOT) -> List[Path]:
    return sorted((root / "docs").glob("*.md")) + [root / "README.md"]


def stale(root: Path = ROOT) -> List[str]:
    return [str(p.relative_to(root)) for p in docs(root) if regenerate(p.read_text(), root) != p.read_text()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/tables.py", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a doc's tables are stale")
    args = ap.parse_args(argv)
    if args.check:
        out = stale()
        for p in out:
            print(f"{p}: its tables differ from results/ (python scripts/tables.py rewrites them)")
        return 1 if out else 0
    for p in docs():
        new = regenerate(p.read_text())
        if new != p.read_text():
            p.write_text(new)
            print(f"rewrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
