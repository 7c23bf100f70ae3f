"""Joint search against the per-shape baseline by replay (no GPU needed).

Most tests replay the table recorded on an H100 (tests/_recorded.py; benchmarks/report_table.py scores the
same table): the search machinery, its edge cases, the runtime's refusals, and joint against per-shape
search at equal budget. Those marked ``simulated`` replay synthetic tables from tuner/simulate.py, built from
the cost model's own formulas, where a test needs what a recorded table cannot give: a roofline prior of
known quality, a per-shape tuner far from the oracle at ten times joint search's trials.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import pytest

from _recorded import H100_TABLE, cells
from dietcode_ort.errors import DietcodeError
from tuner.dispatch import VENDOR, build_dispatch, settled_dispatch
from tuner.hardware import get_profile
from tuner.measure import REFUSED, MeasureResult, Measurer, ReplayMeasurer
from tuner.search import SearchOptions, neighbours, settle, tune_joint, tune_per_shape
from tuner.simulate import bert_dense_case
from tuner.space import Family, MicroKernel, enumerate_space
from tuner.workload import Instance, Problem

FAMILY = Family("gemm", "float16", "sm_90")
BMM = Family("bmm", "float16", "sm_90")
PROFILE = get_profile("sm_90")


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return bert_dense_case(tmp_path_factory.mktemp("synthetic"), PROFILE, enumerate_space(FAMILY))


@dataclass(frozen=True)
class Recorded:
    """One set of the H100 table: its measurer, configs, problems and times (the interface of simulate's cases)."""

    measurer: ReplayMeasurer
    configs: tuple[MicroKernel, ...]
    problems: tuple[Problem, ...]
    seconds: dict[tuple[str, Problem], float]  # inf: failed or refused
    vendor: dict[Problem, float]

    def oracle(self, p: Problem) -> float:
        return min(self.seconds[(c.key(), p)] for c in self.configs)


def recorded_set(tag: str) -> Recorded:
    data = cells(tag)
    seconds = {(c, Problem(*p)): math.inf if error else s for (c, p), (s, error) in data.items()}
    configs = tuple(sorted({MicroKernel.from_key(c) for c, _ in data if c != "vendor"}))
    problems = tuple(sorted({Problem(*p) for _, p in data}))
    return Recorded(ReplayMeasurer(H100_TABLE, family=tag), configs, problems,
                    {k: v for k, v in seconds.items() if k[0] != "vendor"},
                    {p: v for (c, p), v in seconds.items() if c == "vendor"})


@pytest.fixture(scope="module")
def dense():
    """dense-768x768 of the H100 table: 97 configs on M = 16..2048 (N = K = 768)."""
    return recorded_set("dense-768x768")


def geomean_ratio(case, choice, problems) -> float:
    logs = [math.log(case.seconds[(c.key(), p)] / case.oracle(p)) if c is not None else 5.0
            for c, p in zip(choice, problems)]
    return math.exp(sum(logs) / len(logs))


def first_within(case, result, tolerance: float = 1.03) -> int | None:
    for record in result.history:
        if geomean_ratio(case, record.choice, result.problems) <= tolerance:
            return record.trials
    return None


@pytest.mark.simulated
def test_joint_search_reaches_3_percent_with_a_tenth_of_per_shape_trials(case):
    measurer = ReplayMeasurer(case.path)
    instances = [(p, 1.0) for p in case.problems]
    joint = tune_joint(FAMILY, instances, case.configs, measurer, PROFILE,
                       SearchOptions(max_trials=320, progress=False, seed=0))
    joint_trials = first_within(case, joint)
    assert joint_trials is not None, [geomean_ratio(case, r.choice, joint.problems) for r in joint.history]
    # the per-shape tuner (rounds of 32 per shape, finer than joint's 64) given ten times the trials
    # has not got there yet: it needs more than 10x
    per_shape = tune_per_shape(FAMILY, instances, case.configs, measurer, PROFILE,
                               SearchOptions(max_trials=10 * joint_trials, round_size=32, progress=False))
    assert per_shape.trials == 10 * joint_trials
    assert first_within(case, per_shape) is None
    print(f"joint within 3% after {joint_trials} trials; per-shape after {per_shape.trials}: "
          f"{geomean_ratio(case, per_shape.choice, per_shape.problems):.4f}")
    # the fitted partial-wave exponent is a calibration, not the default
    assert 0.0 < joint.model.alpha <= 1.0 and joint.model.latency > 0


def test_search_is_deterministic_under_a_seed(dense):
    instances = [(p, 1.0) for p in dense.problems[:16]]
    opts = SearchOptions(max_trials=96, round_size=32, progress=False, seed=3)
    a = tune_joint(FAMILY, instances, dense.configs, dense.measurer, PROFILE, opts)
    b = tune_joint(FAMILY, instances, dense.configs, dense.measurer, PROFILE, opts)
    assert [(m.config, m.problem) for m in a.measurements] == [(m.config, m.problem) for m in b.measurements]
    assert a.choice == b.choice and a.trials == b.trials == 96


def test_reported_seconds_include_the_warm_start_and_setup(dense, monkeypatch):
    """The seconds a search reports (the model's info, the log) count from the call: a warm start that takes
    0.3 s is in them (the clock started after the setup, which on 1024 instances was most of the time)."""
    import time

    from tuner.cost_model import LearnedCostModel

    slow = LearnedCostModel.warm_start

    def warm_start(self, *args, **kwargs):
        time.sleep(0.3)
        return slow(self, *args, **kwargs)

    monkeypatch.setattr(LearnedCostModel, "warm_start", warm_start)
    instances = [(p, 1.0) for p in dense.problems[:4]]
    warm = tune_joint(FAMILY, instances, dense.configs, dense.measurer, PROFILE,
                      SearchOptions(max_trials=8, progress=False)).measurements
    result = tune_joint(FAMILY, instances, dense.configs, dense.measurer, PROFILE,
                        SearchOptions(max_trials=8, progress=False), warm=warm)
    assert result.seconds >= 0.3


def test_result_table_marks_measured_and_predicted(dense):
    result = tune_joint(FAMILY, [(p, 1.0) for p in dense.problems[:8]], dense.configs, dense.measurer, PROFILE,
                        SearchOptions(max_trials=64, round_size=32, progress=False))
    assert result.times.shape == result.measured.shape == (8, len(result.candidates))
    for m in result.measurements:
        if math.isfinite(m.seconds):
            i, j = result.problems.index(m.problem), result.candidates.index(m.config)
            assert result.measured[i, j] and result.times[i, j] == m.seconds
    assert (result.times[~result.measured] > 0).all()


def test_neighbours_move_one_field_to_an_adjacent_value():
    space = enumerate_space(FAMILY)
    config = MicroKernel(64, 64, 32, 4, 3)
    near = neighbours(config, space)
    assert near and all(n in space for n in near)
    for n in near:
        diff = [f for f in ("block_m", "block_n", "block_k", "num_warps", "num_stages", "split_k", "tma")
                if getattr(n, f) != getattr(config, f)]
        assert len(diff) == 1
    assert MicroKernel(128, 64, 32, 4, 3) in near and MicroKernel(64, 64, 32, 4, 4) in near
    assert MicroKernel(256, 64, 32, 4, 3) not in near


@pytest.mark.parametrize("kwargs, instances, words", [
    ({}, [], "no instances"),
    ({"max_trials": 0}, None, "budget"),
    ({"round_size": 0}, None, "budget"),
    ({"min_rounds": 0}, None, "min_rounds"),
    ({"max_seconds": 0}, None, "time budget"),
])
def test_bad_inputs_name_the_problem(dense, kwargs, instances, words):
    instances = [(p, 1.0) for p in dense.problems[:2]] if instances is None else instances
    with pytest.raises(DietcodeError, match=words):
        tune_joint(FAMILY, instances, dense.configs, dense.measurer, PROFILE, SearchOptions(progress=False, **kwargs))


@pytest.mark.parametrize("max_trials, round_size, want", [
    (1, 64, 1), (4, 64, 2), (8, 64, 4), (12, 64, 6), (15, 64, 8), (16, 64, 8), (32, 64, 8), (64, 64, 16),
    (100, 64, 25), (256, 64, 64), (1000, 64, 64), (128, 1, 1), (96, 32, 24), (8, 2, 2)])
def test_a_small_budget_spreads_over_four_rounds(max_trials, round_size, want):
    """Rounds of budget / 4, at least 8 measurements, but never a single round: a budget under 16 runs two."""
    assert SearchOptions(max_trials=max_trials, round_size=round_size).round_trials() == want


def test_budget_64_ranks_the_kernels_within_3_percent_on_the_h100_table(dense):
    """dense-768x768 as recorded, at --budget 64: four rounds of 16, not one of 64; the first round times the
    roofline's picks on the instances they were picked for, across the M range (it used to time every new config
    on its best-f_adapt instance, M = 1408 or 2048, and in one round nothing else was measured); and the settled
    tree without vendor leaves runs within 3% of the best config per instance (geomean; it was 1.160x)."""
    instances = [(p, 1.0) for p in dense.problems]
    result = tune_joint(FAMILY, instances, dense.configs, dense.measurer, PROFILE,
                        SearchOptions(max_trials=64, progress=False, seed=0))
    assert [r.trials for r in result.history] == [16, 32, 48, 64]
    first = result.measurements[:16]
    assert min(m.problem.m for m in first) <= 256 and len({m.problem for m in first}) >= 4
    tree, _ = settled_dispatch(("M",), [Instance((("M", p.m),)) for p in result.problems], result, None,
                               dense.measurer)
    picks = [tree.select({"M": p.m}) for p in result.problems]
    ratio = geomean_ratio(dense, picks, result.problems)
    print(f"budget 64: the kernels' tree at {ratio:.3f}x the per-instance best config")
    assert 1.0 <= ratio <= 1.03


def _kernels_tree_ratio(s: Recorded, result) -> float:
    """The settled tree without vendor leaves against the best config per instance (report_table's kernels' regret)."""
    tree, _ = settled_dispatch(("M",), [Instance((("M", p.m),)) for p in result.problems], result, None, s.measurer)
    return geomean_ratio(s, [tree.select({"M": p.m}) for p in result.problems], result.problems)


def test_warm_start_from_the_other_dense_sets_ranks_768x768_better_at_budget_32(dense):
    """dense-768x768 at --budget 32, warm-started with what the same search measured on the table's two other
    dense sets (3072x768 and 768x3072: other N and K, same device): the first round is still the roofline's
    picks, and the kernels' tree gets within 3% of the per-instance best config (geomean; 1.010x). Cold it gets
    as close now that the roofline's constants are fitted to this table (it was 11% off with the assumed ones)."""
    options = SearchOptions(max_trials=32, progress=False, seed=0)
    warm = []
    for tag in ("dense-3072x768", "dense-768x3072"):
        other = recorded_set(tag)
        warm += tune_joint(FAMILY, [(p, 1.0) for p in other.problems], other.configs, other.measurer, PROFILE,
                           options).measurements
    instances = [(p, 1.0) for p in dense.problems]
    cold = tune_joint(FAMILY, instances, dense.configs, dense.measurer, PROFILE, options)
    warmed = tune_joint(FAMILY, instances, dense.configs, dense.measurer, PROFILE, options, warm=warm)
    assert warmed.model.warm_samples == sum(math.isfinite(m.seconds) for m in warm) > 32
    first = [(m.config, m.problem) for m in cold.measurements[:8]]
    assert [(m.config, m.problem) for m in warmed.measurements[:8]] == first
    cold_ratio, warm_ratio = _kernels_tree_ratio(dense, cold), _kernels_tree_ratio(dense, warmed)
    print(f"budget 32: the kernels' tree at {cold_ratio:.3f}x cold, {warm_ratio:.3f}x warm-started")
    assert max(warm_ratio, cold_ratio) <= 1.03


def test_replay_gap_during_search_names_missing_instances(dense):
    with pytest.raises(DietcodeError, match=r"no row for .*m=7 n=768 k=768"):  # the table has M = 16 * T
        tune_joint(FAMILY, [(Problem(7, 768, 768), 1.0)], dense.configs, dense.measurer, PROFILE,
                   SearchOptions(max_trials=8, progress=False))


def test_joint_search_beats_per_shape_at_equal_budget_on_the_h100_table():
    """dense-768x3072 as recorded: after 128 measurements (one per instance) joint search's choice is within
    5% of the per-instance oracle (geomean over the 128 instances); per-shape tuning, each instance given
    its one measurement (the roofline prior's pick), is more than 10% off (12%)."""
    s = recorded_set("dense-768x3072")
    instances = [(p, 1.0) for p in s.problems]
    joint = tune_joint(FAMILY, instances, s.configs, s.measurer, PROFILE,
                       SearchOptions(max_trials=128, progress=False, seed=0))
    per_shape = tune_per_shape(FAMILY, instances, s.configs, s.measurer, PROFILE,
                               SearchOptions(max_trials=128, round_size=1, progress=False, seed=0))
    assert joint.trials == per_shape.trials == 128
    joint_ratio = geomean_ratio(s, joint.choice, joint.problems)
    per_shape_ratio = geomean_ratio(s, per_shape.choice, per_shape.problems)
    print(f"geomean time / oracle after 128 measurements: joint {joint_ratio:.3f}, per-shape {per_shape_ratio:.3f}")
    assert 1.0 <= joint_ratio <= 1.05 and per_shape_ratio > 1.1


# the runtime's refusals --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qk():
    """attention-qk of the H100 table (batch 192, M = N = T, K = 64): its 37 TMA configs assume N a multiple of
    16, and the runtime refuses them on the other T (the recorded rows' error)."""
    return recorded_set("attention-qk")


def _refused(s: Recorded, config: MicroKernel, p: Problem) -> bool:
    return not math.isfinite(s.seconds[(config.key(), p)])


class Blind(ReplayMeasurer):
    """The table, without foreseeing its refusals: they show only when measured (as the runtime's checks
    other than div16 do on a GPU)."""

    refusals = Measurer.refusals


@pytest.mark.parametrize("blind", [False, True])
def test_a_refused_call_leaves_the_config_for_the_instances_it_fits(qk, blind):
    """T = 32 and 33: the TMA configs are the fastest at 32 and refused at 33. Whether the refusal is foreseen
    (never measured) or measured, the config stays a candidate at 32 and is infinite at 33."""
    tma = [c for c in qk.configs if c.tma][:3]
    plain = [c for c in qk.configs if not c.tma][:2]
    problems = [Problem(32, 32, 64, 192), Problem(33, 33, 64, 192)]
    measurer = Blind(H100_TABLE, family="attention-qk") if blind else qk.measurer
    result = tune_joint(BMM, [(p, 1.0) for p in problems], tma + plain, measurer, PROFILE,
                        SearchOptions(max_trials=64, progress=False))
    refused = [m for m in result.measurements if m.error is not None]
    assert all(m.error.startswith(REFUSED) and m.problem == problems[1] and m.config.tma for m in refused)
    assert bool(refused) == blind  # a foreseen refusal is never measured
    assert set(tma) <= set(result.candidates)
    for j, c in enumerate(result.candidates):
        assert (result.times[1, j] == math.inf) == bool(c.tma)
        assert result.times[0, j] == qk.seconds[(c.key(), problems[0])]  # everything at 32 was measured
    assert all(c is not None and c.tma for c in result.choice[:1]) and not result.choice[1].tma


def test_joint_search_on_attention_never_dispatches_a_refused_call(qk):
    """All 128 T with every config: the result is infinite on every refused pair of its candidates, no refused
    call is measured, and the dispatcher (vendor leaf) picks no kernel the runtime refuses, nor one measured
    slower than the vendor."""
    from tuner.dispatch import build_dispatch

    result = tune_joint(BMM, [(p, 1.0) for p in qk.problems], qk.configs, qk.measurer, PROFILE,
                        SearchOptions(max_trials=128, progress=False, seed=0))
    assert all(m.error is None for m in result.measurements)
    refused = np.array([[_refused(qk, c, p) for c in result.candidates] for p in result.problems])
    assert refused.any() and np.isinf(result.times[refused]).all()
    assert any(c.tma for c in result.candidates)  # measured where they fit
    names = ("M", "N", "K", "batch")
    instances = [Instance(tuple(zip(names, (p.m, p.n, p.k, p.batch)))) for p in result.problems]
    dispatch = build_dispatch(names, instances, result.candidates, result.times,
                              [qk.vendor[p] for p in result.problems])
    picks = [(dispatch.select(inst.as_dict()), p) for inst, p in zip(instances, result.problems)]
    assert not any(k != "vendor" and _refused(qk, k, p) for k, p in picks)
    # where the dispatched kernel's time was measured, it is the table's and no slower than the vendor's
    measured = [(i, k, p) for i, (k, p) in enumerate(picks)
                if k != "vendor" and result.measured[i, result.candidates.index(k)]]
    assert measured
    for i, k, p in measured:
        assert result.times[i, result.candidates.index(k)] == qk.seconds[(k.key(), p)] <= qk.vendor[p]


# the roofline prior ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def roofline_case(tmp_path_factory):
    """Times the roofline predicts up to a per-kernel log-normal factor (sigma 0.15): a table where the prior
    is informative (simulate.roofline_table)."""
    return bert_dense_case(tmp_path_factory.mktemp("roofline"), PROFILE, enumerate_space(FAMILY),
                           roofline_sigma=0.15)


def _roofline(configs, problems):
    from tuner.roofline import roofline_matrix

    return roofline_matrix(configs, problems, PROFILE, "float16")


def test_roofline_matrix_is_the_analytic_measurer():
    from tuner.measure import AnalyticMeasurer
    from tuner.workload import Problem

    configs = enumerate_space(FAMILY)[::97]
    problems = [Problem(16, 768, 768), Problem(1000, 3072, 768), Problem(64, 64, 64, 48)]
    answers = AnalyticMeasurer(PROFILE, "float16").measure(FAMILY, [(c, p) for c in configs for p in problems])
    assert _roofline(configs, problems).ravel().tolist() == [a.seconds for a in answers]


@pytest.mark.parametrize("dtype, tf32", [("float16", False), ("float32", True), ("float32", False)])
def test_roofline_matrix_computes_each_pair_as_roofline_does(dtype, tf32):
    """The matrix computes a config's row over all problems at once; every answer is the float ``roofline``
    gives for that pair, over the whole sm_90 space (persistent, TMA, split-K and mma.sync configs) and shapes
    from one row to persistent grids that loop, batched ones, a K below BLOCK_K, and sizes past what int64
    counts hold (those take the per-pair path)."""
    from tuner.cost_model import blocks_per_sm, config_peak_flops
    from tuner.roofline import roofline, roofline_matrix
    from tuner.workload import Problem

    space = enumerate_space(Family("gemm", dtype, "sm_90"), "tf32" if tf32 else "ieee")
    assert any(c.persistent for c in space) == (dtype == "float16" or tf32)
    problems = [Problem(1, 16, 1), Problem(7, 176, 64), Problem(1000, 3072, 768), Problem(33333, 3072, 5000),
                Problem(64, 64, 64, 48), Problem(4097, 768, 3, 5)]
    huge = [Problem(1 << 40, 4096, 4096)]
    for chosen in (problems, problems + huge):
        matrix = roofline_matrix(space, chosen, PROFILE, dtype, tf32)
        for i, config in enumerate(space):
            peak, resident = config_peak_flops(config, PROFILE, dtype, tf32), blocks_per_sm(config, PROFILE, dtype)
            for j, problem in enumerate(chosen):
                terms = roofline(config, problem, PROFILE, dtype, peak, resident)
                assert matrix[i, j] == (math.inf if terms is None else terms.seconds), (config, problem)
    # a config that cannot launch (no resident block) is inf on every problem
    heavy = replace(space[0], block_m=256, block_n=256, block_k=128, num_stages=4)
    assert np.isinf(roofline_matrix([heavy], problems, PROFILE, dtype, tf32)).all()


def test_first_round_holds_the_roofline_top(roofline_case):
    import numpy as np

    problems = list(roofline_case.problems[:16])
    weights = [1.0] * 15 + [20.0]  # the last problem is the heaviest: its roofline best comes first
    configs = list(roofline_case.configs)
    prior = _roofline(configs, problems)
    slow = np.log(prior / prior.min(axis=0)) @ (np.array(weights) / sum(weights))
    overall_best = configs[int(np.argmin(slow))]
    heaviest_best = configs[int(np.argmin(prior[:, -1]))]
    measurer = ReplayMeasurer(roofline_case.path)
    opts = SearchOptions(max_trials=32, round_size=32, progress=False, seed=1)
    with_prior = tune_joint(FAMILY, list(zip(problems, weights)), configs, measurer, PROFILE, opts)
    first = [m.config for m in with_prior.measurements]
    assert len(first) == 32 and overall_best in first and heaviest_best in first
    without = tune_joint(FAMILY, list(zip(problems, weights)), configs, measurer, PROFILE,
                         SearchOptions(max_trials=32, round_size=32, progress=False, seed=1, prior=False))
    index = {c: i for i, c in enumerate(configs)}

    def mean_slowdown(result):
        return float(np.mean([slow[index[m.config]] for m in result.measurements]))

    # the prior's round is far nearer the roofline's bests than a random one (3 of its 32 stay random)
    assert mean_slowdown(with_prior) < 0.5 * mean_slowdown(without)


def test_prior_reaches_the_oracle_with_fewer_trials(roofline_case):
    measurer = ReplayMeasurer(roofline_case.path)
    instances = [(p, 1.0) for p in roofline_case.problems]
    budget = 256
    runs = {prior: tune_joint(FAMILY, instances, roofline_case.configs, measurer, PROFILE,
                              SearchOptions(max_trials=budget, progress=False, seed=0, prior=prior, patience=budget))
            for prior in (True, False)}
    with_prior, without = first_within(roofline_case, runs[True]), first_within(roofline_case, runs[False])
    print(f"within 3% of the oracle: prior after {with_prior} trials, random first round after {without}")
    assert with_prior is not None and with_prior <= 128
    assert without is None or without > with_prior


def test_prior_with_the_analytic_measurer_stops_at_its_optimum():
    """With the analytic measurer the prior is the measurer: the first round holds every problem's optimum,
    nothing is predicted to gain after it, and the search stops early."""
    import numpy as np

    from tuner.measure import AnalyticMeasurer
    from tuner.workload import Problem

    space = enumerate_space(FAMILY)[::4]
    problems = [Problem(16 * t, 768, 768) for t in (1, 3, 8, 20, 64)]
    result = tune_joint(FAMILY, [(p, 1.0) for p in problems], space, AnalyticMeasurer(PROFILE, "float16"),
                        PROFILE, SearchOptions(max_trials=640, progress=False))
    prior = _roofline(space, problems)
    best = [space[int(i)] for i in np.argmin(prior, axis=0)]
    assert list(result.choice) == best
    first = {(m.config, m.problem) for m in result.measurements[:result.history[0].trials]}
    # each problem's optimum is in the first round, timed on a problem it is the optimum of (the first: equal
    # weights), so with the prediction margin the first round's choice is already the optimum everywhere
    assert all((c, p) in first for c, p in zip(best, problems) if best.index(c) == problems.index(p))
    assert result.history[0].choice == tuple(best)
    assert result.trials < 640


def test_the_first_round_times_a_shared_optimum_on_its_heaviest_problem():
    """The roofline's best for M = 16, 48 and 128 is one config: the first round times it once, on the heaviest
    of the three (not on the largest-f_adapt problem, where no pick of the prior is the best)."""
    import numpy as np

    from tuner.measure import AnalyticMeasurer
    from tuner.workload import Problem

    space = enumerate_space(FAMILY)[::4]
    problems = [Problem(16 * t, 768, 768) for t in (1, 3, 8, 20, 64)]
    prior = _roofline(space, problems)
    shared = space[int(np.argmin(prior[:, 0]))]
    assert all(space[int(np.argmin(prior[:, p]))] == shared for p in (1, 2))
    result = tune_joint(FAMILY, list(zip(problems, (1.0, 5.0, 1.0, 1.0, 1.0))), space,
                        AnalyticMeasurer(PROFILE, "float16"), PROFILE, SearchOptions(max_trials=8, progress=False))
    first = result.measurements[:result.history[0].trials]  # a budget of 8 runs two rounds of 4
    assert len(first) == 4 and len(result.history) == 2
    assert [m.problem for m in first if m.config == shared] == [problems[1]]


def test_optimize_takes_no_prior():
    from dietcode_ort.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["optimize", "m.onnx", "-o", "out"]).prior is True
    assert parser.parse_args(["optimize", "m.onnx", "-o", "out", "--no-prior"]).prior is False


class _Failing(Measurer):
    """``inner``, but failing every call at M = ``fail_m``; counts what it is asked."""

    def __init__(self, inner: Measurer, fail_m: int) -> None:
        self.inner, self.fail_m, self.asked = inner, fail_m, []

    def device_key(self) -> str:
        return self.inner.device_key()

    def measure(self, family, configs_and_problems):
        self.asked += list(configs_and_problems)
        out = self.inner.measure(family, configs_and_problems)
        return [MeasureResult(math.inf, "div16 assumption fails") if p.m == self.fail_m else r
                for (_, p), r in zip(configs_and_problems, out)]


def _predicted_picks(result) -> list[tuple[int, int]]:
    col = {c: j for j, c in enumerate(result.candidates)}
    return [(i, col[c]) for i, c in enumerate(result.choice) if c is not None and not result.measured[i, col[c]]]


def test_settle_times_the_predicted_picks_once_and_counts_them(dense):
    """A small budget from a random first round (no prior) leaves most problems' choices resting on the model's
    prediction (16 trials over 8 problems); settle times exactly those, per problem: a failure costs inf there
    alone, and timing the same pairs again asks the measurer nothing."""
    problems = dense.problems[::16]
    small = problems[1].m
    measurer = _Failing(dense.measurer, fail_m=small)
    result = tune_joint(FAMILY, [(p, 1.0) for p in problems], dense.configs, measurer, PROFILE,
                        SearchOptions(max_trials=16, progress=False, seed=0, prior=False))
    pending = _predicted_picks(result)
    assert len(pending) >= len(problems) // 2, "a budget of 16 should leave predicted picks to settle"
    asked = len(measurer.asked)
    settled = settle(result, pending, measurer)
    assert len(measurer.asked) - asked == len(pending) and settled.trials == result.trials + len(pending)
    assert len(settled.measurements) == len(result.measurements) + len(pending)
    for i, j in pending:
        assert settled.measured[i, j] and not result.measured[i, j]
        config, problem = result.candidates[j], result.problems[i]
        want = math.inf if problem.m == small else dense.seconds[(config.key(), problem)]
        assert settled.times[i, j] == want
    failed = {j for i, j in pending if result.problems[i].m == small}
    assert failed and all(np.isfinite(settled.times[i, j]) for i in range(len(problems)) for j in failed
                          if result.problems[i].m != small)  # one problem's failure is that problem's only
    assert settle(settled, pending, measurer) is settled and len(measurer.asked) - asked == len(pending)


def test_settled_dispatch_never_sends_an_instance_to_a_kernel_slower_than_cublas(dense):
    """On the H100 table with its cuBLAS times: after 16 trials from a random first round (no prior) the tree
    built on predictions sends instances to kernels that the table times slower than cuBLAS there; the settled
    tree sends an instance to a compiled kernel only where that kernel was measured there, and so never to one
    slower than cuBLAS."""
    problems = dense.problems[::4]
    result = tune_joint(FAMILY, [(p, 1.0) for p in problems], dense.configs, dense.measurer, PROFILE,
                        SearchOptions(max_trials=16, progress=False, seed=0, prior=False))
    vendor = [dense.vendor[p] for p in result.problems]
    instances = [Instance((("M", p.m),)) for p in result.problems]

    def real(dispatch) -> list[float]:
        picks = [dispatch.select(inst.as_dict()) for inst in instances]
        return [v if k == VENDOR else dense.seconds[(k.key(), p)] for k, v, p in zip(picks, vendor, result.problems)]

    naive = build_dispatch(("M",), instances, result.candidates, result.times, vendor)
    assert any(t > v for t, v in zip(real(naive), vendor))
    dispatch, settled = settled_dispatch(("M",), instances, result, vendor, dense.measurer)
    assert all(t <= v for t, v in zip(real(dispatch), vendor))
    assert settled.trials > result.trials
    col = {c: j for j, c in enumerate(settled.candidates)}
    for i, inst in enumerate(instances):
        k = dispatch.select(inst.as_dict())
        assert k == VENDOR or settled.measured[i, col[k]]
    # the report it carries judges the real times
    assert [r.seconds for r in dispatch.report.rows] == pytest.approx(real(dispatch))
    # an instance whose vendor call failed (no time) keeps a compiled kernel, predicted if need be (no rounds)
    unmeasured = [i for i in range(len(instances)) if not result.measured[i].any()]
    assert unmeasured
    vendor[unmeasured[0]] = math.inf
    dispatch, same = settled_dispatch(("M",), instances, result, vendor, dense.measurer, passes=0)
    assert same is result and dispatch.select(instances[unmeasured[0]].as_dict()) != VENDOR
