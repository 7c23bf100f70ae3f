"""The deployment checks of scripts/wheel_smoke.sh, run by the Python of a new virtual environment that holds
only the dietcode-ort wheel and the runtime's dependencies (onnxruntime-gpu, onnx, numpy, rich), with no
compiler on PATH and a custom-op library cache that cannot be created.

    python wheel_smoke.py --model M.onnx --optimized M.dietcode.onnx

Each check prints one line; the first that fails prints why and exits 1. A module of the tuner imported by
the runtime is named as such (a serving install has none of them).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

# What only the offline tuner (or tests) may import: a serving install has none of these but `tuner`.
TUNER_MODULES = ("tuner", "triton", "sklearn", "sympy", "torch", "matplotlib")
COMPILERS = ("g++", "c++", "gcc", "cc", "clang++", "clang")
# Symbolic dims per case: "batch"-like dims take the first value, every other dim the second.
CASES = ((1, 16), (2, 37), (3, 100))


class SmokeFailure(Exception):
    pass


def ok(what: str) -> None:
    print(f"wheel smoke: ok    {what}", flush=True)


def _where(exc: BaseException) -> str:
    """The file and line of the innermost frame that raised ``exc``, the import statement for an ImportError."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    return f"imported at {frames[-1].filename}:{frames[-1].lineno}" if frames else "import site unknown"


def check_environment() -> None:
    found = {c: shutil.which(c) for c in COMPILERS if shutil.which(c)}
    if found:
        raise SmokeFailure(f"a compiler is reachable, so the check would prove nothing: {found}")
    ok("no C/C++ compiler on PATH")


def check_import() -> Any:
    try:
        import dietcode_ort
    except ModuleNotFoundError as exc:
        raise SmokeFailure(f"`import dietcode_ort` needs {exc.name!r} ({_where(exc)}), which a serving install "
                           "does not have (only onnxruntime-gpu, onnx, numpy and rich): the runtime imports a tuner "
                           "dependency") from exc
    leaked = [m for m in TUNER_MODULES if m in sys.modules]
    if leaked:
        raise SmokeFailure(f"`import dietcode_ort` imported tuner modules: {', '.join(leaked)}")
    ok(f"import dietcode_ort {dietcode_ort.__version__} from {Path(dietcode_ort.__file__).parent} "
       f"(no tuner module loaded)")
    return dietcode_ort


def check_library(dietcode_ort: Any) -> Path:
    from dietcode_ort import build

    path = dietcode_ort.library_path(build=False)
    if path.parent != build.PACKAGED_DIR:
        raise SmokeFailure(f"library_path() is {path}, not the packaged library in {build.PACKAGED_DIR}")
    info = build.packaged_build()
    ok(f"packaged custom-op library {path} ({info.platform_tag if info else 'no build_info.json'})")
    return path


def feeds(session: Any, case: tuple[int, int]) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(list(case))
    out = {}
    for value in session.get_inputs():
        dims = [d if isinstance(d, int) else case[0] if "batch" in str(d).lower() else case[1] for d in value.shape]
        if "int" in value.type:
            arr = np.ones(dims, np.int64) if "mask" in value.name else rng.integers(0, 100, dims, np.int64)
            padded = min(3, arr.shape[-1] // 4) if "mask" in value.name and arr.ndim else 0
            if padded:
                arr[..., -padded:] = 0
        else:
            arr = rng.standard_normal(dims).astype(np.float32)
        out[value.name] = arr
    return out


def compare(label: str, stock: Any, other: Any) -> float:
    import numpy as np

    worst = 0.0
    for case in CASES:
        feed = feeds(stock, case)
        want = stock.run(None, feed)
        got = other.run(None, feed)
        for name, a, b in zip([o.name for o in stock.get_outputs()], want, got):
            if a.shape != b.shape:
                raise SmokeFailure(f"{label}: output {name} is {list(b.shape)}, stock ORT gives {list(a.shape)}")
            err = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if a.size else 0.0
            if not np.allclose(a, b, rtol=1e-4, atol=1e-4):
                raise SmokeFailure(f"{label}: output {name} differs from stock ORT at dims {case}: max abs error {err:.3g}")
            worst = max(worst, err)
    return worst


def check_sessions(dietcode_ort: Any, model: Path, optimized: Path) -> None:
    import onnxruntime as ort

    cpu = ["CPUExecutionProvider"]
    stock = ort.InferenceSession(str(model), providers=cpu)
    err = compare("dietcode_ort.InferenceSession", stock, dietcode_ort.InferenceSession(str(optimized), providers=cpu))
    ok(f"dietcode_ort.InferenceSession (CPU EP) matches stock onnxruntime {ort.__version__} on dims {list(CASES)} "
       f"(max abs error {err:.2g})")
    opts = ort.SessionOptions()
    dietcode_ort.reset_node_stats()
    dietcode_ort.register(opts)
    err = compare("session with the library registered", stock, ort.InferenceSession(str(optimized), opts, providers=cpu))
    stats = dietcode_ort.node_stats()
    calls = sum(s["launches"] + s["fallbacks"] for s in stats.values())
    if not calls:
        raise SmokeFailure("the library was registered but ran no ai.dietcode node (node_stats is empty)")
    ok(f"the packaged library runs the model's {len(stats)} ai.dietcode nodes ({calls} calls, CPU kernel) and "
       f"matches stock (max abs error {err:.2g})")


def check_doctor() -> None:
    exe = Path(sys.executable).parent / "dietcode-ort"
    proc = subprocess.run([str(exe), "doctor", "--json"], capture_output=True, text=True, timeout=300)
    try:
        rows = json.loads(proc.stdout)
    except ValueError:
        raise SmokeFailure(f"`dietcode-ort doctor --json` exited {proc.returncode} without JSON:\n"
                           f"{proc.stdout}\n{proc.stderr[-3000:]}") from None
    for r in rows:
        print(f"    doctor [{r['status']:>4}] {r['name']}: {r['detail']}")
    library = {r["name"]: r for r in rows}.get("custom-op library", {})
    if proc.returncode != 0 or library.get("status") != "ok":
        raise SmokeFailure(f"`dietcode-ort doctor` exited {proc.returncode}; custom-op library: {library}\n"
                           f"{proc.stderr[-3000:]}")
    ok("`dietcode-ort doctor` passes, the custom-op library check included")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--optimized", type=Path, required=True)
    args = parser.parse_args()
    try:
        check_environment()
        dietcode_ort = check_import()
        check_library(dietcode_ort)
        check_sessions(dietcode_ort, args.model, args.optimized)
        leaked = [m for m in TUNER_MODULES if m in sys.modules]
        if leaked:
            raise SmokeFailure(f"loading and running a model imported tuner modules: {', '.join(leaked)}")
        check_doctor()
    except SmokeFailure as exc:
        print(f"wheel smoke: FAIL  {exc}", flush=True)
        return 1
    except ModuleNotFoundError as exc:
        print(f"wheel smoke: FAIL  the runtime imports {exc.name!r} ({_where(exc)}), a tuner dependency a serving "
              "install does not have (only onnxruntime-gpu, onnx, numpy and rich)", flush=True)
        return 1
    except Exception as exc:  # onnxruntime's own errors among them: say which check and why, then the trace
        import traceback

        traceback.print_exc()
        print(f"wheel smoke: FAIL  {type(exc).__name__}: {exc}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
