"""Report on a recorded measurement table (``record_table.py``) on any machine, GPU or not.

    python benchmarks/report_table.py TABLE.csv[.gz] [--target sm_90] [--budget 512] [--no-warm-start] [--plot F.png]
        [--json F]

Per workload (the table's ``family`` tag), against the vendor library's time on each instance:
- the per-instance oracle (the best config on every instance): geomean speed vs vendor, and on how many
  instances the vendor kernel is faster than every config;
- the best single config (one kernel for all shapes): its geomean speed vs vendor;
- DietCode by replay: joint search with ``--budget`` measurements (``tuner.search.tune_joint`` on a
  ``ReplayMeasurer``; in tag order, each gemm search warm-started from the earlier gemm ones as optimize
  does, unless ``--no-warm-start``), then the dispatcher (``tuner.dispatch.build_dispatch``, vendor leaves allowed):
  the dispatched kernels' geomean speed vs vendor, and their regret against the oracle (the best of the
  configs and the vendor per instance); and the search's regret among the kernels alone: the same search's
  settled tree without vendor leaves, against the best config per instance (where the vendor wins nearly
  everywhere, the first regret says nothing of how well the search ranks the kernels). A dispatched kernel the
  runtime refuses on an instance (a row whose
  error is the runtime's fit check, ``tuner.measure.REFUSED``: e.g. a TMA kernel's div16 assumption on a
  T that is not a multiple of 16) runs the vendor path there, as the custom op does (custom_ops/ort_ops.cc:
  a call dc_launch_fit refuses runs cuBLAS / cuDNN), so it costs the vendor's time; ``fallbacks`` counts
  those instances.
- the roofline fraction (dense and attention sets): per instance, min-time bound / measured time, where the
  bound is max(2*M*N*K*batch / peak, bytes / bandwidth) with bytes = (M*K + K*N + M*N) * batch * 2 (fp16,
  each operand moved once); the median over the instances with M >= 512, for the dispatched kernels and the
  oracle. Peaks are the datasheet figures of the table's device (``tuner.hardware.device_profile``: an H200's
  or an H100 PCIe's own; else ``--target``'s profile), or ``--peak-tflops`` / ``--bandwidth-gbs``. The
  replayed search models the same device.
- the tuning cost: the joint search's measurements and distinct configs against per-shape autotuning over
  the same configs (every config on every instance, each config compiled once). With the recorder's cost
  units in table.json beside the CSV (seconds per compiled config and per timed launch), the ratio of
  compile-plus-measure seconds; else the ratio of measurements alone.
Speeds are unweighted geometric means of vendor_seconds / seconds (> 1: faster than the vendor). The
oracle and the best single config take only calls the runtime launches.
"""
from __future__ import annotations

import argparse
import csv
import gzip
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dietcode_ort.errors import DietcodeError  # noqa: E402
from tuner.measure import MeasureResult  # noqa: E402
from tuner.workload import Problem  # noqa: E402

__all__ = ["TagTable", "load_table", "WorkloadFigures", "report", "main", "Peaks", "CostUnits",
           "device_peaks", "table_device", "cost_units", "roofline_fraction"]

ROOFLINE_MIN_M = 512


@dataclass(frozen=True)
class TagTable:
    """One workload's measurements: times[i, j] of config j on problem i (inf: failed or missing);
    refused[i, j]: the runtime refuses that call (the instance runs the vendor path; None: no refusals)."""

    tag: str
    problems: tuple[Problem, ...]
    configs: tuple[str, ...]
    times: np.ndarray
    vendor: np.ndarray
    refused: np.ndarray | None = None

    def refuses(self, i: int, j: int) -> bool:
        return self.refused is not None and bool(self.refused[i, j])


def load_table(path: Path) -> dict[str, TagTable]:
    opener = gzip.open if path.suffix == ".gz" else open
    rows: dict[str, dict[tuple[str, Problem], float]] = {}
    refusals: dict[str, set[tuple[str, Problem]]] = {}
    try:
        with opener(path, "rt", newline="") as fh:  # type: ignore[operator]
            reader = csv.DictReader(fh)
            if not {"config", "m", "n", "k", "batch", "seconds", "family"} <= set(reader.fieldnames or ()):
                raise DietcodeError(f"{path} is not a measurement table (needs config, m, n, k, batch, seconds, "
                                    "family columns)")
            for row in reader:
                seconds = math.inf if row.get("error") else float(row["seconds"])
                p = Problem(int(row["m"]), int(row["n"]), int(row["k"]), int(row["batch"]))
                rows.setdefault(row["family"], {})[(row["config"], p)] = seconds
                if MeasureResult(seconds, row.get("error") or None).refused:
                    refusals.setdefault(row["family"], set()).add((row["config"], p))
    except (OSError, EOFError, ValueError, csv.Error) as exc:
        raise DietcodeError(f"cannot read measurement table {path}: {exc}") from None
    out = {}
    for tag, cells in rows.items():
        problems = tuple(sorted({p for _, p in cells}))
        configs = tuple(sorted({c for c, _ in cells} - {"vendor"}))
        times = np.array([[cells.get((c, p), math.inf) for c in configs] for p in problems])
        vendor = np.array([cells.get(("vendor", p), math.inf) for p in problems])
        if not configs or not np.isfinite(vendor).all():
            raise DietcodeError(f"{path}: workload {tag!r} needs config rows and a vendor time for every instance")
        refused = refusals.get(tag, set())
        out[tag] = TagTable(tag, problems, configs, times, vendor,
                            np.array([[(c, p) in refused for c in configs] for p in problems], dtype=bool))
    if not out:
        raise DietcodeError(f"{path} holds no measurements")
    return out


@dataclass(frozen=True)
class WorkloadFigures:
    tag: str
    instances: int
    configs: int
    oracle_vs_vendor: float
    vendor_wins: int
    best_single: str
    best_single_vs_vendor: float
    search_trials: int | None = None
    dispatched_vs_vendor: float | None = None
    dispatched_kernels: int | None = None
    regret: float | None = None
    fallbacks: int | None = None  # instances whose dispatched kernel the runtime refuses: they run the vendor path
    kernel_regret: float | None = None  # the settled tree without vendor leaves against the best config per instance
    roofline_instances: int = 0  # instances with M >= ROOFLINE_MIN_M
    roofline_dispatched: float | None = None  # median fraction of the bound there, dispatched kernels
    roofline_oracle: float | None = None  # the same for the per-instance oracle
    joint_measurements: int | None = None  # (config, instance) timings the joint search made
    joint_configs: int | None = None  # distinct configs among them (each compiled once)
    per_shape_measurements: int | None = None  # every config on every instance
    tuning_cost_ratio: float | None = None  # joint / per-shape, in seconds where table.json has the units
    tuning_cost_unit: str | None = None  # "seconds" or "measurements"


@dataclass(frozen=True)
class Peaks:
    tflops: float
    bandwidth_gbs: float
    source: str


@dataclass(frozen=True)
class CostUnits:
    """The recorder's cost of one compiled config and one timed launch of a set (wall seconds)."""

    compile_s: float
    timing_s: float


def device_peaks(table: Path, target: str, tflops: float | None = None, bandwidth_gbs: float | None = None
                 ) -> Peaks:
    """The roofline's peaks: the overrides, else the datasheet figures of table.json's device
    (``tuner.hardware.device_profile``), else the ``target`` profile's."""
    from tuner.hardware import device_profile

    device = table_device(table)
    profile = device_profile(device, target)
    base = Peaks(profile.fp16_tensor_tflops, profile.dram_bandwidth_gbs,
                 f"profile {profile.name}" + (f" for {device}" if device else ""))
    if tflops is None and bandwidth_gbs is None:
        return base
    if (tflops is not None and not tflops > 0) or (bandwidth_gbs is not None and not bandwidth_gbs > 0):
        raise DietcodeError(f"--peak-tflops and --bandwidth-gbs must be positive, got {tflops}, {bandwidth_gbs}")
    return Peaks(tflops or base.tflops, bandwidth_gbs or base.bandwidth_gbs, "given")


def roofline_fraction(p: Problem, seconds: float, peaks: Peaks) -> float:
    """The min-time bound of ``p`` in fp16 over ``seconds`` (1.0: at the roof)."""
    flops = 2.0 * p.m * p.n * p.k * p.batch
    moved = 2.0 * (p.m * p.k + p.k * p.n + p.m * p.n) * p.batch
    return max(flops / (peaks.tflops * 1e12), moved / (peaks.bandwidth_gbs * 1e9)) / seconds


def _metadata(table: Path) -> dict:
    """table.json beside the CSV (record_table.py), or {} when there is none or it is not JSON."""
    try:
        meta = json.loads((table.parent / "table.json").read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def table_device(table: Path) -> str:
    """The name of the GPU the table was recorded on (table.json's ``device``; "" when it has none)."""
    return str(_metadata(table).get("device", ""))


def cost_units(table: Path) -> dict[str, CostUnits]:
    """Per set tag, the recorder's cost units from table.json's ``done`` entries (runs appended to one
    table add up); tags without them (an analytic rehearsal, an older table) are left out.

    A table recorded before each set compiled into a cache of its own (``cost``'s ``cache`` is not
    "per-set") timed, for a set after the first of its op, reads of the kernels an earlier set had compiled
    (the dense sets' kernels are the same binaries), not compiles: there every set of an op takes the
    largest compile seconds per config among that op's sets (the least cached one's)."""
    meta = _metadata(table)
    ops = {str(s.get("tag")): str(s.get("op")) for s in meta.get("sets", []) if isinstance(s, dict)}
    totals: dict[str, list[float]] = {}
    shared: set[str] = set()  # tags timed with a cache shared across sets
    for done in meta.get("done", []):
        cost = done.get("cost") if isinstance(done, dict) else None
        if not isinstance(cost, dict):
            continue
        try:
            values = [float(cost[k]) for k in ("compile_s", "compiled", "timing_s", "timed")]
        except (KeyError, TypeError, ValueError):
            continue
        tag = str(done.get("tag"))
        if cost.get("cache") != "per-set":
            shared.add(tag)
        t = totals.setdefault(tag, [0.0] * 4)
        totals[tag] = [a + b for a, b in zip(t, values)]
    units = {tag: CostUnits(c / n, s / m) for tag, (c, n, s, m) in totals.items() if n > 0 and m > 0}
    shared &= set(units)
    least_cached = {}  # op -> the largest compile seconds per config among its sets with a shared cache
    for tag in shared:
        op = ops.get(tag, tag)
        least_cached[op] = max(least_cached.get(op, 0.0), units[tag].compile_s)
    return {tag: CostUnits(least_cached[ops.get(tag, tag)], u.timing_s) if tag in shared else u
            for tag, u in units.items()}


def _geomean(x: np.ndarray) -> float:
    return float(np.exp(np.mean(np.log(x))))


def _figures(t: TagTable) -> tuple[WorkloadFigures, np.ndarray]:
    oracle = t.times.min(axis=1)
    with np.errstate(divide="ignore"):
        per_config = np.exp(np.log(t.times).mean(axis=0))
    best = int(np.argmin(per_config))
    figures = WorkloadFigures(t.tag, len(t.problems), len(t.configs), _geomean(t.vendor / oracle),
                              int((t.vendor < oracle).sum()), t.configs[best], _geomean(t.vendor / t.times[:, best]))
    return figures, oracle


def _op(t: TagTable) -> str:
    return "bmm" if any(p.batch > 1 for p in t.problems) else "gemm"


def _replay(path: Path, t: TagTable, fig: WorkloadFigures, target: str, budget: int, seed: int, warm: Sequence = ()
            ) -> tuple[WorkloadFigures, np.ndarray, tuple]:
    """The replayed search and settled tree's figures, the dispatched seconds per instance, and what the search
    and the settling measured (the next workload's warm start, as optimize passes it on)."""
    from dataclasses import replace

    from tuner.dispatch import settled_dispatch
    from tuner.measure import ReplayMeasurer, tuning_profile
    from tuner.search import SearchOptions, tune_joint
    from tuner.space import Family, MicroKernel
    from tuner.workload import Instance

    family = Family(_op(t), "float16", target)
    space = [MicroKernel.from_key(c) for c in t.configs]
    measurer = ReplayMeasurer(path, family=t.tag)
    result = tune_joint(family, [(p, 1.0) for p in t.problems], space, measurer,  # modelling the table's GPU
                        tuning_profile(measurer, target), SearchOptions(max_trials=budget, seed=seed, progress=False), warm=warm)
    names = ("M", "N", "K", "batch")
    instances = [Instance(tuple(zip(names, (p.m, p.n, p.k, p.batch)))) for p in result.problems]
    row = {p: i for i, p in enumerate(t.problems)}
    vendor = t.vendor[[row[p] for p in result.problems]]
    searched = result
    # as optimize ships it: the tree's picks timed where they were predicted (tuner.dispatch.settled_dispatch)
    dispatch, result = settled_dispatch(names, instances, result, vendor, measurer, 8, seed)
    col = {c: j for j, c in enumerate(t.configs)}
    rows = [row[p] for p in result.problems]

    def real_times(tree) -> tuple[np.ndarray, list[bool]]:
        # judge a dispatched choice by the table's real times, not by the model's predictions; a kernel the
        # runtime refuses on an instance runs the vendor path there (custom_ops/ort_ops.cc), at the vendor's time
        picked = [tree.select(inst.as_dict()) for inst in instances]
        fell_back = [k != "vendor" and t.refuses(r, col[k.key()]) for r, k in zip(rows, picked)]
        return np.array([vendor[i] if k == "vendor" or fell_back[i] else t.times[r, col[k.key()]]
                         for i, (r, k) in enumerate(zip(rows, picked))]), fell_back

    real, fell_back = real_times(dispatch)
    kernel_oracle = t.times[rows].min(axis=1)  # refused calls are inf in the table (their rows carry an error)
    oracle = np.minimum(kernel_oracle, vendor)
    # the same search's kernels alone (no vendor leaf, settled on its own): how well it ranks the configs
    kernels_only, _ = settled_dispatch(names, instances, searched, None, measurer, 8, seed)
    kernel_real, _ = real_times(kernels_only)
    order = np.argsort(rows)
    return replace(fig, search_trials=result.trials, dispatched_vs_vendor=_geomean(vendor / real),
                   dispatched_kernels=len(dispatch.kernels), regret=_geomean(real / oracle), fallbacks=sum(fell_back),
                   kernel_regret=_geomean(np.maximum(kernel_real, kernel_oracle) / kernel_oracle),
                   joint_measurements=len(result.measurements),
                   joint_configs=len({m.config for m in result.measurements})), real[order], result.measurements


def _roofline(t: TagTable, fig: WorkloadFigures, oracle: np.ndarray, dispatched: np.ndarray | None, peaks: Peaks
              ) -> WorkloadFigures:
    from dataclasses import replace

    rows = [i for i, p in enumerate(t.problems) if p.m >= ROOFLINE_MIN_M]
    if not rows:
        return fig

    def median(seconds: np.ndarray) -> float:
        return float(np.median([roofline_fraction(t.problems[i], float(seconds[i]), peaks) for i in rows]))

    return replace(fig, roofline_instances=len(rows), roofline_oracle=median(np.minimum(oracle, t.vendor)),
                   roofline_dispatched=None if dispatched is None else median(dispatched))


def _tuning_cost(t: TagTable, fig: WorkloadFigures, units: CostUnits | None) -> WorkloadFigures:
    from dataclasses import replace

    if fig.joint_measurements is None or fig.joint_configs is None:
        return fig
    configs, per_shape = len(t.configs), len(t.configs) * len(t.problems)
    if units is None:
        ratio, unit = fig.joint_measurements / per_shape, "measurements"
    else:
        joint = units.compile_s * fig.joint_configs + units.timing_s * fig.joint_measurements
        ratio, unit = joint / (units.compile_s * configs + units.timing_s * per_shape), "seconds"
    return replace(fig, per_shape_measurements=per_shape, tuning_cost_ratio=ratio, tuning_cost_unit=unit)


def report(path: Path, *, target: str = "sm_90", budget: int = 512, seed: int = 0, plot: Path | None = None,
           peaks: Peaks | None = None, warm_start: bool = True) -> list[WorkloadFigures]:
    """The figures per workload, replayed in tag order; with ``warm_start`` a search of an op in
    ``tuner.search.WARM_START_OPS`` (gemm) starts from what the searches of its op before it measured, as optimize
    runs a model's workloads (tuner.optimize.warm_family)."""
    from tuner.search import WARM_START_OPS

    tables = load_table(path)
    peaks = peaks or device_peaks(path, target)
    units = cost_units(path)
    figures, curves = [], {}
    measured: dict[str, list] = {}  # op -> the earlier replays' measurements
    for tag, t in sorted(tables.items()):
        fig, oracle = _figures(t)
        dispatched = None
        if not tag.startswith("conv"):  # conv rows lack the layer geometry a replay search needs
            op = _op(t)
            warm = tuple(measured.get(op, ())) if warm_start and op in WARM_START_OPS else ()
            fig, dispatched, log = _replay(path, t, fig, target, budget, seed, warm)
            measured.setdefault(op, []).extend(log)
            fig = _tuning_cost(t, _roofline(t, fig, oracle, dispatched, peaks), units.get(tag))
        figures.append(fig)
        curves[tag] = (t, oracle, dispatched)
    if plot is not None:
        _plot(curves, plot)
    return figures


def _plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tags = [t for t in curves if not t.startswith("conv")] or list(curves)
    fig, axes = plt.subplots(len(tags), 1, figsize=(8, 2.6 * len(tags)), squeeze=False)
    for ax, tag in zip(axes[:, 0], tags):
        t, oracle, dispatched = curves[tag]
        x = [p.m for p in t.problems]
        ax.plot(x, t.vendor / oracle, label="per-instance oracle")
        if dispatched is not None:
            ax.plot(x, t.vendor / dispatched, label="DietCode (joint search + dispatcher)")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(tag, fontsize=9)
        ax.set_ylabel("speed vs vendor")
        ax.legend(fontsize=7)
    axes[-1, 0].set_xlabel("M")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _print(figures: Sequence[WorkloadFigures]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="speed vs vendor (geomean over instances; > 1 is faster)")
    for col in ("workload", "inst", "configs", "oracle", "vendor wins", "best single", "DietCode", "kernels",
                "regret", "kernels' regret", "fallbacks", "trials"):
        table.add_column(col)
    fmt = lambda v, spec=".3f": "-" if v is None else format(v, spec)  # noqa: E731
    for f in figures:
        table.add_row(f.tag, str(f.instances), str(f.configs), fmt(f.oracle_vs_vendor), str(f.vendor_wins),
                      f"{fmt(f.best_single_vs_vendor)} ({f.best_single})", fmt(f.dispatched_vs_vendor),
                      fmt(f.dispatched_kernels, "d"), fmt(f.regret), fmt(f.kernel_regret), fmt(f.fallbacks, "d"),
                      fmt(f.search_trials, "d"))
    Console(width=160).print(table)
    extra = Table(title=f"roofline (median fraction of the bound, M >= {ROOFLINE_MIN_M}) and tuning cost "
                        "(joint search / per-shape autotuning over the same configs)")
    for col in ("workload", "inst M>=512", "DietCode", "oracle", "joint meas.", "joint configs", "per-shape meas.",
                "cost ratio"):
        extra.add_column(col)
    for f in figures:
        if f.joint_measurements is None and not f.roofline_instances:
            continue
        ratio = "-" if f.tuning_cost_ratio is None else f"1/{1 / f.tuning_cost_ratio:.0f} ({f.tuning_cost_unit})"
        extra.add_row(f.tag, str(f.roofline_instances), fmt(f.roofline_dispatched), fmt(f.roofline_oracle),
                      fmt(f.joint_measurements, "d"), fmt(f.joint_configs, "d"), fmt(f.per_shape_measurements, "d"),
                      ratio)
    Console(width=160).print(extra)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("table", type=Path, help="table.csv or table.csv.gz from record_table.py")
    p.add_argument("--target", default="sm_90", help="hardware profile for the cost model (default sm_90)")
    p.add_argument("--budget", type=int, default=512, help="joint-search measurements per workload (default 512)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warm-start", action=argparse.BooleanOptionalAction, default=True,
                   help="each gemm workload's search starts from what the gemm searches before it (tag order) "
                        "measured, as optimize's do (default; --no-warm-start: each on its own)")
    p.add_argument("--plot", type=Path, help="PNG of speed vs M per workload")
    p.add_argument("--json", type=Path, help="write the figures as JSON")
    p.add_argument("--peak-tflops", type=float, help="the roofline's fp16 tensor-core TFLOP/s (default: by device)")
    p.add_argument("--bandwidth-gbs", type=float, help="the roofline's DRAM GB/s (default: by device)")
    args = p.parse_args(argv)
    try:
        peaks = device_peaks(args.table, args.target, args.peak_tflops, args.bandwidth_gbs)
        figures = report(args.table, target=args.target, budget=args.budget, seed=args.seed, plot=args.plot,
                         peaks=peaks, warm_start=args.warm_start)
    except DietcodeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _print(figures)
    print(f"roofline peaks: {peaks.tflops} TFLOP/s fp16, {peaks.bandwidth_gbs} GB/s ({peaks.source})")
    if args.json:
        args.json.write_text(json.dumps({"table": str(args.table), "peaks": asdict(peaks),
                                         "figures": [asdict(f) for f in figures]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
