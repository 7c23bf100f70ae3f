"""Dispatcher: greedy cover, exported tree == sklearn, regret report against hand-computed numbers."""
from __future__ import annotations

import math

import numpy as np
import pytest

from dietcode_ort.errors import DietcodeError
from tuner.dispatch import VENDOR, build_dispatch, greedy_cover, regret_report
from tuner.space import MicroKernel
from tuner.workload import Instance

K = [MicroKernel(16, 64, 64, 4, 3), MicroKernel(64, 64, 64, 4, 3), MicroKernel(128, 128, 64, 8, 3),
     MicroKernel(32, 128, 64, 4, 4)]


def _times(ts):
    """Smooth synthetic preference: small T likes small tiles, large T likes large ones."""
    out = np.empty((len(ts), len(K)))
    for i, t in enumerate(ts):
        for j, size in enumerate((16, 64, 128, 40)):
            out[i, j] = 1.0 + abs(math.log2(16 * t / (size * 4)))
    return out


def test_exported_tree_reproduces_sklearn_on_every_instance():
    """The exported arrays against references computed here: each instance gets the fastest of the kernels
    the greedy cover picked (argmin over ``times``), and unseen integer points go where sklearn's own
    classifier, trained on those labels, sends them."""
    from sklearn.tree import DecisionTreeClassifier

    rng = np.random.default_rng(0)
    instances = [Instance.of({"batch": int(b), "seq": int(s)}) for b in (1, 2, 4, 8) for s in range(1, 40, 3)]
    times = rng.uniform(1.0, 2.0, size=(len(instances), len(K)))
    weights = [i.weight for i in instances]
    d = build_dispatch(("batch", "seq"), instances, K, times, max_kernels=4)
    picked = greedy_cover(times, weights, 4)
    expected = [K[picked[int(np.argmin(times[r, picked]))]] for r in range(len(instances))]
    assert [d.select(i.as_dict()) for i in instances] == expected
    # unseen points: sklearn's classifier on the same data, mapped through the same kernel list
    x = np.array([[i.as_dict()["batch"], i.as_dict()["seq"]] for i in instances])
    labels = np.array([d.kernels.index(k) for k in expected])
    ref = DecisionTreeClassifier(random_state=0).fit(x, labels, sample_weight=np.asarray(weights))
    grid = np.array([[b, s] for b in range(0, 10) for s in range(0, 45)])
    assert [d.kernels[int(c)] for c in ref.predict(grid)] == [d.select({"batch": int(b), "seq": int(s)})
                                                            for b, s in grid]
    assert all(isinstance(t, int) for t in d.tree.threshold)


def test_dispatch_tree_is_the_bundles_tree():
    """build_dispatch returns the bundle's DispatchTree as it is written: valid for the payload, and the C
    core's reader picks the same kernel as the dispatcher at every point (no conversion in between)."""
    from dietcode_ort.bundle import Bundle, BundleKernel, DispatchTree, Feature
    from dietcode_ort.runtime import load_core

    instances = [Instance.of({"batch": b, "seq": s}) for b in (1, 2, 4, 8) for s in range(1, 40, 3)]
    d = build_dispatch(("batch", "seq"), instances, K, np.random.default_rng(1).uniform(1, 2, (len(instances), 4)),
                       max_kernels=3)
    assert type(d.tree) is DispatchTree and len(d.tree.leaf) > 1
    d.tree.validate(2, len(d.kernels))
    kernels = tuple(BundleKernel(name=f"k{i}", images=(("sm_90a", b"\x7fELF"),), params=("a", "b", "c"))
                    for i in range(len(d.kernels)))
    parsed = load_core().parse(Bundle((Feature("batch", ((0, 0),)), Feature("seq", ((0, 1),))), kernels,
                                      d.tree).to_bytes())
    for b in range(0, 10):
        for s in range(0, 45, 2):
            assert d.kernels[parsed.select([b, s])] == d.select({"batch": b, "seq": s})


def test_threshold_conversion_is_floor_of_midpoint():
    instances = [Instance.of({"T": t}) for t in (16, 17)]
    times = np.array([[1.0, 2.0], [2.0, 1.0]])
    d = build_dispatch(("T",), instances, K[:2], times)
    assert d.tree.threshold[0] == 16  # sklearn splits at 16.5
    assert d.select({"T": 16}) == K[0] and d.select({"T": 17}) == K[1]


def test_kernel_cap_and_greedy_cover():
    ts = list(range(1, 65))
    times = _times(ts)
    assert len(greedy_cover(times, np.ones(len(ts)), 2)) == 2
    d = build_dispatch(("T",), [Instance.of({"T": t}) for t in ts], K, times, max_kernels=2)
    assert len(d.kernels) <= 2
    with pytest.raises(DietcodeError, match="max_kernels"):
        greedy_cover(times, np.ones(len(ts)), 0)


def test_regret_report_matches_hand_computation():
    # three instances, weights 1, 2, 1; kernels A, B and the vendor library
    instances = [Instance.of({"T": 1}, 1.0), Instance.of({"T": 2}, 2.0), Instance.of({"T": 3}, 1.0)]
    times = np.array([[1.0, 2.0], [4.0, 2.0], [3.0, 3.0]])
    vendor = np.array([5.0, 5.0, 2.0])
    # cap 1: A costs log(4/2) * 2 on T=2; B costs log(2/1) on T=1 -> A is picked (regret 2 log 2 vs log 2?)
    # A: T=1 ratio 1, T=2 ratio 4/2 (w 2), T=3 vendor 2/2 -> regret 2*log 2
    # B: T=1 ratio 2 (w 1), T=2 ratio 1, T=3 vendor -> regret log 2  => B is picked
    d = build_dispatch(("T",), instances, K[:2], times, vendor=vendor, max_kernels=1)
    assert d.kernels == (K[1], VENDOR)
    rows = d.report.rows
    assert [r.kernel for r in rows] == [K[1].key(), K[1].key(), VENDOR]
    assert [r.best for r in rows] == [K[0].key(), K[1].key(), VENDOR]
    assert [r.ratio for r in rows] == [2.0, 1.0, 1.0]
    assert d.report.geomean == pytest.approx(2.0 ** (1 / 4))  # exp((1*log 2 + 2*0 + 1*0) / 4)
    assert d.report.worst == 2.0
    assert d.select({"T": 3}) == VENDOR


def test_regret_report_function():
    r = regret_report([[1], [2]], [3.0, 1.0], ["a", "b"], [2.0, 1.0], ["x", "b"], [1.0, 1.0])
    assert r.geomean == pytest.approx(math.exp(3 * math.log(2) / 4))


def test_render_is_an_if_chain_ending_in_else():
    ts = [1, 2, 4, 8, 16, 32, 64]
    d = build_dispatch(("T",), [Instance.of({"T": t}) for t in ts], K, _times(ts))
    text = d.render()
    lines = text.splitlines()
    assert lines[0].startswith("if ") and lines[-1].startswith("else ->")
    for t in ts:
        assert d.select({"T": t}).key() in text


def test_bad_inputs():
    with pytest.raises(DietcodeError, match="empty instance set"):
        build_dispatch(("T",), [], K, np.zeros((0, len(K))))
    with pytest.raises(DietcodeError, match="shape"):
        build_dispatch(("T",), [Instance.of({"T": 1})], K, np.zeros((2, 2)))
    with pytest.raises(DietcodeError, match="every candidate failed"):
        build_dispatch(("T",), [Instance.of({"T": 1})], K[:1], np.array([[np.inf]]))
