"""The benchmark scripts run and print their tables (numbers are not asserted:
speed and memory are measured, never tested)."""
import pytest

from veloxquant.bench import decode_ops, decode_split, prefill_peak


def test_decode_split_prints_its_table(capsys):
    assert decode_split.main(["--context", "64", "--layers", "2", "--vocab", "300", "--steps", "2",
                              "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    for row in ("| mlx-lm KVCache |", "| fp16 |", "| kivi |", "| kivi kernels off |"):
        assert row in out


def test_decode_ops_prints_its_table(capsys):
    assert decode_ops.main(["--layers", "2", "--context", "64", "--steps", "2", "--dtype", "float32",
                            "--recipes", "fp16,kivi", "--as-cuda"]) == 0
    out = capsys.readouterr().out
    assert "graph of the CUDA path" in out and "| kivi |" in out


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
    assert e2e.main(["--context", "64", "--decode", "2", "--layers", "1", "--heads", "4/2", "--head-dim", "64",
                     "--vocab", "300", "--dtype", "float32", "--recipes", "fp16", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| fp16 |") or line.startswith("| mlx-lm KVCache |")]
    assert len(rows) == 2 and all("–" in r for r in rows), out  # one line per row, with the range of 2 runs


def test_host_calls_prints_its_table(capsys):
    from veloxquant.bench import host_calls
    assert host_calls.main(["--seq", "256", "--window", "16", "--calls", "16"]) == 0
    out = capsys.readouterr().out
    assert "| fp16 SDPA |" in out and "| x + 1 |" in out


def test_long_generation_prints_first_and_last_windows(capsys):
    from veloxquant.bench import long_generation
    assert long_generation.main(["--tokens", "60", "--window", "20", "--recipes", "identity,h2o",
                                 "--layers", "1"]) == 0
    rows = {line.split(" | ")[0].strip("| "): line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and "---" not in line}
    assert set(rows) == {"cache", "mlx-lm KVCache", "identity", "h2o"}
    assert rows["identity"].endswith("| all |")  # float32 K/V as computed: mlx-lm's tokens exactly


def test_eviction_cost_prints_ratios_against_interleaved_fp16(capsys, tmp_path):
    from veloxquant.bench import eviction_cost
    before = tmp_path / "before.json"
    assert eviction_cost.main(["tova", "knorm", "--tokens", "200", "--chunk", "64", "--decode", "2",
                               "--fp16-every", "2", "--json", str(before)]) == 0
    assert eviction_cost.main(["tova", "--tokens", "200", "--chunk", "64", "--decode", "2",
                               "--before", str(before)]) == 0
    out = capsys.readouterr().out
    assert "| fp16 | " in out and "| knorm | " in out and "before: peak ÷ fp16" in out
    row = next(line for line in out.splitlines()[::-1] if line.startswith("| tova |"))
    assert len(row.split("|")) == 12  # the before columns are filled
