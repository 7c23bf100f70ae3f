"""``dietcode-ort doctor``: what this machine has for running dietcode models, check by check.

Each check is a record (name, status, detail) rather than an exception, so one missing piece (no GPU on a
build machine, say) does not hide the others. Status "fail" means the runtime cannot work (no onnxruntime,
library does not build or load); "warn" means a feature is unavailable (no GPU: the CPU kernels still run);
"skip" means the check does not apply here (no compiler or headers are needed beside a prebuilt library).
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import importlib.util
import io
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from dietcode_ort.errors import DietcodeError

if TYPE_CHECKING:
    from dietcode_ort.bundle import BundleKernel

__all__ = ["Check", "LibraryLoad", "cuda_library_sonames", "load_libraries", "cuda_libraries_check", "run_checks",
           "doctor_command", "model_check"]


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


@dataclass(frozen=True)
class LibraryLoad:
    """Whether the dynamic loader can load ``soname``: ``detail`` is the file it loaded (and how it was found),
    or the loader's reason when it could not."""

    soname: str
    loaded: bool
    detail: str


_CUDNN_MAJOR = 9  # cuDNN 9: what onnxruntime-gpu builds against since 1.19


def cuda_library_sonames() -> tuple[str, ...]:
    """The CUDA libraries onnxruntime-gpu's CUDA provider loads, for the CUDA major version it was built with
    (``onnxruntime.cuda_version``); none for an onnxruntime without CUDA."""
    import onnxruntime as ort

    major = str(getattr(ort, "cuda_version", "") or "").split(".")[0]
    if not major.isdigit():
        return ()
    return (f"libcudart.so.{major}", f"libcublas.so.{major}", f"libcublasLt.so.{major}",
            f"libcudnn.so.{_CUDNN_MAJOR}")


def _loaded_file(soname: str) -> str:
    """The file a loaded library came from (this process's memory map), else ""."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split(maxsplit=5)[-1]
            if Path(path).name.startswith(soname):
                return path
    return ""


def load_libraries(sonames: Sequence[str], preload: Callable[[], object] | None = None) -> list[LibraryLoad]:
    """Load each soname with ``ctypes.CDLL`` (the dynamic loader's own search: LD_LIBRARY_PATH, ldconfig's
    cache, ...); when some fail and ``preload`` is given (``onnxruntime.preload_dlls``, which loads the nvidia-*
    pip wheels' copies), run it with its printing silenced and try those again. A missing library's detail is
    the loader's reason."""
    def attempt(soname: str, how: str = "") -> LibraryLoad:
        try:
            ctypes.CDLL(soname)
        except OSError as exc:
            return LibraryLoad(soname, False, str(exc))
        return LibraryLoad(soname, True, (_loaded_file(soname) or "loaded") + how)

    loads = [attempt(s) for s in sonames]
    if preload is not None and not all(r.loaded for r in loads):
        failure = ""
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                preload()
        except Exception as exc:  # a doctor reports what went wrong, whatever raised it
            failure = f" (onnxruntime.preload_dlls() failed: {type(exc).__name__}: {exc})"
        loads = [r if r.loaded else attempt(r.soname, " (found by onnxruntime.preload_dlls())") for r in loads]
        loads = [r if r.loaded else LibraryLoad(r.soname, False, r.detail + failure) for r in loads]
    return loads


def cuda_libraries_check() -> Check:
    """Which CUDA libraries ORT's CUDA provider needs and can load here (also after
    ``onnxruntime.preload_dlls()``): warn naming each missing one with the loader's reason (the CPU EP still
    runs every model)."""
    import onnxruntime as ort

    name = "CUDA libraries"
    sonames = cuda_library_sonames()
    if not sonames:
        return Check(name, "skip", f"onnxruntime {ort.__version__} is not built with CUDA")
    preload = getattr(ort, "preload_dlls", None)
    loads = load_libraries(sonames, preload)
    loaded = ", ".join(f"{r.soname} ({r.detail})" for r in loads if r.loaded)
    missing = "; ".join(r.detail for r in loads if not r.loaded)
    if not missing:
        return Check(name, "ok", f"loaded: {loaded}")
    return Check(name, "warn", (f"loaded: {loaded}; " if loaded else "") + f"missing: {missing}"
                 + (" (also after onnxruntime.preload_dlls())" if preload else "")
                 + ". The CUDA EP needs them: pip install 'dietcode-ort[cuda]' (onnxruntime-gpu's CUDA and "
                   "cuDNN wheels), or put a CUDA toolkit's and cuDNN's libraries on LD_LIBRARY_PATH")


def _cannot_run(kernel: "BundleKernel", driver: int, device: tuple[int, int] | None) -> str:
    """Why a CUDA session would find ``kernel`` unable to run (dc_bundle_fit_device's decision, from what doctor
    knows: the driver, and the device's compute capability when given), "" when it can. Without a device a
    kernel is only known unable when every image of it needs a newer driver."""
    from dietcode_ort.bundle import select_image
    from dietcode_ort.toolchain import format_driver

    if device is not None:
        try:
            select_image(kernel, device[0], device[1], driver)
        except DietcodeError as exc:
            return str(exc)
        return ""
    images = kernel.all_images()
    if images and all(chain.min_driver > driver for _, chain in images):
        oldest = min(chain.min_driver for _, chain in images)
        return (f"kernel {kernel.name!r}: every image needs a newer driver (the oldest needs >= "
                f"{format_driver(oldest)}), this driver is {format_driver(driver)}")
    return ""


def _node_names(nodes: Sequence[str], shown: int = 3) -> str:
    """'a', 'b', 'c' and 4 more."""
    names = ", ".join(repr(n) for n in nodes[:shown])
    return names + (f" and {len(nodes) - shown} more" if len(nodes) > shown else "")


def model_check(path: str, driver: int | None, device: tuple[int, int] | None = None,
                driver_source: str = "") -> Check:
    """Whether an optimized model's kernel images load under a CUDA driver of version ``driver``
    (cuDriverGetVersion's encoding; None: no driver here) and, with ``device`` (compute capability), which
    kernels would run as ORT's kernel on it: each image's recorded minimum driver against the driver, and the
    image choice of docs/bundle.md. "warn" when some image needs a newer driver (a MatMul/Gemm/Conv kernel
    runs as ORT's kernel where no other image of it loads) or there is no driver to compare with. "fail" when
    no kernel of an Attention node's bundle can run: Attention has no vendor path, so the custom op refuses
    to create the CUDA session (AttentionKernel::FitDevice in custom_ops/attention.cc); an Attention bundle
    that some kernels can still run only fails the calls its tree sends to the others (a warning)."""
    from pathlib import Path

    from dietcode_ort.bundle import LIBRARY_OP_TYPES, Bundle, is_attention, node_bundles, read_bundle
    from dietcode_ort.inspect_model import load_optimized, renamed_note
    from dietcode_ort.toolchain import format_driver, format_isa

    name = f"model {Path(path).name}"
    model = load_optimized(path)  # what inspect reads, with its errors (the check reports them)
    bundles: dict[str, Bundle] = {}
    users: dict[str, list[tuple[str, str]]] = {}  # bundle initializer -> (node, op type) of each node taking it
    for where in node_bundles(model, str(Path(path).parent)):
        users.setdefault(where.initializer, []).append((where.node, where.op_type))
        if where.initializer not in bundles:
            try:
                bundles[where.initializer] = read_bundle(where.payload)
            except DietcodeError as exc:
                raise DietcodeError(f"node {where.node!r}: {exc}") from None
    if not bundles:
        return Check(name, "warn", "no ai.dietcode nodes (not optimized by dietcode-ort)")
    renamed = renamed_note([(node, op_type) for users_of in users.values() for node, op_type in users_of
                            if op_type not in LIBRARY_OP_TYPES])
    kernels = [k for b in bundles.values() for k in b.kernels if k.kind == "triton"]
    groups: dict[str, int] = {}
    refused: dict[str, int] = {}
    for kernel in kernels:
        for choice, chain in kernel.all_images():
            label = (f"{choice.kind} {choice.arch} (triton {chain.triton or '?'}, ptxas {chain.ptxas or '?'}, "
                     f"PTX ISA {format_isa(chain.ptx_isa) if chain.ptx_isa else '?'}) needs driver >= "
                     + (format_driver(chain.min_driver) if chain.min_driver else "? (not recorded)"))
            groups[label] = groups.get(label, 0) + 1
            if driver is not None and chain.min_driver > driver:
                refused[label] = refused.get(label, 0) + 1
    summary = f"{len(kernels)} compiled kernels in {len(bundles)} bundles"
    if driver is None:
        return Check(name, "warn", f"{summary}; " + (f"{renamed}; " if renamed else "")
                     + "no driver on this machine, nothing to compare; the images: "
                     + "; ".join(f"{label}: {n}" for label, n in sorted(groups.items())))
    here = f"this driver is {format_driver(driver)}{driver_source}"
    lines = [renamed] if renamed else []
    lines += [f"{label}, {here}: {n} image(s) would not load" for label, n in sorted(refused.items())]
    on = f"under driver {format_driver(driver)}{driver_source}" + (
        f" on sm_{device[0]}{device[1]}" if device is not None else "")
    again = f"--min-driver {format_driver(driver)}" + (f" --target sm_{device[0]}{device[1]}"
                                                       if device is not None else "")
    failures: list[str] = []
    vendor: list[str] = []  # MatMul/Gemm/Conv kernels: the node runs ORT's kernel for them
    for initializer, bundle in bundles.items():
        compiled = [k for k in bundle.kernels if k.kind == "triton"]
        unfit = [why for why in (_cannot_run(k, driver, device) for k in compiled) if why]
        if not unfit:
            continue
        attention = [node for node, op_type in users[initializer] if is_attention(op_type)]
        if not attention:
            vendor += unfit
        elif len(unfit) == len(compiled):
            failures.append(f"Attention node(s) {_node_names(attention)}: no kernel of their bundle can run {on}, "
                            "and Attention has no vendor path: the custom op would refuse to create the CUDA "
                            f"session; first: {unfit[0]} (optimize the original model again with {again})")
        else:
            lines.append(f"Attention node(s) {_node_names(attention)}: {len(unfit)} of their bundle's "
                         f"{len(compiled)} kernels cannot run {on}, and Attention has no vendor path: a call the "
                         f"dispatch tree sends to one of those fails; first: {unfit[0]}")
    if device is not None and vendor:
        major, minor = device
        lines.append(f"{len(vendor)} kernel(s) would run as ORT's kernel on sm_{major}{minor}; first: {vendor[0]}")
    if failures:
        return Check(name, "fail", f"{summary}; " + "; ".join(failures + lines))
    if lines:
        return Check(name, "warn", f"{summary}; " + "; ".join(lines))
    loads = f"every image loads under driver {format_driver(driver)}{driver_source}"
    return Check(name, "ok", f"{summary}; {loads}" + (f" and every kernel has an image for sm_{device[0]}{device[1]}"
                                                       if device is not None else ""))


def run_checks(build: bool = True, model: str | None = None, driver: int | None = None) -> list[Check]:
    """Run every check in order; building the library when ``build`` and it is not cached yet. With
    ``model``, also whether its kernels load under ``driver`` (else the driver libcuda reports)."""
    from dietcode_ort import build as b

    checks: list[Check] = []

    def onnxruntime_check() -> Check:
        import onnxruntime as ort

        return Check("onnxruntime", "ok", f"{ort.__version__}; providers: {', '.join(ort.get_available_providers())}")

    prebuilt: list[Path | None] = []

    def build_tool(name: str, find: Callable[[], str]) -> Callable[[], Check]:
        """A check of what the source build needs; "skip" beside a prebuilt library, which needs none of it."""
        def check() -> Check:
            if not prebuilt:
                try:
                    prebuilt.append(b.prebuilt_library())
                except DietcodeError:  # a bad prebuilt library: the library check below says what is wrong
                    prebuilt.append(None)
            if prebuilt[0] is not None:
                return Check(name, "skip", f"not needed: the library is prebuilt ({prebuilt[0]})")
            return Check(name, "ok", find())
        return check

    def compiler() -> str:
        path, version = b._find_compiler()
        return f"{path} ({version})"

    def headers() -> str:
        inc = b._find_ort_include()
        return f"{inc} ({b.headers_version(inc)})"

    def cuda_ep_check() -> Check:
        return cuda_provider_check()

    checks += [_guard("onnxruntime", onnxruntime_check), _guard("CUDA provider", cuda_ep_check, missing="warn"),
               _guard("CUDA libraries", cuda_libraries_check, missing="warn"),
               _guard("compiler", build_tool("compiler", compiler)),
               _guard("onnxruntime headers", build_tool("onnxruntime headers", headers)),
               _guard("cuda.h", build_tool("cuda.h", lambda: str(b._find_cuda_include() / "cuda.h")))]

    core_holder: list[object] = []

    def library_check() -> Check:
        import onnxruntime as ort

        from dietcode_ort.runtime import Core

        start = time.perf_counter()
        path = b.library_path(build=build)
        took = time.perf_counter() - start
        core_holder.append(Core(path))
        ort.SessionOptions().register_custom_ops_library(str(path))
        packaged = b.packaged_build() if path.parent == b.PACKAGED_DIR else None
        origin = (f"shipped in the wheel, built for onnxruntime >= 1.{packaged.ort_api_version}, "
                  f"{packaged.platform_tag}" if packaged else f"ready in {took:.1f} s")
        return Check("custom-op library", "ok", f"{path} ({origin}; loads into onnxruntime)")

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
    if model is not None:
        checks.append(_guard(f"model {model}", lambda: _model_here(model, driver, core_holder)))
    return checks


def _model_here(model: str, driver: int | None, core_holder: list[object]) -> Check:
    """model_check against the given driver, else this machine's (through the library's libcuda), with the
    device's compute capability when a GPU answers."""
    device = None
    source = " (given)" if driver is not None else ""
    if core_holder:
        core = core_holder[0]
        try:
            info = core.cuda_probe(0)  # type: ignore[attr-defined]
            device = (int(info["major"]), int(info["minor"]))
        except DietcodeError:
            device = None
        if driver is None:
            try:
                driver = int(core.driver_version())  # type: ignore[attr-defined]
                source = " (libcuda)"
            except DietcodeError:
                driver = None
    return model_check(model, driver, device, source)


def doctor_command(as_json: bool = False, build: bool = True, model: str | None = None,
                   driver: int | None = None) -> int:
    """Print the checks; exit status 1 when any check failed, else 0."""
    checks = run_checks(build=build, model=model, driver=driver)
    if as_json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            print(f"[{c.status:>4}] {c.name:<{width}}  {c.detail}")
    return 1 if any(c.status == "fail" for c in checks) else 0
