"""Run the standard benchmark suites: build each model, optimize it, benchmark it against stock ORT.

    python benchmarks/run_suite.py --suite bert|resnet50|mobilenet_v2|mlp|all --provider cpu|cuda [--dtype float16]

Each suite is one row of ``SUITES``: the model builder and preset (``python -m models``), and the shapes
swept per provider. The shapes the tuner sees (``dietcode-ort optimize --shapes``) are exactly the ones
benchmarked, written as a shape log. Results go to ``benchmarks/results/<device>/<suite>-<preset>-<provider>``
with ``.json`` (``dietcode-ort bench --json``), ``.png`` and ``.txt`` (the printed table, written as it is
printed, so a run cut off keeps what it printed); ``--dtype float16`` adds ``-fp16`` to the name. The plot
is left out (with a note) where matplotlib is missing. Where optimize rewrites nothing because every tuned
workload lost to cuDNN (``--min-speedup``), the model is optimized again with ``--min-speedup 0`` and a
``.note.txt`` beside the results says so, with optimize's figures. Models and optimized models are cached under
``--workdir`` and rebuilt only with ``--rebuild``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dietcode_ort import bench, bench_report  # noqa: E402  (the repository root must be on the path first)
from dietcode_ort.errors import DietcodeError  # noqa: E402

__all__ = ["Suite", "SUITES", "slugify", "results_dir", "shape_log", "suite_tag", "suite_models", "run_suite", "main"]


@dataclass(frozen=True)
class Suite:
    """One standard benchmark: a model preset and the shapes swept on each provider."""

    name: str
    model: str                          # python -m models NAME
    preset: str
    dims: dict[str, tuple[str, ...]]    # provider -> --dim NAME=SPEC options
    ties: tuple[str, ...] = ()          # --tie NAME=OTHER options
    repeat: dict[str, int] | None = None  # provider -> timed repetitions


SUITES: dict[str, Suite] = {s.name: s for s in (
    Suite("bert", "bert", "base",
          {"cuda": ("batch=1,4,16,32", "seq=16,32,64,100,128,256,384,512"),
           "cpu": ("batch=1,4", "seq=16,32,64,100,128,256")},
          repeat={"cuda": 50, "cpu": 10}),
    Suite("resnet50", "resnet50", "full",
          {"cuda": ("batch=1,8,32", "height=160,192,224,256,288"),
           "cpu": ("batch=1,4", "height=160,224,288")},
          ties=("width=height",), repeat={"cuda": 50, "cpu": 10}),
    # grouped convs: MobileNetV2's 17 depthwise convs beside its 1x1s (the stock comparison that decides whether
    # a depthwise conv as a GEMM per group beats cuDNN)
    Suite("mobilenet_v2", "mobilenet_v2", "full",
          {"cuda": ("batch=1,8,32", "height=160,192,224,256,288"),
           "cpu": ("batch=1,4", "height=160,224,288")},
          ties=("width=height",), repeat={"cuda": 50, "cpu": 10}),
    Suite("mlp", "mlp", "llama-7b-layer",
          {"cuda": ("tokens=1,7,16,33,64,100,128,256,512,1000,2048,4096",),
           "cpu": ("tokens=1,7,16,64,100,256,512",)},
          repeat={"cuda": 100, "cpu": 10}),
)}


def slugify(text: str) -> str:
    """A device name as a folder name: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown-device"


def results_dir(base: Path, provider: str) -> Path:
    return base / slugify(bench_report.device_name(provider))


def shape_log(model: Path, suite: Suite, provider: str) -> dict:
    """The benchmarked shapes as a shape log (``{"shapes": [{input: dims}]}``) for ``optimize --shapes``."""
    info = bench.load_model_info(model)
    records = []
    for shape in bench.sweep(info.symbols, suite.dims[provider], suite.ties):
        records.append({s.name: [d if isinstance(d, int) else shape[d] for d in s.dims] for s in info.inputs})
    return {"shapes": records}


def _run(cmd: Sequence[str], what: str, log: Path | None = None) -> None:
    """Run ``cmd`` from the repository root; with ``log``, copy its output there line by line as it comes."""
    print("+", shlex.join(cmd), flush=True)
    if log is None:
        returncode = subprocess.run(cmd, cwd=ROOT).returncode
    else:
        with log.open("w") as fh, subprocess.Popen(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                print(line, end="", flush=True)
                fh.write(line)
                fh.flush()
        returncode = proc.returncode
    if returncode != 0:
        raise DietcodeError(f"{what} failed (exit {returncode}): {shlex.join(cmd)}")


DTYPE_SUFFIX = {"float32": "", "float16": "-fp16"}  # the precisions `python -m models` builds
# what optimize says when --min-speedup left every tuned workload to ORT (tuner/optimize.py) and wrote nothing
LOST = "every tuned workload lost to cuDNN"


def _optimize(cmd: Sequence[str], note: Path) -> None:
    """Run ``dietcode-ort optimize``; where it writes nothing because every tuned workload lost to cuDNN at the
    default ``--min-speedup``, run it again with ``--min-speedup 0`` and say so in ``note``: the suite's bench
    then times the kernels anyway and shows by how much the project loses, rather than the suite going missing
    from a device run. Any other failure stops the suite."""
    print("+", shlex.join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    sys.stderr.write(proc.stderr)
    if proc.returncode == 0:
        return
    if LOST not in proc.stderr or any(a.startswith("--min-speedup") for a in cmd):
        raise DietcodeError(f"dietcode-ort optimize failed (exit {proc.returncode}): {shlex.join(cmd)}")
    note.parent.mkdir(parents=True, exist_ok=True)
    note.write_text("optimize at the default --min-speedup rewrote nothing: every tuned workload lost to cuDNN "
                    "(its figures:)\n" + proc.stderr + "\nthe bench beside this file times the model optimized "
                    "with --min-speedup 0, every workload rewritten: what a user gets is stock ORT\n")
    _run([*cmd, "--min-speedup", "0"], "dietcode-ort optimize --min-speedup 0")


def suite_tag(suite: Suite, preset: str | None = None, dtype: str = "float32") -> str:
    """The suite's file name stem: ``<suite>-<preset>`` plus ``-fp16`` for float16 (``bert-base-fp16``)."""
    if dtype not in DTYPE_SUFFIX:
        raise DietcodeError(f"unknown dtype {dtype!r}; allowed: {', '.join(DTYPE_SUFFIX)}")
    return f"{suite.name}-{preset or suite.preset}{DTYPE_SUFFIX[dtype]}"


def suite_models(suite: Suite, provider: str, workdir: Path, note: Path, *, preset: str | None = None,
                 dtype: str = "float32", rebuild: bool = False, optimize_args: Sequence[str] = ()) -> tuple[Path, Path]:
    """The suite's model and its model optimized for the suite's sweep on ``provider``, both under ``workdir``:
    reused when there (and the optimized one is not older), else built (``python -m models``) and optimized
    (``dietcode-ort optimize --shapes``, ``optimize_args`` added; ``note`` as in ``_optimize``)."""
    preset = preset or suite.preset
    tag = suite_tag(suite, preset, dtype)
    workdir.mkdir(parents=True, exist_ok=True)
    model, optimized = workdir / f"{tag}.onnx", workdir / f"{tag}.{provider}.dietcode.onnx"
    py = sys.executable
    if rebuild or not model.exists():
        _run([py, "-m", "models", suite.model, "--preset", preset, "--dtype", dtype, "-o", str(model)],
             "building the model")
    if rebuild or not optimized.exists() or optimized.stat().st_mtime < model.stat().st_mtime:
        shapes = workdir / f"{tag}.{provider}.shapes.json"
        shapes.write_text(json.dumps(shape_log(model, suite, provider), indent=1) + "\n")
        note.unlink(missing_ok=True)  # about an earlier optimized model
        _optimize([py, "-m", "dietcode_ort", "optimize", str(model), "-o", str(optimized), "--shapes", str(shapes),
                   *optimize_args], note)
    return model, optimized


def run_suite(suite: Suite, provider: str, workdir: Path, results: Path, *, preset: str | None = None,
              repeat: int | None = None, warmup: int = 5, rebuild: bool = False,
              optimize_args: Sequence[str] = (), dtype: str = "float32", plot: bool = True) -> Path:
    """Build, optimize and benchmark one suite; returns the JSON results file."""
    out = results_dir(results, provider)
    stem = out / f"{suite_tag(suite, preset, dtype)}-{provider}"
    model, optimized = suite_models(suite, provider, workdir, Path(f"{stem}.note.txt"), preset=preset, dtype=dtype,
                                    rebuild=rebuild, optimize_args=optimize_args)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "dietcode_ort", "bench", str(model), "--optimized", str(optimized),
           "--provider", provider, "--repeat", str(repeat or (suite.repeat or {}).get(provider, 20)),
           "--warmup", str(warmup), "--json", f"{stem}.json"]
    if plot and importlib.util.find_spec("matplotlib") is not None:
        cmd += ["--plot", f"{stem}.png"]
    elif plot:
        print("note: matplotlib is not installed here: no plot", flush=True)
    cmd += [a for d in suite.dims[provider] for a in ("--dim", d)]
    cmd += [a for t in suite.ties for a in ("--tie", t)]
    _run(cmd, "dietcode-ort bench", log=Path(f"{stem}.txt"))
    return Path(f"{stem}.json")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", required=True, choices=[*SUITES, "all"])
    p.add_argument("--provider", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--preset", help="model preset instead of the suite's (e.g. tiny for a quick check)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPE_SUFFIX),
                   help="model precision (default float32); float16 adds -fp16 to the names")
    p.add_argument("--no-plot", action="store_true", help="do not draw the latency plot")
    p.add_argument("--repeat", type=int, help="timed repetitions per shape instead of the suite's")
    p.add_argument("--warmup", type=int, default=5, help="untimed repetitions per shape (default 5)")
    p.add_argument("--workdir", type=Path, default=ROOT / ".cache" / "benchmarks",
                   help="where models and optimized models are cached (default .cache/benchmarks)")
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results",
                   help="results root; files go to RESULTS/<device>/ (default benchmarks/results)")
    p.add_argument("--rebuild", action="store_true", help="rebuild and re-optimize even if cached")
    p.add_argument("--optimize-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `dietcode-ort optimize` (repeat for several)")
    args = p.parse_args(argv)
    names = list(SUITES) if args.suite == "all" else [args.suite]
    try:
        for name in names:
            path = run_suite(SUITES[name], args.provider, args.workdir, args.results, preset=args.preset,
                             repeat=args.repeat, warmup=args.warmup, rebuild=args.rebuild,
                             optimize_args=args.optimize_arg, dtype=args.dtype, plot=not args.no_plot)
            print(f"wrote {path}")
    except DietcodeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
