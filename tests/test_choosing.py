"""docs/choosing.md is generated from the committed leaderboard files: regenerate it and compare."""

import os
from pathlib import Path

import pytest

from veloxquant.board import choosing

ROOT = Path(__file__).resolve().parents[1]


def test_committed_choosing_page_is_what_the_leaderboard_gives():
    boards = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "results").glob("leaderboard-*.json"))
    if not boards:
        pytest.skip("no leaderboard files under results/")
    cwd = os.getcwd()
    os.chdir(ROOT)  # the page names its files relative to the repository root
    try:
        text = choosing.render(choosing.load(boards))
    finally:
        os.chdir(cwd)
    assert (ROOT / "docs" / "choosing.md").read_text() == text, (
        "regenerate: veloxquant report --choosing docs/choosing.md results/leaderboard-*.json"
    )


def test_best_respects_the_size_and_family():
    rows = [
        {"spec": s, "family": f, "held_ratio": r, "delta_ppl_pct": d}
        for s, f, r, d in [
            ("a", "compression", 0.26, 1.0),
            ("b", "compression", 0.24, 3.0),
            ("c", "eviction", 0.125, 9.0),
            ("d", "eviction", 0.3, 0.5),
            ("fp16", "baseline", 1.0, 0.0),
        ]
    ]
    board = {"rows": rows}
    assert [r["spec"] for r in choosing.best(board, 4)] == ["a", "b", "c"]  # a: within 10% of 1/4
    assert [r["spec"] for r in choosing.best(board, 4, "eviction")] == ["c"]
    assert choosing.best(board, 16) == []
