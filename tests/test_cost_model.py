"""Cost model: f_adapt against hand-computed values, device calibration, learned f_MK, save/load.

The calibration and learning tests fit timings from tuner/simulate.py, whose formulas are the cost
model's own: they check the fitting code, not the model's accuracy on hardware (marked ``simulated``).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from dietcode_ort.errors import DietcodeError
from tuner.cost_model import (AnalyticCostModel, LearnedCostModel, adapt_terms, blocks_per_sm, calibrate_device,
                              f_adapt, f_adapt_matrix, launch_weight, load_model)
from tuner.hardware import get_profile
from tuner.simulate import TRUE_WAVE_ALPHA, simulate_seconds
from tuner.space import Family, MicroKernel, enumerate_space
from tuner.workload import Problem

H100 = get_profile("sm_90")  # 132 SMs
CFG = MicroKernel(64, 64, 32, 4, 3)


def test_f_adapt_hand_computed():
    # M=100 pads to 128: padding 100/128; tiles 2 x 12 = 24 in 132 x 2 = 264 slots: one partial wave
    t = adapt_terms(CFG, Problem(100, 768, 768), H100, blocks_per_sm=2)
    assert (t.tiles, t.waves) == (24, 1)
    assert t.padding == pytest.approx(100 / 128)
    assert t.occupancy == pytest.approx(24 / 264)  # alpha = 0: G / roundup(G, 264)
    assert t.value == pytest.approx(100 / 128 * 24 / 264)
    assert f_adapt(CFG, Problem(100, 768, 768), H100, 2, alpha=1.0) == pytest.approx(100 / 128)
    # 384 tiles: 2 waves, the second filled to 120/264
    assert f_adapt(CFG, Problem(2048, 768, 768), H100, 2) == pytest.approx(384 / 528)
    assert f_adapt(CFG, Problem(2048, 768, 768), H100, 2, alpha=0.5) == pytest.approx(
        (384 / 264) / (1 + math.sqrt(120 / 264)))
    # K padding and split-K: K=100 with BLOCK_K 32 x SPLIT_K 2 -> 100/128, tiles doubled
    split = MicroKernel(64, 64, 32, 4, 3, split_k=2)
    t = adapt_terms(split, Problem(64, 64, 100), H100, 1)
    assert t.padding == pytest.approx(100 / 128) and t.tiles == 2
    assert f_adapt(CFG, Problem(64, 64, 64), H100, 0) == 0.0  # cannot launch


def test_split_k_costs_are_in_f_adapt():
    """Split-K's programs (tiles x splits), its K per program and its workspace traffic (each split writes its
    fp32 partial, the last reads all of them back, its own too) are in f_adapt, and its counter memset is a
    stream command before the launch, weighed as a fraction of a launch."""
    from tuner.cost_model import (LAUNCH_SECONDS, MEMSET_SECONDS, blocks_per_sm, launch_weight,
                                  split_k_partials, workspace_bytes_moved)

    base, split = MicroKernel(16, 64, 64, 2, 3), MicroKernel(16, 64, 64, 2, 3, split_k=8)
    bert = Problem(16, 768, 3072)  # BERT-base FFN2 at 16 tokens: 12 tiles of 16x64
    t1, t8 = (adapt_terms(c, bert, H100, 1, dtype="float16") for c in (base, split))
    assert (t1.tiles, t8.tiles) == (12, 96)
    assert split_k_partials(8) == (8, 8) and split_k_partials(1) == (0, 0)
    assert workspace_bytes_moved(split, bert) == 12 * 2 * 8 * 16 * 64 * 4
    assert workspace_bytes_moved(base, bert) == 0
    operands = 12 * (16 + 64) * 3072 * 2  # each tile's A and B slices over all of K, fp16
    assert t1.reduction == 1.0
    assert t8.reduction == pytest.approx(operands / (operands + 12 * 16 * 16 * 64 * 4))
    assert adapt_terms(split, bert, H100, 1, dtype="float32").reduction > t8.reduction  # fp32 operands weigh more
    assert t8.value == pytest.approx(t8.padding * t8.occupancy * t8.reduction)
    assert t8.value > 4 * t1.value  # 96 programs fill an H100 far better than 12, traffic included
    many = Problem(4096, 768, 3072)  # 3072 tiles: the split only adds programs and traffic
    assert f_adapt(split, many, H100, 1, dtype="float16") < f_adapt(base, many, H100, 1, dtype="float16")
    # K per program: K = 3000 pads to 64 x 8 steps (3072) under split 8, to 64 (3008) without
    assert adapt_terms(split, Problem(16, 768, 3000), H100, 1).padding == pytest.approx(3000 / 3072)
    assert launch_weight(base) == 1.0
    assert launch_weight(split) == pytest.approx(1.0 + MEMSET_SECONDS / LAUNCH_SECONDS)
    assert launch_weight(split) == 2  # a launch's worth more (fitted to the H100 table, timed with a memset)
    mat = f_adapt_matrix([base, split], [bert, many], H100, "float16")
    bps = blocks_per_sm(split, H100, "float16")
    assert mat[1].tolist() == pytest.approx([f_adapt(split, p, H100, bps, dtype="float16") for p in (bert, many)])
    assert adapt_terms(split, bert, H100, bps, dtype="float16").reduction == pytest.approx(t8.reduction)


def test_vectorized_matrix_matches_scalar():
    configs = enumerate_space(Family("gemm", "float16", "sm_90"))[::40]
    problems = [Problem(16 * t, 768, 3072, batch=b) for t in (1, 7, 33) for b in (1, 3)]
    mat = f_adapt_matrix(configs, problems, H100, "float16", alpha=0.3)
    from tuner.cost_model import blocks_per_sm
    for i, c in enumerate(configs):
        for j, p in enumerate(problems):
            assert mat[i, j] == pytest.approx(f_adapt(c, p, H100, blocks_per_sm(c, H100, "float16"), 0.3, "float16"))


@pytest.mark.simulated
def test_calibration_recovers_the_partial_wave_exponent():
    configs = enumerate_space(Family("gemm", "float16", "sm_90"))[::25]
    problems = [Problem(16 * t, 768, 768) for t in (8, 24, 40, 64, 100, 160)]
    pairs = [(c, p) for c in configs for p in problems]
    seconds = [simulate_seconds(c, p, H100, "float16", seed=1, noise=False) for c, p in pairs]
    fitted = calibrate_device(pairs, seconds, H100, "float16")
    assert fitted is not None
    alpha, latency = fitted
    assert abs(alpha - TRUE_WAVE_ALPHA) <= 0.2 and 1e-6 < latency < 6e-6
    assert calibrate_device(pairs[:1], seconds[:1], H100, "float16") is None  # no evidence


@pytest.mark.simulated
def test_learned_model_predicts_seconds_and_round_trips(tmp_path):
    space = enumerate_space(Family("gemm", "float16", "sm_90"))
    train = space[::6]
    problems = [Problem(16 * t, 768, 768) for t in (4, 32, 64)]
    pairs = [(c, problems[(i + j) % 3]) for i, c in enumerate(train) for j in (0, 1)]  # lets it calibrate
    seconds = [simulate_seconds(c, p, H100, "float16", seed=2) for c, p in pairs]
    model = LearnedCostModel(H100, "float16")
    model.update(pairs, seconds)
    got = model.predict(pairs)
    finite = np.isfinite(seconds)
    assert np.allclose(got[finite], np.array(seconds)[finite], rtol=0.35)
    test_pairs = [(c, Problem(512, 768, 768)) for c in space[3::6]]
    truth = np.array([simulate_seconds(c, p, H100, "float16", seed=2) for c, p in test_pairs])
    pred = model.predict(test_pairs)
    ok = np.isfinite(truth) & np.isfinite(pred)
    rank = np.corrcoef(np.argsort(np.argsort(truth[ok])), np.argsort(np.argsort(pred[ok])))[0, 1]
    assert rank > 0.6  # unseen configs on an unseen shape are ranked far better than chance
    model.save(tmp_path / "m.pkl")
    again = load_model(tmp_path / "m.pkl")
    assert np.array_equal(again.predict(test_pairs), pred) and again.alpha == model.alpha


def test_analytic_model_and_bad_inputs(tmp_path):
    model = AnalyticCostModel(H100, "float16")
    small, large = MicroKernel(16, 16, 64, 2, 2), MicroKernel(128, 128, 64, 8, 3)
    t = model.predict([(small, Problem(4096, 4096, 4096)), (large, Problem(4096, 4096, 4096))])
    assert t[1] < t[0]  # big tiles win on a big problem
    with pytest.raises(DietcodeError, match="dtype"):
        AnalyticCostModel(H100, "int8")
    (tmp_path / "junk.pkl").write_bytes(b"junk")
    with pytest.raises(DietcodeError, match="cannot load"):
        load_model(tmp_path / "junk.pkl")
    with pytest.raises(DietcodeError, match="pairs"):
        LearnedCostModel(H100, "float16").update([(small, Problem(1, 1, 1))], [])


def test_warm_start_answers_for_configs_this_workload_has_not_measured():
    """Another workload's measurements (same device and op, other N and K) give a config its label here; a
    measurement of this workload's own replaces it; a failure here is not covered by a label from there, and a
    failure there says nothing here."""
    fast, slow, broken, failed_there = (MicroKernel(32, 64, 32, 2, 2), MicroKernel(128, 128, 64, 8, 3),
                                        MicroKernel(64, 128, 64, 4, 3), MicroKernel(64, 64, 64, 4, 4))
    there = Problem(2048, 3072, 768)
    warm_pairs = [(fast, there), (slow, there), (broken, there), (failed_there, there)]
    model = LearnedCostModel(H100, "float16")
    model.warm_start(warm_pairs, [20e-6, 80e-6, 30e-6, math.inf])
    assert model.warm_samples == 3 and model.samples == 0
    cold = LearnedCostModel(H100, "float16")
    here = Problem(2048, 768, 768)
    fast_here, slow_here = model.predict([(fast, here), (slow, here)])
    assert fast_here < slow_here
    swapped = LearnedCostModel(H100, "float16")  # the other workload's times swapped: so is the ranking here
    swapped.warm_start(warm_pairs[:2], [80e-6, 20e-6])
    swapped_fast, swapped_slow = swapped.predict([(fast, here), (slow, here)])
    assert swapped_fast > swapped_slow
    assert np.isfinite(model.predict([(failed_there, here)])[0])
    label = model.f_mk([fast])[0]
    model.update([(fast, here)], [50e-6])  # measured here: its own label, not a mean with the other workload's
    assert model.f_mk([fast])[0] != pytest.approx(label)
    flops = 2 * here.m * here.n * here.k
    adapt = f_adapt(fast, here, H100, blocks_per_sm(fast, H100, "float16"), model.alpha, "float16")
    busy = 50e-6 - model.latency * launch_weight(fast)
    assert model.f_mk([fast])[0] == pytest.approx(flops / busy / adapt, rel=1e-9)
    model.update([(broken, here)], [math.inf])  # fails here: the other workload's label does not revive it
    assert model.f_mk([broken])[0] == 0.0 and model.predict([(broken, here)])[0] == math.inf
    assert cold.warm_samples == 0 and AnalyticCostModel(H100, "float16").warm_samples == 0
    with pytest.raises(DietcodeError, match="warm_start: 1 pairs but 0"):
        model.warm_start(warm_pairs[:1], [])
