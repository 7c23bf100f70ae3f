"""The dispatcher: which kernel runs for which instance, as a decision tree over the symbolic dims.

1. Per instance, the best known kernel (``TuningResult.times``: measured where measured, else predicted).
2. At most ``max_kernels`` distinct kernels per workload: a greedy cover that each time adds the kernel
   reducing the weighted regret (sum of weight x log(time / best time)) most. The vendor library, when
   timed, is a free extra choice: an instance where it is faster dispatches to "vendor", so a tuned
   model is never slower than stock ONNX Runtime on the instances it was tuned for.
3. A scikit-learn DecisionTreeClassifier fitted on the instances' symbol values (features) -> chosen
   kernel, exported as the bundle's ``DispatchTree`` (flat arrays, integer thresholds: ``value <= threshold``
   goes left). sklearn splits integer features at midpoints (x <= 16.5); for integer x that is x <= 16.
4. A regret report: per instance, the dispatched kernel's time against the best known, and the
   weighted geometric mean of the ratios.

``settled_dispatch`` (what ``optimize`` ships) times the picks that rest on predictions before the tree is
final, so that the vendor comparison in step 2 is between two measurements wherever the tree sends an instance
to a compiled kernel.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence, Union

import numpy as np

from dietcode_ort.bundle import DispatchTree
from dietcode_ort.errors import DietcodeError
from tuner.space import MicroKernel
from tuner.workload import Instance, Problem, Workload

if TYPE_CHECKING:
    from tuner.measure import Measurer
    from tuner.search import TuningResult

__all__ = ["VENDOR", "RegretRow", "RegretReport", "Dispatch", "greedy_cover", "build_dispatch",
           "settled_dispatch", "dispatch_from_tuning", "regret_report", "SETTLE_PASSES"]

VENDOR = "vendor"
Kernel = Union[MicroKernel, str]


@dataclass(frozen=True)
class RegretRow:
    values: tuple[int, ...]  # symbol values, in Dispatch.symbols order
    weight: float
    kernel: str  # dispatched kernel's key or "vendor"
    seconds: float
    best: str
    best_seconds: float

    @property
    def ratio(self) -> float:
        return self.seconds / self.best_seconds


@dataclass(frozen=True)
class RegretReport:
    rows: tuple[RegretRow, ...]
    geomean: float  # weighted geometric mean of dispatched / best
    worst: float


@dataclass(frozen=True)
class Dispatch:
    """Kernels (MicroKernel or "vendor"), the tree over ``symbols`` and its regret report."""

    symbols: tuple[str, ...]
    kernels: tuple[Kernel, ...]
    tree: DispatchTree  # the bundle's tree type: optimize writes it as it is
    report: RegretReport

    def select(self, values: Mapping[str, int]) -> Kernel:
        """The kernel for one assignment of the symbols."""
        missing = [s for s in self.symbols if s not in values]
        if missing:
            raise DietcodeError(f"dispatch needs values for {missing}; symbols: {list(self.symbols)}")
        return self.kernels[self.tree.evaluate([int(values[s]) for s in self.symbols])]

    def render(self) -> str:
        """The tree as an if-chain, most specific condition first, ending in the catch-all."""
        names = [k if isinstance(k, str) else f"k{i} {k.key()}" for i, k in enumerate(self.kernels)]
        return self.tree.render(self.symbols, names)


def _log_ratio(times: np.ndarray, best: np.ndarray) -> np.ndarray:
    """log(time / best) per entry; a failed (inf) entry is a prohibitive 1000."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(np.isfinite(times), np.log(times / best[:, None]), 1e3)
    return ratio


def greedy_cover(times: np.ndarray, weights: Sequence[float] | np.ndarray, max_kernels: int,
                 free: np.ndarray | None = None) -> list[int]:
    """Pick at most ``max_kernels`` columns of ``times`` [instances, kernels] minimizing the weighted
    regret sum_i w_i log(min over picked (and ``free``[i], e.g. the vendor time) / best_i)."""
    if max_kernels <= 0:
        raise DietcodeError(f"max_kernels must be at least 1, got {max_kernels}")
    w = np.asarray(weights, dtype=np.float64)
    free_t = np.full(times.shape[0], np.inf) if free is None else np.asarray(free, dtype=np.float64)
    best = np.minimum(times.min(axis=1), free_t)
    if not np.isfinite(best).all():
        bad = int(np.flatnonzero(~np.isfinite(best))[0])
        raise DietcodeError(f"instance {bad} has no kernel with a finite time (every candidate failed)")
    log_t = _log_ratio(times, best)
    current = _log_ratio(free_t[:, None], best)[:, 0]
    picked: list[int] = []
    while len(picked) < min(max_kernels, times.shape[1]):
        totals = (w[:, None] * np.minimum(current[:, None], log_t)).sum(axis=0)
        totals[picked] = np.inf
        j = int(np.argmin(totals))
        if picked and totals[j] >= (w * current).sum() - 1e-12:
            break
        picked.append(j)
        current = np.minimum(current, log_t[:, j])
        if (w * current).sum() <= 1e-12:
            break
    return picked


def regret_report(values: Sequence[Sequence[int]], weights: Sequence[float] | np.ndarray, dispatched: Sequence[str],
                  seconds: Sequence[float], best: Sequence[str], best_seconds: Sequence[float]) -> RegretReport:
    """Rows plus the weighted geometric mean (and the worst) of dispatched / best seconds."""
    rows = tuple(RegretRow(tuple(int(v) for v in vals), float(w), d, float(s), b, float(bs))
                 for vals, w, d, s, b, bs in zip(values, weights, dispatched, seconds, best, best_seconds))
    total = sum(r.weight for r in rows)
    geomean = math.exp(sum(r.weight * math.log(r.ratio) for r in rows) / total)
    return RegretReport(rows, geomean, max(r.ratio for r in rows))


def build_dispatch(symbols: Sequence[str], instances: Sequence[Instance], candidates: Sequence[MicroKernel],
                   times: np.ndarray, vendor: Sequence[float] | np.ndarray | None = None, max_kernels: int = 8,
                   seed: int = 0) -> Dispatch:
    """Choose kernels for ``instances`` from ``times`` [instance, candidate] (+ optional vendor times)."""
    from sklearn.tree import DecisionTreeClassifier

    if not instances:
        raise DietcodeError("cannot build a dispatcher for an empty instance set")
    times = np.asarray(times, dtype=np.float64)
    if times.shape != (len(instances), len(candidates)):
        raise DietcodeError(f"times has shape {times.shape}, expected ({len(instances)}, {len(candidates)})")
    x = np.array([[inst.as_dict()[s] for s in symbols] for inst in instances], dtype=np.int64)
    if len({tuple(r) for r in x}) != len(x):
        raise DietcodeError("instances repeat the same symbol values; merge them (sum their weights) first")
    w = np.array([inst.weight for inst in instances], dtype=np.float64)
    vend = None if vendor is None else np.asarray(vendor, dtype=np.float64)
    picked = greedy_cover(times, w, max_kernels, vend) if len(candidates) else []
    kernels: list[Kernel] = [candidates[j] for j in picked]
    options = times[:, picked] if picked else np.zeros((len(instances), 0))
    if vend is not None:
        kernels.append(VENDOR)
        options = np.concatenate([options, vend[:, None]], axis=1)
    if options.shape[1] == 0:
        raise DietcodeError("no candidate kernels and no vendor timings: nothing to dispatch to")
    labels = options.argmin(axis=1)
    used = sorted(set(int(v) for v in labels))  # drop kernels no instance picks (e.g. an unused vendor)
    kernels = [kernels[i] for i in used]
    remap = {old: new for new, old in enumerate(used)}
    labels = np.array([remap[int(v)] for v in labels])
    options = options[:, used]
    clf = DecisionTreeClassifier(random_state=seed).fit(x, labels, sample_weight=w)
    tree = DispatchTree.from_sklearn(clf, {int(c): int(c) for c in clf.classes_})
    chosen = [tree.evaluate(list(row)) for row in x]
    names = [k if isinstance(k, str) else k.key() for k in kernels]
    all_names = [c.key() for c in candidates] + ([VENDOR] if vend is not None else [])
    all_times = times if vend is None else np.concatenate([times, vend[:, None]], axis=1)
    best_idx = all_times.argmin(axis=1)
    report = regret_report(x.tolist(), w, [names[c] for c in chosen],
                           [options[i, c] for i, c in enumerate(chosen)],
                           [all_names[b] for b in best_idx], all_times[np.arange(len(x)), best_idx])
    return Dispatch(tuple(symbols), tuple(kernels), tree, report)


SETTLE_PASSES = 3  # rounds of timing the tree's predicted picks before it is final


def settled_dispatch(symbols: Sequence[str], instances: Sequence[Instance], result: "TuningResult",
                     vendor: Sequence[float] | np.ndarray | None, measurer: "Measurer", max_kernels: int = 8,
                     seed: int = 0, passes: int = SETTLE_PASSES) -> tuple[Dispatch, "TuningResult"]:
    """``build_dispatch`` over ``result`` (``instances`` row for row with ``result.problems``) once each
    instance's pick is measured there where it was predicted (``tuner.search.settle``; one measurement per
    instance and round, at most ``passes`` rounds, since a measurement can send an instance to another kernel).
    With vendor times the final tree weighs measurements only: a kernel never measured on an instance cannot take
    it from the vendor leaf, so no instance is dispatched to a kernel measured slower than the vendor; without
    them (conv) predictions fill the gaps. Returns the dispatch and the result with the new measurements."""
    from tuner.search import settle

    if len(instances) != len(result.problems):
        raise DietcodeError(f"{len(instances)} instances for {len(result.problems)} tuned problems")
    col = {c: j for j, c in enumerate(result.candidates)}
    for _ in range(passes):
        dispatch = build_dispatch(symbols, instances, result.candidates, result.times, vendor, max_kernels, seed)
        picks = [dispatch.select(inst.as_dict()) for inst in instances]
        pending = [(i, col[k]) for i, k in enumerate(picks) if not isinstance(k, str) and not result.measured[i, col[k]]]
        if not pending:
            break
        result = settle(result, pending, measurer)
    times = result.times
    if vendor is not None:  # where the vendor has no time (its call failed there), predictions still count
        vend = np.asarray(vendor, dtype=np.float64)
        times = np.where(result.measured | ~np.isfinite(vend)[:, None], result.times, np.inf)
    return build_dispatch(symbols, instances, result.candidates, times, vendor, max_kernels, seed), result


def dispatch_from_tuning(workload: Workload, result: "TuningResult", vendor: Sequence[float] | None = None,
                         max_kernels: int = 8) -> Dispatch:
    """Dispatch ``workload``'s instances from a ``TuningResult`` (times per problem, mapped per instance).

    ``vendor`` is one time per problem of ``result.problems``.
    """
    problems: tuple[Problem, ...] = result.problems
    row = {p: i for i, p in enumerate(problems)}
    merged: dict[tuple[tuple[str, int], ...], Instance] = {}
    for inst in workload.instances:
        prev = merged.get(inst.values)
        merged[inst.values] = Instance(inst.values, inst.weight + (prev.weight if prev else 0.0))
    instances = list(merged.values())
    try:
        rows = [row[workload.problem(i)] for i in instances]
    except KeyError as exc:
        raise DietcodeError(f"the tuning result has no problem {exc.args[0]} for one of the workload's "
                            f"instances; tune the same instance set") from None
    times = result.times[rows]
    vend = None if vendor is None else np.asarray(vendor, dtype=np.float64)[rows]
    return build_dispatch(workload.symbols, instances, result.candidates, times, vend, max_kernels)
