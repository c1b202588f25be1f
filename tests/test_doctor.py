"""Issue 26: ``ds4mlx doctor`` passes here, its JSON has the documented fields, and a
deliberately wrong device result (the documented test hook ``DS4MLX_DOCTOR_FAULT``) makes
it exit non-zero naming the broken check. Real ``ds4mlx`` processes."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
from server_util import REPO

pytestmark = pytest.mark.slow

FIELDS = ["python", "mlx", "device", "memory", "wired_limit", "disk", "fits", "checks", "verdict"]


def _doctor(*args, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "120"}
    env.pop("DS4MLX_DOCTOR_FAULT", None)
    if fault:
        env["DS4MLX_DOCTOR_FAULT"] = fault
    return subprocess.run(
        [sys.executable, "-m", "ds4mlx.cli", "doctor", *args],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip


def test_doctor_passes_here_with_every_field():
    r = _doctor("--json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert list(report) == FIELDS
    assert report["verdict"] == "ok"
    assert [c["name"] for c in report["checks"]] == ["sinkhorn", "forward", "decode"]
    assert all(c["ok"] and c["detail"] for c in report["checks"])
    assert "tok/s" in report["checks"][2]["detail"]
    assert report["python"]["version"] == platform.python_version()
    assert report["mlx"]["version"][0].isdigit()
    assert report["memory"]["ram_bytes"] > 0 and report["memory"]["budget_bytes"] > 0
    assert {"kv_cache", "models"} <= set(report["disk"])
    assert all(d["free_bytes"] > 0 for d in report["disk"].values())
    # The fit check's arithmetic per convert build, the WEIGHTS.md table's numbers.
    builds = {f["build"]: f for f in report["fits"]}
    lossless = builds["--expert-mode mxfp4 --bits mxfp8"]
    assert 150e9 < lossless["weights_bytes"] < 160e9 and lossless["ctx"] == 65536
    assert all(f["fits"] == (f["total_bytes"] <= report["memory"]["budget_bytes"])
               for f in report["fits"])  # fmt: skip
    if not report["device"]["metal"]:
        assert "Metal was not available" in report["device"]["note"]
        assert "Metal was not available" in report["wired_limit"]["detail"]


@pytest.mark.parametrize("check", ["sinkhorn", "forward"])
def test_a_wrong_device_result_is_caught_by_name(check):
    r = _doctor("--json", fault=check)
    assert r.returncode == 1, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["verdict"] == f"broken: {check}"
    failed = [c for c in report["checks"] if not c["ok"]]
    assert [c["name"] for c in failed] == [check]
    # The table says it too.
    text = _doctor(fault=check)
    assert text.returncode == 1 and f"verdict: broken: {check}" in text.stdout
    assert "FAILED" in text.stdout
