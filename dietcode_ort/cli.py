"""The ``dietcode-ort`` command line.

Settings are read here, at the edge, and handed down as typed values. Each command's work lives in the
module that owns it; heavy modules (the tuner, triton, scikit-learn) are imported only by the commands
that need them, so ``doctor`` and ``inspect`` work on a deployment that has only the runtime, and a tuner
command there says which extra to install.
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import signal
import sys
import threading
from typing import Callable, Sequence

from dietcode_ort import __version__
from dietcode_ort.errors import DietcodeError, check_model_file, note_stop, raise_if_stopped

__all__ = ["main", "build_parser"]

Handler = Callable[[argparse.Namespace], int]
_INTERNAL_ERROR = 70  # EX_SOFTWARE: distinct from bad input (2), so tests can tell a bug from a refusal
# The commands that run the tuner (the `tune` extra: pip install 'dietcode-ort[tune]') and its modules
_TUNER_COMMANDS = ("scan", "space", "optimize", "bench")
_TUNER_MODULES = ("triton", "sklearn", "sympy")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or blocked install counts as missing
        return False


def _tuner_missing(command: str, missing: Sequence[str]) -> DietcodeError:
    return DietcodeError(f"`dietcode-ort {command}` needs the tuner's dependencies, not installed here "
                         f"({', '.join(missing)} missing): pip install 'dietcode-ort[tune]'")


def _require_tuner(command: str) -> None:
    """DietcodeError naming the command and the extra when one of the tuner's modules is missing."""
    missing = [m for m in _TUNER_MODULES if not _installed(m)]
    if missing:
        raise _tuner_missing(command, missing)


def _dim_help() -> str:
    return ("symbol range NAME=SPEC, SPEC being lo:hi, lo:hi:step or a comma list v1,v2,...; each value may "
            "carry a weight as VALUE@WEIGHT in a list (e.g. seq=16@3,64@1). Repeat for each symbol")


def _add_instance_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dim", action="append", default=[], metavar="NAME=SPEC", help=_dim_help())
    p.add_argument("--shapes", metavar="FILE.json",
                   help="observed input shapes instead of --dim: a JSON list of {input name: shape} records "
                        "(or {\"shapes\": [...]}, each record may carry a \"count\"); repeats become weights")


def _cmd_scan(args: argparse.Namespace) -> int:
    from tuner import scan

    return scan.scan_command(args.model, dims=args.dim, shapes_file=args.shapes, as_json=args.json)


def _add_scan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scan", help="list the MatMul/Gemm/Conv workloads with symbolic dims",
                       description="Load MODEL, infer symbolic shapes, and list every MatMul, Gemm and Conv "
                                   "node whose shapes depend on a symbolic dim as a workload (GEMM view "
                                   "M, N, K over the model's symbols), plus the nodes left out and why.")
    p.add_argument("model", help="ONNX model file (external data next to it is loaded too)")
    _add_instance_options(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(handler=_cmd_scan)


def _cmd_bench(args: argparse.Namespace) -> int:
    import shlex
    from pathlib import Path

    from dietcode_ort import bench

    options = bench.BenchOptions(
        model=Path(args.model), optimized=Path(args.optimized), dims=tuple(args.dim), ties=tuple(args.tie),
        provider=args.provider, repeat=args.repeat, warmup=args.warmup, seed=args.seed,
        json_path=Path(args.json) if args.json else None, plot_path=Path(args.plot) if args.plot else None,
        command=shlex.join(sys.argv), with_library=args.with_library)
    return bench.bench_command(options)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="end-to-end latency of an optimized model against stock ONNX Runtime",
        description="Run MODEL with stock ONNX Runtime and OPT with the custom-op library on the same provider "
                    "over a sweep of shapes: check that their outputs agree, then time the first call of each "
                    "fresh shape and the steady state (median, p90; ABBA-interleaved). Symbols not given with "
                    "--dim default to 1 (batch-like), 128 (seq/len/token-like), 224 (height/width/size), else 1.")
    p.add_argument("model", help="the original ONNX model")
    p.add_argument("--optimized", required=True, metavar="OPT",
                   help="the model written by `dietcode-ort optimize`")
    p.add_argument("--dim", action="append", default=[], metavar="NAME=SPEC",
                   help="symbol sweep NAME=SPEC, SPEC being lo:hi (inclusive), lo:hi:step or v1,v2,...; the "
                        "shapes are the cartesian product over the given symbols. Repeat for each symbol")
    p.add_argument("--tie", action="append", default=[], metavar="NAME=OTHER",
                   help="NAME takes OTHER's value in every shape (e.g. width=height for square images), or a sum "
                        "of symbols and sizes (a merged decoder's attention_mask_sequence_length="
                        "past_sequence_length+sequence_length). Input dims the graph makes equal (scan lists "
                        "them) follow the one --dim gives without a tie")
    p.add_argument("--provider", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--repeat", type=int, default=20, help="timed runs per model and shape (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs per model and shape (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated inputs (default 0)")
    p.add_argument("--json", metavar="FILE", help="write environment, settings and raw timings as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="write latency and speedup against the swept symbol")
    p.add_argument("--with-library", action="store_true",
                   help="register the custom-op library for the optimized model even on the CPU provider "
                        "(by default a CPU-only session runs the model's fallback functions, which ORT inlines "
                        "and fuses as in the original model)")
    p.set_defaults(handler=_cmd_bench)


def _at_least(option: str, value: int | None, least: int) -> None:
    """DietcodeError (exit 2) for a numeric option below ``least``; None (not given) passes."""
    if value is not None and value < least:
        raise DietcodeError(f"{option} must be at least {least}, got {value}")


def _cmd_space(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tuner import aot, space

    _at_least("--workers", args.workers, 1)
    if args.estimate and not args.json:
        raise DietcodeError("--estimate applies to --json (the JSON's shared bytes estimated, not compiled); the "
                            "table compiles only with --compile")
    if args.estimate and args.compile:
        raise DietcodeError("--estimate and --compile contradict each other: give one")
    cache_dir = Path(args.cache_dir) if args.cache_dir else aot.default_cache_dir()
    compile_ = args.compile or (args.json and not args.estimate)  # JSON reports compiled shared bytes
    if compile_:
        aot.ensure_cache_dir(cache_dir)
    return space.space_command(args.target, args.op, args.dtype, as_json=args.json, compile_=compile_,
                               workers=args.workers, cache_dir=cache_dir, fp32_precision=args.fp32_precision)


def _add_space(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("space", help="show the shape-generic micro-kernel search space of a family",
                       description="List the micro-kernel configs (tile sizes, warps, stages, group_m, "
                                   "split_k) of one op/dtype on one target GPU, derived from the GPU's limits "
                                   "only, with the number each pruning rule removed. --compile compiles "
                                   "every candidate (cached; minutes for a whole space) and drops those "
                                   "whose compiled shared memory or register spills break the limits; "
                                   "each compiled kernel then shows the MMA its PTX uses (wgmma or mma.sync "
                                   "on sm_90).")
    p.add_argument("--target", required=True, help="GPU target: sm_80, sm_89 or sm_90")
    p.add_argument("--op", required=True, help="gemm, bmm or conv")
    p.add_argument("--dtype", default="float16", help="float16 (default), bfloat16 or float32")
    p.add_argument("--fp32-precision", choices=("tf32", "ieee"), default="tf32",
                   help="how float32 dots are computed, as optimize's option: tf32 (default; tensor cores, so "
                        "sm_90's float32 space gets the wgmma rule and TMA configs) or ieee (FMA units)")
    p.add_argument("--json", action="store_true",
                   help="print JSON instead of tables; shared_bytes are the compiled kernels' (each candidate is "
                        "compiled on demand and cached) unless --estimate is given")
    p.add_argument("--compile", action="store_true",
                   help="compile each candidate for the table too; shared_bytes becomes the compiled kernel's")
    p.add_argument("--estimate", action="store_true",
                   help="with --json: report the estimated shared bytes instead of compiling")
    p.add_argument("--workers", type=int, default=None,
                   help="compile processes, at least 1 (default and at most: the CPUs this process may use)")
    p.add_argument("--cache-dir", default=None,
                   help="kernel cache folder (default: $DIETCODE_CACHE, else kernels/ in "
                        "$XDG_CACHE_HOME/dietcode-ort or ~/.cache/dietcode-ort)")
    p.set_defaults(handler=_cmd_space)


def _cmd_optimize(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dietcode_ort import toolchain
    from tuner import optimize

    targets = tuple(t.strip() for t in args.target.split(",") if t.strip())
    if not args.target.strip():  # not given: this machine's GPU (',,' names none: refused with the options)
        targets = optimize.default_targets()
    min_driver = toolchain.parse_driver(args.min_driver)
    toolchain.max_ptx_isa(min_driver)  # a driver the PTX table knows
    if args.ptxas is not None:
        toolchain.ptxas_version(args.ptxas)  # it runs and says its version, before any tuning
    options = optimize.OptimizeOptions(
        targets=targets, measure=args.measure, budget=args.budget, max_kernels=args.max_kernels,
        db=Path(args.db) if args.db else optimize.default_db(), seed=args.seed, dims=tuple(args.dim),
        shapes_file=Path(args.shapes) if args.shapes else None, progress=not args.quiet, ray=args.ray,
        ray_gpu=args.ray_gpu, cache_dir=Path(args.cache_dir) if args.cache_dir else None,
        min_driver=min_driver, ptxas=args.ptxas, fuse_attention=args.fuse_attention,
        fp32_precision=args.fp32_precision, prior=args.prior, warm_start=args.warm_start,
        min_speedup=args.min_speedup, conv_layout=args.conv_layout, analytic_gpu=args.analytic_gpu)
    return optimize.optimize_command(args.model, args.output, options)


def _add_optimize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("optimize", help="tune the dynamic workloads and rewrite them to ai.dietcode custom ops",
                       description="Scan MODEL, tune every workload's micro-kernels jointly over its shapes, "
                                   "train a decision-tree dispatcher, compile the chosen kernels ahead of time "
                                   "and write a model whose nodes are ai.dietcode custom ops (with fallback "
                                   "functions, so stock onnxruntime still runs it).")
    p.add_argument("model", nargs="+",
                   help="ONNX model file(s); workloads several models share are tuned once and written to each")
    p.add_argument("-o", "--output", required=True,
                   help="where to write the optimized model; with several models, a folder (each keeps its "
                        "file name)")
    _add_instance_options(p)
    p.add_argument("--target", default="",
                   help="GPU arch(es) to compile for, comma-separated: sm_80, sm_89, sm_90; tuning uses the "
                        "first. Default: the visible GPU's (sm_90 without a GPU). Add sm_80 for a bundle "
                        "that also runs on Ampere/Ada and, through its PTX, on newer GPUs")
    p.add_argument("--measure", default="auto",
                   help="gpu (time on this machine's GPU), analytic (roofline model, no GPU), replay:FILE "
                        "(a recorded table), or auto (the default): gpu when a GPU is visible, else analytic")
    p.add_argument("--analytic-gpu", default="", metavar="NAME",
                   help="with --measure analytic: the GPU of the first --target to model, by name (NVIDIA H200, "
                        "H100 PCIe, H100 NVL, L40S...); default: the target's own (sm_90: H100 SXM5). Measured "
                        "tuning models the GPU it measures")
    p.add_argument("--budget", type=int, default=256,
                   help="measured trials of each workload's search, in rounds of 64, or of budget / 4 (at least "
                        "8, and two rounds under 16) under 256 (default 256); the chosen kernels are then timed on "
                        "each shape the search left untimed, up to one more trial per shape")
    p.add_argument("--max-kernels", type=int, default=8, help="distinct kernels per workload (default 8)")
    p.add_argument("--min-speedup", type=float, default=1.0, metavar="X",
                   help="with measured tuning (gpu, replay), leave a conv workload to ORT where its kernels reach "
                        "less than X times cuDNN's speed (weighted geomean over its shapes; a conv's dispatch tree "
                        "has no vendor leaf, a GEMM's takes cuBLAS per shape); 0 rewrites every workload "
                        "(default 1.0)")
    p.add_argument("--conv-layout", choices=("nhwc", "nchw"), default="nhwc",
                   help="nhwc (default): conv nodes run channels-last where they can (ungrouped, X's channels a "
                        "whole number of 16-byte vectors, the weight an initializer), with Transposes only where "
                        "such a chain starts and ends; nchw: in the model's own layout")
    p.add_argument("--db", help="tuning database (SQLite); default tuning.db in $XDG_CACHE_HOME/dietcode-ort "
                                "or ~/.cache/dietcode-ort (created on first use)")
    p.add_argument("--cache-dir", default=None,
                   help="compiled-kernel cache folder (default: $DIETCODE_CACHE, else kernels/ in "
                        "$XDG_CACHE_HOME/dietcode-ort or ~/.cache/dietcode-ort)")
    p.add_argument("--min-driver", default="13.0", metavar="MAJOR.MINOR",
                   help="the oldest CUDA driver (the CUDA version nvidia-smi shows) the kernels must load on: the "
                        "PTX ISA is capped at what it JIT-compiles and cubins must come from a ptxas of its CUDA "
                        "major (default 13.0, driver R580)")
    p.add_argument("--ptxas", metavar="PATH",
                   help="the ptxas to compile with for every arch, instead of Triton's bundled ones (CUDA 12.9 "
                        "below sm_90, 13.4 from sm_90); $TRITON_PTXAS_PATH / $TRITON_PTXAS_BLACKWELL_PATH "
                        "choose them per arch")
    p.add_argument("--fuse-attention", action=argparse.BooleanOptionalAction, default=True,
                   help="fuse each attention chain (MatMul, scale, mask Add, Softmax, MatMul) into one "
                        "ai.dietcode::ScaledDotProductAttention node with tuned flash-style kernels (default; --no-fuse-attention "
                        "leaves the chains as they are: their MatMuls then get tuned GEMM kernels)")
    p.add_argument("--fp32-precision", choices=("tf32", "ieee"), default="tf32",
                   help="how float32 kernels compute their products: tf32 (tensor cores, operands rounded to "
                        "TF32; the default, as ONNX Runtime's CUDA EP runs float32 MatMul/Gemm/Conv unless its "
                        "use_tf32 option is 0) or ieee (exact float32 products on the FMA units, slower)")
    p.add_argument("--seed", type=int, default=0, help="search seed (default 0)")
    p.add_argument("--prior", action=argparse.BooleanOptionalAction, default=True,
                   help="start the search from the analytic roofline: its first round measures the configs the "
                        "roofline ranks best, and its predictions are blended with the learned model's until "
                        "that predicts measurements better (default; --no-prior: a random first round and the "
                        "learned model alone)")
    p.add_argument("--warm-start", action=argparse.BooleanOptionalAction, default=True,
                   help="a MatMul/Gemm workload's search starts from what the searches before it in this run "
                        "measured on the same dtype and target (their kernels' speeds train its cost model before "
                        "its first round; default; --no-warm-start: each workload on its own). Searches run at "
                        "once on a Ray cluster, and batched MatMuls and convs, start on their own")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--ray", metavar="auto|local|ADDRESS",
                   help="run compiles (CPU tasks) and measurements (one GPU each) on a Ray cluster: auto (the "
                        "running cluster or $RAY_ADDRESS), local (start one here) or the head's address; "
                        "this machine keeps the search and the database. Needs dietcode-ort[distributed]")
    p.add_argument("--ray-gpu", metavar="MODEL",
                   help="with --ray: the GPU model to time on, as Ray names it (H100, A100, L4...); default: "
                        "the first --target's (sm_90: H100, sm_80: A100, sm_89: L4)")
    p.set_defaults(handler=_cmd_optimize)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from dietcode_ort import inspect_model

    return inspect_model.inspect_command(args.model, args.json)


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="show the kernels and dispatch trees an optimized model carries",
                       description="Print each ai.dietcode node's workload, kernels, dispatch tree and tuned "
                                   "ranges.")
    p.add_argument("model", help="an optimized ONNX model")
    p.add_argument("--json", action="store_true",
                   help='print {"nodes": [{"name", "op", "kernels", "tree", "ranges", ...}]}')
    p.set_defaults(handler=_cmd_inspect)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from dietcode_ort import doctor
    from dietcode_ort.toolchain import parse_driver

    driver = parse_driver(args.driver) if args.driver is not None else None
    if args.model is not None:
        check_model_file(args.model)
    if args.driver is not None and args.model is None:
        raise DietcodeError("--driver compares a MODEL's kernels with a driver: name the model")
    return doctor.doctor_command(as_json=args.json, build=not args.no_build, model=args.model, driver=driver)


def _add_doctor(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check onnxruntime, GPU/driver, compiler, headers and the custom-op library",
                       description="Report what this machine has for running dietcode models: onnxruntime and "
                                   "its providers, the GPU and driver (through libcuda), the C++ compiler and "
                                   "headers, whether the custom-op library builds and loads, and triton.")
    p.add_argument("model", nargs="?",
                   help="an optimized model: also check that its kernel images load under the driver (each "
                        "image's recorded minimum driver) and, on a GPU, which kernels would run as ORT's; fails "
                        "where no kernel of an attention node can run (attention has no vendor path)")
    p.add_argument("--driver", metavar="MAJOR.MINOR",
                   help="with MODEL: compare against this CUDA driver version (e.g. 13.0) instead of the one "
                        "libcuda reports")
    p.add_argument("--json", action="store_true", help="print JSON instead of lines")
    p.add_argument("--no-build", action="store_true", help="do not build the library if it is not cached")
    p.set_defaults(handler=_cmd_doctor)


# One explicit list of commands; each _add_* function defines its options and handler.
_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_doctor,
    _add_scan,
    _add_optimize,
    _add_inspect,
    _add_bench,
    _add_space,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dietcode-ort",
        description="Shape-generic (DietCode) kernel tuning for dynamic-shape ONNX models in ONNX Runtime.")
    parser.add_argument("--version", action="version", version=f"dietcode-ort {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _COMMANDS:
        add(sub)
    return parser


class _Notes(logging.Handler):
    """Prints the project's warnings (e.g. instances bucketed past the cap) as ``note: ...`` lines on
    the current stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"note: {record.getMessage()}", file=sys.stderr)


def _show_notes() -> None:
    for name in ("tuner", "dietcode_ort"):
        logger = logging.getLogger(name)
        if not any(isinstance(h, _Notes) for h in logger.handlers):
            logger.addHandler(_Notes(logging.WARNING))


class _Terminated(BaseException):
    """SIGTERM, raised so that cleanup runs (temporary files removed, compile workers stopped)."""


def _on_signal(signum: int, frame: object) -> None:
    """SIGTERM raises ``_Terminated``, SIGINT KeyboardInterrupt (as Python's own handler does); both are recorded
    first (``errors.note_stop``), so that a raise Python swallows (in an at-fork hook, say) still stops the
    command before it writes its result."""
    kind: type[BaseException] = _Terminated if signum == signal.SIGTERM else KeyboardInterrupt
    note_stop(kind)
    raise kind()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _show_notes()
    in_main = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    note_stop(None)
    handled = (signal.SIGTERM, signal.SIGINT)
    previous = {s: signal.getsignal(s) for s in handled} if in_main else {}
    if in_main:
        signal.signal(signal.SIGTERM, _on_signal)
        if previous[signal.SIGINT] is signal.default_int_handler:  # not where the caller ignores Ctrl-C
            signal.signal(signal.SIGINT, _on_signal)
    try:
        return _run(args)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def console() -> int:
    """The ``dietcode-ort`` command (and ``python -m dietcode_ort``): ``main``'s exit status. Once the command
    is done, Ctrl-C is ignored, so that one pressed while imported libraries' exit handlers run (torch's, a second
    or more after a large optimize) does not print their traceback over the result."""
    try:
        return main()
    finally:  # also after argparse's exits (--help, --version, a usage error)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run(args: argparse.Namespace) -> int:
    tuner = args.command in _TUNER_COMMANDS
    try:
        if tuner:
            _require_tuner(args.command)
        status = int(args.handler(args) or 0)
        raise_if_stopped()  # a signal whose raise was swallowed on the way: the command did not end on its own
        return status
    except ModuleNotFoundError as exc:
        if not tuner or (exc.name or "").split(".")[0] not in _TUNER_MODULES:
            return _internal(exc)
        print(f"error: {_tuner_missing(args.command, [exc.name or '?'])}", file=sys.stderr)
        return 2
    except _Terminated:
        print("terminated", file=sys.stderr)
        return 143
    except DietcodeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        print("error: out of memory (fewer instances: narrower --dim ranges or a coarser step)", file=sys.stderr)
        return 2
    except BrokenPipeError as exc:
        if not _stdout_closed():
            return _internal(exc)
        return 128 + signal.SIGPIPE  # what a shell reports for a writer whose reader left (`... | head`)
    except Exception as exc:  # noqa: BLE001 - a bug: one line, the traceback only on request
        return _internal(exc)


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (``dietcode-ort inspect --json OUT | head``: the
    kernel flags its write end with POLLERR); if so, stdout is sent to /dev/null so that the interpreter's last
    flush at exit does not fail again."""
    import select

    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        if not any(events & select.POLLERR for _, events in poller.poll(0)):
            return False
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    except (OSError, ValueError, AttributeError):  # no file behind stdout (a capture), or no poll
        return False
    return True


def _internal(exc: Exception) -> int:
    if os.environ.get("DIETCODE_TRACEBACK"):
        raise exc
    print(f"error: internal error ({type(exc).__name__}: {exc}); this is a bug in dietcode-ort: set "
          "DIETCODE_TRACEBACK=1 to see the traceback", file=sys.stderr)
    return _INTERNAL_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
