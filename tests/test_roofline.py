"""The analytic roofline (tuner/roofline.py) against what the kernels and the launcher do, its agreement with
the learned model's accounting (tuner/cost_model.py), and sanity checks on the dense BERT-base GEMMs (fp16,
sm_90).

Nothing here is a GPU measurement: these check the model's structure (split-K traffic, the launcher's
commands, the persistent grid, the pipeline's latency hiding) and that its choices stay physically
sensible."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from tuner.cost_model import (LAUNCH_SECONDS, AnalyticCostModel, adapt_terms, blocks_per_sm,
                              config_peak_flops, f_adapt, launch_weight, peak_flops, persistent_loops,
                              split_k_partials, useful_flops, workspace_bytes_moved)
from tuner.hardware import get_profile
from tuner.measure import AnalyticMeasurer
from tuner.roofline import DRAM_LATENCY_SECONDS, SM_BANDWIDTH_FACTOR
from tuner.space import Family, MicroKernel, enumerate_space, wgmma_eligible
from tuner.templates import programs
from tuner.workload import Problem

FAMILY = Family("gemm", "float16", "sm_90")
H100 = get_profile("sm_90")
BERT = ((768, 768), (3072, 768), (768, 3072))  # (N, K) of BERT-base's dense GEMMs
BERT_M = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
CAP = SM_BANDWIDTH_FACTOR * H100.dram_bandwidth_gbs * 1e9 / H100.num_sms  # per-SM bytes per second


@pytest.fixture(scope="module")
def space() -> list[MicroKernel]:
    return enumerate_space(FAMILY)


@pytest.fixture(scope="module")
def bert_times(space: list[MicroKernel]) -> dict[Problem, list[float]]:
    measurer = AnalyticMeasurer(H100, "float16")
    problems = [Problem(m, n, k) for n, k in BERT for m in BERT_M]
    return {p: [r.seconds for r in measurer.measure(FAMILY, [(c, p) for c in space])] for p in problems}


def _tiles(config: MicroKernel, problem: Problem) -> int:
    return math.ceil(problem.m / config.block_m) * math.ceil(problem.n / config.block_n) * problem.batch


def _best(space: list[MicroKernel], times: list[float], keep=lambda c: True) -> tuple[float, MicroKernel]:
    return min((t, c) for t, c in zip(times, space) if keep(c))


# ---- split-K: one accounting of the workspace and the launcher's commands in both models ----

def test_split_k_workspace_is_written_and_read_in_full_in_both_models(space: list[MicroKernel]) -> None:
    """Each split writes its fp32 partial and the last-arriving split reads all SPLIT_K back, its own too
    (templates._split_k_reduce): 2 x SPLIT_K partial tiles per output tile, in the roofline's DRAM bytes, its
    reduction tail and f_adapt's workspace share alike."""
    measurer = AnalyticMeasurer(H100, "float16")
    splits = [c for c in space if c.split_k > 1][::5]
    assert splits
    bandwidth = H100.dram_bandwidth_gbs * 1e9
    for config in splits:
        for problem in (Problem(16, 768, 3072), Problem(100, 3072, 768), Problem(48, 64, 64, batch=12)):
            terms = measurer.terms(config, problem)
            assert terms is not None
            tiles = _tiles(config, problem)
            partial = config.block_m * config.block_n * 4
            assert workspace_bytes_moved(config, problem) == tiles * 2 * config.split_k * partial
            p = problem
            operands = (p.m * p.k + p.k * p.n + p.m * p.n) * 2 * p.batch
            assert terms.dram * bandwidth == pytest.approx(operands + workspace_bytes_moved(config, problem))
            written, read = split_k_partials(config.split_k)
            assert written == read == config.split_k
            assert terms.reduce * CAP == pytest.approx(read * partial + config.block_m * config.block_n * 2)
            t = adapt_terms(config, problem, H100, blocks_per_sm(config, H100, "float16"), dtype="float16")
            k = math.ceil(problem.k / (config.block_k * config.split_k)) * config.block_k * config.split_k
            ops = tiles * (config.block_m + config.block_n) * k * 2
            assert t.reduction == pytest.approx(ops / (ops + tiles * 2 * config.split_k * partial))


def test_the_counter_memset_weighs_the_same_in_both_models() -> None:
    """Split-K's fixed cost per call (fitted to the H100 table, timed when the launcher zeroed the counters with
    a memset before every split-K launch): the roofline's launch term and the learned model's fitted latency
    both take launch_weight of it: a second launch's worth, as that table has it (tuner/roofline.py)."""
    measurer = AnalyticMeasurer(H100, "float16")
    plain, split = MicroKernel(16, 64, 64, 2, 3), MicroKernel(16, 64, 64, 2, 3, split_k=8)
    problem = Problem(16, 768, 3072)
    for config in (plain, split):
        terms = measurer.terms(config, problem)
        assert terms is not None and terms.launch == pytest.approx(LAUNCH_SECONDS * launch_weight(config))
    assert launch_weight(plain) == 1.0 and launch_weight(split) == 2.0
    model = AnalyticCostModel(H100, "float16")
    model.latency = 1e-3  # large enough to dominate the predictions
    got = model.predict([(plain, problem), (split, problem)])
    fmk = model.f_mk([plain, split])
    for i, config in enumerate((plain, split)):
        bps = blocks_per_sm(config, H100, "float16")
        through = fmk[i] * f_adapt(config, problem, H100, bps, 0.0, "float16")
        fixed = got[i] - useful_flops(problem) / through
        assert fixed == pytest.approx(model.latency * launch_weight(config))


# ---- the pipeline's latency hiding (Little's law) ----

def test_shallow_pipelines_are_charged_on_load_bound_tiles() -> None:
    """BERT's FFN2 at 16 tokens: 12 tiles of 16x128, one program per busy SM and 24 BLOCK_K steps of 36 KiB.
    Two stages keep one step in flight, so each step waits a DRAM round trip: the pipeline term binds. Four
    stages keep 108 KiB in flight, more than latency x the per-SM cap (76 KB): the bandwidth binds instead."""
    measurer = AnalyticMeasurer(H100, "float16")
    problem = Problem(16, 768, 3072)
    shallow, deep = (measurer.terms(MicroKernel(16, 128, 128, 4, s), problem) for s in (2, 4))
    assert shallow is not None and deep is not None
    assert (shallow.resident, shallow.k_steps, deep.resident) == (1, 24, 1)
    assert shallow.pipeline == pytest.approx(24 * DRAM_LATENCY_SECONDS)
    assert deep.pipeline == pytest.approx(24 / 3 * DRAM_LATENCY_SECONDS)
    step = (16 + 128) * 128 * 2
    assert 1 * 1 * step < DRAM_LATENCY_SECONDS * CAP < 1 * 3 * step
    assert shallow.pipeline > shallow.sm_memory and deep.pipeline < deep.sm_memory
    assert shallow.seconds > 1.5 * deep.seconds
    # a compute-bound call (4096 tokens, FFN1, 128x256 tiles) hides its latency behind the MMAs
    big = measurer.terms(MicroKernel(128, 256, 64, 8, 3), Problem(4096, 3072, 768))
    assert big is not None and big.pipeline < big.mma


def test_the_pipeline_term_binds_only_below_the_littles_law_threshold(space: list[MicroKernel]) -> None:
    """With at least latency x per-SM cap bytes in flight (resident programs x (stages - 1) x step bytes) and
    a loop as long as the prefetch depth, the latency bound stays within the bandwidth bound."""
    measurer = AnalyticMeasurer(H100, "float16")
    checked = 0
    for config in space[::3]:
        if config.persistent:
            continue
        for problem in (Problem(16, 768, 768), Problem(300, 3072, 768), Problem(2048, 768, 3072)):
            terms = measurer.terms(config, problem)
            assert terms is not None
            step = (config.block_m + config.block_n) * config.block_k * 2
            in_flight = terms.resident * (config.num_stages - 1) * step
            if in_flight >= DRAM_LATENCY_SECONDS * CAP and terms.k_steps >= config.num_stages - 1:
                assert terms.pipeline <= terms.sm_memory * (1 + 1e-9), (config.key(), problem)
                checked += 1
            else:
                assert terms.pipeline >= DRAM_LATENCY_SECONDS
    assert checked > 50


# ---- persistent kernels: the launcher's grid ----

def test_persistent_models_follow_the_launchers_grid(space: list[MicroKernel]) -> None:
    """The launcher runs min(tiles x batch, SMs x n) persistent programs (templates.programs, the C core's
    dc_kernel_grid): no SM holds more than n at once, the busiest program computes ceil(tiles / grid) tiles
    (f_adapt's waves), and the programs loop only when the grid is smaller than the tiles."""
    measurer = AnalyticMeasurer(H100, "float16")
    persistent = [c for c in space if c.persistent]
    assert persistent
    for config in persistent[::4]:
        bps = blocks_per_sm(config, H100, "float16")
        assert 1 <= config.persistent <= bps  # the space's rule: n is what fits, so all n are resident
        for problem in (Problem(64, 768, 768), Problem(1000, 3072, 768), Problem(4096, 768, 3072),
                        Problem(128, 64, 64, batch=96)):
            tiles = _tiles(config, problem)
            grid = programs(problem.m, problem.n, problem.batch, config.block_m, config.block_n, 1,
                            config.persistent, H100.num_sms)
            assert grid == min(tiles, H100.num_sms * config.persistent)
            assert adapt_terms(config, problem, H100, bps).waves == math.ceil(tiles / grid)
            assert persistent_loops(config.persistent, tiles, H100.num_sms) == (grid < tiles)
            terms = measurer.terms(config, problem)
            assert terms is not None and terms.resident == min(terms.programs_per_sm, config.persistent)


def test_a_persistent_config_that_does_not_loop_gets_no_tail_credit(space: list[MicroKernel]) -> None:
    """With no more tiles than its grid, a persistent kernel launches one program per tile, as its plain twin
    does: both models predict the two alike. Once its programs loop, the partial last round is credited."""
    measurer = AnalyticMeasurer(H100, "float16")
    pairs = [(c, replace(c, persistent=0)) for c in space
             if c.persistent and blocks_per_sm(c, H100, "float16") == c.persistent]
    assert pairs
    for config, twin in pairs[::3]:
        bps = blocks_per_sm(config, H100, "float16")
        slots = H100.num_sms * config.persistent
        width = math.ceil(768 / config.block_n)
        few = Problem(config.block_m * max(1, slots // width // 2), 768, 768)  # half the grid or less
        rows = math.ceil(slots / width) + 1
        many = Problem(config.block_m * rows, 768, 768)  # the grid and a partial round more
        for problem, loops in ((few, False), (many, True)):
            tiles = math.ceil(problem.m / config.block_m) * width
            assert persistent_loops(config.persistent, tiles, H100.num_sms) == loops, (config.key(), problem)
            mine, theirs = (measurer.terms(c, problem) for c in (config, twin))
            assert mine is not None and theirs is not None
            credit_f = f_adapt(config, problem, H100, bps) / f_adapt(twin, problem, H100, bps)
            if loops:
                assert mine.mma < theirs.mma and credit_f > 1.0, (config.key(), problem)
            else:
                assert mine.seconds == pytest.approx(theirs.seconds) and credit_f == pytest.approx(1.0)


# ---- the dense BERT-base GEMMs on the H100 profile ----

def test_bert_predictions_never_exceed_the_peak(space: list[MicroKernel], bert_times) -> None:
    device_peak = peak_flops(H100, "float16")
    for problem, times in bert_times.items():
        for config, seconds in zip(space, times):
            if math.isfinite(seconds):
                peak = config_peak_flops(config, H100, "float16")
                assert useful_flops(problem) / seconds <= peak <= device_peak


def test_bert_best_throughput_grows_with_m(space: list[MicroKernel], bert_times) -> None:
    """More rows fill more of the GPU: the best config's predicted throughput does not fall as M grows, and a
    2048-token call runs far closer to the peak than a 16-token one (still well below it: the H100 table's
    best at 2048 tokens ran 0.39 to 0.50 of it, cuBLAS included, L2 cold)."""
    for n, k in BERT:
        problems = [Problem(m, n, k) for m in BERT_M]
        flops = [useful_flops(p) / _best(space, bert_times[p])[0] for p in problems]
        shown = [f"{f / 1e12:.0f}" for f in flops]
        assert all(b >= 0.97 * a for a, b in zip(flops, flops[1:])), (n, k, shown)
        assert flops[-1] > 10 * flops[0] and flops[-1] < 0.7 * peak_flops(H100, "float16")


def test_bert_split_k_only_for_few_rows_and_long_k(space: list[MicroKernel], bert_times) -> None:
    for n, k in BERT:
        for m in BERT_M:
            best = _best(space, bert_times[Problem(m, n, k)])[1]
            if m <= 32 and k == 3072:
                assert best.split_k > 1, (m, n, k, best.key())
            if m >= 1024:
                assert best.split_k == 1, (m, n, k, best.key())


def test_bert_prefers_wgmma_once_the_mmas_matter(space: list[MicroKernel], bert_times) -> None:
    """From 256 rows on the best config is a wgmma one, and from 512 the best mma.sync config is at least 5%
    slower than the best wgmma one (the H100 table: 6% to 35% at 512 rows, 28% to 56% at 1024). Below that the calls are load-bound and a 32-row mma.sync tile, making
    twice the programs, can win: the MMA rate is not what limits them."""
    def wgmma(c: MicroKernel) -> bool:
        return wgmma_eligible(c, "float16", H100)

    for n, k in BERT:
        for m in BERT_M:
            times = bert_times[Problem(m, n, k)]
            best, config = _best(space, times)
            if m >= 256:
                assert wgmma(config), (m, n, k, config.key())
            if m >= 512:
                assert _best(space, times, lambda c: not wgmma(c))[0] > 1.05 * best, (m, n, k)


def test_the_roofline_models_the_product_it_is_given() -> None:
    """An H200 (4.8 TB/s) streams a weight-bound call's bytes faster than the H100 SXM5 (3.35 TB/s), an H100 PCIe
    (2 TB/s, 114 SMs) slower; a call of 32 programs on 32 SMs waits on DRAM's latency, not its bandwidth, and
    takes as long on the H200 as on the H100."""
    from tuner.hardware import device_profile

    h200, pcie = device_profile("NVIDIA H200", "sm_90"), device_profile("NVIDIA H100 PCIe", "sm_90")
    config = MicroKernel(64, 128, 64, 4, 4)
    weights, latency = Problem(64, 11008, 4096), Problem(16, 4096, 11008)

    def seconds(profile, problem):
        (r,) = AnalyticMeasurer(profile, "float16").measure(FAMILY, [(config, problem)])
        return r.seconds

    assert seconds(h200, weights) < 0.8 * seconds(H100, weights) < 0.8 * 0.8 * seconds(pcie, weights)
    assert seconds(h200, latency) == pytest.approx(seconds(H100, latency))
