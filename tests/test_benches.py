"""The benchmark scripts run and print their tables (numbers are not asserted:
speed and memory are measured, never tested)."""

import io

import pytest

from benchmarks import decode_split, prefill_peak
from veloxquant.bench import decode_ops


def test_decode_split_prints_its_table(capsys):
    assert (
        decode_split.main(
            [
                "--context",
                "64",
                "--layers",
                "2",
                "--vocab",
                "300",
                "--steps",
                "2",
                "--rounds",
                "1",
                "--dtype",
                "float32",
            ]
            + ["--batch", "2", "--recipes", "fp16,kivi[bits=2],kivi@off"]
        )
        == 0
    )
    out = capsys.readouterr().out
    for row in ("| mlx-lm KVCache, 16 tokens |", "| mlx-lm KVCache |", "| fp16 |", "| kivi[bits=2] |", "| kivi@off |"):
        assert row in out


def test_decode_ops_prints_its_table(capsys):
    assert (
        decode_ops.main(
            [
                "--layers",
                "2",
                "--context",
                "64",
                "--steps",
                "2",
                "--dtype",
                "float32",
                "--recipes",
                "fp16,kivi",
                "--as-cuda",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "graph of the CUDA path" in out and "| kivi |" in out


def test_decode_ops_counts_a_gemma3_with_sliding_layers(capsys):
    # Past the window every sliding layer's kivi tier leaves expired tokens out by count: all on the kernel.
    assert (
        decode_ops.main(
            [
                "--arch",
                "gemma3",
                "--layers",
                "6",
                "--heads",
                "2/1",
                "--head-dim",
                "64",
                "--window",
                "256",
                "--context",
                "512",
                "--steps",
                "4",
                "--dtype",
                "float32",
                "--recipes",
                "kivi",
                "--as-cuda",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "random Gemma 3 (window 256, every 6th layer global)" in out and "Sin 6" in out


@pytest.mark.slow
def test_prefill_peak_prints_its_table(capsys):
    assert prefill_peak.main(["fp16", "h2o", "--tokens", "256", "--chunk", "128"]) == 0
    out = capsys.readouterr().out
    assert "| fp16 |" in out and "| h2o |" in out
    assert prefill_peak.main(["kivi", "--tokens", "256", "--chunk", "128", "--sync-layers"]) == 0
    out = capsys.readouterr().out
    assert "evaluated before the next" in out and "| kivi |" in out


def test_layers_synced_keeps_the_logits_and_restores_attend():
    import mlx.core as mx

    from veloxquant.bench.e2e import random_llama
    from veloxquant.runtime import make_prompt_cache, uninstall
    from veloxquant.runtime.cache import TieredCache

    model = random_llama(2, 4, 2, 64, 300, mx.float32)
    tokens = mx.random.randint(0, 300, (1, 40), key=mx.random.key(3))
    plain = model(tokens, cache=make_prompt_cache(model, "kivi"))
    attend = TieredCache.attend
    with prefill_peak.layers_synced(True):
        assert TieredCache.attend is not attend
        synced = model(tokens, cache=make_prompt_cache(model, "kivi"))
    uninstall(model)
    assert TieredCache.attend is attend
    assert bool(mx.array_equal(plain, synced))


def test_e2e_repeats_rows_and_prints_medians(capsys):
    from veloxquant.bench import e2e

    assert (
        e2e.main(
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
                "--repeat",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| fp16 |") or line.startswith("| mlx-lm KVCache |")]
    assert len(rows) == 2 and all("–" in r for r in rows), out  # one line per row, with the range of 2 runs
    assert "| 1.000× |" in rows[0] and rows[0].startswith("| mlx-lm KVCache |")  # paired ratio: KVCache to itself


def test_run_peaks_prints_a_row_per_run(capsys):
    from benchmarks import run_peaks

    assert (
        run_peaks.main(
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
                "kvcache,fp16",
                "--runs",
                "2",
            ]
        )
        == 0
    )
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| kvcache |", "| fp16 |"))]
    assert len(rows) == 4 and all(len(r.split("|")) == 7 for r in rows)


def test_fp16_decode_step_builds_kvcache_graph():
    # The fp16 recipe's decode step must build mlx-lm KVCache's primitives, one for one, in the same
    # order (docs/kernels.md, "The fp16 path at KVCache's op count"): any extra op is a launch per layer.
    import re

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache as mlx_prompt_cache

    from benchmarks import host_step
    from veloxquant.bench.e2e import random_llama
    from veloxquant.eval.feed import prefill
    from veloxquant.runtime import make_prompt_cache, uninstall

    model = random_llama(2, 4, 2, 64, 300, mx.float16)
    prompt = mx.random.randint(0, 300, (1, 300), key=mx.random.key(1))
    y = mx.array([[1]])
    graphs = []
    for cache in (mlx_prompt_cache(model), make_prompt_cache(model, "fp16")):
        prefill(model, prompt, cache, 128)
        mx.eval(model(y, cache=cache))
        out = mx.argmax(model(y, cache=cache)[:, -1:], axis=-1)
        f = io.StringIO()
        mx.export_to_dot(f, out)
        graphs.append(re.findall(r'label ="([^"]+)", shape=rectangle', f.getvalue()))
        mx.eval(out)
        assert sum(host_step.step_ops(model, cache, y).values()) == len(graphs[-1])
    uninstall(model)
    assert graphs[0] == graphs[1]


def test_host_step_prints_ops_table(capsys):
    from benchmarks import host_step

    assert (
        host_step.main(
            [
                "--context",
                "64",
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
                "--rounds",
                "1",
                "--steps",
                "2",
                "--ops-table",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| primitive per layer | mlx-lm KVCache | fp16 |" in out and "| all primitives |" in out
    assert "(Python calls)" in out


def test_host_calls_prints_its_table(capsys):
    from benchmarks import host_calls

    assert host_calls.main(["--seq", "256", "--window", "16", "--calls", "16"]) == 0
    out = capsys.readouterr().out
    assert "| fp16 SDPA |" in out and "| x + 1 |" in out


def test_long_generation_prints_first_and_last_windows(capsys):
    from veloxquant.bench import long_generation

    assert long_generation.main(["--tokens", "60", "--window", "20", "--recipes", "identity,h2o", "--layers", "1"]) == 0
    rows = {
        line.split(" | ")[0].strip("| "): line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| ") and "---" not in line
    }
    assert set(rows) == {"cache", "mlx-lm KVCache", "identity", "h2o"}
    assert rows["identity"].endswith("| all |")  # float32 K/V as computed: mlx-lm's tokens exactly


def test_eviction_cost_prints_ratios_against_interleaved_fp16(capsys, tmp_path):
    from benchmarks import eviction_cost

    before = tmp_path / "before.json"
    assert (
        eviction_cost.main(
            [
                "tova",
                "knorm",
                "--tokens",
                "200",
                "--chunk",
                "64",
                "--decode",
                "2",
                "--fp16-every",
                "2",
                "--json",
                str(before),
            ]
        )
        == 0
    )
    assert (
        eviction_cost.main(["tova", "--tokens", "200", "--chunk", "64", "--decode", "2", "--before", str(before)]) == 0
    )
    out = capsys.readouterr().out
    assert "| fp16 | " in out and "| knorm | " in out and "before: peak ÷ fp16" in out
    row = next(line for line in out.splitlines()[::-1] if line.startswith("| tova |"))
    assert len(row.split("|")) == 12  # the before columns are filled


def test_contract_prints_a_row_per_recipe_and_fails_on_an_error(capsys, tmp_path):
    from veloxquant.bench import contract

    bad = tmp_path / "bad.yaml"
    bad.write_text("veloxquant: 1\nname: bad\npipeline: evict(budget=8, sinks=8)\n")
    assert contract.main(["kivi", str(bad), "--prompt", "200", "--tokens", "2"]) == 1
    out = capsys.readouterr().out
    assert "| kivi | ok (" in out and "identical" in out and "WRONG" not in out
    assert f"| {bad} | error: " in out and "1 of 2 recipes pass" in out


def test_eviction_cost_rounds_print_one_median_row_per_spec(capsys):
    from benchmarks import eviction_cost

    assert (
        eviction_cost.main(
            ["h2o[slack=8]", "--tokens", "200", "--chunk", "64", "--decode", "2", "--rounds", "2", "--no-warmup"]
        )
        == 0
    )
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in table[1:]] == ["fp16", "h2o[slack=8]"] and "medians of 2" in out


def test_peak_phases_prints_a_row_per_recipe(capsys):
    from benchmarks import peak_phases

    assert peak_phases.main(["fp16", "tova[slack=4]", "--tokens", "128"]) == 0
    out = capsys.readouterr().out
    assert "| fp16 | " in out and "| tova[slack=4] | " in out and "first decode" in out


def test_e2e_runs_a_recipe_under_a_named_kernel_and_restores_the_setting(capsys, monkeypatch):
    import os

    from veloxquant.bench import e2e

    monkeypatch.setenv("VELOXQUANT_CUDA_IMPL", "mma")
    assert (
        e2e.main(
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
                "kivi,kivi@v1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| kivi |" in out and "| kivi@v1 |" in out
    assert os.environ["VELOXQUANT_CUDA_IMPL"] == "mma"  # the process's own setting is back


def test_launch_cost_builds_its_empty_kernels_where_cuda_is():
    from benchmarks import launch_cost
    from veloxquant.kernels import backend

    if backend() != "cuda":
        return  # mx.fast.cuda_kernel exists only on the CUDA backend; the module must still import
    assert launch_cost.empty_kernel("vq_lc_test", 3, 2, True, 2, 300)() is not None


def test_host_step_steps_a_merged_batch(capsys):
    """`--batch 3`: three prefilled caches of each kind merged into one batch cache per layer, one token
    per row each step."""
    from benchmarks import host_step

    argv = ["--context", "80", "--layers", "1", "--heads", "4/2", "--head-dim", "64", "--vocab", "300"]
    argv += ["--dtype", "float32", "--recipes", "fp16,kivi", "--rounds", "1", "--steps", "2", "--batch", "3"]
    assert host_step.main(argv) == 0
    out = capsys.readouterr().out
    assert "batch=3" in out
    assert {line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")} >= {"fp16", "kivi"}
