"""dietcode-ort doctor: every check reported as a record; the CLI prints them and exits 0 when usable."""
from __future__ import annotations

import ctypes
import json

import onnxruntime as ort
import pytest

from dietcode_ort import build
from dietcode_ort.cli import main
from dietcode_ort.doctor import cuda_libraries_check, cuda_library_sonames, load_libraries, run_checks


def test_checks_cover_runtime_pieces() -> None:
    checks = {c.name: c for c in run_checks(build=True)}
    assert set(checks) == {"onnxruntime", "CUDA provider", "CUDA libraries", "compiler", "onnxruntime headers", "cuda.h",
                           "custom-op library", "GPU", "triton"}
    assert checks["custom-op library"].status == "ok", checks["custom-op library"].detail
    assert checks["onnxruntime"].status == "ok" and "CPUExecutionProvider" in checks["onnxruntime"].detail
    assert checks["GPU"].status in ("ok", "warn")  # no GPU is a warning, never a failure


def test_cli_doctor_json(capsys) -> None:
    assert main(["doctor", "--json", "--no-build"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["name"] for r in rows} >= {"custom-op library", "GPU"}


def test_load_libraries_gives_the_loaders_reason() -> None:
    calls = []
    loads = load_libraries(["libdietcode-no-such-lib.so.7", "libm.so.6"], preload=lambda: calls.append(1))
    missing, libm = loads
    assert not missing.loaded and missing.soname == "libdietcode-no-such-lib.so.7"
    assert "libdietcode-no-such-lib.so.7: cannot open shared object file" in missing.detail
    assert libm.loaded and "libm" in libm.detail
    assert calls == [1]  # the preload ran once, for the missing library
    assert load_libraries(["libm.so.6"], preload=lambda: calls.append(2))[0].loaded and calls == [1]


def test_load_libraries_reports_a_failing_preload() -> None:
    def preload() -> None:
        print("noise that must not reach the report's reader")
        raise RuntimeError("no nvidia packages")

    (load,) = load_libraries(["libdietcode-no-such-lib.so.7"], preload=preload)
    assert not load.loaded and "onnxruntime.preload_dlls() failed: RuntimeError: no nvidia packages" in load.detail


def test_cuda_library_sonames_follow_onnxruntimes_cuda(monkeypatch) -> None:
    monkeypatch.setattr(ort, "cuda_version", "12.8", raising=False)
    assert cuda_library_sonames() == ("libcudart.so.12", "libcublas.so.12", "libcublasLt.so.12", "libcudnn.so.9")
    monkeypatch.setattr(ort, "cuda_version", "", raising=False)
    assert cuda_library_sonames() == ()
    assert cuda_libraries_check().status == "skip"


def test_cuda_libraries_check_names_each_missing_library_with_the_reason() -> None:
    sonames = cuda_library_sonames()
    if not sonames:
        pytest.skip("this onnxruntime has no CUDA build")
    check = cuda_libraries_check()
    missing = []
    for soname in sonames:  # the check has run (and preloaded what it could): the loader answers the same now
        try:
            ctypes.CDLL(soname)
        except OSError as exc:
            missing.append(soname)
            assert str(exc) in check.detail
    assert check.status == ("warn" if missing else "ok")
    if missing:
        assert "missing: " in check.detail and "dietcode-ort[cuda]" in check.detail


def test_doctor_beside_a_prebuilt_library_needs_no_compiler(monkeypatch, capsys) -> None:
    library = build.library_path(build=True)
    monkeypatch.setenv("DIETCODE_ORT_LIBRARY", str(library))
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    monkeypatch.setenv("DIETCODE_ORT_INCLUDE", "/nonexistent")
    assert main(["doctor", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["compiler"]["status"] == "skip" and str(library) in rows["compiler"]["detail"]
    assert rows["custom-op library"]["status"] == "ok"
