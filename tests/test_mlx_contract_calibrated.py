"""mlx-lm's cache contract (tests/test_mlx_contract.py's checks, on SmolLM2) for calibrated
built-ins: run where their SmolLM2 artifact is in the cache directory (`veloxquant calibrate
NAME` first), skipped with the command that makes it otherwise."""

import pytest

from veloxquant.artifacts import CalibrationError
from veloxquant.runtime.make import plan_for

import test_mlx_contract as contract
from test_mlx_contract import prompt, smollm2  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow
CALIBRATED = ("commvq", "a2ats", "ratekivi", "lagrate", "kvzap", "duo_attention", "duo_kivi")
CHECKS = {
    "save_load": contract.test_save_load_round_trip_with_metadata,
    "two_steps": contract.test_generating_in_two_steps_equals_one,
    "trim": contract.test_trim_then_regenerate,
    "deep_copy": contract.test_deep_copy_continues_identically,
    "nbytes_state": contract.test_nbytes_empty_state_meta_state,
}


@pytest.fixture(params=CALIBRATED)
def calibrated(request, smollm2):  # noqa: F811
    try:
        plan_for(smollm2[0], request.param)
    except CalibrationError as e:
        pytest.skip(str(e))
    return request.param


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_contract(smollm2, prompt, tmp_path, calibrated, check, record_property):  # noqa: F811
    fn = CHECKS[check]
    args = (smollm2, prompt, tmp_path) if check == "save_load" else (smollm2, prompt)
    fn(*args, calibrated, record_property)
