"""Build (once) and locate the custom-op library ``libdietcode_ort-<hash>.so``.

The one build entry point: plain ``g++`` (or ``$CXX``) compiles custom_ops/*.cc against the ONNX Runtime C/C++
headers and the ``cuda.h`` shipped in the triton wheel; no CUDA toolkit is needed because the library opens
libcuda with dlopen at run time. The result is cached under a key hashing every source, the headers, the
compiler's version and the flags, so an unchanged tree never rebuilds and a changed one never loads a stale
library. A missing compiler or header is a DietcodeError that says what to install.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from dietcode_ort.errors import DietcodeError

__all__ = ["BuildConfig", "find_config", "library_path", "source_dir", "cache_dir", "build_library"]

_REPO = Path(__file__).resolve().parents[1]
_CFLAGS = ("-std=c++17", "-O2", "-fPIC", "-Wall", "-Wextra")
_LDFLAGS = ("-shared", "-ldl", "-pthread", "-Wl,--exclude-libs,ALL")
# Symbols the library exports: ORT's entry point and the C core used through ctypes.
_EXPORTS = ("RegisterCustomOps", "dc_*")
_FETCH_HINT = "bash scripts/fetch_ort_headers.sh .deps/onnxruntime"


@dataclass(frozen=True)
class BuildConfig:
    """Everything that determines the library's bytes: compiler, include dirs, sources, flags."""

    compiler: str
    compiler_version: str
    ort_include: Path
    cuda_include: Path
    sources: tuple[Path, ...]

    def key(self) -> str:
        """Hash of sources, headers, compiler version and flags: the cache key."""
        h = hashlib.sha256()
        for part in (self.compiler_version, " ".join(_CFLAGS), " ".join(_LDFLAGS)):
            h.update(part.encode() + b"\0")
        files = list(self.sources) + sorted((self.sources[0].parent).glob("*.h"))
        files += [self.ort_include / "onnxruntime_c_api.h", self.ort_include / "onnxruntime_cxx_api.h",
                  self.ort_include / "onnxruntime_cxx_inline.h", self.cuda_include / "cuda.h"]
        for f in files:
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
        return h.hexdigest()[:16]


def source_dir() -> Path:
    """custom_ops/ of a source checkout, else the copy a wheel installs under <prefix>/share/dietcode-ort."""
    checkout = _REPO / "custom_ops"
    if (checkout / "core.cc").is_file():
        return checkout
    return Path(sys.prefix) / "share" / "dietcode-ort" / "custom_ops"


def cache_dir() -> Path:
    """Where built libraries are kept: ``$DIETCODE_ORT_BUILD_DIR`` if set, else project-local
    ``.cache/dietcode_ort`` in a writable checkout, else ``library`` in the user cache folder
    ($XDG_CACHE_HOME/dietcode-ort or ~/.cache/dietcode-ort). Created by ``library_path`` on first use."""
    from dietcode_ort.paths import user_cache_dir

    env = os.environ.get("DIETCODE_ORT_BUILD_DIR")
    if env:
        return Path(env).expanduser()
    if (_REPO / "pyproject.toml").is_file() and os.access(_REPO, os.W_OK):
        return _REPO / ".cache" / "dietcode_ort"
    return user_cache_dir() / "library"


def _find_ort_include() -> Path:
    candidates = []
    env = os.environ.get("DIETCODE_ORT_INCLUDE")
    if env:
        candidates += [Path(env), Path(env) / "onnxruntime"]
    candidates += [_REPO / ".deps" / "onnxruntime" / "include" / "onnxruntime", Path("/usr/include/onnxruntime")]
    for c in candidates:
        if (c / "onnxruntime_cxx_api.h").is_file():
            return c
    where = f"DIETCODE_ORT_INCLUDE={env!r}, " if env else ""
    raise DietcodeError(f"ONNX Runtime C/C++ headers not found (looked in {where}.deps/onnxruntime/include/onnxruntime "
                        f"and /usr/include/onnxruntime): run `{_FETCH_HINT}` in the repository, or set "
                        f"DIETCODE_ORT_INCLUDE to the folder holding onnxruntime_cxx_api.h")


def _find_cuda_include() -> Path:
    env = os.environ.get("DIETCODE_CUDA_INCLUDE")
    if env and (Path(env) / "cuda.h").is_file():
        return Path(env)
    spec = importlib.util.find_spec("triton")  # locates the wheel without importing triton
    if spec is not None and spec.origin:
        inc = Path(spec.origin).parent / "backends" / "nvidia" / "include"
        if (inc / "cuda.h").is_file():
            return inc
    raise DietcodeError("cuda.h not found: install triton (its wheel ships triton/backends/nvidia/include/cuda.h) "
                        "or set DIETCODE_CUDA_INCLUDE to a folder holding cuda.h; no CUDA toolkit is needed")


def _find_compiler() -> tuple[str, str]:
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    for name in names:
        path = shutil.which(name)
        if path:
            out = subprocess.run([path, "--version"], capture_output=True, text=True, check=False)
            return path, out.stdout.splitlines()[0] if out.stdout else name
    raise DietcodeError(f"no C++17 compiler found (tried {', '.join(names)}): install g++ "
                        "(Debian/Ubuntu: apt-get install g++) or set CXX")


def find_config() -> BuildConfig:
    """Locate compiler, headers and sources; DietcodeError saying what to install when one is missing."""
    src = source_dir()
    sources = tuple(sorted(src.glob("*.cc")))
    if not sources:
        raise DietcodeError(f"custom-op sources not found in {src}: the library builds from a source checkout")
    compiler, version = _find_compiler()
    return BuildConfig(compiler, version, _find_ort_include(), _find_cuda_include(), sources)


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_library(config: BuildConfig, dest: Path, jobs: int = 2) -> float:
    """Compile and link into ``dest`` (atomically); returns the seconds it took."""
    start = time.perf_counter()
    includes = ("-I", str(config.ort_include), "-I", str(config.cuda_include), "-I", str(source_dir()))
    with tempfile.TemporaryDirectory(prefix="dietcode_build_") as tmp:
        objs = [Path(tmp) / (s.stem + ".o") for s in config.sources]

        def compile_one(pair: tuple[Path, Path]) -> subprocess.CompletedProcess[str]:
            src, obj = pair
            return subprocess.run([config.compiler, *_CFLAGS, *includes, "-c", str(src), "-o", str(obj)],
                                  capture_output=True, text=True, check=False)

        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            results = list(pool.map(compile_one, zip(config.sources, objs)))
        for src, res in zip(config.sources, results):
            if res.returncode != 0:
                raise DietcodeError(f"compiling {src.name} failed:\n{res.stderr.strip()[-4000:]}")
        version_script = Path(tmp) / "exports.map"
        version_script.write_text("{ global: " + "; ".join(_EXPORTS) + "; local: *; };\n")
        tmp_lib = Path(tmp) / dest.name
        res = subprocess.run([config.compiler, *map(str, objs), "-o", str(tmp_lib), *_LDFLAGS,
                              f"-Wl,--version-script={version_script}"], capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise DietcodeError(f"linking {dest.name} failed:\n{res.stderr.strip()[-4000:]}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        staged = dest.with_suffix(f".tmp{os.getpid()}")
        shutil.copyfile(tmp_lib, staged)
        os.replace(staged, dest)
    return time.perf_counter() - start


def library_path(build: bool = True) -> Path:
    """Path of the built library for the current sources, building it first when ``build`` and missing.

    ``DIETCODE_ORT_LIBRARY`` names a prebuilt library to use instead (a deployment without a compiler).
    """
    prebuilt = os.environ.get("DIETCODE_ORT_LIBRARY")
    if prebuilt:
        if not Path(prebuilt).is_file():
            raise DietcodeError(f"DIETCODE_ORT_LIBRARY={prebuilt!r} does not exist")
        return Path(prebuilt)
    config = find_config()
    dest = cache_dir() / f"libdietcode_ort-{config.key()}.so"
    if dest.is_file():
        return dest
    if not build:
        raise DietcodeError(f"the custom-op library is not built ({dest} missing): call library_path(build=True)")
    from dietcode_ort.paths import writable_dir

    writable_dir(dest.parent, "custom-op library cache", "DIETCODE_ORT_BUILD_DIR (or DIETCODE_ORT_LIBRARY for a "
                 "prebuilt library)")
    with _lock(dest.with_suffix(".lock")):
        if not dest.is_file():  # another process may have built it while this one waited
            build_library(config, dest)
            _prune(dest)
    return dest


def _prune(keep: Path, min_age_s: float = 600.0) -> None:
    """Remove libraries of other source versions that nothing has touched for a while."""
    now = time.time()
    for old in keep.parent.glob("libdietcode_ort-*.so"):
        with contextlib.suppress(OSError):
            if old != keep and now - old.stat().st_mtime > min_age_s:
                old.unlink()
                old.with_suffix(".lock").unlink(missing_ok=True)
