"""`veloxquant bench NAME`: every registered bench runs on a tiny configuration and prints its table;
the research instruments in benchmarks/ reach no private name of a veloxquant module."""

import ast
from pathlib import Path

import pytest

from veloxquant.bench import registry
from veloxquant.cli import main as cli
from veloxquant.errors import VeloxError

# One tiny run per bench, and a line of the table it must print.
TINY = {
    "attention": (
        [
            "--seq",
            "1k",
            "--bits",
            "4",
            "--shapes",
            "4/2/64",
            "--methods",
            "sdpa,reference",
            "--iters",
            "1",
            "--warmup",
            "0",
            "--per-eval",
            "2",
            "--copies",
            "1",
        ],
        "| 4/2/64 | 1k | 4 |",
    ),
    "contract": (["kivi", "--prompt", "200", "--tokens", "2"], "| kivi | ok ("),
    "decode-ops": (
        ["--layers", "2", "--context", "64", "--steps", "2", "--dtype", "float32", "--recipes", "fp16,kivi"],
        "| kivi |",
    ),
    "e2e": (
        [
            "--context",
            "64",
            "--decode",
            "2",
            "--layers",
            "1",
            "--heads",
            "4/2",
            "--head-dim",
            "64",
            "--vocab",
            "300",
            "--dtype",
            "float32",
            "--recipes",
            "fp16",
        ],
        "| fp16 |",
    ),
    "entropy": (["--tokens", "512"], "| cachegen (as written) |"),
    "kept-mass": (["--prompt-tokens", "128", "--next", "8", "--budget", "32", "--only", "h2o,tova"], "| tova | 32 |"),
    "kvpress": (["knorm", "--fractions", "0.5", "--windows", "1"], "| ours knorm |"),
    "long-generation": (["--tokens", "60", "--window", "20", "--recipes", "identity", "--layers", "1"], "| identity |"),
    "parity": (["--tokens", "64", "--chunk", "32"], "| fp16 |"),
    "serve": (
        [
            "--recipes",
            "fp16",
            "--context",
            "40",
            "--decode",
            "3",
            "--concurrency",
            "1",
            "--layers",
            "2",
            "--budget-mib",
            "1",
            "--dtype",
            "float32",
            "--weights-bits",
            "4",
        ],
        "| fp16 |",
    ),
    "sharded": (["fp16"], "| fp16 |"),
}
SLOW = {"entropy", "kvpress", "sharded"}  # tens of seconds on the CPU (real model; sharded: two mlx.launch ranks)


def test_every_registered_bench_has_a_tiny_run_here():
    assert set(registry.discover()) == set(TINY)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in TINY])
def test_bench_prints_its_table(name, capsys):
    argv, row = TINY[name]
    assert cli(["bench", name, *argv]) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert len(table) >= 3 and set(table[1].replace(" ", "")) <= set("|-:"), out  # header, rule, a row
    assert any(line.startswith(row) for line in table), out


def test_e2e_batches_sequences_through_batch_generator(capsys):
    """`bench e2e --batch 2`: two sequences through mlx-lm's BatchGenerator with each row's caches,
    past kivi's window (a coded tier in the batch), and the qmm route's row beside the decoded one."""
    argv = ["--context", "320", "--decode", "3", "--layers", "1", "--heads", "4/2", "--head-dim", "64"]
    argv += ["--vocab", "300", "--dtype", "float32", "--recipes", "fp16,kivi,kivi@qmm", "--batch", "2"]
    assert cli(["bench", "e2e", *argv]) == 0
    out = capsys.readouterr().out
    assert "batch 2 (aggregate tok/s, BatchGenerator)" in out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert {"mlx-lm KVCache", "fp16", "kivi", "kivi@qmm"} <= set(rows), out
    mib = {k: float(v.split("|")[-2]) for k, v in rows.items() if k != "cache"}
    assert mib["kivi"] < mib["fp16"], out  # the coded tier's bytes, all sequences


def test_e2e_batch_times_decode_only_once_every_sequence_decodes(monkeypatch):
    """BatchGenerator decodes the prefilled sequences between the next prompt's prefill chunks: the
    measured decode steps start once all of them are in the batch, and each decodes every row."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from veloxquant.bench import e2e_batch
    from veloxquant.bench.e2e import random_model

    rows_per_step = []

    class Counting(e2e_batch.BatchGenerator):
        def next_generated(self):
            got = super().next_generated()
            rows_per_step.append(len(got))
            return got

    monkeypatch.setattr(e2e_batch, "BatchGenerator", Counting)
    model, _ = random_model("llama", (1, 4, 2, 32, 300, mx.float32, 64, 128))
    prompt = mx.random.randint(0, 300, (2100,))  # two prefill chunks of 2048: decode starts mid-fill
    *_, held = e2e_batch.measure_batch(model, prompt, lambda: make_prompt_cache(model), 3, 4)
    assert rows_per_step == [3] * 4
    assert held > 3 * 2100 * 2 * 2 * 32 * 4  # every sequence's prompt is held (float32 K and V)


@pytest.mark.parametrize("argv", [["--list"], ["--help"], []])
def test_list_and_help_name_every_bench_with_its_purpose(argv, capsys):
    assert cli(["bench", *argv]) == 0
    out = capsys.readouterr().out
    for bench in registry.discover().values():
        assert f"{bench.name} " in out and bench.purpose in out and bench.purpose


def test_an_unknown_bench_is_an_error_naming_the_benches():
    with pytest.raises(VeloxError, match="no bench named 'nope'.*kept-mass"):
        registry.run("nope", [])


def test_a_name_registered_by_two_modules_is_an_error():
    with pytest.raises(VeloxError, match="registered twice"):
        registry.bench("e2e", "again")(lambda argv=None: 0)


def _private_reaches(path: Path):
    """`module._name` where `module` was imported from veloxquant (attribute of an imported name)."""
    tree = ast.parse(path.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("veloxquant"):
            imported |= {a.asname or a.name for a in node.names}
            yield from (f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_"))
        elif isinstance(node, ast.Import):
            imported |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("veloxquant")}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and isinstance(node.value, ast.Name)
            and node.value.id in imported
        ):
            yield f"{node.value.id}.{node.attr} (line {node.lineno})"


def test_the_research_instruments_reach_no_private_name():
    root = Path(__file__).resolve().parents[1] / "benchmarks"
    found = {p.name: list(_private_reaches(p)) for p in sorted(root.glob("*.py"))}
    assert len(found) > 10 and not {k: v for k, v in found.items() if v}


def test_the_private_name_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from veloxquant.kernels import cuda\nfrom veloxquant.artifacts import _SLOTS\ncuda._launch_mma()\n")
    assert sorted(_private_reaches(bad)) == ["cuda._launch_mma (line 3)", "veloxquant.artifacts._SLOTS"]


def test_e2e_reports_a_row_the_device_cannot_hold_and_runs_the_others(monkeypatch, capsys):
    """A row that runs out of device memory (8 x 32k of fp16 on an 80 GB card) is that row's result,
    not a traceback: the other rows are measured, without a ratio to a baseline that did not fit."""
    from mlx_lm.models.cache import KVCache

    from veloxquant.bench import e2e

    real = e2e.measure

    def measure(model, prompt, cache, decode):
        if isinstance(cache[0], KVCache):
            raise RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")
        return real(model, prompt, cache, decode)

    monkeypatch.setattr(e2e, "measure", measure)
    assert cli(["bench", "e2e", *TINY["e2e"][0]]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert "out of memory" in rows["mlx-lm KVCache"], out
    assert rows["fp16"].split("|")[4].strip() == "–" and float(rows["fp16"].split("|")[3].replace(",", "")) > 0, out
    monkeypatch.setattr(e2e, "measure", lambda *a: (_ for _ in ()).throw(RuntimeError("another error")))
    with pytest.raises(RuntimeError, match="another error"):
        cli(["bench", "e2e", *TINY["e2e"][0]])
