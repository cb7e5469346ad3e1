"""`eval --ray` and `tune --ray` on a local Ray cluster the test starts: results equal a serial run's.

Ray is a test dependency (the `test` extra), so this is not skipped when it is
missing: a missing Ray is a broken test environment. The one exception is a
Python that Ray publishes no wheels for (pyproject's marker), where it is not
installed.
"""

import os
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 14):  # pyproject: ray is installed only below 3.14 (no wheels yet)
    pytest.skip("Ray publishes no wheels for this Python", allow_module_level=True)

import ray  # noqa: E402
from mlx_lm.tokenizer_utils import TokenizerWrapper  # noqa: E402

from veloxquant.eval.config import EvalConfig  # noqa: E402
from veloxquant.eval.distributed import evaluate_distributed  # noqa: E402
from veloxquant.eval.rows import expand  # noqa: E402
from veloxquant.eval.run import evaluate  # noqa: E402
from veloxquant.pool import run_all  # noqa: E402
from veloxquant.tune.measure import Slice, measure_task  # noqa: E402
from veloxquant.tune.search import builtin_text  # noqa: E402

from conftest import tiny_llama  # noqa: E402
from test_eval import SENTENCES, CharTokenizer  # noqa: E402


class TinyModel:
    """A picklable model reference: Ray workers build the same tiny random model."""

    def __call__(self):
        return tiny_llama(layers=2), TokenizerWrapper(CharTokenizer())

    def __repr__(self):
        return "TinyModel()"


@pytest.fixture(scope="module")
def cluster():
    tests = Path(__file__).resolve().parent  # workers import this module, conftest and test_eval by name
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)])}},
    )
    yield
    ray.shutdown()


def strip(result):
    """What must be equal: everything but times, peak memory and the run's bookkeeping."""
    keep = []
    for r in result["rows"]:
        r = dict(r)
        r["cost"] = {k: v for k, v in r["cost"].items() if "tok_s" not in k and "peak" not in k}
        if r["passkey"]:
            r["passkey"] = {k: v for k, v in r["passkey"].items() if "tps" not in k and "_s" not in k}
        keep.append(r)
    return keep


def test_eval_rows_as_ray_tasks_equal_serial(cluster):
    cfg = EvalConfig(
        windows=1,
        prefix=64,
        score_tokens=16,
        prefill_chunk=32,
        score_chunk=8,
        fidelity_windows=1,
        passkey_lengths=(),
        passkey_depths=(0.5,),
        passkey_trials=1,
        passkey_max_tokens=2,
    )
    rows = expand(["kivi[window=16]", "kivi_sink[window=16,bits=4]"], [])
    model, tok = TinyModel()()
    serial = evaluate(model, tok, rows, SENTENCES * 2, cfg, {"model": "tiny"}, progress=False)
    spread = evaluate_distributed(TinyModel(), rows, SENTENCES * 2, cfg, {"model": "tiny"}, "", progress=False)
    assert [r["name"] for r in spread["rows"]] == ["fp16", "kivi[window=16]", "kivi_sink[window=16,bits=4]"]
    assert strip(spread) == strip(serial)
    assert spread["ray"]["tasks"] == 3


def test_tune_measurements_as_ray_tasks_equal_serial(cluster):
    tokens = tuple(range(3, 3 + 81))
    sl = Slice("calibration", (tokens,), 64, 32, 8)
    calls = [(TinyModel(), builtin_text(n), sl) for n in ("fp16", "kivi")]
    serial = dict(run_all(measure_task, calls))
    spread = dict(run_all(measure_task, calls, ray=""))
    assert spread == serial


def test_a_failing_task_is_a_clear_error(cluster):
    from veloxquant.errors import RecipeError

    sl = Slice("calibration", (tuple(range(3, 84)),), 64, 32, 8)
    with pytest.raises(RecipeError, match="missing schema version"):
        list(run_all(measure_task, [(TinyModel(), "name: x\npipeline: fp16\n", sl)], ray=""))
