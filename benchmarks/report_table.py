"""Report on a recorded measurement table (``record_table.py``) on any machine, GPU or not.

    python benchmarks/report_table.py TABLE.csv[.gz] [--target sm_90] [--budget 512] [--plot F.png] [--json F]

Per workload (the table's ``family`` tag), against the vendor library's time on each instance:
- the per-instance oracle (the best config on every instance): geomean speed vs vendor, and on how many
  instances the vendor kernel is faster than every config;
- the best single config (one kernel for all shapes): its geomean speed vs vendor;
- DietCode by replay: joint search with ``--budget`` measurements (``tuner.search.tune_joint`` on a
  ``ReplayMeasurer``), then the dispatcher (``tuner.dispatch.build_dispatch``, vendor leaves allowed):
  the dispatched kernels' geomean speed vs vendor, and their regret against the oracle.
Speeds are unweighted geometric means of vendor_seconds / seconds (> 1: faster than the vendor).
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
from tuner.workload import Problem  # noqa: E402

__all__ = ["TagTable", "load_table", "WorkloadFigures", "report", "main"]


@dataclass(frozen=True)
class TagTable:
    """One workload's measurements: times[i, j] of config j on problem i (inf: failed or missing)."""

    tag: str
    problems: tuple[Problem, ...]
    configs: tuple[str, ...]
    times: np.ndarray
    vendor: np.ndarray


def load_table(path: Path) -> dict[str, TagTable]:
    opener = gzip.open if path.suffix == ".gz" else open
    rows: dict[str, dict[tuple[str, Problem], float]] = {}
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
        out[tag] = TagTable(tag, problems, configs, times, vendor)
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


def _replay(path: Path, t: TagTable, fig: WorkloadFigures, target: str, budget: int, seed: int
            ) -> tuple[WorkloadFigures, np.ndarray]:
    from dataclasses import replace

    from tuner.dispatch import build_dispatch
    from tuner.hardware import get_profile
    from tuner.measure import ReplayMeasurer
    from tuner.search import SearchOptions, tune_joint
    from tuner.space import Family, MicroKernel
    from tuner.workload import Instance

    op = "bmm" if any(p.batch > 1 for p in t.problems) else "gemm"
    family = Family(op, "float16", target)
    space = [MicroKernel.from_key(c) for c in t.configs]
    result = tune_joint(family, [(p, 1.0) for p in t.problems], space, ReplayMeasurer(path, family=t.tag),
                        get_profile(target), SearchOptions(max_trials=budget, seed=seed, progress=False))
    names = ("M", "N", "K", "batch")
    instances = [Instance(tuple(zip(names, (p.m, p.n, p.k, p.batch)))) for p in result.problems]
    row = {p: i for i, p in enumerate(t.problems)}
    vendor = t.vendor[[row[p] for p in result.problems]]
    dispatch = build_dispatch(names, instances, result.candidates, result.times, vendor, 8, seed)
    # judge the dispatched choice by the table's real times, not by the model's predictions
    col = {c: j for j, c in enumerate(t.configs)}
    picked = [dispatch.select(inst.as_dict()) for inst in instances]
    real = np.array([vendor[i] if k == "vendor" else t.times[row[p], col[k.key()]]
                     for i, (p, k) in enumerate(zip(result.problems, picked))])
    oracle = np.minimum(t.times[[row[p] for p in result.problems]].min(axis=1), vendor)
    order = np.argsort([row[p] for p in result.problems])
    return replace(fig, search_trials=result.trials, dispatched_vs_vendor=_geomean(vendor / real),
                   dispatched_kernels=len(dispatch.kernels), regret=_geomean(real / oracle)), real[order]


def report(path: Path, *, target: str = "sm_90", budget: int = 512, seed: int = 0, plot: Path | None = None
           ) -> list[WorkloadFigures]:
    tables = load_table(path)
    figures, curves = [], {}
    for tag, t in sorted(tables.items()):
        fig, oracle = _figures(t)
        dispatched = None
        if not tag.startswith("conv"):  # conv rows lack the layer geometry a replay search needs
            fig, dispatched = _replay(path, t, fig, target, budget, seed)
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
                "regret", "trials"):
        table.add_column(col)
    fmt = lambda v, spec=".3f": "-" if v is None else format(v, spec)  # noqa: E731
    for f in figures:
        table.add_row(f.tag, str(f.instances), str(f.configs), fmt(f.oracle_vs_vendor), str(f.vendor_wins),
                      f"{fmt(f.best_single_vs_vendor)} ({f.best_single})", fmt(f.dispatched_vs_vendor),
                      fmt(f.dispatched_kernels, "d"), fmt(f.regret), fmt(f.search_trials, "d"))
    Console(width=160).print(table)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("table", type=Path, help="table.csv or table.csv.gz from record_table.py")
    p.add_argument("--target", default="sm_90", help="hardware profile for the cost model (default sm_90)")
    p.add_argument("--budget", type=int, default=512, help="joint-search measurements per workload (default 512)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", type=Path, help="PNG of speed vs M per workload")
    p.add_argument("--json", type=Path, help="write the figures as JSON")
    args = p.parse_args(argv)
    try:
        figures = report(args.table, target=args.target, budget=args.budget, seed=args.seed, plot=args.plot)
    except DietcodeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _print(figures)
    if args.json:
        args.json.write_text(json.dumps({"table": str(args.table), "figures": [asdict(f) for f in figures]},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
