"""dietcode-ort doctor: every check reported as a record; the CLI prints them and exits 0 when usable."""
from __future__ import annotations

import json

from dietcode_ort.cli import main
from dietcode_ort.doctor import run_checks


def test_checks_cover_runtime_pieces() -> None:
    checks = {c.name: c for c in run_checks(build=True)}
    assert set(checks) == {"onnxruntime", "CUDA provider", "compiler", "onnxruntime headers", "cuda.h", "custom-op library",
                           "GPU", "triton"}
    assert checks["custom-op library"].status == "ok", checks["custom-op library"].detail
    assert checks["onnxruntime"].status == "ok" and "CPUExecutionProvider" in checks["onnxruntime"].detail
    assert checks["GPU"].status in ("ok", "warn")  # no GPU is a warning, never a failure


def test_cli_doctor_json(capsys) -> None:
    assert main(["doctor", "--json", "--no-build"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["name"] for r in rows} >= {"custom-op library", "GPU"}
