"""Joint search (DietCode) and the per-shape baseline over the same micro-kernel space.

Joint search: every instance of a workload shares one candidate population and one cost model. Each
round measures ``SearchOptions.round_trials()`` candidates (``round_size``, less where the budget would
otherwise fit in fewer than ``min_rounds`` rounds: a search that spends its whole budget in the first round
never uses what it learns); a new candidate is timed on the instance where its f_adapt is best (its
cleanest label), except in the prior's first round (below), an already measured one on the instance where it
is predicted to gain most over that instance's best so far, and the label fed back is throughput / f_adapt,
so one measurement informs every shape. Candidates come from an evolving population: the model ranks a
population drawn from the space plus single-field mutations (one field moved to an adjacent value present in
the space) of the elite, and an epsilon share of every round is spent on random configs.

The roofline prior (``SearchOptions.prior``, on by default): the analytic roofline (tuner/roofline.py, the
analytic measurer's model) predicts every (config, instance) before anything is measured, and the search
uses it twice.
- The first round, with no data, takes the configs it ranks best, in turn from these lists: each instance's
  best (heaviest instances first); per kind (split-K or not, persistent or not, TMA or not, wgmma or
  mma.sync) the kind's best on each instance where that is within ``_KIND_SLACK`` (1.25x) of the
  instance's best; all configs by their weighted mean log slowdown against the instances' bests. Each is
  timed on the instance where the prior ranks it closest to that instance's best (an instance's best on an
  instance it is best on), so the round checks the prior's per-instance claims and its labels span the
  instances. (Timed on their best-f_adapt instance instead, the largest, the configs picked for small
  instances were never timed on one, and on the recorded H100 table the dispatcher then chose them there by
  the roofline's word.) An epsilon share of the round stays random, so the learned model sees spread.
  Without the prior the first round is all random.
- Every prediction (ranking, gains, the per-instance choice where a pair is not measured) is the geometric
  blend prior^(1 - w) x learned^w. The prior is scaled to the measurements: a measured config's roofline by
  its own geometric-mean measured / roofline ratio, an unmeasured one's by that ratio over all
  measurements. w is 0 for the first two rounds (the learned model has predicted nothing from this
  workload's data yet, warm-started or not: below), then e_prior / (e_prior + e_learned),
  where each e is the mean squared log error of that model's predictions of the last round's measurements,
  made before they were recorded: each model is trusted in inverse proportion to its error on data it had
  not seen. Where the roofline ranks a device's kernels badly the learned model takes over within a few rounds.

Warm start (``tune_joint(..., warm=)``): the measurements of the same device's other workloads of the same
family (op, dtype, target; optimize passes a gemm workload those of the gemm workloads it tuned before in the
same run: ``tuner.optimize.warm_family``) train the learned model before the first round
(``LearnedCostModel.warm_start``). f_MK is the micro-kernel's, whatever the shape, so a config timed on another
workload's GEMM is evidence here; the first round is still the prior's picks, and the model earns its share of
the blend from its error on the second round, as above. Replayed over the recorded H100 table's three dense
sets (``benchmarks/report_table.py``, seeds 0-2), the kernels' tree reaches 0.880, 0.950, 0.973, 0.985 and 0.987
of the per-instance best config at budgets 16, 32, 64, 128 and 256 (cold: 0.874, 0.917, 0.954, 0.983, 0.988).
With the analytic measurer the prior is the measurer: the first round measures the instances' optima first,
w stays 0 (the prior's error is 0), and the search stops when nothing more is predicted to gain.

Per-shape tuning runs the same loop for each instance on its own (its own model, same space and
measurer), round-robin; it is what a shape-specific auto-tuner (Ansor, MetaSchedule) would do and the
baseline joint search is compared with.

Calls the runtime refuses (``MeasureResult.refused``: its per-call fit check, e.g. a TMA kernel's div16
assumption on an N that is not a multiple of 16; the custom op runs the vendor path for them) are per instance,
not failures of the config: the pairs the measurer knows beforehand (``Measurer.refusals``, e.g. a replay
table's recorded refusals) and the refusals measured are never proposed again and are infinite in the result,
so the dispatcher gives those instances another kernel or the vendor, while the config stays a candidate for
the instances it fits. A refusal the measurer did not foresee leaves the config's unmeasured instances
unknown: the result holds it only where it was measured launching. Any other failure drops the config.

A candidate's score is the weighted sum over the instances it has not been measured on of
softplus(log(reference / predicted seconds)), reference being that instance's best measured time (or,
before any, 1.1 x its best prediction). Both searches stop at the trial budget, the time budget, or
after ``patience`` rounds in which no candidate is predicted to gain more than ``min_gain``.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields, replace
from typing import Sequence

import numpy as np

from dietcode_ort.errors import DietcodeError
from tuner.cost_model import CostModel, LearnedCostModel, f_adapt_matrix, launch_weight, useful_flops
from tuner.hardware import HardwareProfile
from tuner.measure import REFUSED, Measurer
from tuner.roofline import roofline_matrix
from tuner.space import Family, MicroKernel, wgmma_eligible
from tuner.workload import Problem

__all__ = ["WARM_START_OPS", "SearchOptions", "Measurement", "RoundRecord", "TuningResult", "tune_joint", "tune_per_shape",
           "neighbours", "settle"]


# the ops whose searches optimize warm-starts (tuner.optimize.warm_family; benchmarks/report_table.py replays the
# same): replayed over the recorded H100 table, a dense GEMM warm-started from the others ranks its kernels
# better at budgets 32 to 128 and about as well at 16 and 256, while attention's Q x K^T warm-started from scores x
# V (bmm, K and N moving with the sequence) ranked them slightly worse at most budgets; a conv config's speed
# depends on the geometry it gathers for, and no conv table is recorded
WARM_START_OPS = frozenset({"gemm"})
MIN_ROUND_TRIALS = 8  # the smallest round min_rounds makes (smaller rounds hardly move the model), except
# that a budget under 2 x this runs two rounds of half of it (one round is the prior's picks alone)


@dataclass(frozen=True)
class SearchOptions:
    """Every knob of both searches (defaults follow DietCode: 64 measurements per round)."""

    round_size: int = 64
    min_rounds: int = 4  # joint search: rounds of max_trials / min_rounds where that is under round_size
    max_trials: int = 1000
    max_seconds: float = math.inf
    epsilon: float = 0.1  # share of each round spent on random configs
    prediction_margin: float = 0.05  # a prediction must beat a measurement by this much to be chosen
    verify: float = 0.25  # share of each round that times a problem's current choice on that problem
    population: int = 128  # configs drawn from the space and kept between rounds
    generations: int = 2  # mutation rounds applied to the elite per round
    patience: int = 2  # rounds without a predicted gain above min_gain before stopping
    min_gain: float = 1e-3
    seed: int = 0
    progress: bool = True
    prior: bool = True  # the analytic roofline (tuner/roofline.py) picks the first round and is blended in

    def check(self) -> None:
        if self.round_size <= 0 or self.max_trials <= 0:
            raise DietcodeError(f"search budget must be positive: round_size={self.round_size}, "
                                f"max_trials={self.max_trials}")
        if not self.max_seconds > 0:
            raise DietcodeError(f"search time budget must be positive, got max_seconds={self.max_seconds}")
        if not 0.0 <= self.epsilon <= 1.0:
            raise DietcodeError(f"epsilon must be in [0, 1], got {self.epsilon}")
        if self.min_rounds <= 0:
            raise DietcodeError(f"min_rounds must be positive, got {self.min_rounds}")

    def round_trials(self) -> int:
        """Measurements per round of the joint search: ``round_size``, or max_trials / ``min_rounds`` (at least
        ``MIN_ROUND_TRIALS``, or half the budget where that is less: a budget under 16 runs two rounds) where
        that is smaller. (The per-shape baseline keeps ``round_size``: its rounds are per problem already.)"""
        spread = math.ceil(self.max_trials / self.min_rounds)
        floor = min(MIN_ROUND_TRIALS, math.ceil(self.max_trials / 2))
        return max(1, min(self.round_size, max(floor, spread)))


@dataclass(frozen=True)
class Measurement:
    config: MicroKernel
    problem: Problem
    seconds: float  # inf when it failed
    error: str | None


@dataclass(frozen=True)
class RoundRecord:
    """State after a round: trials so far and the per-problem choice (None: nothing measured yet)."""

    trials: int
    elapsed_s: float
    choice: tuple[MicroKernel | None, ...]


@dataclass(frozen=True)
class TuningResult:
    """What a search hands the dispatcher.

    ``candidates`` are the configs measured successfully at least once; ``times[p, c]`` is the best
    knowledge of candidate c on problem p: the measurement where there is one, else the model's
    prediction, inf where the runtime refuses the call (or may: see the module docstring); ``measured[p, c]``
    says which. ``model`` is the joint model, or one model per problem
    for the per-shape search.
    """

    method: str
    family: Family
    problems: tuple[Problem, ...]
    weights: tuple[float, ...]
    measurements: tuple[Measurement, ...]
    candidates: tuple[MicroKernel, ...]
    times: np.ndarray
    measured: np.ndarray
    model: CostModel | tuple[CostModel, ...]
    trials: int
    seconds: float
    history: tuple[RoundRecord, ...]

    @property
    def choice(self) -> tuple[MicroKernel | None, ...]:
        """Per problem, the best known candidate (measured where measured, else predicted)."""
        return self.history[-1].choice if self.history else tuple(None for _ in self.problems)


_KIND_SLACK = 1.25  # a kind's best on a problem joins the prior's first round within this factor of the best


def _axis_values(space: Sequence[MicroKernel]) -> dict[str, list[int]]:
    return {f.name: sorted({getattr(c, f.name) for c in space}) for f in fields(MicroKernel)}


def neighbours(config: MicroKernel, space: Sequence[MicroKernel], _axes: dict | None = None,
               _members: set | None = None) -> list[MicroKernel]:
    """Configs of ``space`` that differ from ``config`` in one field, moved to an adjacent value."""
    axes = _axes if _axes is not None else _axis_values(space)
    members = _members if _members is not None else set(space)
    out = []
    for name, values in axes.items():
        value = getattr(config, name)
        if value not in values:
            continue
        i = values.index(value)
        for j in (i - 1, i + 1):
            if 0 <= j < len(values):
                other = replace(config, **{name: values[j]})
                if other in members:
                    out.append(other)
    return out


def _softplus(x: np.ndarray, temperature: float = 0.02) -> np.ndarray:
    return temperature * np.logaddexp(0.0, x / temperature)


class _Search:
    """One search over a set of problems (all of them: joint; one: a per-shape tuner)."""

    def __init__(self, space: Sequence[MicroKernel], problems: Sequence[Problem], weights: Sequence[float],
                 model: CostModel, profile: HardwareProfile, dtype: str, options: SearchOptions,
                 rng: np.random.Generator, refused: np.ndarray | None = None) -> None:
        self.space = list(space)
        self.problems = list(problems)
        self.weights = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
        self.model, self.profile, self.dtype, self.opts, self.rng = model, profile, dtype, options, rng
        self.flops = np.array([useful_flops(p) for p in problems])
        self.launches = np.array([launch_weight(c) for c in self.space], dtype=np.float64)
        # nan: not measured; inf: the runtime refuses that call (known beforehand or measured); else seconds
        self.measured = np.full((len(self.space), len(problems)), np.nan)
        if refused is not None:
            self.measured[np.asarray(refused, dtype=bool)] = np.inf
        self.failed = np.zeros(len(self.space), dtype=bool)
        self.touched = np.zeros(len(self.space), dtype=bool)  # measured on some problem
        self.unforeseen = np.zeros(len(self.space), dtype=bool)  # refused where the measurer did not say so
        self._alpha = model.alpha
        self.adapt = f_adapt_matrix(self.space, problems, profile, dtype, model.alpha)
        self.failed |= self.adapt.max(axis=1) <= 0  # cannot launch at all
        self.prior = roofline_matrix(self.space, self.problems, profile, dtype, model.tf32) if options.prior \
            else None
        axes, members = _axis_values(self.space), set(self.space)
        index = {c: i for i, c in enumerate(self.space)}
        self.neigh = [[index[n] for n in neighbours(c, self.space, axes, members)] for c in self.space]
        size = min(options.population, len(self.space))
        self.population = set(int(i) for i in rng.choice(len(self.space), size=size, replace=False))
        self.stale_rounds = 0
        self.log: list[Measurement] = []
        self.errors: tuple[float, float] | None = None  # (prior, learned) squared log errors, last round

    # knowledge ----------------------------------------------------------------------------------
    def predicted(self) -> np.ndarray:
        """Seconds per (config, problem): the learned model's, blended with the scaled roofline's by
        ``prior_weight`` where there is a prior."""
        learned = self._learned()
        if self.prior is None:
            return learned
        prior, weight = self._scaled_prior(), self.prior_weight()
        if weight == 0.0:
            return prior
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            mixed = np.exp((1.0 - weight) * np.log(prior) + weight * np.log(learned))
        return np.where(np.isfinite(prior) & np.isfinite(learned), mixed, np.inf)

    def _learned(self) -> np.ndarray:
        """The learned model's seconds per (config, problem): launches x latency + FLOPs / (f_MK x f_adapt)."""
        if self.model.alpha != self._alpha:
            self._alpha = self.model.alpha
            self.adapt = f_adapt_matrix(self.space, self.problems, self.profile, self.dtype, self._alpha)
        fmk = self.model.f_mk(self.space)
        through = fmk[:, None] * self.adapt
        with np.errstate(divide="ignore"):
            learned = np.where(through > 0, self.model.latency * self.launches[:, None]
                               + self.flops[None, :] / np.maximum(through, 1e-300), np.inf)
        return learned

    def prior_weight(self) -> float:
        """The learned model's share of a prediction (1 without a prior): 0 until it has predicted a measured
        round from data, then e_prior / (e_prior + e_learned), each e the mean squared log error of that
        model's predictions of the last round's measurements, made before they were recorded
        (inverse-variance weighting)."""
        if self.prior is None:
            return 1.0
        if self.errors is None:
            return 0.0
        e_prior, e_learned = self.errors
        return e_prior / (e_prior + e_learned) if e_prior + e_learned > 0 else 0.5

    def _scaled_prior(self) -> np.ndarray:
        """The roofline scaled to the measurements: a measured config's by its own measured / roofline seconds
        (geometric mean), an unmeasured one's by that ratio over all measurements."""
        assert self.prior is not None
        ok = np.isfinite(self.measured) & np.isfinite(self.prior)
        with np.errstate(divide="ignore", invalid="ignore"):
            logs = np.where(ok, np.log(self.measured / self.prior), 0.0)
        count = ok.sum(axis=1)
        overall = float(logs.sum() / count.sum()) if count.sum() else 0.0
        own = np.where(count > 0, logs.sum(axis=1) / np.maximum(count, 1), overall)
        return np.exp(own)[:, None] * self.prior

    def open_pairs(self) -> np.ndarray:
        """[C, P]: the pairs still worth measuring (not measured, not refused, config not failed)."""
        return np.isnan(self.measured) & ~self.failed[:, None]

    def known(self) -> tuple[np.ndarray, np.ndarray]:
        """(times [C, P]: measured else predicted, inf where refused, failed, or unmeasured on a config with an
        unforeseen refusal; mask of configs measured successfully somewhere)."""
        pred = self.predicted()
        ok = np.isfinite(self.measured)
        times = np.where(ok, self.measured, pred)
        times[np.isinf(self.measured)] = np.inf
        times[self.unforeseen[:, None] & np.isnan(self.measured)] = np.inf
        times[self.failed] = np.inf
        return times, ok.any(axis=1) & ~self.failed

    def choice(self) -> list[int | None]:
        times, cand = self.known()
        if not cand.any():
            return [None] * len(self.problems)
        ok = np.isfinite(self.measured)
        damped = np.where(ok, times, times * (1.0 + self.opts.prediction_margin))
        masked = np.where(cand[:, None], damped, np.inf)
        return [int(i) for i in masked.argmin(axis=0)]

    # proposal -----------------------------------------------------------------------------------
    def _gain(self, pred: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ok = np.isfinite(self.measured)
        measured_best = np.where(ok, self.measured, np.inf).min(axis=0)
        seen = ok.any(axis=1) & ~self.failed
        base = pred[seen] if seen.any() else pred
        ref = np.where(np.isfinite(measured_best), measured_best, 1.1 * base.min(axis=0))
        with np.errstate(divide="ignore", invalid="ignore"):
            log_ratio = np.log(ref[None, :]) - np.log(pred)
        log_ratio = np.where(np.isfinite(log_ratio), log_ratio, -50.0)
        open_pair = self.open_pairs()
        raw = np.where(open_pair, np.maximum(log_ratio, 0.0), 0.0) * self.weights[None, :]
        smooth = np.where(open_pair, _softplus(log_ratio), 0.0) * self.weights[None, :]
        return raw, smooth

    def _evolve(self, score: np.ndarray) -> list[int]:
        pool = set(self.population)
        elite = [int(i) for i in np.argsort(-score, kind="stable")[: max(4, self.opts.population // 8)]]
        choice = self.choice()
        elite += [c for c in choice if c is not None]
        for _ in range(self.opts.generations):
            grown = {n for e in elite for n in self.neigh[e]}
            pool |= grown
            ranked = sorted(pool, key=lambda i: (-score[i], i))
            elite = ranked[: max(4, self.opts.population // 8)]
        ranked = sorted(pool, key=lambda i: (-score[i], i))
        self.population = set(ranked[: self.opts.population])
        return ranked

    def propose(self, n: int) -> list[tuple[int, int]]:
        open_pair = self.open_pairs()
        fresh = [i for i in range(len(self.space)) if not self.touched[i] and open_pair[i].any()]
        if not open_pair.any():
            return []
        pred = self.predicted()
        raw, smooth = self._gain(pred)
        score = np.where(open_pair.any(axis=1), smooth.sum(axis=1), -np.inf)
        best_raw = float(raw.max()) if raw.size else 0.0
        self.stale_rounds = self.stale_rounds + 1 if best_raw < self.opts.min_gain else 0
        pairs: list[tuple[int, int]] = []
        ranked = self._evolve(score)
        picked: list[int] = []
        verified: set[int] = set()
        placed: dict[int, int] = {}  # the prior's picks: config -> the problem it is timed on
        if len(self.log) == 0:  # no data yet: the prior's picks (a random first round without one)
            n_random = n if self.prior is None else int(round(self.opts.epsilon * n))
            placed = dict(self._prior_picks(n - n_random, open_pair))
            picked = list(placed)
        else:
            n_random = int(round(self.opts.epsilon * n))
            pairs = self._verification(int(round(self.opts.verify * n)), open_pair)
            n -= len(pairs)
            verified = {i for i, _ in pairs}
            for i in ranked:
                if len(picked) >= n - n_random:
                    break
                if np.isfinite(score[i]) and open_pair[i].any() and i not in verified:
                    picked.append(i)
        taken = set(picked) | verified
        pool = [i for i in fresh if i not in taken] or [i for i in range(len(self.space))
                                                          if open_pair[i].any() and i not in taken]
        extra = min(n - len(picked), len(pool))
        if extra > 0:
            picked += [pool[int(j)] for j in self.rng.choice(len(pool), size=extra, replace=False)]
        for i in picked:
            if i in placed:  # checks the prior's claim where it made it
                pairs.append((i, placed[i]))
                continue
            if not self.touched[i]:  # new config: its cleanest label, on its best-f_adapt instance
                key = self.adapt[i] + 1e-9 * self.weights * self.flops / self.flops.max()
            else:  # known config: where it is predicted to help most
                key = np.where(open_pair[i], smooth[i], -np.inf)
            pairs.append((i, int(np.argmax(np.where(open_pair[i], key, -np.inf)))))
        return pairs

    def _prior_picks(self, n: int, open_pair: np.ndarray) -> list[tuple[int, int]]:
        """Up to n (config, problem) pairs: distinct configs the roofline ranks best, in turn from these lists:
        per problem (heaviest first) its best config; per kind (split-K, persistent, TMA, wgmma or not) the
        kind's best on each problem where that is within ``_KIND_SLACK`` of the problem's best; every config by
        its weighted mean log slowdown against the problems' bests. Each is paired with the problem where its
        slowdown is least (a problem's best: one it is best on)."""
        usable = ~self.failed & open_pair.any(axis=1)
        if self.prior is None or n <= 0 or not usable.any():
            return []
        prior = np.where(usable[:, None] & ~np.isinf(self.measured), self.prior, np.inf)  # not where refused
        best = prior.min(axis=0)
        with np.errstate(divide="ignore", invalid="ignore"):
            slowdown = np.where(np.isfinite(prior), np.log(prior / best[None, :]), np.inf)
        overall = slowdown @ self.weights
        order = [int(p) for p in np.argsort(-self.weights, kind="stable") if np.isfinite(best[p])]
        lists = [[int(np.argmin(prior[:, p])) for p in order]]
        kinds: dict[tuple[bool, ...], list[int]] = {}
        for i in np.flatnonzero(usable):
            c = self.space[int(i)]
            kind = (c.split_k > 1, c.persistent > 0, bool(c.tma),
                    wgmma_eligible(c, self.dtype, self.profile, tf32=self.model.tf32))
            kinds.setdefault(kind, []).append(int(i))
        for members_of in (kinds[k] for k in sorted(kinds)):
            members = np.array(members_of)
            top = members[np.argmin(prior[members], axis=0)]
            lists.append([int(top[p]) for p in order if prior[top[p], p] <= _KIND_SLACK * best[p]])
        lists.append([int(i) for i in np.argsort(overall, kind="stable") if np.isfinite(overall[i])])
        picked: list[int] = []
        taken: set[int] = set()
        cursors = [0] * len(lists)
        while len(picked) < n and any(cursors[k] < len(lists[k]) for k in range(len(lists))):
            for k, items in enumerate(lists):
                while cursors[k] < len(items) and items[cursors[k]] in taken:
                    cursors[k] += 1
                if cursors[k] < len(items) and len(picked) < n:
                    picked.append(items[cursors[k]])
                    taken.add(items[cursors[k]])
                    cursors[k] += 1
        # each on the problem where the roofline ranks it closest to that problem's best (ties: the heaviest)
        return [(i, int(np.lexsort((-self.weights, slowdown[i]))[0])) for i in picked]

    def _verification(self, n: int, open_pair: np.ndarray) -> list[tuple[int, int]]:
        """Up to n (choice, problem) pairs whose choice rests on a prediction, heaviest problems first."""
        out: list[tuple[int, int]] = []
        choices = self.choice()
        for p in np.argsort(-self.weights, kind="stable"):
            c = choices[int(p)]
            if len(out) >= n:
                break
            if c is not None and open_pair[c, p]:
                out.append((c, int(p)))
        return out

    def record(self, pairs: Sequence[tuple[int, int]], seconds: Sequence[float], errors: Sequence[str | None]
               ) -> None:
        if self.prior is not None:
            self._score_models(pairs, seconds)
        for (i, p), sec, err in zip(pairs, seconds, errors):
            self.measured[i, p] = sec if math.isfinite(sec) else np.inf
            self.touched[i] = True
            if not math.isfinite(sec):
                if err is not None and err.startswith(REFUSED):  # this instance runs the vendor path
                    self.unforeseen[i] = True  # (the pairs foreseen were never proposed)
                else:
                    self.failed[i] = True
            self.log.append(Measurement(self.space[i], self.problems[p], sec, err))
        self.model.update([(self.space[i], self.problems[p]) for i, p in pairs], list(seconds))

    def _score_models(self, pairs: Sequence[tuple[int, int]], seconds: Sequence[float]) -> None:
        """Set ``errors`` from how well the prior and the learned model predicted these measurements (not
        the first round's: the learned model had no data of this workload's to predict them from; a
        warm-started model's predictions of it, from other workloads alone, weighed it too early on the
        recorded H100 table)."""
        if not self.log or self.prior is None:
            return
        prior, learned = self._scaled_prior(), self._learned()  # before the measurements are recorded
        rows = [(math.log(sec), prior[i, p], learned[i, p]) for (i, p), sec in zip(pairs, seconds)
                if math.isfinite(sec) and sec > 0 and np.isfinite(prior[i, p]) and np.isfinite(learned[i, p])]
        if rows:
            logs = np.array(rows)
            self.errors = (float(np.mean((logs[:, 0] - np.log(logs[:, 1])) ** 2)),
                           float(np.mean((logs[:, 0] - np.log(logs[:, 2])) ** 2)))

    def done(self) -> bool:
        return self.stale_rounds >= self.opts.patience or not self.open_pairs().any()


def _check_inputs(problems: Sequence[tuple[Problem, float]], space: Sequence[MicroKernel],
                  options: SearchOptions) -> tuple[list[Problem], list[float]]:
    options.check()
    if not problems:
        raise DietcodeError("the workload has no instances to tune: give symbol values (--dim NAME=lo:hi) "
                            "or a shape log")
    if not space:
        raise DietcodeError("the micro-kernel space is empty: every config was pruned for this family")
    merged: dict[Problem, float] = {}
    for problem, weight in problems:
        if not weight > 0:
            raise DietcodeError(f"instance weights must be positive, got {weight} for {problem}")
        merged[problem] = merged.get(problem, 0.0) + float(weight)
    order = sorted(merged)
    return order, [merged[p] for p in order]


def _refused(measurer: Measurer, family: Family, space: Sequence[MicroKernel], problems: Sequence[Problem]
             ) -> np.ndarray:
    """[C, P]: the calls the measurer knows the runtime refuses (``Measurer.refusal_matrix``)."""
    return np.asarray(measurer.refusal_matrix(family, space, problems), dtype=bool)


def _progress(options: SearchOptions, label: str):  # -> rich Progress or a no-op stand-in
    """The search's bar, on stderr and only on a terminal: rich draws nothing elsewhere but still ends a transient
    bar with an empty line, which went to stdout, one per workload, between a command's results."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    return Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                    disable=not (options.progress and console.is_terminal), transient=True)


def _measure_round(searches: Sequence[_Search], proposals: Sequence[list[tuple[int, int]]], family: Family,
                   measurer: Measurer) -> int:
    """Measure every proposal of this round in one batch (one database transaction)."""
    flat = [(s.space[i], s.problems[p]) for s, props in zip(searches, proposals) for i, p in props]
    if not flat:
        return 0
    results = measurer.measure(family, flat)
    at = 0
    for s, props in zip(searches, proposals):
        chunk = results[at: at + len(props)]
        at += len(props)
        if props:
            s.record(props, [r.seconds for r in chunk], [r.error for r in chunk])
    return len(flat)


def _result(method: str, family: Family, searches: Sequence[_Search], problems: Sequence[Problem],
            weights: Sequence[float], models: CostModel | tuple[CostModel, ...], trials: int, elapsed: float,
            history: list[RoundRecord]) -> TuningResult:
    columns: dict[MicroKernel, None] = {}
    per_problem: list[tuple[np.ndarray, np.ndarray, np.ndarray, _Search, list[int]]] = []
    for s in searches:
        times, cand = s.known()
        for col in np.flatnonzero(cand):
            columns.setdefault(s.space[int(col)], None)
        per_problem.append((times, cand, np.isfinite(s.measured), s, []))
    candidates = tuple(sorted(columns))
    table = np.full((len(problems), len(candidates)), np.inf)
    measured = np.zeros((len(problems), len(candidates)), dtype=bool)
    row_of = {p: r for r, p in enumerate(problems)}
    for times, _cand, ok, s, _ in per_problem:
        index = {c: i for i, c in enumerate(s.space)}
        for j, config in enumerate(candidates):
            i = index[config]
            for p_local, problem in enumerate(s.problems):
                table[row_of[problem], j] = times[i, p_local]
                measured[row_of[problem], j] = ok[i, p_local]
    log = tuple(m for s in searches for m in s.log)
    return TuningResult(method, family, tuple(problems), tuple(weights), log, candidates, table, measured,
                        models, trials, elapsed, tuple(history))


def tune_joint(family: Family, problems: Sequence[tuple[Problem, float]], space: Sequence[MicroKernel],
               measurer: Measurer, profile: HardwareProfile, options: SearchOptions = SearchOptions(),
               model: CostModel | None = None, tf32: bool = False, warm: Sequence[Measurement] = ()
               ) -> TuningResult:
    """DietCode's joint search over all ``problems`` (problem, weight) with one model and population.
    ``tf32``: the float32 kernels compute their dots in TF32 (the default model's peak and wgmma feature).
    ``warm``: other workloads' measurements on the same device and family (op, dtype, target), e.g. the
    earlier searches of the same optimize run: the model starts from them (``CostModel.warm_start``). The
    seconds reported (and ``max_seconds``) count from the call: the model's warm start and the search's setup
    (the roofline prior over every config and instance) included."""
    started = time.perf_counter()
    order, weights = _check_inputs(problems, space, options)
    rng = np.random.default_rng(options.seed)
    model = model or LearnedCostModel(profile, family.dtype, seed=options.seed, tf32=tf32)
    if warm:
        model.warm_start([(m.config, m.problem) for m in warm], [m.seconds for m in warm])
    search = _Search(space, order, weights, model, profile, family.dtype, options, rng,
                     _refused(measurer, family, space, order))
    history: list[RoundRecord] = []
    trials = 0
    with _progress(options, f"joint {family.op} x{len(order)}") as bar:
        task = bar.add_task("tune", total=options.max_trials)
        while trials < options.max_trials and time.perf_counter() - started < options.max_seconds:
            proposal = search.propose(min(options.round_trials(), options.max_trials - trials))
            if not proposal or search.done():
                break
            trials += _measure_round([search], [proposal], family, measurer)
            choice = tuple(None if c is None else search.space[c] for c in search.choice())
            history.append(RoundRecord(trials, time.perf_counter() - started, choice))
            bar.update(task, completed=trials)
    return _result("joint", family, [search], order, weights, model, trials, time.perf_counter() - started,
                   history)


def tune_per_shape(family: Family, problems: Sequence[tuple[Problem, float]], space: Sequence[MicroKernel],
                   measurer: Measurer, profile: HardwareProfile, options: SearchOptions = SearchOptions()
                   ) -> TuningResult:
    """The baseline: each problem tuned on its own (own model and population), round-robin by rounds.

    ``max_trials`` is the total over all problems; a history record is taken after each sweep. Seconds count
    from the call, as ``tune_joint``'s.
    """
    started = time.perf_counter()
    order, weights = _check_inputs(problems, space, options)
    rng = np.random.default_rng(options.seed)
    models = tuple(LearnedCostModel(profile, family.dtype, seed=options.seed) for _ in order)
    refused = _refused(measurer, family, space, order)
    searches = [_Search(space, [p], [1.0], m, profile, family.dtype, options, rng, refused[:, [j]])
                for j, (p, m) in enumerate(zip(order, models))]
    history: list[RoundRecord] = []
    trials = 0
    with _progress(options, f"per-shape {family.op} x{len(order)}") as bar:
        task = bar.add_task("tune", total=options.max_trials)
        while trials < options.max_trials and time.perf_counter() - started < options.max_seconds:
            proposals, budget = [], options.max_trials - trials
            for s in searches:
                props = [] if s.done() else s.propose(min(options.round_size, budget))
                budget -= len(props)
                proposals.append(props)
            if not any(proposals):
                break
            trials += _measure_round(searches, proposals, family, measurer)
            choice = tuple(None if (c := s.choice()[0]) is None else s.space[c] for s in searches)
            history.append(RoundRecord(trials, time.perf_counter() - started, choice))
            bar.update(task, completed=trials)
    return _result("per-shape", family, searches, order, weights, models, trials,
                   time.perf_counter() - started, history)


def settle(result: TuningResult, pairs: Sequence[tuple[int, int]], measurer: Measurer) -> TuningResult:
    """``result`` with the (problem row, candidate column) ``pairs`` that rest on a prediction measured.

    A search with a small budget measures most configs on one problem only (the prior's picks where it picked
    them, later new configs where their f_adapt is best: the largest), so what a dispatcher picks for the other
    problems is the model's word; this times it before it ships (on the first H100, a budget of 16 had measured
    no config below M = 4096 on the LLaMA MLP's GEMMs, when every new config was timed on its largest problem). A failure costs ``inf`` on that problem alone: a kernel's divisibility assumptions can
    fail at one shape and hold at another. The measurements count as trials."""
    todo = sorted({(int(p), int(c)) for p, c in pairs if not result.measured[p, c]})
    if not todo:
        return result
    answers = measurer.measure(result.family, [(result.candidates[c], result.problems[p]) for p, c in todo])
    times, measured = result.times.copy(), result.measured.copy()
    log = list(result.measurements)
    for (p, c), answer in zip(todo, answers):
        times[p, c] = answer.seconds if math.isfinite(answer.seconds) else np.inf
        measured[p, c] = True
        log.append(Measurement(result.candidates[c], result.problems[p], answer.seconds, answer.error))
    return replace(result, times=times, measured=measured, measurements=tuple(log), trials=result.trials + len(todo))
