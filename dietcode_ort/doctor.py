"""``dietcode-ort doctor``: what this machine has for running dietcode models, check by check.

Each check is a record (name, status, detail) rather than an exception, so one missing piece (no GPU on a
build machine, say) does not hide the others. Status "fail" means the runtime cannot work (no onnxruntime,
library does not build or load); "warn" means a feature is unavailable (no GPU: the CPU kernels still run).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import time
from dataclasses import asdict, dataclass
from typing import Callable

from dietcode_ort.errors import DietcodeError

__all__ = ["Check", "run_checks", "doctor_command"]


@dataclass(frozen=True)
class Check:
    """One finding: ``status`` is "ok", "warn" or "fail"; ``detail`` says what was found or what to do."""

    name: str
    status: str
    detail: str


def _guard(name: str, fn: Callable[[], Check], missing: str = "fail") -> Check:
    try:
        return fn()
    except DietcodeError as exc:
        return Check(name, missing, str(exc))
    except Exception as exc:  # a doctor reports every failure, whatever raised it
        return Check(name, missing, f"{type(exc).__name__}: {exc}")


def _cuda_library_error() -> str:
    """Why onnxruntime's CUDA provider library does not load (the dynamic loader's message), or ""."""
    import ctypes
    from pathlib import Path

    import onnxruntime as ort

    capi = Path(ort.__file__).parent / "capi"
    lib = capi / "libonnxruntime_providers_cuda.so"
    if not lib.is_file():
        return ""
    try:
        ctypes.CDLL(str(capi / "libonnxruntime_providers_shared.so"), mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(str(lib))
    except OSError as exc:
        return str(exc)
    return ""


def cuda_provider_check() -> Check:
    """Whether onnxruntime's CUDA provider is listed and can really be created: onnxruntime-gpu lists it
    even where the CUDA/cuDNN libraries are missing, and then runs every session on the CPU."""
    import onnxruntime as ort

    from dietcode_ort.runtime import provider_usable

    name = "CUDA provider"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return Check(name, "warn", "not in this onnxruntime build (install onnxruntime-gpu for GPU kernels); "
                                   "sessions run on the CPU")
    if provider_usable("CUDAExecutionProvider"):
        return Check(name, "ok", "CUDAExecutionProvider is listed and starts")
    reason = _cuda_library_error()
    return Check(name, "warn", "CUDAExecutionProvider is listed but cannot be used"
                 + (f" ({reason})" if reason else " (no GPU, or the CUDA/cuDNN libraries it needs are missing)")
                 + "; sessions fall back to the CPU and dietcode_ort.InferenceSession runs the model's "
                   "fallback functions there")


def run_checks(build: bool = True) -> list[Check]:
    """Run every check in order; building the library when ``build`` and it is not cached yet."""
    from dietcode_ort import build as b

    checks: list[Check] = []

    def onnxruntime_check() -> Check:
        import onnxruntime as ort

        return Check("onnxruntime", "ok", f"{ort.__version__}; providers: {', '.join(ort.get_available_providers())}")

    def compiler_check() -> Check:
        path, version = b._find_compiler()
        return Check("compiler", "ok", f"{path} ({version})")

    def headers_check() -> Check:
        inc = b._find_ort_include()
        version_file = inc.parent.parent / "VERSION"
        version = version_file.read_text().strip() if version_file.is_file() else "version unknown"
        return Check("onnxruntime headers", "ok", f"{inc} ({version})")

    def cuda_h_check() -> Check:
        return Check("cuda.h", "ok", str(b._find_cuda_include() / "cuda.h"))

    def cuda_ep_check() -> Check:
        return cuda_provider_check()

    checks += [_guard("onnxruntime", onnxruntime_check), _guard("CUDA provider", cuda_ep_check, missing="warn"),
               _guard("compiler", compiler_check),
               _guard("onnxruntime headers", headers_check), _guard("cuda.h", cuda_h_check)]

    core_holder: list[object] = []

    def library_check() -> Check:
        import onnxruntime as ort

        from dietcode_ort.runtime import Core

        start = time.perf_counter()
        path = b.library_path(build=build)
        took = time.perf_counter() - start
        core_holder.append(Core(path))
        ort.SessionOptions().register_custom_ops_library(str(path))
        return Check("custom-op library", "ok", f"{path} (ready in {took:.1f} s; loads into onnxruntime)")

    checks.append(_guard("custom-op library", library_check))

    def gpu_check() -> Check:
        if not core_holder:
            return Check("GPU", "warn", "not probed: the custom-op library is not available")
        info = core_holder[0].cuda_probe(0)  # type: ignore[attr-defined]
        drv = info["driver_version"]
        return Check("GPU", "ok", f"{info['name']}, sm_{info['major']}{info['minor']}, "
                                  f"driver CUDA {drv // 1000}.{drv % 1000 // 10}")

    checks.append(_guard("GPU", gpu_check, missing="warn"))

    def triton_check() -> Check:
        if importlib.util.find_spec("triton") is None:
            return Check("triton", "warn", "not installed (needed only by the offline tuner)")
        return Check("triton", "ok", f"{importlib.metadata.version('triton')} (import not attempted)")

    checks.append(_guard("triton", triton_check, missing="warn"))
    return checks


def doctor_command(as_json: bool = False, build: bool = True) -> int:
    """Print the checks; exit status 1 when any check failed, else 0."""
    checks = run_checks(build=build)
    if as_json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            print(f"[{c.status:>4}] {c.name:<{width}}  {c.detail}")
    return 1 if any(c.status == "fail" for c in checks) else 0
