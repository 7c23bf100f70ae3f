"""The same models under PyTorch: eager and torch.compile (Inductor), shape by shape, with compile costs.

    python benchmarks/torch_compile.py bert --preset base --dtype float16 --device cuda \\
        --dim batch=1,16 --dim seq=16,128,512 --json OUT.json [--onnx MODEL.onnx] [--modes ...]

The module is models/torch_models.py's, holding the weights of the ONNX model that ``dietcode-ort bench``
runs (built from the same preset, dtype and seed, or read from ``--onnx``), and the inputs are bench's
own (``dietcode_ort.bench.make_feeds``, same ``--seed``), so a shape's figures here and in a bench JSON
of the same sweep are for the same computation: ``benchmarks/torch_report.py`` joins the two.

Modes (``--modes``, eager always runs first: it is the reference):

- ``eager``: the module as is;
- ``dynamic``: ``torch.compile(dynamic=True)``;
- ``mark_dynamic``: ``torch.compile()`` with ``torch._dynamo.mark_dynamic`` on every symbolic dim of the
  inputs (the ONNX model's ``batch``, ``seq``, ``height``, ...);
- ``max-autotune``: ``torch.compile(dynamic=True, mode="max-autotune")`` (GEMM/conv template autotuning,
  and CUDA graphs on cuda); ``--autotune-shapes N`` runs it on N shapes of the sweep only;
- ``default``: ``torch.compile()`` as is (static first, automatically dynamic after a recompile).

Protocol, per mode, one mode after another: ``torch._dynamo.reset()`` and a fresh, empty Inductor/Triton
cache folder (so every compile is paid in full, as on a new machine); the first call on bench's warm-up
shape (not in the sweep) is the compile; then the first call of every swept shape (a recompile when
dynamo's guards fail: the frames compiled there are counted) with its outputs checked against eager's
(bench's tolerances); then ``--warmup`` untimed and ``--repeat`` timed calls per shape (median, p90). On
cuda each call is synchronized before and after. A call that raises is recorded with its error and the
run goes on; the JSON is re-written after every shape, so a run cut off keeps what it measured.
``--budget-s`` shares a time budget among the compiled modes: a mode past its share skips the shapes left
(recorded as skipped).
"""
from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from dietcode_ort import bench  # noqa: E402  (the repository root must be on the path first)
from dietcode_ort.errors import DietcodeError  # noqa: E402

__all__ = ["SCHEMA", "MODES", "DEFAULT_MODES", "TorchOptions", "ShapeRun", "ModeRun", "autotune_subset",
           "run", "main"]

SCHEMA = "dietcode-ort-torch-compile/1"
# mode -> torch.compile keyword arguments (None: eager); "mark" is ours: mark the symbolic dims dynamic
MODES: dict[str, dict[str, Any] | None] = {
    "eager": None,
    "dynamic": {"dynamic": True},
    "mark_dynamic": {"dynamic": None, "mark": True},
    "max-autotune": {"dynamic": True, "mode": "max-autotune"},
    "default": {"dynamic": None},
}
DEFAULT_MODES = ("eager", "dynamic", "mark_dynamic", "max-autotune")
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class TorchOptions:
    model: str                         # models/ name: bert, resnet50, mlp
    preset: str
    dtype: str = "float32"
    seed: int = 0
    onnx: Path | None = None           # read the weights from this file instead of building them
    dims: tuple[str, ...] = ()
    ties: tuple[str, ...] = ()
    device: str = "cpu"
    modes: tuple[str, ...] = DEFAULT_MODES
    repeat: int = 20
    warmup: int = 3
    autotune_shapes: int | None = None  # max-autotune on this many shapes of the sweep (None: all)
    budget_s: float | None = None       # time shared among the compiled modes
    check_onnx: bool = True             # eager vs onnxruntime (CPU) on the sweep's smallest shape
    json_path: Path | None = None
    command: str = ""


@dataclass
class ShapeRun:
    """One mode at one shape: the first call (compile or recompile), steady state, agreement with eager."""

    dims: dict[str, int]
    first_call: float | None = None
    frames_compiled: int = 0           # dynamo frames compiled during the first call (0: no recompile)
    recompile_reasons: tuple[str, ...] = ()  # the guards that failed at the first call (dynamo's words)
    times: tuple[float, ...] = ()
    steady_frames: int = 0             # frames compiled during the steady state (should stay 0)
    max_abs_error: float | None = None
    agrees: bool | None = None
    error: str | None = None
    skipped: str | None = None

    def as_json(self) -> dict[str, Any]:
        ms = None if not self.times else bench.Timing(self.times, self.first_call).as_json()
        return {"times_ms": ms["times_ms"] if ms else [], "median_ms": ms["median_ms"] if ms else None,
                "p90_ms": ms["p90_ms"] if ms else None,
                "first_call_ms": None if self.first_call is None else self.first_call * 1e3,
                "frames_compiled": self.frames_compiled, "recompile_reasons": list(self.recompile_reasons),
                "steady_frames_compiled": self.steady_frames,
                "max_abs_error": self.max_abs_error, "agrees": self.agrees, "error": self.error,
                "skipped": self.skipped}

    @property
    def median(self) -> float | None:
        return float(np.median(self.times)) if self.times else None


@dataclass
class ModeRun:
    mode: str
    options: dict[str, Any] | None
    compile: ShapeRun | None = None    # the first call of the mode, on the warm-up shape
    shapes: list[ShapeRun] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def frames_compiled(self) -> int:
        runs = [self.compile] if self.compile else []
        return sum(r.frames_compiled + r.steady_frames for r in [*runs, *self.shapes])

    def as_json(self) -> dict[str, Any]:
        frames = self.frames_compiled
        return {"options": self.options, "compile": None if self.compile is None else
                {"dims": self.compile.dims, **self.compile.as_json()},
                "frames_compiled": frames, "recompiles": max(frames - 1, 0) if self.options else 0,
                "seconds": self.seconds}


def autotune_subset(shapes: Sequence[Mapping[str, int]], n: int | None) -> list[int]:
    """Indices of ``n`` shapes spread over the sweep (first and last included), all when n is None."""
    if n is None or n >= len(shapes):
        return list(range(len(shapes)))
    if n <= 0:
        return []
    if n == 1:
        return [0]
    return sorted({round(i * (len(shapes) - 1) / (n - 1)) for i in range(n)})


# --- torch ----------------------------------------------------------------------------------------------

def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:400]


class _Mode:
    """One mode's callable: compiled (or not), inputs on the device, marked dynamic where asked."""

    def __init__(self, torch: Any, module: Any, options: dict[str, Any] | None, device: str,
                 symbolic: Mapping[str, tuple[int, ...]]) -> None:
        self.torch, self.device, self.symbolic = torch, device, symbolic
        self.mark = bool(options and options.get("mark"))
        kwargs = {k: v for k, v in (options or {}).items() if k != "mark"}
        self.fn = module if options is None else torch.compile(module, **kwargs)
        self.compiled = options is not None
        step = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None)
        self.step = step if self.compiled and device == "cuda" else None

    def inputs(self, feeds: Mapping[str, np.ndarray]) -> dict[str, Any]:
        torch = self.torch
        out = {}
        for name, arr in feeds.items():
            t = torch.from_numpy(np.ascontiguousarray(arr)).to(self.device)
            if self.mark:
                for axis in self.symbolic.get(name, ()):
                    torch._dynamo.mark_dynamic(t, axis)
            out[name] = t
        return out

    def call(self, inputs: Mapping[str, Any]) -> Any:
        if self.step is not None:
            self.step()
        with self.torch.no_grad():
            return self.fn(**inputs)

    def sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()


def _frames(torch: Any) -> int:
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


def _guard_failures(torch: Any) -> dict[Any, int]:
    from torch._dynamo.utils import guard_failures

    return {code: len(reasons) for code, reasons in guard_failures.items()}


def _new_guard_failures(torch: Any, before: Mapping[Any, int]) -> tuple[str, ...]:
    from torch._dynamo.utils import guard_failures

    return tuple(r.splitlines()[0][:300] for code, reasons in guard_failures.items()
                 for r in reasons[before.get(code, 0):])


def _fresh_cache(torch: Any, compiled: bool) -> Any:
    import contextlib

    if not compiled:
        return contextlib.nullcontext()
    import torch._inductor.utils as iu

    return (getattr(iu, "fresh_cache", None) or iu.fresh_inductor_cache)()


def _compare(dtype: str, ref: np.ndarray, got: np.ndarray) -> tuple[float | None, bool]:
    """Max abs error and whether every element is within bench's tolerance for ``dtype``."""
    rtol, atol = bench.TOLERANCES.get(dtype, (0.0, 0.0))
    if got.shape != ref.shape:
        return None, False
    diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
    err = float(np.nanmax(diff)) if diff.size else 0.0
    return err, bool(np.isclose(got, ref, rtol=rtol, atol=atol, equal_nan=True).all())


@dataclass
class _Context:
    torch: Any
    module: Any
    info: bench.ModelInfo
    shapes: list[dict[str, int]]
    warm: dict[str, int] | None
    options: TorchOptions
    clock: Callable[[], float]
    save: Callable[[], None]
    references: list[np.ndarray | None] = field(default_factory=list)

    def feeds(self, shape: Mapping[str, int]) -> dict[str, np.ndarray]:
        return bench.make_feeds(self.info, shape, self.options.seed)

    @property
    def symbolic(self) -> dict[str, tuple[int, ...]]:
        return {s.name: tuple(i for i, d in enumerate(s.dims) if isinstance(d, str)) for s in self.info.inputs}


def _timed_call(ctx: _Context, mode: _Mode, inputs: Mapping[str, Any]) -> tuple[float, Any]:
    mode.sync()
    start = ctx.clock()
    out = mode.call(inputs)
    mode.sync()
    return ctx.clock() - start, out


def _first(ctx: _Context, mode: _Mode, dims: dict[str, int]) -> tuple[ShapeRun, np.ndarray | None]:
    run = ShapeRun(dims)
    before, guards = _frames(ctx.torch), _guard_failures(ctx.torch)
    try:
        run.first_call, out = _timed_call(ctx, mode, mode.inputs(ctx.feeds(dims)))
        host = out.detach().cpu().numpy() if out is not None else None
    except Exception as exc:  # a compile or run failure is a result: record it, go on
        run.error, host = _first_line(exc), None
    run.frames_compiled = _frames(ctx.torch) - before
    run.recompile_reasons = _new_guard_failures(ctx.torch, guards) if run.frames_compiled else ()
    return run, host


def _steady(ctx: _Context, mode: _Mode, run: ShapeRun) -> None:
    inputs = mode.inputs(ctx.feeds(run.dims))
    before = _frames(ctx.torch)
    times = []
    try:
        for i in range(ctx.options.warmup + ctx.options.repeat):
            t, _ = _timed_call(ctx, mode, inputs)
            if i >= ctx.options.warmup:
                times.append(t)
    except Exception as exc:
        run.error = _first_line(exc)
    run.times = tuple(times)
    run.steady_frames = _frames(ctx.torch) - before


def _run_mode(ctx: _Context, name: str, result: ModeRun, wanted: Sequence[int], budget: float | None) -> None:
    torch = ctx.torch
    torch._dynamo.reset()
    start = time.monotonic()
    options = MODES[name]
    result.shapes = [ShapeRun(dict(s), skipped="not in the --autotune-shapes subset") for s in ctx.shapes]
    for i in wanted:  # until measured: a run cut off by its caller's time limit says so
        result.shapes[i].skipped = "not reached (the run was cut off)"
    with _fresh_cache(torch, options is not None):
        mode = _Mode(torch, ctx.module, options, ctx.options.device, ctx.symbolic)
        if ctx.warm is not None:
            result.compile, _ = _first(ctx, mode, dict(ctx.warm))
            ctx.save()
        for i in wanted:
            if budget is not None and time.monotonic() - start > budget:
                result.shapes[i].skipped = f"over the mode's time budget ({budget:.0f} s)"
                continue
            run, host = _first(ctx, mode, dict(ctx.shapes[i]))
            if name == "eager":
                ctx.references[i] = host
            elif host is not None and ctx.references[i] is not None:
                run.max_abs_error, run.agrees = _compare(ctx.options.dtype, ctx.references[i], host)
            result.shapes[i] = run
            result.seconds = time.monotonic() - start
            ctx.save()
        for i in wanted:
            run = result.shapes[i]
            if run.skipped or run.error:
                continue
            _steady(ctx, mode, run)
            result.seconds = time.monotonic() - start
            ctx.save()
    torch._dynamo.reset()
    result.seconds = time.monotonic() - start


def _onnx_check(ctx: _Context, onnx_model: Any) -> dict[str, Any]:
    """Eager PyTorch against onnxruntime's CPU provider on the sweep's smallest shape."""
    dims = min(ctx.shapes, key=lambda s: math.prod(s.values()))
    record: dict[str, Any] = {"dims": dims, "provider": "CPUExecutionProvider"}
    try:
        import onnxruntime as ort

        feeds = ctx.feeds(dims)
        session = ort.InferenceSession(onnx_model.SerializeToString(), providers=["CPUExecutionProvider"])
        ref = session.run(None, feeds)[0]
        mode = _Mode(ctx.torch, ctx.module, None, ctx.options.device, ctx.symbolic)
        got = mode.call(mode.inputs(feeds)).cpu().numpy()
        record["max_abs_error"], record["agrees"] = _compare(ctx.options.dtype, ref, got)
    except Exception as exc:
        record["error"] = _first_line(exc)
    return record


# --- the run --------------------------------------------------------------------------------------------

def _environment(device: str, command: str, torch: Any) -> dict[str, Any]:
    from dietcode_ort.bench_report import environment

    sys.path.insert(0, str(HERE))
    import device_info

    env: dict[str, Any] = dict(environment(device, command))
    env["torch"] = device_info._torch()
    env["triton"] = device_info._version("triton")
    env["torch_threads"] = torch.get_num_threads()
    if device == "cuda":
        smi = device_info._nvidia_smi()
        env["driver"] = smi.get("driver_version") if isinstance(smi, dict) else smi
        env["nvidia_smi"] = smi
    env["source"] = device_info._source()
    return env


def _check(options: TorchOptions) -> None:
    import models

    models.get(options.model).config(options.preset)
    if options.device not in DEVICES:
        raise DietcodeError(f"unknown device {options.device!r}; allowed: {', '.join(DEVICES)}")
    unknown = [m for m in options.modes if m not in MODES]
    if unknown:
        raise DietcodeError(f"unknown mode(s) {', '.join(unknown)}; allowed: {', '.join(MODES)}")
    if options.repeat < 1 or options.warmup < 0 or options.seed < 0:
        raise DietcodeError(f"--repeat must be >= 1, --warmup and --seed >= 0 (got {options.repeat}, "
                            f"{options.warmup}, {options.seed})")
    if options.autotune_shapes is not None and options.autotune_shapes < 0:
        raise DietcodeError(f"--autotune-shapes must be >= 0, got {options.autotune_shapes}")
    if options.budget_s is not None and options.budget_s <= 0:
        raise DietcodeError(f"--budget-s must be > 0, got {options.budget_s}")
    if options.onnx is not None and not Path(options.onnx).is_file():
        raise DietcodeError(f"--onnx {options.onnx}: no such file")


def _load(options: TorchOptions) -> tuple[Any, Any]:
    import onnx

    from models import torch_models

    if options.onnx is None:
        return torch_models.build_pair(options.model, options.preset, options.dtype, options.seed)
    try:
        model = onnx.load(str(options.onnx))
    except Exception as exc:
        raise DietcodeError(f"--onnx {options.onnx} is not a readable ONNX model ({type(exc).__name__}: "
                            f"{exc})") from None
    module = torch_models.from_onnx(model, options.model, options.preset)
    got = str(next(module.parameters()).dtype).removeprefix("torch.")
    if got != options.dtype:
        raise DietcodeError(f"--onnx {options.onnx} holds {got} weights, not --dtype {options.dtype}")
    return model, module


def run(options: TorchOptions, clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Measure every mode over the sweep; returns the JSON record (also written to ``json_path``)."""
    _check(options)
    import torch

    if options.device == "cuda" and not torch.cuda.is_available():
        raise DietcodeError("--device cuda: torch sees no CUDA GPU here")
    onnx_model, module = _load(options)
    module.to(options.device)
    info = bench.model_info(onnx_model)
    shapes = bench.sweep(info.symbols, options.dims, options.ties)
    warm = bench.warmup_shape(shapes, options.ties) if info.symbols else None
    modes = ["eager", *(m for m in dict.fromkeys(options.modes) if m != "eager")]
    record: dict[str, Any] = {}

    def save() -> None:
        record.update(_record(options, env, warm, shapes, results, onnx_check))
        if options.json_path is not None:
            _write(options.json_path, record)

    env = _environment(options.device, options.command, torch)
    results = {m: ModeRun(m, MODES[m]) for m in modes}
    onnx_check: dict[str, Any] | None = None
    ctx = _Context(torch, module, info, shapes, warm, options, clock, save, [None] * len(shapes))
    compiled = [m for m in modes if m != "eager"]
    spent = 0.0
    for k, name in enumerate(modes):
        wanted = autotune_subset(shapes, options.autotune_shapes) if name == "max-autotune" \
            else list(range(len(shapes)))
        budget = None
        if options.budget_s is not None and name != "eager":
            budget = (options.budget_s - spent) / (len(compiled) - compiled.index(name))
        print(f"[torch_compile] mode {name} on {len(wanted)} shape(s)"
              f"{'' if budget is None else f', budget {budget:.0f} s'}", flush=True)
        if budget is not None and budget <= 0:  # the modes before spent it all: not even the compile
            results[name].shapes = [ShapeRun(dict(s), skipped="no time left in --budget-s") for s in shapes]
        else:
            _run_mode(ctx, name, results[name], wanted, budget)
        if name != "eager":
            spent += results[name].seconds
        if k == 0 and options.check_onnx:
            onnx_check = _onnx_check(ctx, onnx_model)
        save()
        _print_mode(results[name])
    return record


def _summary(results: Mapping[str, ModeRun]) -> dict[str, Any]:
    eager = results["eager"]
    out = {}
    for name, res in results.items():
        ratios = [e.median / r.median for e, r in zip(eager.shapes, res.shapes)
                  if e.median and r.median and r.agrees is not False]
        out[name] = {"shapes_measured": sum(1 for r in res.shapes if r.times),
                     "errors": sum(1 for r in res.shapes if r.error) + int(bool(res.compile and res.compile.error)),
                     "disagreements": sum(1 for r in res.shapes if r.agrees is False),
                     "geomean_speedup_vs_eager": float(np.exp(np.mean(np.log(ratios)))) if ratios else None,
                     "compile_ms": None if res.compile is None or res.compile.first_call is None
                     else res.compile.first_call * 1e3,
                     "frames_compiled": res.frames_compiled}
    return out


def _record(options: TorchOptions, env: Mapping[str, Any], warm: Mapping[str, int] | None,
            shapes: Sequence[Mapping[str, int]], results: Mapping[str, ModeRun],
            onnx_check: Mapping[str, Any] | None) -> dict[str, Any]:
    settings = {"model": options.model, "preset": options.preset, "dtype": options.dtype, "seed": options.seed,
                "onnx": None if options.onnx is None else str(options.onnx), "device": options.device,
                "dims": list(options.dims), "ties": list(options.ties), "repeat": options.repeat,
                "warmup": options.warmup, "warmup_shape": warm, "autotune_shapes": options.autotune_shapes,
                "budget_s": options.budget_s, "tolerances": bench.TOLERANCES, "fresh_inductor_cache": True,
                "modes": {m: MODES[m] for m in results},
                "protocol": "modes one after another; per mode: dynamo reset, empty Inductor cache, first call "
                            "on the warm-up shape (compile), first call of every shape, then steady state"}
    return {"schema": SCHEMA, "environment": dict(env), "settings": settings, "onnx_check": onnx_check,
            "modes": {m: r.as_json() for m, r in results.items()},
            "shapes": [{"dims": dict(s), "modes": {m: r.shapes[i].as_json() for m, r in results.items()
                                                   if i < len(r.shapes)}} for i, s in enumerate(shapes)],
            "summary": _summary(results)}


def _write(path: Path, record: Mapping[str, Any]) -> None:
    import json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, allow_nan=False, default=str) + "\n")
    tmp.replace(path)


def _ms(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e3:.3f}"


def _print_mode(res: ModeRun) -> None:
    c = res.compile
    print(f"  {res.mode}: compile {_ms(c.first_call) if c else '-'} ms{f' ({c.error})' if c and c.error else ''}"
          f", frames compiled {res.frames_compiled}, {res.seconds:.1f} s", flush=True)
    for r in res.shapes:
        note = r.error or r.skipped or ("" if r.agrees is not False else f"DISAGREES (max err {r.max_abs_error:.3g})")
        label = " ".join(f"{k}={v}" for k, v in r.dims.items())
        print(f"    {label:<28} first {_ms(r.first_call):>10}  median {_ms(r.median):>9}  "
              f"recompiled {r.frames_compiled}  {note}", flush=True)
        for reason in r.recompile_reasons[:2]:
            print(f"      guard failed: {reason[:150]}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="models/ name: bert, resnet50, mlp")
    p.add_argument("--preset", required=True)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    p.add_argument("--seed", type=int, default=0, help="weights and inputs seed (as models and bench; default 0)")
    p.add_argument("--onnx", type=Path, help="take the weights from this ONNX model (built by python -m models)")
    p.add_argument("--dim", action="append", default=[], metavar="NAME=SPEC", help="as dietcode-ort bench")
    p.add_argument("--tie", action="append", default=[], metavar="NAME=OTHER", help="as dietcode-ort bench")
    p.add_argument("--device", default="cpu", choices=list(DEVICES))
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"comma-separated, of {', '.join(MODES)} (default {','.join(DEFAULT_MODES)})")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--autotune-shapes", type=int, help="run max-autotune on this many shapes of the sweep")
    p.add_argument("--budget-s", type=float, help="seconds shared among the compiled modes")
    p.add_argument("--no-onnx-check", action="store_true", help="skip eager vs onnxruntime on one shape")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    options = TorchOptions(
        model=args.model, preset=args.preset, dtype=args.dtype, seed=args.seed, onnx=args.onnx,
        dims=tuple(args.dim), ties=tuple(args.tie), device=args.device,
        modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()), repeat=args.repeat,
        warmup=args.warmup, autotune_shapes=args.autotune_shapes, budget_s=args.budget_s,
        check_onnx=not args.no_onnx_check, json_path=args.json,
        command=shlex.join([os.path.relpath(sys.argv[0]) if sys.argv[0] else "torch_compile.py",
                            *(sys.argv[1:] if argv is None else argv)]))
    try:
        record = run(options)
    except DietcodeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    check = record.get("onnx_check") or {}
    if check.get("agrees") is False or check.get("error"):
        print(f"warning: eager PyTorch vs onnxruntime at {check.get('dims')}: {check}", file=sys.stderr)
    for name, s in record["summary"].items():
        geo = s["geomean_speedup_vs_eager"]
        print(f"{name}: {s['shapes_measured']} shapes, geomean vs eager "
              f"{'-' if geo is None else f'{geo:.3f}x'}, compile {_ms(None if s['compile_ms'] is None else s['compile_ms'] / 1e3)} ms, "
              f"frames compiled {s['frames_compiled']}, errors {s['errors']}, disagreements {s['disagreements']}")
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
