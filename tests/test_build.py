"""Library build: cache key, cached lookup, and clear errors for a missing compiler or headers."""
from __future__ import annotations

import dataclasses
import platform
import shutil
import subprocess
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


def test_prebuilt_library_is_checked_like_a_packaged_one(monkeypatch, tmp_path) -> None:
    """A DIETCODE_ORT_LIBRARY that is no library, another library, or one of another C ABI is refused naming the
    variable (inspect reported the first two as an internal error: a ctypes OSError / AttributeError)."""
    text = tmp_path / "text.so"
    text.write_text("not a library")
    foreign = _tiny_library(tmp_path, "foreign", 'extern "C" int something_else(void) { return 1; }')
    other = _tiny_library(tmp_path, "other", 'extern "C" int dc_abi_version(void) { return 99; }')
    for lib, message in ((text, "does not load"), (foreign, "is not a dietcode-ort custom-op library"),
                         (other, "has C ABI version 99")):
        monkeypatch.setenv("DIETCODE_ORT_LIBRARY", str(lib))
        with pytest.raises(DietcodeError, match=rf"DIETCODE_ORT_LIBRARY.*{message}.*unset it"):
            build.library_path()


# --- the library a platform wheel ships ---------------------------------------------------------------------

def _tiny_library(tmp_path, name: str, source: str, *flags: str):
    """A small shared library compiled from ``source`` (C++), for the packaged-library checks."""
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++")
    src = tmp_path / f"{name}.cc"
    src.write_text(source)
    lib = tmp_path / f"{name}.so"
    subprocess.run([cxx, "-shared", "-fPIC", str(src), "-o", str(lib), *flags], check=True)
    return lib


def _packaged(monkeypatch, tmp_path, library=None):
    """Point the package's _lib folder at tmp_path/_lib, holding ``library`` as libdietcode_ort.so."""
    folder = tmp_path / "_lib"
    folder.mkdir()
    monkeypatch.setattr(build, "PACKAGED_DIR", folder)
    monkeypatch.delenv("DIETCODE_ORT_LIBRARY", raising=False)
    if library is not None:
        shutil.copy(library, folder / "libdietcode_ort.so")
    return folder / "libdietcode_ort.so"


def test_packaged_library_is_used_without_building(monkeypatch, tmp_path) -> None:
    built = build.library_path(build=True)
    packaged = _packaged(monkeypatch, tmp_path, built)
    monkeypatch.setenv("CXX", "/nonexistent/g++")  # a build would fail: there is no compiler
    monkeypatch.setenv("DIETCODE_ORT_BUILD_DIR", str(tmp_path / "never"))
    assert build.library_path(build=True) == packaged
    assert build.prebuilt_library() == packaged
    assert not (tmp_path / "never").exists()


def test_packaged_library_of_another_abi_is_refused(monkeypatch, tmp_path) -> None:
    other = _tiny_library(tmp_path, "other", 'extern "C" int dc_abi_version(void) { return 99; }')
    _packaged(monkeypatch, tmp_path, other)
    expected = rf"C ABI version 99, this package expects {build.C_ABI_VERSION}: reinstall the dietcode-ort"
    with pytest.raises(DietcodeError, match=expected):
        build.library_path(build=True)


def test_packaged_file_that_is_no_library_is_refused(monkeypatch, tmp_path) -> None:
    packaged = _packaged(monkeypatch, tmp_path)
    packaged.write_text("not a library")
    with pytest.raises(DietcodeError, match="packaged custom-op library does not load.*reinstall"):
        build.library_path()
    foreign = _tiny_library(tmp_path, "foreign", 'extern "C" int something_else(void) { return 1; }')
    shutil.copy(foreign, tmp_path / "_lib" / "libdietcode_ort.so")
    build._check_abi.cache_clear()
    with pytest.raises(DietcodeError, match="not a dietcode-ort custom-op library"):
        build.library_path()


def test_no_packaged_library_and_no_sources_says_what_to_do(monkeypatch, tmp_path) -> None:
    _packaged(monkeypatch, tmp_path)
    monkeypatch.setattr(build, "_REPO", tmp_path / "site-packages")
    with pytest.raises(DietcodeError, match="no custom-op library.*platform wheel.*DIETCODE_ORT_LIBRARY"):
        build.library_path(build=True)


def test_build_packaged_records_a_portable_library(monkeypatch, tmp_path) -> None:
    """The wheel's library (same flags as every build, so the cached one stands in for a fresh compile) needs
    glibc only: no libstdc++ (linked statically) and nothing outside the manylinux set."""
    built = build.library_path(build=True)
    monkeypatch.setattr(build, "build_library", lambda config, dest, jobs=2: shutil.copy(built, dest))
    info = build.build_packaged(tmp_path)
    assert (tmp_path / "libdietcode_ort.so").is_file()
    assert "libstdc++.so.6" not in info.needed and "libc.so.6" in info.needed
    assert not [v for v in info.symbol_versions if v.startswith(("GLIBCXX_", "CXXABI_"))]
    major, minor = build.LibraryNeeds(info.needed, info.symbol_versions).glibc()
    assert f"GLIBC_{major}.{minor}" in info.symbol_versions
    assert info.platform_tag == f"manylinux_{major}_{minor}_{platform.machine()}"
    assert info.c_abi_version == build.C_ABI_VERSION and info.ort_api_version >= 11
    monkeypatch.setattr(build, "PACKAGED_DIR", tmp_path)
    assert build.packaged_build() == info


def test_build_packaged_refuses_a_library_needing_libstdcxx(monkeypatch, tmp_path) -> None:
    dynamic = _tiny_library(tmp_path, "dynamic", '#include <string>\nextern "C" int dc_abi_version(void) '
                            '{ static std::string s("x"); return 2 + (int)s.size() - 1; }')
    monkeypatch.setattr(build, "build_library", lambda config, dest, jobs=2: shutil.copy(dynamic, dest))
    with pytest.raises(DietcodeError, match=r"not portable: it links libstdc\+\+\.so\.6"):
        build.build_packaged(tmp_path)


def test_unreadable_build_record_says_to_reinstall(monkeypatch, tmp_path) -> None:
    _packaged(monkeypatch, tmp_path)
    (tmp_path / "_lib" / "build_info.json").write_text('{"c_abi_version": 2}')
    with pytest.raises(DietcodeError, match="build_info.json is unreadable.*reinstall"):
        build.packaged_build()


def test_prune_spares_locked_versions_and_removes_killed_builds_staging(tmp_path) -> None:
    """Old libraries go with their lock files, but not one whose lock a process holds (it is building or checking
    that version: deleting the lock under it would let a second builder in); staged copies of builds whose
    process is gone are removed, a live one's are not; the kept library stays."""
    import fcntl
    import os
    import sys

    keep = tmp_path / "libdietcode_ort-new.so"
    stale, held = tmp_path / "libdietcode_ort-old.so", tmp_path / "libdietcode_ort-busy.so"
    for lib in (keep, stale, held):
        lib.write_bytes(b"x")
        lib.with_suffix(".lock").write_text("")
        os.utime(lib, (time.time() - 3600, time.time() - 3600))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    killed, live = tmp_path / f"libdietcode_ort-old.tmp{dead}", tmp_path / f"libdietcode_ort-new.tmp{os.getpid()}"
    killed.write_bytes(b"x")
    live.write_bytes(b"x")
    with open(held.with_suffix(".lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        build._prune(keep)
    assert not stale.exists() and not stale.with_suffix(".lock").exists()
    assert held.exists() and held.with_suffix(".lock").exists()
    assert keep.exists() and keep.with_suffix(".lock").exists()
    assert not killed.exists() and live.exists()
