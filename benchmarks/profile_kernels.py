"""Where the time goes: a per-kernel profile of stock ONNX Runtime against the optimized model, shape by shape.

    PYTHONPATH=$PWD python benchmarks/profile_kernels.py MODEL --optimized OPT --provider cuda \\
        --shape batch=32,seq=256 --shape batch=1,seq=128 --json prof.json --out prof.txt
    PYTHONPATH=$PWD python benchmarks/profile_kernels.py --suite bert --preset base --dtype float16 --workdir W \\
        --provider cuda --dim batch=1,16 --dim seq=512 [--optimize-arg=--measure=gpu ...]
    PYTHONPATH=$PWD python benchmarks/profile_kernels.py --from-json prof.json     # the table again

``--suite`` takes the models ``run_suite.py`` keeps under ``--workdir`` (the same names, so stage 3's are
reused) and builds and optimizes them for the suite's sweep where they are missing (``run_suite.suite_models``).
Shapes: ``--dim NAME=SPEC`` sweeps as ``dietcode-ort bench`` does (the cartesian product), ``--shape
NAME=V,NAME=V`` adds one point (repeatable); symbols left out take bench's defaults.

The two sessions are bench's (``bench.OrtRunner``): stock ORT with its default graph optimizations, and the
optimized model with the custom-op library registered (on the CPU EP too, so its nodes run the library's
kernels), fed the same seeded inputs (``bench.make_feeds``; on CUDA bound on the device, I/O binding). As
bench, each session first runs once at a warm-up shape (``bench.warmup_shape``: none of the profiled shapes'
values in any symbol). Per shape (the sessions' order alternating by shape): each session's first call of the
shape, one run under the profiler; then one session after the other: ``--warmup`` runs, ``--iters`` runs timed
without a profiler (the wall time: their median), then ``--iters`` runs under the profiler. Where the time is
read (``--source``; ``auto``: cupti on cuda, ort on cpu):

- ``cupti``: ``torch.profiler`` with ``ProfilerActivity.CUDA``. CUPTI records every kernel, memcpy and memset
  of the process, whichever library launched it (ORT's cuBLAS, cuDNN and fused kernels, the custom op's Triton
  cubins and its vendor epilogue ``dc_epilogue``), with its device start, duration and launch grid, and the
  CUDA runtime and driver calls on the host.
- ``ort``: ORT's own profiler (``SessionOptions.enable_profiling``): one event per node run, named by its op
  type (``ai.dietcode::`` before the custom op's). On the CPU EP that is the node's compute time, the real
  information there: ``torch.profiler``'s CPU activity sees only the Python call into ORT. On the CUDA EP it is
  the host time of each node's launches (onnxruntime-gpu's release builds leave ORT's CUDA profiler out), so
  ``auto`` takes it there only when CUPTI cannot run (torch without CUDA) or records no kernel, and says why.

Per shape and session the JSON (``--json``, re-written after every shape) holds per kernel name its category
(``CATEGORIES``), calls, time and share per iteration, mean time per call and its most frequent launch grids;
the same per category; the wall time per iteration without the profiler (median) and under it (mean), the busy
time (the union of the event intervals: the device's, for cupti) and the sum of event times, and so the host
gap (profiled wall - busy); for cupti the CUDA API calls on the host per iteration; and the optimized model's
largest output error against stock's. Per shape and session, ``first_call``: the first call's wall time under
the profiler against the steady runs' under it (per iteration), and side by side the busy time, event sum and
events; for cupti the host's time inside the recorded CUDA calls (of it in synchronize calls) and outside them
(Python, ORT, cuBLAS(Lt)'s host work, the driver calls Kineto leaves out: it keeps the runtime API, cudaMalloc
included, and of the driver API the kernel launches, not module loads), every CUDA call by name (calls, time, longest one)
and the longest single calls with the kernel each launched (a lazily loaded module's first launch shows there);
for ort ORT's ``model_run`` span, its time outside the nodes and its session-level events
(``SequentialExecutor::Execute``); the kernels (nodes) by time and those beyond their steady time. The text
table (``--out``, also printed) gives per shape the totals, the categories side by side, each session's top
kernels and the first call against the steady runs.
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
import shlex
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.run_suite import DTYPE_SUFFIX, SUITES, suite_models, suite_tag  # noqa: E402
from dietcode_ort import bench  # noqa: E402  (the repository root must be on the path first)
from dietcode_ort.bench_report import environment  # noqa: E402
from dietcode_ort.bundle import DOMAIN, subgraphs  # noqa: E402
from dietcode_ort.errors import DietcodeError  # noqa: E402

__all__ = ["SCHEMA", "CATEGORIES", "SIDES", "categorize", "Event", "kineto_events", "ort_events", "KernelStat",
           "SessionProfile", "summarize", "profile_shapes", "profile", "render", "main"]

SCHEMA = "dietcode-ort-profile/1"
SIDES = ("stock", "dietcode")
# (category, pattern searched case-insensitively in a kernel's name): the first that matches names it. GPU
# kernels go by their CUDA names (cuBLAS sm90_xmma_* / nvjet_* / cutlass*, cuDNN's *fprop*, ORT's fmha_* /
# flash_fwd_* and onnxruntime::cuda::* kernels, Kineto's "Memcpy HtoD" / "Memset (Device)"), ORT's profiler's
# events by op type (ai.dietcode::* for the custom op's nodes). Attention and conv come before GEMM: ORT's
# fmha_cutlassF_* and cuDNN's *_fprop_implicit_gemm_* carry GEMM's words too.
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("memcpy/memset", r"memcpy|memset"),
    ("dietcode triton", r"^(gemm|bmm|conv|attention)_kernel"),
    ("dietcode epilogue", r"^dc_epilogue"),
    ("dietcode op", r"^ai\.dietcode::"),
    ("attention", r"attention|fmha|flash_fwd|flash_attn|^mha_"),
    ("conv", r"conv(?!ert)|fprop|cudnn|winograd"),
    ("GEMM", r"gemm|cutlass|xmma|nvjet|cublas|splitkreduce|matmul"),
    ("layernorm", r"layer_?norm|rms_?norm"),
    ("softmax", r"softmax"),
    ("elementwise", r"elementwise|unary|binary|gelu|silu|relu|sigmoid|tanh|_cast|"
                    r"^(add|sub|mul|div|pow|sqrt|erf|cast|where|neg|exp|clip)$"),
    ("other", r""),
)
_PATTERNS = [(name, re.compile(pattern, re.IGNORECASE)) for name, pattern in CATEGORIES]
_DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}  # Kineto's chrome-trace categories of device work
_API_CATS = {"cuda_runtime", "cuda_driver"}             # and of the CUDA calls on the host
_CLOCKS = {"device": "device time of each kernel, CUPTI", "cpu": "compute time of each node, ORT's profiler",
           "host": "host time of each node's launches, ORT's profiler: the GPU runs asynchronously"}


class ProfileError(DietcodeError):
    """The profiler could not run or recorded nothing."""


def categorize(name: str) -> str:
    for category, pattern in _PATTERNS:
        if pattern.search(name):
            return category
    return "other"


# --- events -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Event:
    """One kernel, memcpy or memset on the device, one node run (ORT's profiler) or one CUDA call on the host."""

    name: str
    start_us: float
    dur_us: float
    launch: str = ""  # a GPU kernel's "grid 8x4x1 block 128x1x1 smem 98320"
    correlation: int = 0  # Kineto's: a CUDA call on the host and the kernel it launched share it


def _launch(args: Mapping[str, Any]) -> str:
    grid, block = args.get("grid"), args.get("block")
    if not grid or not block:
        return ""
    smem = args.get("shared memory")
    return f"grid {'x'.join(map(str, grid))} block {'x'.join(map(str, block))}" + (f" smem {smem}" if smem else "")


def kineto_events(trace: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> tuple[list[Event], list[Event]]:
    """(device events, CUDA calls on the host) of a chrome trace ``torch.profiler`` wrote
    (``export_chrome_trace``): complete events of Kineto's categories kernel, gpu_memcpy, gpu_memset and
    cuda_runtime, cuda_driver."""
    items = trace.get("traceEvents", []) if isinstance(trace, Mapping) else trace
    device, api = [], []
    for e in items:
        if e.get("ph") != "X":
            continue
        cat = str(e.get("cat", "")).lower()
        args = e.get("args") or {}
        correlation = int(args.get("correlation") or 0)
        if cat in _DEVICE_CATS:
            launch = _launch(args) if cat == "kernel" else ""
            device.append(Event(str(e.get("name", "")), float(e["ts"]), float(e.get("dur", 0)), launch, correlation))
        elif cat in _API_CATS:
            api.append(Event(str(e.get("name", "")), float(e["ts"]), float(e.get("dur", 0)), "", correlation))
    return device, api


def ort_events(trace: Sequence[Mapping[str, Any]], custom: Iterable[str] = (),
               provider: str = "") -> list[list[Event]]:
    """The node events of ORT's profile (the list ``end_profiling`` writes) per model run, in run order: each
    ``<node>_kernel_time`` event inside a ``model_run`` span, named by its op type; a node named in ``custom``
    (the model's ai.dietcode nodes) as ``ai.dietcode::<op type>``, a node placed on another provider than
    ``provider`` with `` [that provider]`` after it."""
    runs = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in trace
                  if e.get("cat") == "Session" and e.get("name") == "model_run")
    starts = [start for start, _ in runs]
    custom = set(custom)
    out: list[list[Event]] = [[] for _ in runs]
    for e in trace:
        name = str(e.get("name", ""))
        if e.get("cat") != "Node" or not name.endswith("_kernel_time"):
            continue
        ts = float(e["ts"])
        i = bisect.bisect_right(starts, ts) - 1
        if i < 0 or ts > runs[i][1]:
            continue  # not inside a run (none is, today)
        args = e.get("args") or {}
        node = name.removesuffix("_kernel_time")
        op = str(args.get("op_name", node))
        label = f"{DOMAIN}::{op}" if node in custom else op
        where = str(args.get("provider", ""))
        if provider and where and where != provider:
            label += f" [{where}]"
        out[i].append(Event(label, ts, float(e.get("dur", 0))))
    return out


def ort_run_spans(trace: Sequence[Mapping[str, Any]]) -> list[tuple[float, dict[str, float]]]:
    """Per model run of ORT's profile (run order, as ``ort_events``): the ``model_run`` span's microseconds and
    the other session-level events inside it (``SequentialExecutor::Execute``, ...), microseconds by name."""
    runs = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in trace
                  if e.get("cat") == "Session" and e.get("name") == "model_run")
    starts = [start for start, _ in runs]
    out: list[tuple[float, dict[str, float]]] = [(stop - start, {}) for start, stop in runs]
    for e in trace:
        if e.get("cat") != "Session" or e.get("name") == "model_run":
            continue
        ts = float(e["ts"])
        i = bisect.bisect_right(starts, ts) - 1
        if i < 0 or ts > runs[i][1]:
            continue  # model loading, session initialization: before the runs
        name = str(e.get("name", ""))
        out[i][1][name] = out[i][1].get(name, 0.0) + float(e.get("dur", 0))
    return out


def custom_node_names(model: Path) -> set[str]:
    """The names of a model's ai.dietcode nodes (its subgraphs' included), read without the weights."""
    import onnx

    names: set[str] = set()

    def walk(graph: Any) -> None:
        for node in graph.node:
            if node.domain == DOMAIN:
                names.add(node.name)
            for sub in subgraphs(node):
                walk(sub)

    walk(onnx.load(str(model), load_external_data=False).graph)
    return names


# --- summaries ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelStat:
    """One kernel name's calls and time per iteration, its share of the iteration's event time."""

    name: str
    category: str
    calls: float
    ms: float
    share: float
    launches: tuple[tuple[str, float], ...] = ()  # the most frequent launch grids, with calls per iteration

    @property
    def mean_us(self) -> float:
        return self.ms * 1e3 / self.calls if self.calls else 0.0

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "category": self.category, "calls_per_iter": self.calls, "ms_per_iter": self.ms,
                "mean_us": self.mean_us, "share": self.share,
                "launches": [{"launch": text, "calls_per_iter": n} for text, n in self.launches]}


def busy_us(events: Iterable[Event]) -> float:
    """The length of the union of the events' intervals (overlapping ones counted once)."""
    total, end = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e.start_us):
        stop = e.start_us + e.dur_us
        if stop <= end:
            continue
        total += stop - max(e.start_us, end)
        end = stop
    return total


@dataclass(frozen=True)
class SessionProfile:
    """One session at one shape, per iteration: wall times, busy and event time, the kernels by time."""

    iterations: int
    wall_ms: float           # median of the runs timed without the profiler
    profiled_wall_ms: float  # mean of the runs under the profiler
    busy_ms: float
    kernel_sum_ms: float
    kernels: tuple[KernelStat, ...]
    host_api: tuple[tuple[str, float, float], ...] = ()  # (CUDA call, calls, ms) per iteration

    @property
    def host_gap_ms(self) -> float:
        return self.profiled_wall_ms - self.busy_ms

    @property
    def calls(self) -> float:
        return sum(k.calls for k in self.kernels)

    def categories(self) -> dict[str, dict[str, float]]:
        """Per category (in ``CATEGORIES`` order, those with events only): calls, ms per iteration, share."""
        out: dict[str, dict[str, float]] = {}
        for name, _ in CATEGORIES:
            ks = [k for k in self.kernels if k.category == name]
            if ks:
                ms = sum(k.ms for k in ks)
                out[name] = {"calls_per_iter": sum(k.calls for k in ks), "ms_per_iter": ms,
                             "share": ms / self.kernel_sum_ms if self.kernel_sum_ms else 0.0}
        return out

    def as_json(self) -> dict[str, Any]:
        return {"iterations": self.iterations, "wall_ms": self.wall_ms, "profiled_wall_ms": self.profiled_wall_ms,
                "busy_ms": self.busy_ms, "kernel_sum_ms": self.kernel_sum_ms, "host_gap_ms": self.host_gap_ms,
                "kernels_per_iter": self.calls, "categories": self.categories(),
                "kernels": [k.as_json() for k in self.kernels],
                "host_api": [{"name": n, "calls_per_iter": c, "ms_per_iter": ms} for n, c, ms in self.host_api]}


def summarize(events: Sequence[Event], iterations: int, wall_ms: float, profiled_wall_ms: float,
              api: Sequence[Event] = (), launches: int = 3) -> SessionProfile:
    """``iterations`` runs' events as per-iteration figures, kernels by time (largest first)."""
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1 (got {iterations})")
    total_us = sum(e.dur_us for e in events)
    by_name: dict[str, list[Event]] = defaultdict(list)
    for e in events:
        by_name[e.name].append(e)
    stats = []
    for name, es in by_name.items():
        us = sum(e.dur_us for e in es)
        grids = Counter(e.launch for e in es if e.launch).most_common(launches)
        stats.append(KernelStat(name, categorize(name), len(es) / iterations, us / iterations / 1e3,
                                us / total_us if total_us else 0.0,
                                tuple((text, n / iterations) for text, n in grids)))
    stats.sort(key=lambda k: (-k.ms, k.name))
    calls: dict[str, list[Event]] = defaultdict(list)
    for e in api:
        calls[e.name].append(e)
    host = sorted(((n, len(es) / iterations, sum(e.dur_us for e in es) / iterations / 1e3)
                   for n, es in calls.items()), key=lambda t: (-t[2], t[0]))
    return SessionProfile(iterations, wall_ms, profiled_wall_ms, busy_us(events) / iterations / 1e3,
                          total_us / iterations / 1e3, tuple(stats), tuple(host[:8]))


# --- the first call of a shape ------------------------------------------------------------------------

@dataclass(frozen=True)
class Recording:
    """What a source recorded over some runs: the device's events (ORT's profiler: the node events), the CUDA
    calls on the host (cupti), and per run ORT's ``model_run`` span with its session-level events (ort)."""

    device: Sequence[Event]
    api: Sequence[Event] = ()
    runs: Sequence[tuple[float, Mapping[str, float]]] = ()


@dataclass(frozen=True)
class Delta:
    """One kernel name or CUDA call in a shape's first call, against the shape's steady runs (per iteration)."""

    name: str
    calls: int
    ms: float
    steady_calls: float
    steady_ms: float
    max_ms: float  # the longest single one in the first call

    @property
    def excess_ms(self) -> float:
        return self.ms - self.steady_ms

    def as_json(self, category: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "calls": self.calls, "ms": self.ms, "max_ms": self.max_ms,
                               "steady_calls_per_iter": self.steady_calls, "steady_ms_per_iter": self.steady_ms,
                               "excess_ms": self.excess_ms}
        if category:
            out["category"] = categorize(self.name)
        return out


def deltas(first: Iterable[Event], steady: Iterable[Event], iterations: int) -> tuple[Delta, ...]:
    """Per name (the first call's or the steady runs'): the first call's calls and time against the steady
    runs' per iteration, largest first-call time first."""
    ones: dict[str, list[Event]] = defaultdict(list)
    many: dict[str, list[Event]] = defaultdict(list)
    for e in first:
        ones[e.name].append(e)
    for e in steady:
        many[e.name].append(e)
    out = [Delta(name, len(ones[name]), sum(e.dur_us for e in ones[name]) / 1e3, len(many[name]) / iterations,
                 sum(e.dur_us for e in many[name]) / iterations / 1e3,
                 max((e.dur_us for e in ones[name]), default=0.0) / 1e3)
           for name in set(ones) | set(many)]
    return tuple(sorted(out, key=lambda d: (-d.ms, -d.steady_ms, d.name)))


_SYNC = re.compile(r"synchroni[sz]e", re.IGNORECASE)  # cudaStreamSynchronize, cuCtxSynchronize, ...


def _host_figures(api: Sequence[Event], wall_ms: float, iterations: int) -> list[tuple[str, float]]:
    """The host's time split by the recorded CUDA calls (per iteration): inside them (the union of their
    intervals), of that in synchronize calls (the host waiting on the device), and outside them (Python, ORT,
    the custom op's host work, driver calls Kineto leaves out)."""
    inside = busy_us(api) / iterations / 1e3
    return [("api_calls", len(api) / iterations), ("host_in_calls_ms", inside),
            ("host_sync_ms", busy_us(e for e in api if _SYNC.search(e.name)) / iterations / 1e3),
            ("host_outside_calls_ms", max(0.0, wall_ms - inside))]


def _run_figures(runs: Sequence[tuple[float, Mapping[str, float]]], wall_ms: float,
                 node_ms: float) -> dict[str, float]:
    """ORT's runs (their mean): outside ``model_run`` (Python, the binding), ``model_run``, in it outside the
    nodes, and each session-level event inside it."""
    if not runs:
        return {}
    run_ms = sum(d for d, _ in runs) / len(runs) / 1e3
    out = {"outside_run_ms": max(0.0, wall_ms - run_ms), "run_ms": run_ms, "non_node_ms": run_ms - node_ms}
    for name in sorted({k for _, s in runs for k in s}):
        out[f"session:{name}"] = sum(s.get(name, 0.0) for _, s in runs) / len(runs) / 1e3
    return out


@dataclass(frozen=True)
class FirstCall:
    """A shape's first run in a session warm on other shapes, under the profiler, against the shape's steady
    runs under it (per iteration): wall time, figures side by side, kernels and CUDA calls by name, and the
    longest single CUDA calls with the kernel each launched."""

    wall_ms: float
    steady_wall_ms: float
    figures: tuple[tuple[str, float, float], ...]  # (figure, first call, steady per iteration)
    kernels: tuple[Delta, ...]
    host_api: tuple[Delta, ...] = ()
    slowest: tuple[tuple[str, float, str], ...] = ()  # (CUDA call, ms, the kernel it launched or "")

    @property
    def ratio(self) -> float | None:
        return self.wall_ms / self.steady_wall_ms if self.steady_wall_ms > 0 else None

    def as_json(self, top: int = 10) -> dict[str, Any]:
        excess = sorted((k for k in self.kernels if k.excess_ms > 0), key=lambda k: (-k.excess_ms, k.name))
        return {"wall_ms": self.wall_ms, "steady_wall_ms": self.steady_wall_ms, "ratio": self.ratio,
                "excess_ms": self.wall_ms - self.steady_wall_ms,
                "figures": {name: {"first": f, "steady": s} for name, f, s in self.figures},
                "kernels": [k.as_json(True) for k in self.kernels[:top]],
                "excess_kernels": [k.as_json(True) for k in excess[:5]],
                "host_api": [a.as_json() for a in self.host_api],
                "slowest_calls": [{"name": n, "ms": ms, "kernel": k} for n, ms, k in self.slowest]}


def summarize_first(first: Recording, wall_ms: float, steady: Recording, iterations: int, steady_wall_ms: float,
                    slowest: int = 5) -> FirstCall:
    """A first call (one run, ``wall_ms`` under the profiler) against ``iterations`` steady runs under it
    (``steady_wall_ms`` per iteration): device busy time and event sum, events, the host split by the CUDA
    calls (cupti), ORT's run and session-level events (ort), kernels and CUDA calls by name."""
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1 (got {iterations})")
    f_sum = sum(e.dur_us for e in first.device) / 1e3
    s_sum = sum(e.dur_us for e in steady.device) / iterations / 1e3
    figures = [("busy_ms", busy_us(first.device) / 1e3, busy_us(steady.device) / iterations / 1e3),
               ("kernel_sum_ms", f_sum, s_sum), ("events", float(len(first.device)), len(steady.device) / iterations)]
    if first.api or steady.api:
        figures += [(name, f, s) for (name, f), (_, s) in zip(_host_figures(first.api, wall_ms, 1),
                                                            _host_figures(steady.api, steady_wall_ms, iterations))]
    f_runs, s_runs = _run_figures(first.runs, wall_ms, f_sum), _run_figures(steady.runs, steady_wall_ms, s_sum)
    figures += [(name, f_runs.get(name, 0.0), s_runs.get(name, 0.0)) for name in dict.fromkeys([*f_runs, *s_runs])]
    launched = {e.correlation: e.name for e in first.device if e.correlation}
    longest = sorted(first.api, key=lambda e: (-e.dur_us, e.start_us))[:slowest]
    return FirstCall(wall_ms, steady_wall_ms, tuple(figures), deltas(first.device, steady.device, iterations),
                     deltas(first.api, steady.api, iterations),
                     tuple((e.name, e.dur_us / 1e3, launched.get(e.correlation, "") if e.correlation else "")
                           for e in longest))


# --- sources ------------------------------------------------------------------------------------------

Runner = bench.OrtRunner
Key = tuple[int, str]  # (shape index, side)
Register = Callable[[Any], Any]


class CuptiSource:
    """torch.profiler (Kineto, CUPTI) around the runs: every kernel of the process, on the device's clock."""

    name = "cupti"

    def __init__(self, traces: Path | None = None) -> None:
        self.traces = traces  # where each profiled loop's chrome trace is kept (gzipped), if anywhere
        try:
            import torch
        except ImportError as exc:
            raise ProfileError(f"torch is not importable ({exc}): CUPTI is read through torch.profiler") from None
        if not torch.cuda.is_available():
            raise ProfileError(f"torch {torch.__version__} sees no CUDA device: CUPTI is read through "
                               "torch.profiler's CUDA activity")
        torch.cuda.init()
        self._torch = torch

    def runner(self, timing: Runner, path: Path, provider: str, register: Register | None, side: str) -> Runner:
        return timing  # the same session, profiled around its runs

    def warm(self, side: str, call: bench.Prepared) -> None:
        call.run()

    def first(self, key: Key, call: bench.Prepared) -> tuple[float, Recording | None]:
        """The first call of a shape: one run under the profiler (its trace kept as ``<i>-<side>.first``)."""
        return self._profiled(key, call, 1, ".first")

    def record(self, key: Key, call: bench.Prepared, iters: int, warmup: int) -> tuple[float, Recording | None]:
        """Runs ``call`` ``iters`` times under the profiler: (wall seconds, the device events and API calls)."""
        wall, got = self._profiled(key, call, iters, "")
        if not got.device:
            raise ProfileError(f"CUPTI recorded no kernel in {iters} runs of the {key[1]} session "
                               f"(torch {self._torch.__version__})")
        return wall, got

    def _profiled(self, key: Key, call: bench.Prepared, runs: int, suffix: str) -> tuple[float, Recording]:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with tempfile.TemporaryDirectory() as tmp:
            trace = Path(tmp) / "trace.json"
            try:
                with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                    start = time.perf_counter()
                    for _ in range(runs):
                        call.run()
                    self._torch.cuda.synchronize()
                    wall = time.perf_counter() - start
                prof.export_chrome_trace(str(trace))
            except Exception as exc:  # Kineto's and ORT's errors share no useful base class
                raise ProfileError(f"torch.profiler failed ({type(exc).__name__}: {exc})") from exc
            text = trace.read_text()
            if self.traces is not None:
                self.traces.mkdir(parents=True, exist_ok=True)
                (self.traces / f"{key[0]}-{key[1]}{suffix}.json.gz").write_bytes(gzip.compress(text.encode()))
            device, api = kineto_events(json.loads(text))
        return wall, Recording(device, api)

    def finish(self) -> dict[tuple[str, Key], Recording]:
        return {}


class OrtSource:
    """ORT's own profiler: a second session per model with profiling on; its runs are told apart by order."""

    name = "ort"

    def __init__(self, provider: str, folder: Path) -> None:
        self.provider = provider
        self.folder = folder
        self.sessions: dict[str, tuple[Runner, set[str]]] = {}
        self.runs: dict[str, int] = defaultdict(int)
        self.spans: dict[tuple[str, Key], tuple[int, int]] = {}  # (kind, key): (first run, runs)

    def runner(self, timing: Runner, path: Path, provider: str, register: Register | None, side: str) -> Runner:
        prefix = str(self.folder / f"ort-{side}")
        profiled = bench.OrtRunner(path, provider, register, profile=prefix)
        self.sessions[side] = (profiled, custom_node_names(path))
        return profiled

    def warm(self, side: str, call: bench.Prepared) -> None:
        call.run()
        self.runs[side] += 1

    def first(self, key: Key, call: bench.Prepared) -> tuple[float, Recording | None]:
        side = key[1]
        start = time.perf_counter()
        call.run()
        wall = time.perf_counter() - start
        self.spans[("first", key)] = (self.runs[side], 1)
        self.runs[side] += 1
        return wall, None

    def record(self, key: Key, call: bench.Prepared, iters: int, warmup: int) -> tuple[float, Recording | None]:
        side = key[1]
        for _ in range(warmup):  # a session of its own: warmed up again, those runs left out
            call.run()
        start = time.perf_counter()
        for _ in range(iters):
            call.run()
        wall = time.perf_counter() - start
        self.spans[("steady", key)] = (self.runs[side] + warmup, iters)
        self.runs[side] += warmup + iters
        return wall, None

    def finish(self) -> dict[tuple[str, Key], Recording]:
        """Per ("first" or "steady", key): the node events and the runs' spans of those runs."""
        main = bench.PROVIDERS[self.provider][0]
        per_run, spans = {}, {}
        for side, (runner, custom) in self.sessions.items():
            path = Path(runner.session.end_profiling())
            trace = json.loads(path.read_text())
            per_run[side], spans[side] = ort_events(trace, custom, main), ort_run_spans(trace)
            if len(per_run[side]) != self.runs[side]:
                raise ProfileError(f"ORT's profile of the {side} session holds {len(per_run[side])} runs, "
                                   f"{self.runs[side]} were made")
        return {(kind, key): Recording([e for run in per_run[key[1]][first:first + n] for e in run], (),
                                       spans[key[1]][first:first + n])
                for (kind, key), (first, n) in self.spans.items()}


# --- the run ------------------------------------------------------------------------------------------

def profile_shapes(symbols: Sequence[str], dims: Sequence[str], points: Sequence[str],
                   ties: Sequence[str] = ()) -> list[dict[str, int]]:
    """``--shape`` points (NAME=V,NAME=V: one value each) then the ``--dim`` sweep (bench's), without repeats;
    with neither, bench's default shape."""
    shapes: list[dict[str, int]] = []
    for point in points:
        parts = [p.strip() for p in point.split(",") if p.strip()]
        if not parts or any("=" not in p for p in parts):
            raise DietcodeError(f"bad --shape {point!r}: expected NAME=VALUE,NAME=VALUE (one value per symbol; "
                                "--dim NAME=V1,V2 sweeps)")
        found = bench.sweep(symbols, parts, ties)
        if len(found) != 1:
            raise DietcodeError(f"--shape {point!r} names {len(found)} shapes: give one value per symbol")
        shapes += found
    if dims or not points:
        shapes += bench.sweep(symbols, dims, ties)
    unique: dict[tuple, dict[str, int]] = {}
    for s in shapes:
        unique.setdefault(tuple(s.items()), s)
    return list(unique.values())


@dataclass
class ShapeProfile:
    dims: dict[str, int]
    sessions: dict[str, SessionProfile] = field(default_factory=dict)
    max_abs_error: dict[str, float] | None = None
    disagreement: str | None = None
    first_calls: dict[str, FirstCall] = field(default_factory=dict)
    first_call_note: str | None = None  # why the shape has no first call

    def as_json(self) -> dict[str, Any]:
        sessions = {side: s.as_json() for side, s in self.sessions.items()}
        for side, first in self.first_calls.items():
            sessions.setdefault(side, {})["first_call"] = first.as_json()
        return {"dims": self.dims, "label": _label(self.dims), "sessions": sessions,
                "max_abs_error": self.max_abs_error, "disagreement": self.disagreement,
                "first_call_note": self.first_call_note}


def _label(shape: Mapping[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items())


@contextmanager
def _failing(side: str, label: str) -> Iterator[None]:
    """ORT's errors (pybind's, no useful base class) as the session and shape that raised them."""
    try:
        yield
    except DietcodeError:
        raise
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DietcodeError(f"the {side} model fails at shape {label}: {first}") from exc


def profile(model: Path, optimized: Path, provider: str, shapes: Sequence[Mapping[str, int]], *, source: str,
            iters: int, warmup: int, seed: int = 0, register: Register | None = None,
            traces: Path | None = None, warm_shape: Mapping[str, int] | None = None,
            done: Callable[[list[ShapeProfile]], None] = lambda _: None) -> list[ShapeProfile]:
    """Profile both models at every shape with ``source`` ("cupti" or "ort"); ``done`` gets the shapes finished
    so far after each one (cupti) or all at the end (ort, whose events come when its sessions end). ``traces``:
    a folder for cupti's chrome traces (``<shape index>-<side>[.first].json.gz``).

    As bench: each session runs once at ``warm_shape`` (``bench.warmup_shape``: no profiled shape's value in any
    symbol); without one, or where a model rejects it, at the first shape, whose first call is then left out.
    Per shape, both sessions' first call (one run under the profiler, the sessions' order alternating by shape),
    then per session ``warmup`` runs, ``iters`` timed without the profiler and ``iters`` under it."""
    if iters < 1 or warmup < 0:
        raise DietcodeError(f"--iters must be >= 1 and --warmup >= 0 (got {iters}, {warmup})")
    info = bench.load_model_info(model)
    bench.check_compatible(info, bench.load_model_info(optimized))
    if register is None:
        from dietcode_ort.runtime import register as library_register

        register = library_register
    with tempfile.TemporaryDirectory() as tmp:
        src: CuptiSource | OrtSource = CuptiSource(traces) if source == "cupti" else OrtSource(provider, Path(tmp))
        paths = {"stock": (model, None), "dietcode": (optimized, register)}
        timing = {side: bench.OrtRunner(path, provider, reg) for side, (path, reg) in paths.items()}
        profiled = {side: src.runner(timing[side], path, provider, reg, side) for side, (path, reg) in paths.items()}

        def warm(side: str, feeds: Mapping[str, Any]) -> None:
            timing[side].prepare(feeds).run()
            if profiled[side] is not timing[side]:
                src.warm(side, profiled[side].prepare(feeds))

        note = None
        if warm_shape is None:
            note = "no warm-up shape (a model without symbolic dims has one): its first run warmed the sessions"
        else:
            try:
                warm_feeds = bench.make_feeds(info, warm_shape, seed)
                for side in SIDES:
                    warm(side, warm_feeds)
            except Exception as exc:  # a model that rejects the extra shape: bench warms up on the first
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                note = (f"the warm-up shape {_label(warm_shape)} failed ({first}): the first shape's first run "
                        "warmed the sessions")
        if note is not None:
            feeds = bench.make_feeds(info, shapes[0], seed)
            for side in SIDES:
                with _failing(side, _label(shapes[0])):
                    warm(side, feeds)
        results: list[ShapeProfile] = []
        pending: dict[Key, tuple[float, float]] = {}
        firsts: dict[Key, float] = {}
        first_recs: dict[Key, Recording] = {}
        for i, shape in enumerate(shapes):
            feeds = bench.make_feeds(info, shape, seed)
            result = ShapeProfile(dict(shape), first_call_note=note if i == 0 else None)
            label = _label(shape)
            order = SIDES if i % 2 == 0 else SIDES[::-1]
            calls, pcalls, outputs = {}, {}, {}
            for side in order:  # both first calls before either session's steady runs, as in bench
                with _failing(side, label):
                    calls[side] = timing[side].prepare(feeds)
                    pcalls[side] = calls[side] if profiled[side] is timing[side] else profiled[side].prepare(feeds)
                    if result.first_call_note is None:
                        wall, got = src.first((i, side), pcalls[side])
                        firsts[(i, side)] = wall * 1e3
                        if got is not None:
                            first_recs[(i, side)] = got
            for side in order:
                with _failing(side, label):
                    times = []
                    for n in range(warmup + iters):
                        start = time.perf_counter()
                        calls[side].run()
                        if n >= warmup:
                            times.append(time.perf_counter() - start)
                    outputs[side] = calls[side].outputs()
                    wall, got = src.record((i, side), pcalls[side], iters, warmup)
                walls = (statistics.median(times) * 1e3, wall / iters * 1e3)
                if got is None:
                    pending[(i, side)] = walls
                    continue
                result.sessions[side] = summarize(got.device, iters, *walls, api=got.api)
                if (i, side) in first_recs:
                    result.first_calls[side] = summarize_first(first_recs[(i, side)], firsts[(i, side)], got, iters,
                                                               walls[1])
            try:
                result.max_abs_error = bench.check_agreement(label, outputs["stock"], outputs["dietcode"],
                                                             info.computes_in)
            except DietcodeError as exc:
                result.disagreement = str(exc)
            results.append(result)
            if not pending:
                done(results)
        if pending:
            got_all = src.finish()
            for key, walls in pending.items():
                steady = got_all[("steady", key)]
                results[key[0]].sessions[key[1]] = summarize(steady.device, iters, *walls, api=steady.api)
                if ("first", key) in got_all:
                    results[key[0]].first_calls[key[1]] = summarize_first(got_all[("first", key)], firsts[key],
                                                                          steady, iters, walls[1])
            done(results)
    return results


# --- the report ---------------------------------------------------------------------------------------

def report_json(env: Mapping[str, Any], settings: Mapping[str, Any], shapes: Sequence[ShapeProfile],
                complete: bool) -> dict[str, Any]:
    return {"schema": SCHEMA, "environment": dict(env), "settings": dict(settings), "complete": complete,
            "categories": [list(c) for c in CATEGORIES], "shapes": [s.as_json() for s in shapes]}


def _cut(name: str, width: int) -> str:
    return name if len(name) <= width else name[:width - 3] + "..."


def _render_shape(shape: Mapping[str, Any], top: int) -> list[str]:
    sessions = shape["sessions"]
    sides = [s for s in SIDES if s in sessions]
    lines = ["", f"{'## ' + shape['label']:<34}" + "".join(f"{side:>12}" for side in sides)
             + (f"{'dietcode-stock':>16}" if len(sides) == 2 else "")]

    def row(label: str, key: str, fmt: str = "{:12.3f}") -> None:
        values = [sessions[s][key] for s in sides]
        text = f"{label:<34}" + "".join(fmt.format(v) for v in values)
        if len(values) == 2:
            text += ("{:+16" + fmt[4:]).format(values[1] - values[0])
            if key == "wall_ms" and values[1] > 0:
                text += f"  (stock/dietcode {values[0] / values[1]:.2f}x)"
        lines.append(text)

    row("wall ms/iter (no profiler, median)", "wall_ms")
    row("wall ms/iter (profiled, mean)", "profiled_wall_ms")
    row("busy ms/iter (union of events)", "busy_ms")
    row("event sum ms/iter", "kernel_sum_ms")
    row("host gap ms/iter (profiled - busy)", "host_gap_ms")
    row("events/iter", "kernels_per_iter", "{:12.1f}")
    if shape.get("disagreement"):
        lines.append(f"!! {shape['disagreement']}")
    cats = [name for name, _ in CATEGORIES if any(name in sessions[s]["categories"] for s in sides)]
    lines.append(f"{'category':<20}" + "".join(f"{s + ' ms':>14}{'share':>8}" for s in sides)
                 + (f"{'diff ms':>16}" if len(sides) == 2 else ""))
    for cat in cats:
        got = [sessions[s]["categories"].get(cat, {"ms_per_iter": 0.0, "share": 0.0}) for s in sides]
        text = f"{cat:<20}" + "".join(f"{g['ms_per_iter']:14.3f}{g['share']:8.1%}" for g in got)
        if len(got) == 2:
            text += f"{got[1]['ms_per_iter'] - got[0]['ms_per_iter']:+16.3f}"
        lines.append(text)
    for side in sides:
        lines.append(f"top kernels, {side:<9}{'ms/iter':>10}{'share':>8}{'calls':>8}{'mean us':>10}  "
                     "category            name")
        for k in sessions[side]["kernels"][:top]:
            lines.append(f"{'':<22}{k['ms_per_iter']:10.3f}{k['share']:8.1%}{k['calls_per_iter']:8.1f}"
                         f"{k['mean_us']:10.1f}  {k['category']:<19} {_cut(k['name'], 90)}")
        api = sessions[side].get("host_api") or []
        if api:
            lines.append(f"{'':<22}host: " + ", ".join(f"{a['name']} {a['calls_per_iter']:.0f}x "
                                                       f"{a['ms_per_iter']:.3f} ms" for a in api[:4]))
    return lines + _render_first(shape, sides)


# the first call's figures, as the table names them (ORT's session-level events: "session:<name>")
_FIGURES = {"busy_ms": "busy ms (union of events)", "kernel_sum_ms": "event sum ms", "events": "events",
            "api_calls": "CUDA calls on the host", "host_in_calls_ms": "host in CUDA calls ms",
            "host_sync_ms": "  of it synchronize ms", "host_outside_calls_ms": "host outside CUDA calls ms",
            "outside_run_ms": "outside ORT's model_run ms", "run_ms": "ORT's model_run ms",
            "non_node_ms": "  of it outside the nodes ms"}
_COUNTS = {"events", "api_calls"}


def _render_first(shape: Mapping[str, Any], sides: Sequence[str]) -> list[str]:
    """The first call of the shape against its steady runs (both under the profiler), per session."""
    firsts = {s: shape["sessions"][s]["first_call"] for s in sides if shape["sessions"][s].get("first_call")}
    if not firsts:
        return [f"first call: none ({shape['first_call_note']})"] if shape.get("first_call_note") else []
    have = list(firsts)
    lines = [f"{'first call vs steady (profiled)':<34}" + "".join(f"{s + ' 1st':>14}{'steady':>10}" for s in have)]

    def cells(values: Iterable[tuple[float, float] | None], fmt: str = "{:14.3f}{:10.3f}") -> str:
        return "".join(fmt.format(*v) if v is not None else f"{'-':>14}{'-':>10}" for v in values)

    lines.append(f"{'wall ms':<34}" + cells((f["wall_ms"], f["steady_wall_ms"]) for f in firsts.values())
                 + "".join(f"  {s} {f['ratio']:.2f}x" for s, f in firsts.items() if f["ratio"] is not None))
    # the event sum is the busy time but for overlaps (and in the JSON): the table leaves it out
    keys = [k for k in dict.fromkeys(k for f in firsts.values() for k in f["figures"]) if k != "kernel_sum_ms"]
    for key in keys:
        label = _FIGURES.get(key) or (f"  {key.removeprefix('session:')} ms" if key.startswith("session:") else key)
        fmt = "{:14.1f}{:10.1f}" if key in _COUNTS else "{:14.3f}{:10.3f}"
        values = [(f["figures"][key]["first"], f["figures"][key]["steady"]) if key in f["figures"] else None
                  for f in firsts.values()]
        lines.append(f"{_cut(label, 33):<34}" + cells(values, fmt))
    for side, f in firsts.items():
        api = sorted((a for a in f["host_api"] if a["excess_ms"] > 0), key=lambda a: -a["excess_ms"])[:3]
        if api:
            lines.append(f"  {side} CUDA calls beyond steady: " + ", ".join(
                f"{a['name']} {a['calls']}x {a['ms']:.3f} ms (steady {a['steady_calls_per_iter']:.1f}x "
                f"{a['steady_ms_per_iter']:.3f})" for a in api))
        if f["slowest_calls"]:
            lines.append(f"  {side} longest CUDA calls: " + ", ".join(
                f"{c['name']} {c['ms']:.3f} ms" + (f" ({_cut(c['kernel'], 40)})" if c["kernel"] else "")
                for c in f["slowest_calls"][:3]))
        if f["excess_kernels"]:
            lines.append(f"  {side} {'kernels' if 'api_calls' in f['figures'] else 'nodes'} beyond steady: "
                         + ", ".join(f"{_cut(k['name'], 40)} +{k['excess_ms']:.3f} ms ({k['calls']}x, steady "
                                     f"{k['steady_calls_per_iter']:.1f}x)" for k in f["excess_kernels"][:3]))
    return lines


def render(report: Mapping[str, Any], top: int = 8) -> str:
    """The text table of a profile's JSON: per shape the totals, the categories, each session's top kernels."""
    env, s = report["environment"], report["settings"]
    lines = [f"# kernel profile of {s['model']} vs {s['optimized']}",
             f"# {env['device']}, provider {s['provider']}, source {s['source']} ({_CLOCKS[s['clock']]}), "
             f"{s['iters']} iterations after {s['warmup']} warm-up runs per shape and session",
             f"# onnxruntime {env['onnxruntime']}, torch {env.get('torch') or 'none'}, {env['date']}",
             f"$ {env['command']}"]
    if s.get("fallback"):
        lines.append(f"# {s['fallback']}")
    if "warmup_shape" in s:
        warm = s["warmup_shape"]
        lines.append(f"# first call of each shape: one run under the profiler in sessions warm on "
                     f"{_label(warm) if warm else 'no other shape'} and the shapes before it, before its warm-up")
    if not report.get("complete", True):
        lines.append("# INCOMPLETE: the run stopped before its last shape")
    for shape in report["shapes"]:
        lines += _render_shape(shape, top)
    return "\n".join(lines) + "\n"


def _torch_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", type=Path, help="the original model (or --suite)")
    p.add_argument("--optimized", type=Path, help="the optimized model (with MODEL)")
    p.add_argument("--suite", choices=list(SUITES), help="run_suite.py's model and optimized model, built if missing")
    p.add_argument("--preset", help="with --suite: the model preset instead of the suite's")
    p.add_argument("--dtype", default="float32", choices=list(DTYPE_SUFFIX), help="with --suite: precision")
    p.add_argument("--workdir", type=Path, default=ROOT / ".cache" / "benchmarks",
                   help="with --suite: where the models are kept (run_suite.py's --workdir)")
    p.add_argument("--optimize-arg", action="append", default=[], metavar="ARG",
                   help="with --suite: an argument for `dietcode-ort optimize` when it has to run")
    p.add_argument("--provider", default="cuda", choices=sorted(bench.PROVIDERS))
    p.add_argument("--source", default="auto", choices=["auto", "cupti", "ort"],
                   help="cupti (torch.profiler) or ORT's profiler; auto: cupti on cuda, ort on cpu")
    p.add_argument("--dim", action="append", default=[], metavar="NAME=SPEC", help="swept as bench sweeps")
    p.add_argument("--shape", action="append", default=[], metavar="NAME=V,NAME=V", help="one shape (repeatable)")
    p.add_argument("--tie", action="append", default=[], metavar="NAME=OTHER", help="as bench's --tie")
    p.add_argument("--iters", type=int, default=20, help="profiled (and timed) runs per shape and session")
    p.add_argument("--warmup", type=int, default=5, help="runs before them (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--top", type=int, default=8, help="kernels listed per session in the table")
    p.add_argument("--json", type=Path, help="write the profile here (re-written after every shape)")
    p.add_argument("--traces", type=Path, help="cupti: keep each profiled loop's chrome trace here (Perfetto), "
                   "as <shape index>-<side>.json.gz (<...>.first.json.gz: the shape's first call)")
    p.add_argument("--out", type=Path, help="write the table here (also printed)")
    p.add_argument("--from-json", type=Path, help="print the table of an earlier --json and stop")
    args = p.parse_args(argv)

    def write(report: dict[str, Any], final: bool) -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1) + "\n")
        if final:
            text = render(report, args.top)
            print(text, end="")
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(text)

    try:
        if args.from_json:
            print(render(json.loads(args.from_json.read_text()), args.top), end="")
            return 0
        if args.suite:
            if args.model or args.optimized:
                p.error("give MODEL --optimized OPT or --suite, not both")
            suite = SUITES[args.suite]
            tag = suite_tag(suite, args.preset, args.dtype)
            note = (args.json or args.workdir / tag).with_suffix(".note.txt")
            model, optimized = suite_models(suite, args.provider, args.workdir, note, preset=args.preset,
                                            dtype=args.dtype, optimize_args=args.optimize_arg)
        elif args.model and args.optimized:
            model, optimized = args.model, args.optimized
        else:
            p.error("give MODEL --optimized OPT, or --suite NAME")
        symbols = bench.load_model_info(model).symbols
        given = [*args.dim, *(part for point in args.shape for part in point.split(","))]
        ties = bench.model_ties(model, given, args.tie)[0] if symbols else args.tie
        shapes = profile_shapes(symbols, args.dim, args.shape, ties)
        warm = bench.warmup_shape(shapes, ties) if symbols else None
        source, fallback = args.source, None
        if source == "auto":
            source = "cupti" if args.provider == "cuda" else "ort"
        if source == "cupti" and args.provider != "cuda":
            p.error("--source cupti reads CUDA kernels: it needs --provider cuda")
        env = {**environment(args.provider, "python benchmarks/profile_kernels.py "
                             + shlex.join(sys.argv[1:] if argv is None else argv)), "torch": _torch_version()}
        settings: dict[str, Any] = {"model": str(model), "optimized": str(optimized), "provider": args.provider,
                                    "iters": args.iters, "warmup": args.warmup, "seed": args.seed,
                                    "shapes": shapes, "library_registered": True, "warmup_shape": warm}

        def run(source: str) -> list[ShapeProfile]:
            clock = "device" if source == "cupti" else ("cpu" if args.provider == "cpu" else "host")
            settings.update(source=source, clock=clock, fallback=fallback)
            return profile(model, optimized, args.provider, shapes, source=source, iters=args.iters,
                           warmup=args.warmup, seed=args.seed, traces=args.traces, warm_shape=warm,
                           done=lambda got: write(report_json(env, settings, got, len(got) == len(shapes)), False))

        try:
            results = run(source)
        except ProfileError as exc:
            if args.source != "auto" or source != "cupti":
                raise
            fallback = f"CUPTI could not be used ({exc}): ORT's profiler instead, host times of each node's launches"
            print(f"profile_kernels: {fallback}", file=sys.stderr)
            results = run("ort")
        write(report_json(env, settings, results, True), True)
    except DietcodeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
