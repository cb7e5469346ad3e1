"""The measured tables in docs/ are what scripts/tables.py makes from results/: a doc whose table
was edited by hand, or whose JSON changed, fails here."""

import importlib.util
import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("tables", ROOT / "scripts" / "tables.py")
tables = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tables)


def test_the_committed_docs_tables_match_results():
    assert tables.stale() == []


def test_every_json_in_results_names_its_command_or_its_entries_do():
    missing = []
    for p in sorted((ROOT / "results").glob("*.json*")):
        text = p.read_text()
        rows = [json.loads(x) for x in text.splitlines() if x.strip()] if p.suffix == ".jsonl" else [json.loads(text)]
        if not all("command" in r or "commands" in r for r in rows) and '"command"' not in text:
            missing.append(p.name)
    # Session notes whose commands were never recorded (the docs say so); nothing new may join them.
    assert set(missing) <= KNOWN_WITHOUT_COMMAND, sorted(set(missing) - KNOWN_WITHOUT_COMMAND)


KNOWN_WITHOUT_COMMAND = {
    "results-cpu-round11.json",
    "results-h200-round11.json",
    "results-h200-round12.json",
    "results-h200-round13.json",
    "results-h200-round14.json",
    "results-h200-round15.json",
    "results-h200-round16.json",
}


def test_a_hand_edited_table_is_stale(tmp_path):
    for d in ("docs", "results"):
        shutil.copytree(ROOT / d, tmp_path / d)
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    doc = next(p for p in tables.docs(tmp_path) if "<!-- table: " in p.read_text())
    text = doc.read_text()
    i = text.index("<!-- table: ")
    j = text.index("| ", i)
    doc.write_text(text[:j] + "| edited " + text[j + 2 :])
    assert tables.stale(tmp_path) == [str(doc.relative_to(tmp_path))]


def test_ranks_compare_the_order_on_two_texts():
    assert tables.spearman([1.0, 2.0, 3.0], [10.0, 20.0, 30.0]) == 1.0
    assert tables.spearman([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == -1.0
    doc = (ROOT / "docs" / "results.md").read_text()
    spec = doc.split("<!-- ranks: ")[1].split(" -->")[0]
    text = tables.ranks(spec)
    assert "| ≤ 0.125 | lagquant | 0.123 |" in text and "Spearman's ρ over all" in text


def test_kvpress_reference_puts_our_namesake_under_each_press_with_its_gap(tmp_path):
    ref = {
        "versions": {"kvpress": "0.5.5", "torch": "2.13.0+cpu", "transformers": "5.2.0"},
        "dtype": "float32",
        "device": "cpu",
        "baseline_ppl": 25.9,
        "windows": 4,
        "fractions": [0.5, 0.75, 0.85],
        "namesakes": {"LagKV": "lagkv", "DuoAttention": "duo_attention", "Knorm": "knorm"},
        "delta_ppl_percent": {"LagKV": [3.0, 5.0, 10.0], "DuoAttention": [2.0, 9.0, None], "Knorm": [1, 2, 3]},
        "errors": {"KVzap": "OSError: offline"},
    }
    (tmp_path / "ref.json").write_text(json.dumps(ref))
    (tmp_path / "ours.json").write_text(json.dumps({"delta_ppl_percent": {"lagkv": [3.1, 5.3, 9.0]}}))
    (tmp_path / "later.json").write_text(json.dumps({"delta_ppl_percent": {"duo_attention": [2.1, 8.0, 12.0]}}))
    text = tables.kvpress_reference("ref.json :: ours.json later.json", tmp_path)
    assert "| kvpress LagKV | +3.00% | +5.00% | +10.00% | | |" in text
    assert "| ours lagkv | +3.10% | +5.30% | +9.00% | +0.10 / +0.30 / -1.00 | no |" in text
    assert "| ours duo_attention | +2.10% | +8.00% | +12.00% | +0.10 / -1.00 / – | yes |" in text
    assert "| kvpress Knorm | +1.00% | +2.00% | +3.00% | | |" in text and "ours knorm" not in text
    assert "- kvpress KVzap could not run here: OSError: offline" in text


def test_the_kvpress_reference_bench_names_a_namesake_only_for_a_row_it_measures():
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("kvpress_reference", ROOT / "benchmarks" / "kvpress_reference.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # stdlib only at import: torch and kvpress are imported by `measure`
    assert set(bench.NAMESAKES) <= set(bench.press_rows(SimpleNamespace()))
