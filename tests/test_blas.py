"""The automatic OpenBLAS preload of the `veloxquant` command (veloxquant/blas.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from veloxquant import blas

ROOT = Path(__file__).resolve().parent.parent
CLEAN = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.OFF, blas.DONE)}
linux_cpu_wheel = pytest.mark.skipif(
    not sys.platform.startswith("linux") or blas.bundled_blas() is None,
    reason="MLX's bundled BLAS is only used by the Linux mlx-cpu wheel",
)


@linux_cpu_wheel
def test_decision(monkeypatch, capsys):
    monkeypatch.setattr(blas, "system_openblas", lambda: "/lib/libopenblas.so.0")
    assert blas.should_reexec("run", CLEAN) == "/lib/libopenblas.so.0"
    assert blas.should_reexec("eval", CLEAN) == "/lib/libopenblas.so.0"
    assert blas.should_reexec("check", CLEAN) is None  # light commands start once
    assert blas.should_reexec("run", {**CLEAN, blas.OFF: "1"}) is None
    assert blas.should_reexec("run", {**CLEAN, blas.DONE: "1"}) is None  # never loops
    assert blas.should_reexec("run", {**CLEAN, "LD_PRELOAD": "/x/libopenblas.so"}) is None
    env = blas.preload_env({"LD_PRELOAD": "/a.so"}, "/lib/libopenblas.so.0")
    assert env["LD_PRELOAD"] == "/lib/libopenblas.so.0:/a.so" and env[blas.DONE] == "1"
    monkeypatch.setattr(blas, "system_openblas", lambda: None)
    assert blas.should_reexec("run", CLEAN) is None
    assert "apt-get install libopenblas0-pthread" in capsys.readouterr().err


PROBE = """
import os, sys
from veloxquant.blas import maybe_reexec
maybe_reexec(sys.argv[1:])
import mlx.core as mx
a = mx.ones((64, 64))
mx.eval(a @ a)
print("libopenblas" in open("/proc/self/maps").read())
"""


@linux_cpu_wheel
@pytest.mark.skipif(blas.system_openblas() is None, reason="no system OpenBLAS installed")
@pytest.mark.parametrize("env, loaded", [({}, "True"), ({blas.OFF: "1"}, "False")])
def test_reexec_loads_openblas(tmp_path, env, loaded):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    out = subprocess.run(
        [sys.executable, str(probe), "run"],
        env={**CLEAN, **env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.stdout.strip() == loaded, out.stderr
