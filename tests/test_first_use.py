"""First use on a fresh machine: every default location (tuning database, kernel cache, custom-op library
cache) is created when missing, and an unusable one is an error naming it and its override."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from _bad_models import ROOT, matmul_model, save
from dietcode_ort import build
from dietcode_ort.cli import main
from dietcode_ort.errors import DietcodeError
from dietcode_ort.paths import user_cache_dir
from tuner import aot
from tuner.optimize import default_db

_MOVED = ("DIETCODE_CACHE", "DIETCODE_ORT_BUILD_DIR", "XDG_CACHE_HOME")


def _fresh_env(home: Path, xdg: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _MOVED}
    env.update(HOME=str(home), PYTHONPATH=str(ROOT))
    if xdg is not None:
        env["XDG_CACHE_HOME"] = str(xdg)
    return env


def test_optimize_on_a_fresh_home_creates_its_folders(tmp_path):
    home, xdg = tmp_path / "home", tmp_path / "xdg"
    home.mkdir()
    xdg.mkdir()
    model = save(matmul_model(), tmp_path / "tiny.onnx")
    proc = subprocess.run([sys.executable, "-m", "dietcode_ort", "optimize", str(model), "-o", str(tmp_path / "o.onnx"),
                           "--dim", "n=1:16", "--measure", "analytic", "--budget", "8", "--quiet"],
                          env=_fresh_env(home, xdg), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (xdg / "dietcode-ort" / "tuning.db").is_file()
    assert list((xdg / "dietcode-ort" / "kernels").glob("*.json"))
    assert (tmp_path / "o.onnx").is_file()


def test_default_locations_follow_xdg_then_home(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("DIETCODE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_db() == tmp_path / ".cache" / "dietcode-ort" / "tuning.db"
    assert aot.default_cache_dir() == tmp_path / ".cache" / "dietcode-ort" / "kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_db() == tmp_path / "x" / "dietcode-ort" / "tuning.db"
    assert user_cache_dir({"HOME": "/nowhere", "XDG_CACHE_HOME": "/xdg"}) == Path("/xdg/dietcode-ort")
    # the XDG spec ignores a relative XDG_CACHE_HOME; an empty or relative HOME is the password entry's home
    assert user_cache_dir({"HOME": "/nowhere", "XDG_CACHE_HOME": "rel"}) == Path("/nowhere/.cache/dietcode-ort")
    import pwd

    entry = Path(pwd.getpwuid(os.getuid()).pw_dir) / ".cache" / "dietcode-ort"
    assert user_cache_dir({"HOME": ""}) == entry and user_cache_dir({"HOME": "."}) == entry
    assert user_cache_dir({}) == entry


def test_read_only_home_names_the_database_and_its_option(tmp_path, monkeypatch, capsys, read_only_dir):
    for name in _MOVED:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(read_only_dir))
    model = save(matmul_model(), tmp_path / "tiny.onnx")
    argv = ["optimize", str(model), "-o", str(tmp_path / "o.onnx"), "--dim", "n=1:16", "--measure", "analytic",
            "--budget", "8", "--quiet"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{read_only_dir}/.cache/dietcode-ort" in err and "--db" in err and "Traceback" not in err
    monkeypatch.setenv("XDG_CACHE_HOME", str(read_only_dir))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{read_only_dir}/dietcode-ort" in err and "--db" in err
    # with a writable database, the kernel cache is next: named with --cache-dir and DIETCODE_CACHE
    assert main(argv + ["--db", str(tmp_path / "t.db")]) == 2
    err = capsys.readouterr().err
    assert f"{read_only_dir}/dietcode-ort/kernels" in err and "DIETCODE_CACHE" in err
    assert not (tmp_path / "o.onnx").exists()


def test_unwritable_library_cache_names_its_variable(monkeypatch, read_only_dir):
    monkeypatch.delenv("DIETCODE_ORT_LIBRARY", raising=False)
    monkeypatch.setenv("DIETCODE_ORT_BUILD_DIR", str(read_only_dir / "library"))
    assert build.cache_dir() == read_only_dir / "library"
    with pytest.raises(DietcodeError, match="DIETCODE_ORT_BUILD_DIR") as info:
        build.library_path(build=True)
    assert str(read_only_dir) in str(info.value)


def test_library_cache_is_created_on_first_use(monkeypatch, tmp_path):
    """The library builds into a missing DIETCODE_ORT_BUILD_DIR (copied from the existing build when one
    is there, so the test does not compile it again)."""
    monkeypatch.delenv("DIETCODE_ORT_LIBRARY", raising=False)
    monkeypatch.delenv("DIETCODE_ORT_BUILD_DIR", raising=False)
    built = build.library_path(build=True)
    target = tmp_path / "fresh" / "library"
    monkeypatch.setenv("DIETCODE_ORT_BUILD_DIR", str(target))
    monkeypatch.setattr(build, "build_library", lambda config, dest, jobs=2: dest.write_bytes(built.read_bytes()))
    path = build.library_path(build=True)
    assert path.parent == target and path.is_file()


def test_read_only_home_with_moved_caches_still_compiles(tmp_path, read_only_dir):
    """With --db and DIETCODE_CACHE moved, nothing is written under a read-only HOME: not even Triton's
    working files (which default to ~/.triton). A fresh process, since Triton resolves HOME once."""
    env = _fresh_env(read_only_dir, None)
    for name in ("TRITON_CACHE_DIR", "TRITON_HOME"):
        env.pop(name, None)
    env["DIETCODE_CACHE"] = str(tmp_path / "kernels")
    model = save(matmul_model(), tmp_path / "tiny.onnx")
    proc = subprocess.run([sys.executable, "-m", "dietcode_ort", "optimize", str(model), "-o", str(tmp_path / "o.onnx"),
                           "--dim", "n=1:16", "--measure", "analytic", "--budget", "8", "--quiet",
                           "--db", str(tmp_path / "t.db")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert list((tmp_path / "kernels").glob("*.json"))


def test_the_checkout_tracks_no_symbolic_links():
    """A link the repository tracks points into the machine that committed it: a tracked ``.deps`` link to a
    local folder left every other clone with a dangling ``.deps``, where ./dev.sh setup then failed to fetch the
    ORT headers ("cannot create directory '.deps': File exists")."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (an sdist or an installed copy)")
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-s"], capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip(f"git cannot list the checkout: {listed.stderr.strip()}")
    links = [line.split("\t", 1)[1] for line in listed.stdout.splitlines() if line.startswith("120000 ")]
    assert links == []
