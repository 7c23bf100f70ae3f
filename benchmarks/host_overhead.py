"""Per-call host overhead of the ai.dietcode custom op against stock ONNX Runtime's per-node overhead.

Two measurements, written as one raw text file (``--out``):

1. The decision path in C (``dc_bench_select``, custom_ops/bench.cc): what the CUDA kernel's Compute runs
   on the host before a launch (feature vector, tree walk, vendor check, ``dc_kernel_fit``), timed in a C
   loop on the optimized model's own bundle, per shape. No GPU needed.
2. End to end: a chain of ``--nodes`` tiny MatMuls ([batch, 8] x [8, 8], so compute is negligible), run as
   the original model (stock), the optimized model without the library (its fallback functions, inlined by
   ORT) and the optimized model with the library registered (the custom op's kernels). Per-node overhead
   = (config - stock) / nodes. Stock's own per-node cost is (stock chain - stock 1-node model) / (nodes - 1).
   On CUDA, inputs and outputs are bound on the device (I/O binding) and the library is always registered.
   ``--baseline-library FILE`` adds the optimized model with another build of the library (e.g. one made
   before a change to the hot path) to the same rounds, and its decision path, for a before/after comparison
   under the same machine load.

Every configuration gets ``--warmup`` untimed runs, then ``--rounds`` rounds in rotating order, each round
timing ``--runs`` consecutive calls; a round's figure is its mean per call, the result the median over
rounds. Sessions run with one intra-op thread and spinning off::

    PYTHONPATH=$PWD python -m benchmarks.host_overhead --work /tmp/hostov --out FILE [--provider cpu|cuda]
"""
from __future__ import annotations

import argparse
import datetime as dt
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from dietcode_ort.bench_report import device_name

__all__ = ["build_chain", "optimize_chain", "decision_costs", "chain_timings", "main"]

HIDDEN = 8
PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}


def build_chain(path: Path, nodes: int, hidden: int = HIDDEN, seed: int = 0) -> None:
    """``nodes`` MatMuls [batch, hidden] x [hidden, hidden], each weight its own initializer."""
    rng = np.random.default_rng(seed)
    graph_nodes, inits, x = [], [], "x"
    for i in range(nodes):
        w = (rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)).astype(np.float32)
        inits.append(onnx.numpy_helper.from_array(w, f"w{i}"))
        graph_nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"h{i}"], name=f"mm{i}"))
        x = f"h{i}"
    graph = helper.make_graph(graph_nodes, "chain",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", hidden])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", hidden])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.save_model(model, str(path))


def optimize_chain(src: Path, out: Path, work: Path, measure: str, target: str) -> float:
    """``dietcode-ort optimize`` in process (budget 8, batch=1:16); returns its seconds."""
    from tuner.optimize import OptimizeOptions, optimize

    options = OptimizeOptions(targets=(target,), measure=measure, budget=8, dims=("batch=1:16",),
                              db=work / "tuning.db", cache_dir=work / "kernels", progress=False)
    start = time.perf_counter()
    optimize(src, out, options, log=lambda _: None)
    return time.perf_counter() - start


def _bundle_bytes(model_path: Path) -> bytes:
    model = onnx.load(str(model_path))
    for init in model.graph.initializer:
        if init.data_type == TensorProto.UINT8:
            return onnx.numpy_helper.to_array(init).tobytes()
    raise SystemExit(f"{model_path} carries no bundle initializer: was it optimized?")


@dataclass(frozen=True)
class Decision:
    batch: int
    kernel: int
    vendor: bool
    fit: str
    ns: float


def decision_costs(core: Any, opt: Path, batches: Sequence[int], n_iter: int, repeats: int = 5) -> list[Decision]:
    """Median ns per decision (of ``repeats`` C loops of ``n_iter``) on the optimized model's bundle, in
    ``core`` (a ``dietcode_ort.runtime.Core``)."""
    bundle = core.parse(_bundle_bytes(opt))
    out = []
    for batch in batches:
        a, b = (batch, HIDDEN), (HIDDEN, HIDDEN)
        k = bundle.select(bundle.features([a, b]))
        args = core.abi_view("MatMul", a, b, batched=core.lib.dc_bundle_kernel_view(bundle.handle, k) == 1)
        if args is None:
            raise SystemExit(f"the ABI cannot express [{batch}, {HIDDEN}] x [{HIDDEN}, {HIDDEN}]")
        args.c_bytes = batch * HIDDEN * 4
        runs = [bundle.bench_select([a, b], args, n_iter) for _ in range(repeats)]
        kernel, fit, _ = runs[0]
        out.append(Decision(batch, kernel, bundle.is_vendor(kernel), core.lib.dc_fit_name(fit).decode(),
                            statistics.median(r[2] for r in runs)))
    return out


def _session(path: Path, provider: str, library: bool | Path) -> Any:
    """``library``: False (none), True (this checkout's, built if needed) or a library file."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if isinstance(library, Path):
        options.register_custom_ops_library(str(library))
    elif library:
        from dietcode_ort.runtime import register

        register(options)
    session = ort.InferenceSession(str(path), options, providers=PROVIDERS[provider])
    if PROVIDERS[provider][0] not in session.get_providers():
        raise SystemExit(f"{PROVIDERS[provider][0]} is not available: {session.get_providers()}")
    return session


def _caller(session: Any, provider: str, x: np.ndarray) -> Callable[[], Any]:
    out_name = session.get_outputs()[0].name
    if provider == "cpu":
        feeds = {"x": x}
        return lambda: session.run([out_name], feeds)
    import onnxruntime as ort

    binding = session.io_binding()
    binding.bind_ortvalue_input("x", ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0))
    binding.bind_output(out_name, "cuda", 0)
    return lambda: session.run_with_iobinding(binding)


def chain_timings(configs: dict[str, Callable[[], Any]], warmup: int, rounds: int, runs: int) -> dict[str, list[float]]:
    """Per-round mean µs per call of each config, rounds in rotating order."""
    for call in configs.values():
        for _ in range(warmup):
            call()
    names = list(configs)
    samples: dict[str, list[float]] = {n: [] for n in names}
    clock = time.perf_counter
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            call = configs[n]
            start = clock()
            for _ in range(runs):
                call()
            samples[n].append((clock() - start) / runs * 1e6)
    return samples


def _versions() -> str:
    import onnxruntime as ort

    return (f"python {platform.python_version()}, onnxruntime {ort.__version__}, onnx {onnx.__version__}, "
            f"numpy {np.__version__}, {platform.platform()}")


def _git_head() -> str:
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "custom_ops"], cwd=root, capture_output=True,
                               text=True, check=True).stdout.strip()
        return head + (" + uncommitted custom_ops changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="folder for the models, tuning db and kernels")
    parser.add_argument("--out", type=Path, help="append the raw results to this file (also printed)")
    parser.add_argument("--label", default="", help="a label for this run in the file (e.g. before, after)")
    parser.add_argument("--provider", choices=sorted(PROVIDERS), default="cpu")
    parser.add_argument("--nodes", type=int, default=200)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--measure", default="analytic", help="optimize's measurer (analytic, gpu, auto)")
    parser.add_argument("--target", default="sm_90")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--iters", type=int, default=200_000, help="C loop length per decision timing")
    parser.add_argument("--baseline-library", type=Path,
                        help="another build of the library (e.g. before a change), timed in the same rounds")
    args = parser.parse_args(argv)
    if args.nodes < 2:
        parser.error("--nodes must be at least 2")
    args.work.mkdir(parents=True, exist_ok=True)
    src, one = args.work / f"chain{args.nodes}.onnx", args.work / "chain1.onnx"
    opt = args.work / f"chain{args.nodes}.{args.target}.opt.onnx"
    build_chain(src, args.nodes)
    build_chain(one, 1)
    optimize_s = None
    if not opt.exists():
        optimize_s = optimize_chain(src, opt, args.work, args.measure, args.target)

    from dietcode_ort.runtime import Core, load_core, node_stats, reset_node_stats

    baseline = args.baseline_library.resolve() if args.baseline_library is not None else None
    if baseline is not None and not baseline.is_file():
        parser.error(f"--baseline-library {baseline} does not exist")

    lines = [f"# host overhead{' (' + args.label + ')' if args.label else ''}: "
             f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {device_name('cpu')}, provider {args.provider}",
             f"$ PYTHONPATH=$PWD python -m benchmarks.host_overhead {shlex.join(sys.argv[1:] if argv is None else argv)}",
             f"# {_versions()}", f"# library {load_core().path.name}, source {_git_head()}"
             + (f"; baseline library {baseline}" if baseline is not None else ""),
             f"# model: {args.nodes} x MatMul [batch, {HIDDEN}] x [{HIDDEN}, {HIDDEN}] fp32; optimized with "
             f"--measure {args.measure} --target {args.target} --budget 8 --dim batch=1:16"
             + (f" ({optimize_s:.1f} s)" if optimize_s is not None else " (reused)")]

    lines.append(f"## decision path in C (dc_bench_select, {args.iters} iterations x 5, median ns/call)")
    cores = {"library": load_core()}
    if baseline is not None:
        cores["baseline"] = Core(baseline)
    lines.append("library    batch  kernel  vendor  fit          ns/call")
    for which, core in cores.items():
        for d in decision_costs(core, opt, (1, 7, 16), args.iters):
            lines.append(f"{which:<10} {d.batch:<6} {d.kernel:<7} {str(d.vendor):<7} {d.fit:<12} {d.ns:8.1f}")

    x = np.random.default_rng(0).standard_normal((args.batch, HIDDEN)).astype(np.float32)
    configs: dict[str, Callable[[], Any]] = {}
    configs["stock"] = _caller(_session(src, args.provider, False), args.provider, x)
    configs["stock-1-node"] = _caller(_session(one, args.provider, False), args.provider, x)
    if args.provider == "cpu":
        configs["optimized"] = _caller(_session(opt, args.provider, False), args.provider, x)
    configs["optimized+library"] = _caller(_session(opt, args.provider, True), args.provider, x)
    if baseline is not None:
        configs["optimized+baseline"] = _caller(_session(opt, args.provider, baseline), args.provider, x)
    reference = np.asarray(configs["stock"]()[0]) if args.provider == "cpu" else None
    if reference is not None:
        got = np.asarray(configs["optimized+library"]()[0])
        if not np.allclose(got, reference, rtol=1e-3, atol=1e-3):
            raise SystemExit("the optimized model with the library disagrees with stock")
    reset_node_stats()
    samples = chain_timings(configs, args.warmup, args.rounds, args.runs)
    stats = node_stats()
    launches = sum(s["launches"] for s in stats.values())
    fallbacks = sum(s["fallbacks"] for s in stats.values())
    reasons = sorted({s["reason"] for s in stats.values() if s["reason"]})

    lines.append(f"## end to end, batch {args.batch}: warmup {args.warmup}, {args.rounds} rounds x {args.runs} runs "
                 "(µs per model call: median and min over the rounds' means; p10..p90 over rounds)")
    med = {n: statistics.median(v) for n, v in samples.items()}
    low = {n: min(v) for n, v in samples.items()}
    for n, v in samples.items():
        q = np.percentile(v, [10, 90])
        lines.append(f"{n:<20} median {med[n]:9.1f}   min {low[n]:9.1f}   ({q[0]:.1f}..{q[1]:.1f})")
    lines.append("per node, µs                          from medians   from mins")
    stock_med = (med["stock"] - med["stock-1-node"]) / (args.nodes - 1)
    stock_min = (low["stock"] - low["stock-1-node"]) / (args.nodes - 1)
    lines.append(f"{'stock per-node cost':<38} {stock_med:9.3f}   {stock_min:9.3f}   "
                 f"(stock - stock-1-node) / {args.nodes - 1}")
    for n in ("optimized", "optimized+library", "optimized+baseline"):
        if n in med:
            extra_med = (med[n] - med["stock"]) / args.nodes
            extra_min = (low[n] - low["stock"]) / args.nodes
            lines.append(f"{n + ' per-node overhead':<38} {extra_med:9.3f}   {extra_min:9.3f}   "
                         f"({n} - stock) / {args.nodes}; / stock's per-node cost: "
                         f"{extra_med / stock_med:.2f}, {extra_min / stock_min:.2f}")
    lines.append(f"# custom-op calls counted by the library during the timed runs: {launches} kernel launches, "
                 f"{fallbacks} calls on ORT's / the vendor kernel" + (f"; reason: {'; '.join(reasons)}" if reasons else ""))
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
