"""Locate the custom-op library, and build it: ``libdietcode_ort-<hash>.so`` in a checkout, or the one a
platform wheel ships (``dietcode_ort/_lib/libdietcode_ort.so``, built by setup.py through ``build_packaged``).

The one build entry point: plain ``g++`` (or ``$CXX``) compiles custom_ops/*.cc against the ONNX Runtime C/C++
headers and the ``cuda.h`` shipped in the triton wheel; no CUDA toolkit is needed because the library opens
libcuda with dlopen at run time. The result is cached under a key hashing every source, the headers, the
compiler's version and the flags, so an unchanged tree never rebuilds and a changed one never loads a stale
library. A missing compiler or header is a DietcodeError that says what to install.

libstdc++ is linked statically (its symbols stay hidden) and libgcc_s dynamically, so the library needs only
glibc: built on Debian 12 (GCC 12, glibc 2.36) it needs GLIBC_2.34 at most and no GLIBCXX/CXXABI version.
``-static-libgcc`` would add GLIBC_2.35 (GCC 12's unwinder calls _dl_find_object); ``--gc-sections`` drops the
parts of libstdc++.a nothing calls, which would otherwise need GLIBC_2.36 (arc4random in random.o).
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

from dietcode_ort.errors import DietcodeError

__all__ = ["BuildConfig", "find_config", "library_path", "source_dir", "cache_dir", "build_library",
           "C_ABI_VERSION", "PACKAGED_DIR", "PackagedBuild", "packaged_library", "packaged_build",
           "prebuilt_library", "LibraryNeeds", "library_needs", "build_packaged"]

C_ABI_VERSION = 14  # DC_ABI_VERSION in custom_ops/core.h (7: the split-K workspace, the kernel causal flag;
# 8: persistent kernels: dc_launch_args.sm_count, dc_kernel_grid, dc_cuda_sm_count; the packed QKV attention layout;
# 9: the residual before the activation: dc_bundle_kernel_residual_first, dc_epilogue.residual_first;
# 10: activations 3 gelu_tanh, 4 silu, 5 relu6 in the plans, dc_epilogue and dc_bundle_check_node; the residual
# multiplied after the activation: dc_bundle_kernel_residual_mul, dc_epilogue.residual_mul; attention kernels'
# HEAD_DIM, MASK_ROWS and NAN_TO_ZERO: dc_bundle_kernel_attention, dc_bundle_check_attention (was
# dc_bundle_check_layout), which also checks the node's head_dim, mask_rows and nan_to_zero, and per launch:
# dc_launch_args.head_dim, last, dc_kernel_fit code 9; 11: grouped conv kernels: dc_bundle_kernel_grouped, and
# dc_abi_view's conv view of a node with group > 1: one group's N and K, batch = group; 12: the vendor GEMM's
# cuBLASLt path: dc_gemm_lt_plan, dc_vendor_cublaslt_load, dc_vendor_cublaslt_handle, dc_vendor_gemm_lt,
# dc_vendor_gemm_call, dc_vendor_lt_stats; 13: channels-last (NHWC) conv kernels: bundle format 11,
# dc_bundle_kernel_channels_last, dc_bundle_check_node's channels_last, dc_abi_view's 10th conv int,
# dc_conv_plan_make's channels_last and dc_conv_plan.channels_last; 14: split-K kernels take the counters (param
# 29, bundle format 12), kept per (context, stream) by dc_launch_fit)
_REPO = Path(__file__).resolve().parents[1]
# Where a platform wheel carries the library (setup.py builds it there); absent in a source checkout.
PACKAGED_DIR = Path(__file__).resolve().parent / "_lib"
_PACKAGED_NAME = "libdietcode_ort.so"
_PACKAGED_INFO = "build_info.json"
_CFLAGS = ("-std=c++17", "-O2", "-fPIC", "-Wall", "-Wextra")
# -z nodelete: onnxruntime unloads a custom-op library with the SessionOptions that registered it when no session
# kept it, and the static libstdc++ leaves ~75 KB behind at each unload (a server registering the library per
# session grew without bound); never unloaded, it is initialised once per process.
_LDFLAGS = ("-shared", "-ldl", "-pthread", "-static-libstdc++", "-Wl,--gc-sections", "-Wl,--exclude-libs,ALL",
            "-Wl,-z,nodelete")
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
    """custom_ops/ of the source checkout (or unpacked sdist) this package runs from; an installed wheel has
    none and uses the library it ships (``packaged_library``)."""
    return _REPO / "custom_ops"


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
        raise DietcodeError(f"no custom-op library: this installation has no prebuilt one "
                            f"({PACKAGED_DIR / _PACKAGED_NAME} is missing) and no sources to build one from ({src} "
                            "is not a source checkout's custom_ops/): install the dietcode-ort platform wheel "
                            "(docs/deploying.md), set DIETCODE_ORT_LIBRARY to a built libdietcode_ort.so, or run "
                            "from a source checkout")
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


def build_library(config: BuildConfig, dest: Path, jobs: int | None = None) -> float:
    """Compile and link into ``dest`` (atomically), ``jobs`` sources at a time (default: one per core, up to
    one per source); returns the seconds it took."""
    jobs = jobs or min(len(config.sources), os.cpu_count() or 2)
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


def prebuilt_library() -> Path | None:
    """The library to use without building: ``DIETCODE_ORT_LIBRARY`` when set, else the one a platform wheel
    ships (``packaged_library``); None in a source checkout, which builds its own."""
    prebuilt = os.environ.get("DIETCODE_ORT_LIBRARY")
    if prebuilt:
        if not Path(prebuilt).is_file():
            raise DietcodeError(f"DIETCODE_ORT_LIBRARY={prebuilt!r} does not exist")
        _check_abi(Path(prebuilt), "DIETCODE_ORT_LIBRARY", _REBUILD)
        return Path(prebuilt)
    return packaged_library()


def library_path(build: bool = True) -> Path:
    """Path of the custom-op library: the prebuilt one (``prebuilt_library``) when there is one, else the one
    built from the checkout's custom_ops/ for the current sources, building it first when ``build`` and
    missing."""
    prebuilt = prebuilt_library()
    if prebuilt is not None:
        return prebuilt
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


# --- the library a platform wheel ships --------------------------------------------------------------------

_REINSTALL = ("reinstall the dietcode-ort wheel built for this platform (docs/deploying.md), or set "
              "DIETCODE_ORT_LIBRARY to a libdietcode_ort.so built from the same version")
_REBUILD = ("point it at a libdietcode_ort.so built from this version of dietcode-ort (docs/deploying.md), or unset "
            "it")


def packaged_library() -> Path | None:
    """``dietcode_ort/_lib/libdietcode_ort.so`` of a platform wheel, checked to load and to have this
    package's C ABI (``dc_abi_version``); None where there is none (a source checkout). DietcodeError when it
    is there but unusable."""
    lib = PACKAGED_DIR / _PACKAGED_NAME
    if not lib.is_file():
        return None
    _check_abi(lib, "the packaged custom-op library", _REINSTALL)
    return lib


@functools.lru_cache(maxsize=None)
def _check_abi(lib: Path, what: str, remedy: str) -> None:
    """DietcodeError (``what`` names the library, ``remedy`` says what to do) unless ``lib`` loads and has this
    package's C ABI: a library of another version, or a file that is no library, fails here rather than as a
    ctypes error at its first use."""
    try:
        handle = ctypes.CDLL(str(lib))
    except OSError as exc:
        raise DietcodeError(f"{what} does not load ({exc}): {remedy}") from None
    try:
        version = handle.dc_abi_version()
    except AttributeError:
        raise DietcodeError(f"{what} ({lib}) is not a dietcode-ort custom-op library (no dc_abi_version): "
                            f"{remedy}") from None
    if version != C_ABI_VERSION:
        raise DietcodeError(f"{what} ({lib}) has C ABI version {version}, this package expects {C_ABI_VERSION}: "
                            f"{remedy}")


@dataclass(frozen=True)
class LibraryNeeds:
    """What a built library asks of the machine that loads it, read from its ELF dynamic section and version
    needs: the sonames it links (``needed``) and the symbol versions it uses (``GLIBC_2.34``, ``GCC_3.0``)."""

    needed: tuple[str, ...]
    versions: tuple[str, ...]

    def glibc(self) -> tuple[int, int]:
        """The newest glibc version it needs, as (2, 34)."""
        found = [(int(m[1]), int(m[2])) for v in self.versions
                 if (m := re.fullmatch(r"GLIBC_(\d+)\.(\d+)(?:\.\d+)?", v))]
        return max(found, default=(2, 17))


# Shared libraries a manylinux wheel may link (PEP 600 / PEP 599): the system's own C runtime and libgcc_s.
_MANYLINUX_LIBS = frozenset({"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1",
                             "libgcc_s.so.1", "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1"})


def library_needs(lib: Path) -> LibraryNeeds:
    """``readelf -d`` and ``readelf -V`` of ``lib`` (binutils, there wherever g++ is)."""
    def readelf(flag: str) -> str:
        exe = shutil.which("readelf")
        if exe is None:
            raise DietcodeError("readelf not found: install binutils (Debian/Ubuntu: apt-get install "
                                "binutils)")
        res = subprocess.run([exe, flag, "--wide", str(lib)], capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise DietcodeError(f"readelf {flag} {lib} failed: {res.stderr.strip()}")
        return res.stdout

    needed = tuple(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", readelf("-d")))
    versions = sorted(set(re.findall(r"Name: ([A-Z]+_[0-9][0-9.]*)", readelf("-V"))),
                      key=lambda v: (v.split("_")[0], [int(x) for x in v.split("_", 1)[1].split(".") if x]))
    return LibraryNeeds(needed, tuple(versions))


@dataclass(frozen=True)
class PackagedBuild:
    """``dietcode_ort/_lib/build_info.json``: how the wheel's library was built and what it needs."""

    c_abi_version: int
    key: str  # BuildConfig.key() of the sources it was built from
    compiler: str
    onnxruntime_headers: str  # the headers' package version
    ort_api_version: int  # ORT_API_VERSION it asks for: onnxruntime 1.<this> or newer
    needed: tuple[str, ...]
    symbol_versions: tuple[str, ...]
    platform_tag: str  # manylinux_2_<glibc>_<machine>


def packaged_build() -> PackagedBuild | None:
    """The build record of the packaged library, or None where there is none."""
    info = PACKAGED_DIR / _PACKAGED_INFO
    if not info.is_file():
        return None
    try:
        data: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                                for k, v in json.loads(info.read_text()).items()}
        return PackagedBuild(**data)
    except (ValueError, TypeError, AttributeError) as exc:
        raise DietcodeError(f"{info} is unreadable ({exc}): {_REINSTALL}") from None


def headers_version(ort_include: Path) -> str:
    """The ORT headers' package version (the VERSION file fetch_ort_headers.sh writes), else "unknown"."""
    version_file = ort_include.parent.parent / "VERSION"
    return version_file.read_text().strip() if version_file.is_file() else "unknown"


def build_packaged(dest_dir: Path, jobs: int | None = None) -> PackagedBuild:
    """Build the library a platform wheel ships into ``dest_dir`` (``libdietcode_ort.so`` and
    ``build_info.json``), with the flags of every build; refuse one that links anything beyond the system C
    runtime (a manylinux wheel may not) or needs a libstdc++ symbol version (it is linked statically)."""
    config = find_config()
    lib = dest_dir / _PACKAGED_NAME
    build_library(config, lib, jobs)
    needs = library_needs(lib)
    foreign = [n for n in needs.needed if n not in _MANYLINUX_LIBS]
    cxx = [v for v in needs.versions if v.startswith(("GLIBCXX_", "CXXABI_"))]
    if foreign or cxx:
        raise DietcodeError(f"{lib} is not portable: it links {', '.join(foreign) or 'nothing extra'} and "
                            f"needs {', '.join(cxx) or 'no libstdc++ version'}; only "
                            f"{', '.join(sorted(_MANYLINUX_LIBS))} may be linked, libstdc++ statically")
    c_api = (config.ort_include / "onnxruntime_c_api.h").read_text()
    api = re.search(r"#define\s+ORT_API_VERSION\s+(\d+)", c_api)
    major, minor = needs.glibc()
    info = PackagedBuild(C_ABI_VERSION, config.key(), config.compiler_version,
                         headers_version(config.ort_include), int(api.group(1)) if api else 0, needs.needed,
                         needs.versions, f"manylinux_{major}_{minor}_{platform.machine()}")
    (dest_dir / _PACKAGED_INFO).write_text(json.dumps(asdict(info), indent=2) + "\n")
    return info


def _prune(keep: Path, min_age_s: float = 600.0) -> None:
    """Remove libraries of other source versions that nothing has touched for a while, with their lock files
    (not while a process holds one: it is building or checking that version), and the staged copies of builds
    that were killed (``NAME.tmpPID``, that process gone)."""
    from dietcode_ort.paths import process_gone

    now = time.time()
    for old in keep.parent.glob("libdietcode_ort-*.so"):
        with contextlib.suppress(OSError):
            if old == keep or now - old.stat().st_mtime <= min_age_s:
                continue
            lock = old.with_suffix(".lock")
            with open(lock, "a") as fh:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                old.unlink()
                lock.unlink()
    for staged in keep.parent.glob("libdietcode_ort-*.tmp*"):
        pid = staged.suffix.removeprefix(".tmp")
        if pid.isdigit() and process_gone(int(pid)):
            staged.unlink(missing_ok=True)
