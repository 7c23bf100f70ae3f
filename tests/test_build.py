"""Library build: cache key, cached lookup, and clear errors for a missing compiler or headers."""
from __future__ import annotations

import dataclasses
import shutil
import time

import pytest

from dietcode_ort import build
from dietcode_ort.errors import DietcodeError


def test_cached_library_is_found_without_rebuilding() -> None:
    path = build.library_path(build=True)
    start = time.perf_counter()
    assert build.library_path(build=False) == path
    assert time.perf_counter() - start < 1.0
    assert path.name == f"libdietcode_ort-{build.find_config().key()}.so"


def test_key_covers_sources(tmp_path) -> None:
    config = build.find_config()
    copies = []
    for src in config.sources:
        shutil.copy(src, tmp_path / src.name)
        copies.append(tmp_path / src.name)
    for header in build.source_dir().glob("*.h"):
        shutil.copy(header, tmp_path / header.name)
    same = dataclasses.replace(config, sources=tuple(copies))
    assert same.key() == config.key()
    copies[0].write_text(copies[0].read_text() + "\n// changed\n")
    assert same.key() != config.key()


def test_missing_compiler_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(DietcodeError, match="no C\\+\\+17 compiler found.*install g\\+\\+"):
        build.find_config()


def test_missing_headers_say_how_to_fetch(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(build, "_REPO", tmp_path)
    monkeypatch.setenv("DIETCODE_ORT_INCLUDE", str(tmp_path / "nowhere"))
    if (build.Path("/usr/include/onnxruntime") / "onnxruntime_cxx_api.h").is_file():
        pytest.skip("system headers present")
    with pytest.raises(DietcodeError, match="fetch_ort_headers.sh"):
        build._find_ort_include()


def test_prebuilt_library_override(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("DIETCODE_ORT_LIBRARY", str(tmp_path / "missing.so"))
    with pytest.raises(DietcodeError, match="DIETCODE_ORT_LIBRARY"):
        build.library_path()
