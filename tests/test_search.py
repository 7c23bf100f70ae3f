"""Joint search against the per-shape baseline on a synthetic replay table (no GPU needed).

These are unit tests of the search machinery, not evidence for DietCode's claims: the table comes from
tuner/simulate.py, which is built from the cost model's own formulas (marked ``simulated``). The claims
are scored on a recorded GPU table by benchmarks/report_table.py.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from dietcode_ort.errors import DietcodeError
from tuner.dispatch import VENDOR, build_dispatch, settled_dispatch
from tuner.hardware import get_profile
from tuner.measure import MeasureResult, ReplayMeasurer
from tuner.search import SearchOptions, neighbours, settle, tune_joint, tune_per_shape
from tuner.simulate import bert_dense_case
from tuner.space import Family, MicroKernel, enumerate_space
from tuner.workload import Instance

FAMILY = Family("gemm", "float16", "sm_90")
PROFILE = get_profile("sm_90")
pytestmark = pytest.mark.simulated


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return bert_dense_case(tmp_path_factory.mktemp("synthetic"), PROFILE, enumerate_space(FAMILY))


def geomean_ratio(case, choice, problems) -> float:
    logs = [math.log(case.seconds[(c.key(), p)] / case.oracle(p)) if c is not None else 5.0
            for c, p in zip(choice, problems)]
    return math.exp(sum(logs) / len(logs))


def first_within(case, result, tolerance: float = 1.03) -> int | None:
    for record in result.history:
        if geomean_ratio(case, record.choice, result.problems) <= tolerance:
            return record.trials
    return None


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


def test_search_is_deterministic_under_a_seed(case):
    measurer = ReplayMeasurer(case.path)
    instances = [(p, 1.0) for p in case.problems[:16]]
    opts = SearchOptions(max_trials=96, round_size=32, progress=False, seed=3)
    a = tune_joint(FAMILY, instances, case.configs, measurer, PROFILE, opts)
    b = tune_joint(FAMILY, instances, case.configs, measurer, PROFILE, opts)
    assert [(m.config, m.problem) for m in a.measurements] == [(m.config, m.problem) for m in b.measurements]
    assert a.choice == b.choice and a.trials == b.trials == 96


def test_result_table_marks_measured_and_predicted(case):
    measurer = ReplayMeasurer(case.path)
    result = tune_joint(FAMILY, [(p, 1.0) for p in case.problems[:8]], case.configs, measurer, PROFILE,
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
    ({"max_seconds": 0}, None, "time budget"),
])
def test_bad_inputs_name_the_problem(case, kwargs, instances, words):
    measurer = ReplayMeasurer(case.path)
    instances = [(p, 1.0) for p in case.problems[:2]] if instances is None else instances
    with pytest.raises(DietcodeError, match=words):
        tune_joint(FAMILY, instances, case.configs, measurer, PROFILE, SearchOptions(progress=False, **kwargs))


def test_replay_gap_during_search_names_missing_instances(case):
    from tuner.workload import Problem

    measurer = ReplayMeasurer(case.path)
    with pytest.raises(DietcodeError, match=r"no row for .*m=7 n=768 k=768"):
        tune_joint(FAMILY, [(Problem(7, 768, 768), 1.0)], case.configs, measurer, PROFILE,
                   SearchOptions(max_trials=8, progress=False))


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
    assert result.history[0].choice == tuple(best)
    assert result.trials < 640


def test_optimize_takes_no_prior():
    from dietcode_ort.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["optimize", "m.onnx", "-o", "out"]).prior is True
    assert parser.parse_args(["optimize", "m.onnx", "-o", "out", "--no-prior"]).prior is False


class _Slow(ReplayMeasurer):
    """The replay table, but ``factor`` times slower on problems with M below ``below`` (what a cost model
    fitted on large problems does not foresee), failing outright on ``fail_m``; counts what it is asked."""

    def __init__(self, path, below: int, factor: float, fail_m: int | None = None) -> None:
        super().__init__(path)
        self.below, self.factor, self.fail_m, self.asked = below, factor, fail_m, []

    def measure(self, family, configs_and_problems):
        self.asked += list(configs_and_problems)
        out = super().measure(family, configs_and_problems)
        return [MeasureResult(math.inf, "div16 assumption fails") if p.m == self.fail_m
                else MeasureResult(r.seconds * (self.factor if p.m < self.below else 1.0), r.error)
                for (_, p), r in zip(configs_and_problems, out)]


def _predicted_picks(result) -> list[tuple[int, int]]:
    col = {c: j for j, c in enumerate(result.candidates)}
    return [(i, col[c]) for i, c in enumerate(result.choice) if c is not None and not result.measured[i, col[c]]]


def test_settle_times_the_predicted_picks_once_and_counts_them(case):
    """A small budget leaves most problems' choices resting on the model's prediction (the first round times a
    new config where its f_adapt is best); settle times exactly those, per problem: a failure costs inf there
    alone, and timing the same pairs again asks the measurer nothing."""
    problems = sorted(case.problems, key=lambda p: p.m)[::16]
    small = problems[1].m
    measurer = _Slow(case.path, below=0, factor=1.0, fail_m=small)
    result = tune_joint(FAMILY, [(p, 1.0) for p in problems], case.configs, measurer, PROFILE,
                        SearchOptions(max_trials=16, progress=False, seed=0))
    pending = _predicted_picks(result)
    assert len(pending) >= len(problems) // 2, "the budget of 16 should leave predicted picks to settle"
    asked = len(measurer.asked)
    settled = settle(result, pending, measurer)
    assert len(measurer.asked) - asked == len(pending) and settled.trials == result.trials + len(pending)
    assert len(settled.measurements) == len(result.measurements) + len(pending)
    for i, j in pending:
        assert settled.measured[i, j] and not result.measured[i, j]
        config, problem = result.candidates[j], result.problems[i]
        if problem.m == small:
            assert settled.times[i, j] == math.inf
        else:
            assert settled.times[i, j] == pytest.approx(case.seconds[(config.key(), problem)])
    failed = [j for i, j in pending if result.problems[i].m == small]
    assert failed and all(np.isfinite(settled.times[i, j]) for i in range(len(problems)) for j in failed
                          if result.problems[i].m != small)  # one problem's failure is that problem's only
    assert settle(settled, pending, measurer) is settled and len(measurer.asked) - asked == len(pending)


def test_settled_dispatch_sends_a_mispredicted_instance_to_the_vendor_leaf(case):
    """The kernels are 20x slower than the model learned below M = 512 and the vendor library is 2x slower
    than the table's best everywhere: built on the predictions, the tree keeps compiled kernels there; settled,
    every instance it sends to a compiled kernel was measured there, and the small ones go to the vendor."""
    problems = sorted(case.problems, key=lambda p: p.m)[::8]
    measurer = _Slow(case.path, below=512, factor=20.0)
    result = tune_joint(FAMILY, [(p, 1.0) for p in problems], case.configs, measurer, PROFILE,
                        SearchOptions(max_trials=16, progress=False, seed=0))
    vendor = [2.0 * case.oracle(p) for p in result.problems]
    instances = [Instance((("M", p.m),)) for p in result.problems]
    naive = build_dispatch(("M",), instances, result.candidates, result.times, vendor)
    small = [inst for inst, p in zip(instances, result.problems) if p.m < 512]
    assert any(naive.select(inst.as_dict()) != VENDOR for inst in small)
    dispatch, settled = settled_dispatch(("M",), instances, result, vendor, measurer)
    col = {c: j for j, c in enumerate(settled.candidates)}
    for i, inst in enumerate(instances):
        k = dispatch.select(inst.as_dict())
        if k != VENDOR:
            assert settled.measured[i, col[k]]
            assert settled.times[i, col[k]] <= vendor[i]
    assert all(dispatch.select(inst.as_dict()) == VENDOR for inst in small)
    assert settled.trials > result.trials
    # the report judges measured picks: nothing it dispatches is slower than the vendor leaf
    assert all(row.seconds <= v for row, v in zip(dispatch.report.rows, vendor))
