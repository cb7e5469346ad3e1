"""veloxquant report -o report.html: the page's structure, and its behaviour in headless Chromium when installed."""

import json
import os
import re
import shutil
import subprocess

import pytest

from veloxquant.cli import main

from test_recommend import BOARD


def _board(tmp_path):
    rows = []
    for i, r in enumerate(BOARD["rows"]):
        sets = r["spec"][r["spec"].index("[") + 1 : -1].split(",") if "[" in r["spec"] else []
        rows.append(
            dict(
                r,
                name=r["spec"],
                kind="recipe",
                ref=r["spec"].split("[")[0],
                sets=sets,
                held_ratio=1.0 - 0.2 * i,
                cost={"ratio": 1.0 - 0.2 * i, "peak_memory_bytes": 2**28},
            )
        )
    path = tmp_path / "leaderboard-x.json"
    path.write_text(json.dumps({**BOARD, "rows": rows}))
    return path


def test_page_is_self_contained_with_data_and_recipes(tmp_path):
    out = tmp_path / "r.html"
    assert main(["report", str(_board(tmp_path)), "-o", str(out)]) == 0
    page = out.read_text()
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page
    assert "<script src" not in page and "<link" not in page  # no network, nothing external
    data = json.loads(re.search(r'<script type="application/json" id="data">(.*?)</script>', page, re.S)[1])
    assert [d["name"] for d in data] == [r["spec"] for r in BOARD["rows"]]
    kivi = next(d for d in data if d["name"] == "kivi[bits=4]")
    assert "pipeline" in kivi["recipe"] and "# with bits=4" in kivi["recipe"] and kivi["bits"] == pytest.approx(12.8)
    assert 'id="plot-ppl"' in page and 'id="plot-kld"' in page


def test_report_rejects_other_json(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("[1]")
    assert main(["report", str(bad), "-o", str(tmp_path / "r.html")]) == 2
    assert main(["report", str(bad)]) == 2  # neither -o nor --choosing


def _chromium(*args):
    # Without the OpenBLAS LD_PRELOAD the tests run under: Chromium spins under it.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    return subprocess.run(
        [
            shutil.which("chromium"),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--in-process-gpu",
            "--enable-logging=stderr",
            "--v=0",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        env=env,
    )


@pytest.mark.skipif(not shutil.which("chromium"), reason="needs Debian's chromium (apt-get install -y chromium)")
def test_page_in_headless_chromium(tmp_path):
    out = tmp_path / "r.html"
    assert main(["report", str(_board(tmp_path)), "-o", str(out)]) == 0
    url = out.as_uri()
    loaded = _chromium("--dump-dom", url)
    # no script error
    assert "CONSOLE" not in loaded.stderr and "<tbody><tr>" in loaded.stdout and 'id="errors"></pre>' in loaded.stdout
    names = lambda dom: re.findall(r"<tr><td>[^<]*</td><td>([^<]*)</td>", dom)  # noqa: E731
    assert names(loaded.stdout) == ["streaming_llm[window=252]", "h2o[budget=1024]", "kivi", "kivi[bits=4]", "fp16"]
    assert len(re.findall(r"<circle", loaded.stdout)) == 2 * 5 and "<title>kivi (SmolLM2" in loaded.stdout
    view = _chromium("--dump-dom", url + "#sort=dppl&desc=1&family=compression")
    assert names(view.stdout) == ["kivi", "kivi[bits=4]"] and "2 of 5 rows" in view.stdout
    shot = tmp_path / "report.png"
    _chromium(f"--screenshot={shot}", "--window-size=1300,900", url)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
