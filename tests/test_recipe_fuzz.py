"""Recipe fuzzer: whatever bytes a recipe file holds and whatever `--set` says,
`veloxquant check` either passes (exit 0, "ok") or prints `error: FILE[:LINE:COL]: ...`
(exit non-zero) -- never a traceback, never a hang, never unbounded memory.

CI runs a bounded, derandomized number of examples (seconds). The long run:
    VELOXQUANT_FUZZ_EXAMPLES=2500 python -m pytest -q -s tests/test_recipe_fuzz.py \\
        -p no:cacheprovider --hypothesis-seed=1
runs that many examples per fuzz test (4 tests) and prints a summary; add
VELOXQUANT_FUZZ_MEMORY=1 to trace each example's memory (several times slower).
"""

import io
import os
import re
import subprocess
import sys
import tempfile
import time
import tracemalloc
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from veloxquant import cli
from veloxquant.recipe.limits import MAX_FILE_BYTES

from recipe_strategies import pipeline_text, recipe_bytes, recipe_doc, render, set_value

LONG = int(os.environ.get("VELOXQUANT_FUZZ_EXAMPLES", "0"))
TRACE = os.environ.get("VELOXQUANT_FUZZ_MEMORY") == "1"
HANG_S = 10.0  # CPU seconds: a hang detector, not a benchmark (CPU time: the machine is shared, wall time is not ours)
PEAK_BYTES = 256 << 20  # checked when memory is traced
TRACED_SLOWDOWN = 3.0  # tracemalloc hooks every allocation: PyYAML's pure-Python scanner runs ~3x slower under it


def fuzz(ci_examples: int):
    return settings(
        max_examples=LONG or ci_examples,
        derandomize=not LONG,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )


DIR = Path(tempfile.mkdtemp(prefix="vq-fuzz-"))
STATS = {"examples": 0, "ok": 0, "error": 0, "max_s": 0.0, "max_wall": 0.0, "max_peak": 0, "slowest": ""}


def _helpers():
    """Files the fuzzer's `extends` may name: a valid parent, itself, a cycle, a long chain, UTF-16."""
    ok = "veloxquant: 1\nname: parent\nparams: {bits: 2, window: 16}\npipeline: recent($window) >> affine(bits=$bits)\n"
    (DIR / "parent.yaml").write_text(ok)
    (DIR / "utf16_parent.yaml").write_bytes(ok.encode("utf-16"))
    (DIR / "self.yaml").write_text("veloxquant: 1\nname: s\nextends: self.yaml\n")
    (DIR / "cycle_a.yaml").write_text("veloxquant: 1\nname: a\nextends: cycle_b.yaml\n")
    (DIR / "cycle_b.yaml").write_text("veloxquant: 1\nname: b\nextends: cycle_a.yaml\n")
    for i in range(20):
        (DIR / f"chain_{i:02}.yaml").write_text(f"veloxquant: 1\nname: c{i}\nextends: chain_{i + 1:02}.yaml\n")
    (DIR / "chain_20.yaml").write_text(ok)
    (DIR / "sub").mkdir(exist_ok=True)


_helpers()
_LOCATED = re.compile(r"error: (?P<file>[^\n]+?)(?::(?P<line>\d+)(?::(?P<col>\d+))?)?(?: \([^\n]*\))?: \S")


def check(data: bytes, sets=(), trace: bool = TRACE) -> int:
    """`veloxquant check` in-process on a file holding `data`; asserts the property."""
    path = DIR / "fuzzed.yaml"
    path.write_bytes(data)
    out, err = io.StringIO(), io.StringIO()
    if trace:
        tracemalloc.start()
    start, cpu = time.perf_counter(), time.process_time()
    try:
        with redirect_stdout(out), redirect_stderr(err):
            code = cli.main(["check", str(path), *(f"--set={s}" for s in sets)])
    finally:
        wall, elapsed = time.perf_counter() - start, time.process_time() - cpu
        peak = tracemalloc.get_traced_memory()[1] if trace else 0
        if trace:
            tracemalloc.stop()
    STATS["examples"] += 1
    STATS["max_peak"], STATS["max_wall"] = max(STATS["max_peak"], peak), max(STATS["max_wall"], wall)
    STATS["last_peak"] = peak
    if elapsed > STATS["max_s"]:
        STATS["max_s"], STATS["slowest"] = elapsed, (err.getvalue() or out.getvalue())[:160]
    limit = HANG_S * (TRACED_SLOWDOWN if trace else 1.0)
    assert elapsed < limit, f"check took {elapsed:.1f} s of CPU (limit {limit:.0f} s{', traced' if trace else ''})"
    assert peak < PEAK_BYTES, f"check peaked at {peak >> 20} MiB"
    o, e = out.getvalue(), err.getvalue()
    assert "Traceback" not in o + e
    if code == 0:
        STATS["ok"] += 1
        assert o.startswith("ok ") and e == "", (o, e)
        return code
    STATS["error"] += 1
    assert o == "" and e.startswith("error: "), (o, e)
    m = _LOCATED.match(e)
    assert m, f"error without a place: {e!r}"
    if m["file"] != "--set":
        where = Path(m["file"])
        assert where.is_file() or m["file"].startswith(str(DIR)), e  # the file checked or one it extends
        if m["line"] and where.is_file() and where.stat().st_size <= MAX_FILE_BYTES:
            n_lines = where.read_bytes().count(b"\n") + 1
            assert 1 <= int(m["line"]) <= n_lines, e
    return code


@fuzz(ci_examples=300)
@given(recipe_bytes(), st.lists(set_value, max_size=2))
@example(b"weloxquant: 1\nname: fp16\nsummary: U\npipeline: f\xc2\x85p16\n", [])  # found: U+0085 is a YAML line break
@example(b'veloxquant: 1\nname: "\\U001BC1C3"\npipeline: fp16\n', [])  # found: chr() ValueError in PyYAML's scanner
@example(b'veloxquant: 1\nname: "\\uD800"\npipeline: fp16\n', [])  # a surrogate: could not be printed
def test_fuzz_recipe_files(data, sets):
    check(data, sets)


@fuzz(ci_examples=200)
@given(pipeline_text(), st.sampled_from(["", "params: {bits: 2, window: 64, budget: 'linear(from=1e309, to=1)'}\n"]))
@example('affine("\x1f") | affine\n>> affine() | keys: affine values: affine()\n>> affine(0, , 0)', "")  # found:
def test_fuzz_pipelines(pipeline, params):  # an escaped multi-line pipeline was placed past its last line
    doc = render({"veloxquant": 1, "name": "p", "pipeline": pipeline})
    check((doc + params).encode())


@fuzz(ci_examples=200)
@given(recipe_doc(), st.lists(set_value, max_size=3))
@example({"extends": None, "layers": [{"\x85": None}, {"\x85": None}], "unknown": None}, [])  # found (U+0085)
def test_fuzz_recipe_fields(doc, sets):
    check(render(doc).encode(), sets)


@fuzz(ci_examples=100)
@given(st.binary(max_size=400))
def test_fuzz_raw_bytes(data):
    check(data)


def test_valid_recipes_still_pass():
    from veloxquant.paths import recipes_dir

    for path in sorted(recipes_dir().glob("*.yaml")):
        assert check(path.read_bytes()) == 0, path.name
    assert check(b"veloxquant: 1\nname: x\npipeline: fp16\n", ["bits=2"]) != 0  # fp16 takes no parameters


def test_zz_report():
    """Prints what the fuzz tests above ran (visible with -s); in CI it only checks they ran."""
    assert STATS["examples"] > 0
    print(
        f"\nfuzz examples: {STATS['examples']} (ok {STATS['ok']}, located errors {STATS['error']}); "
        f"slowest {STATS['max_s']:.2f} s CPU ({STATS['max_wall']:.2f} s wall at most); peak traced memory "
        f"{STATS['max_peak'] / 2**20:.1f} MiB{'' if TRACE else ' (not traced)'}\n  slowest: {STATS['slowest']!r}"
    )


def test_real_subprocess_on_hostile_files():
    """A few of the worst inputs through a real `python -m veloxquant.cli check` process."""
    bomb = "lol: &a [1,1,1,1,1,1,1,1,1]\n" + "".join(
        f"l{i}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for i, (p, c) in enumerate(zip("abcdefgh", "bcdefghi"))
    )
    cases = {
        "utf16.yaml": "veloxquant: 1\nname: u\npipeline: fp16\n".encode("utf-16"),  # valid
        "bom.yaml": b"\xef\xbb\xbfveloxquant: 1\nname: b\npipeline: fp16\n",  # valid
        "big.yaml": b"veloxquant: 1\n#" + b"x" * MAX_FILE_BYTES + b"\n",
        "bomb.yaml": ("veloxquant: 1\nname: b\npipeline: fp16\n" + bomb).encode(),
        "deep.yaml": ("veloxquant: 1\nname: d\npipeline: " + "residual(" * 5000 + "fp16" + ")" * 5000 + "\n").encode(),
        "nul.yaml": b"veloxquant: 1\x00\n",
        "self.yaml": b"veloxquant: 1\nname: s\nparams: &p {bits: *p}\npipeline: fp16\n",
    }
    for name, data in cases.items():
        (DIR / name).write_bytes(data)
    files = [str(DIR / n) for n in cases]
    proc = subprocess.run(
        [sys.executable, "-m", "veloxquant.cli", "check", *files, "--set=x=&a [*a]"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in proc.stdout + proc.stderr and proc.returncode == 1
    blocks = [b for b in re.split(r"^(?=error: )", proc.stderr, flags=re.M) if b.strip()]
    assert len(blocks) == len(cases), proc.stderr  # every file fails: the recipes take no parameter 'x'
    for block, name in zip(blocks, cases):
        assert _LOCATED.match(block) and name in block or "--set" in block, block


@pytest.mark.parametrize("size", [MAX_FILE_BYTES - 100, MAX_FILE_BYTES + 1])
def test_file_size_limit(size):
    head = b"veloxquant: 1\nname: big\npipeline: fp16\n#"
    data = head + b"x" * (size - len(head) - 1) + b"\n"
    code = check(data)
    assert code == (0 if size <= MAX_FILE_BYTES else 1)


def test_worst_inputs_stay_in_bounded_memory():
    """The inputs that would grow without the limits, traced: each peaks far below PEAK_BYTES."""
    bomb = "lol:\n  a: &a [1,1,1,1,1,1,1,1,1]\n" + "".join(
        f"  {c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")
    )
    worst = [
        b"veloxquant: 1\nname: b\npipeline: fp16\n" + bomb.encode(),
        b"veloxquant: 1\nname: d\npipeline: " + b"residual(" * 100_000 + b"fp16" + b")" * 100_000 + b"\n",
        b"veloxquant: 1\nname: big\nsummary: " + b"a" * (MAX_FILE_BYTES - 100) + b"\npipeline: fp16\n",
        b"veloxquant: 1\nname: l\nparams: {w: [" + b"1," * 9_000 + b"1]}\npipeline: recent($w) >> drop\n",
        b"veloxquant: 1\nname: n\npipeline: " + b" >> ".join([b"recent(1)"] * 80_000) + b"\n",
        b"veloxquant: 1\nname: a\npipeline: affine(" + b"1," * 8_000 + b"1)\n",  # the densest pipeline allowed
    ]
    peaks = []
    for data in worst:
        check(data, trace=True)
        peaks.append(STATS["last_peak"])
    print(f"\nworst inputs, traced peak MiB: {[round(p / 2**20, 1) for p in peaks]}")
    assert max(peaks) < 64 << 20, [p >> 20 for p in peaks]
