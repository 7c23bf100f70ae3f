"""The Python half of ``benchmarks/device_run.sh``: what the shell runner cannot say by itself.

    python benchmarks/device_info.py slug --provider cuda|cpu      the results folder name of this device
    python benchmarks/device_info.py preflight --json FILE         which modules the stages need are missing
    python benchmarks/device_info.py environment --json FILE       device, driver, clocks, library versions
    python benchmarks/device_info.py metadata --work DIR --json F  environment + every call and step so far
    python benchmarks/device_info.py bundles --out DIR MODEL...    each optimized model's bundles and inspect
    python benchmarks/device_info.py backup-db SRC DST             a consistent copy of a SQLite database

Each subcommand works on a machine without a GPU (the GPU fields then say so), imports only what it
needs, and never fails because an optional library is missing: a record of what is missing is the point.
"""
from __future__ import annotations

import argparse
import datetime
import gzip
import hashlib
import importlib
import importlib.util
import json
import os
import platform
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

__all__ = ["NEEDED", "OPTIONAL", "preflight", "environment", "metadata", "extract_bundles", "main"]

# module -> the stages that import it (the GPU image is expected to hold all of them; see docs/device.md)
NEEDED = {"numpy": "all", "onnx": "all", "onnxruntime": "all", "sympy": "scan (symbolic shape inference)",
          "rich": "record_table, optimize progress, tables", "sklearn": "optimize (dispatch tree, cost model)",
          "triton": "optimize, record_table (kernels)", "torch": "GPU measurement", "pytest": "stage 1"}
OPTIONAL = {"matplotlib": "plots (left out without it)"}


def slug(provider: str) -> str:
    sys.path.insert(0, str(HERE))
    from run_suite import slugify

    from dietcode_ort.bench_report import device_name

    return slugify(device_name(provider))


def preflight() -> dict[str, Any]:
    """Which of the modules the stages import are missing (found by spec, not imported)."""
    missing = {m: why for m, why in NEEDED.items() if importlib.util.find_spec(m) is None}
    optional = {m: why for m, why in OPTIONAL.items() if importlib.util.find_spec(m) is None}
    return {"python": sys.executable, "version": platform.python_version(), "missing": missing,
            "missing_optional": optional}


def _version(module: str) -> str | None:
    try:
        return str(importlib.import_module(module).__version__)
    except Exception as exc:  # a record of what is there: an import failure is an answer too
        return f"unavailable ({type(exc).__name__}: {str(exc)[:120]})"


SMI_FIELDS = ["name", "driver_version", "pci.bus_id", "memory.total", "clocks.sm", "clocks.mem", "clocks.max.sm",
              "clocks.max.mem", "clocks.applications.graphics", "power.draw", "power.limit", "temperature.gpu",
              "pstate", "compute_mode", "mig.mode.current", "persistence_mode"]
SMI_BASIC = ["name", "driver_version", "memory.total", "clocks.sm", "clocks.mem", "clocks.max.sm", "power.draw",
             "temperature.gpu"]


def _nvidia_smi() -> dict[str, str] | str:
    """The first GPU's name, driver, clocks and power as nvidia-smi reads them (read only: nothing is set);
    a driver that refuses a field gets the basic set instead."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "nvidia-smi not found"
    errors = []
    for fields in (SMI_FIELDS, SMI_BASIC):
        try:
            proc = subprocess.run([exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"nvidia-smi failed: {exc}"
        if proc.returncode == 0 and proc.stdout.strip():
            return dict(zip(fields, (v.strip() for v in proc.stdout.splitlines()[0].split(","))))
        errors.append(f"exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[:200]}")
    return "nvidia-smi " + "; ".join(errors)


def _torch() -> dict[str, Any]:
    try:
        import torch
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    out: dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda,
                           "cuda_available": bool(torch.cuda.is_available())}
    try:
        out["cudnn"] = torch.backends.cudnn.version()
        out["allow_tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
        if out["cuda_available"]:
            props = torch.cuda.get_device_properties(0)
            out.update(device=props.name, capability=f"sm_{props.major}{props.minor}",
                       sms=props.multi_processor_count, memory_bytes=props.total_memory,
                       l2_bytes=getattr(props, "L2_cache_size", None))
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def _onnxruntime() -> dict[str, Any]:
    try:
        import onnxruntime as ort
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"version": ort.__version__, "file": ort.__file__, "providers": ort.get_available_providers()}


def _source() -> dict[str, Any]:
    """The commit the working tree came from: git here, or what scripts/prepare_device.sh wrote beside it."""
    for candidate in (ROOT / ".device" / "source.json",):
        if candidate.is_file():
            return json.loads(candidate.read_text())
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        commit = ""
    return {"commit": commit or "unknown"}


def environment() -> dict[str, Any]:
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            "python_executable": sys.executable, "nvidia_smi": _nvidia_smi(), "torch": _torch(),
            "triton": _version("triton"), "onnxruntime": _onnxruntime(), "numpy": _version("numpy"),
            "onnx": _version("onnx"), "sklearn": _version("sklearn"), "source": _source(),
            "env": {k: os.environ.get(k, "") for k in ("PYTHONPATH", "LD_LIBRARY_PATH", "DIETCODE_ORT_INCLUDE",
                                                        "DIETCODE_CACHE", "CUDA_VISIBLE_DEVICES")}}


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def metadata(work: Path) -> dict[str, Any]:
    """Every call's environment (``WORK/calls.jsonl``) and every step (``WORK/steps.jsonl``) so far."""
    calls = _jsonl(work / "calls.jsonl")
    for call in calls:
        env_file = work / f"environment-{call['call']}.json"
        if env_file.is_file():
            call["environment"] = json.loads(env_file.read_text())
    steps = _jsonl(work / "steps.jsonl")
    return {"schema": "dietcode-ort-device-run/1", "calls": calls, "steps": steps,
            "timed_out": [f"stage {s['stage']}: {s['step']}" for s in steps if s.get("timed_out")],
            "failed": [f"stage {s['stage']}: {s['step']} (exit {s['rc']})" for s in steps
                       if s.get("rc") not in (0, None) and not s.get("timed_out")]}


def extract_bundles(models: Sequence[Path], out: Path) -> dict[str, Any]:
    """Per optimized model: the distinct bundles of its ai.dietcode nodes (``<sha256[:16]>.bundle.xz``: xz
    makes them about 12 times smaller, and the committed results travel with every device call), an index
    mapping nodes to them, and ``dietcode-ort inspect --json``; no weights."""
    import lzma

    import onnx

    from dietcode_ort.bundle import dietcode_nodes, node_bundles
    from dietcode_ort.inspect_model import describe

    index: dict[str, Any] = {}
    for path in models:
        model = onnx.load(str(path), load_external_data=False)
        folder = out / path.name.removesuffix(".onnx")
        folder.mkdir(parents=True, exist_ok=True)
        nodes = {}
        custom = [d.node for d in dietcode_nodes(model)]
        for node, bundle in zip(custom, node_bundles(model, str(path.parent))):  # each bundle is a shared input
            name = hashlib.sha256(bundle.payload).hexdigest()[:16] + ".bundle.xz"
            if not (folder / name).exists():
                (folder / name).write_bytes(lzma.compress(bundle.payload, preset=9 | lzma.PRESET_EXTREME))
            nodes[node.name or node.output[0]] = name
        (folder / "index.json").write_text(json.dumps({"model": path.name, "nodes": nodes}, indent=1) + "\n")
        try:
            text = json.dumps({"nodes": describe(model, path.parent)}, indent=1) + "\n"
            (folder / "inspect.json.gz").write_bytes(gzip.compress(text.encode(), 9))  # every node's kernels: big
        except Exception as exc:  # the bundles are kept even if a description fails
            (folder / "inspect.error.txt").write_text(f"{type(exc).__name__}: {exc}\n")
        index[path.name] = {"custom_nodes": len(nodes), "bundles": len(set(nodes.values()))}
    return index


def backup_db(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(dst.suffix + ".tmp")
    tmp.unlink(missing_ok=True)
    with sqlite3.connect(str(src)) as a, sqlite3.connect(str(tmp)) as b:
        a.backup(b)
    tmp.replace(dst)


def _write(path: str | None, data: Any) -> None:
    text = json.dumps(data, indent=2, default=str) + "\n"
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    else:
        print(text, end="")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("slug")
    s.add_argument("--provider", default="cuda", choices=["cuda", "cpu"])
    for name in ("preflight", "environment"):
        sub.add_parser(name).add_argument("--json")
    m = sub.add_parser("metadata")
    m.add_argument("--work", type=Path, required=True)
    m.add_argument("--json")
    b = sub.add_parser("bundles")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("models", type=Path, nargs="*")
    d = sub.add_parser("backup-db")
    d.add_argument("src", type=Path)
    d.add_argument("dst", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "slug":
        print(slug(args.provider))
    elif args.cmd == "preflight":
        report = preflight()
        _write(args.json, report)
        for module, why in report["missing"].items():
            print(f"preflight: MISSING {module} (needed by {why})", file=sys.stderr)
        for module, why in report["missing_optional"].items():
            print(f"preflight: missing {module}: {why}", file=sys.stderr)
    elif args.cmd == "environment":
        _write(args.json, environment())
    elif args.cmd == "metadata":
        _write(args.json, metadata(args.work))
    elif args.cmd == "bundles":
        _write(str(args.out / "index.json"), extract_bundles(args.models, args.out))
    else:
        if not args.src.is_file():
            print(f"error: no database at {args.src}", file=sys.stderr)
            return 2
        backup_db(args.src, args.dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
