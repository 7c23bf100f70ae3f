"""Measurers: replay tables (synthetic, labelled as such), the analytic measurer, the GPU measurer's guard."""
from __future__ import annotations

import csv
import gzip
import math
from dataclasses import replace

import numpy as np
import pytest

from dietcode_ort.errors import DietcodeError
from tuner.hardware import get_profile
from tuner.measure import AnalyticMeasurer, GpuMeasurer, MeasureResult, ReplayMeasurer
from tuner.simulate import simulate_table, synthetic_table_name, write_synthetic_table
from tuner.space import Family, MicroKernel, enumerate_space
from tuner.workload import ConvParams, Epilogue, Problem

FAMILY = Family("gemm", "float16", "sm_90")
H100 = get_profile("sm_90")
CONFIGS = [MicroKernel(64, 64, 32, 4, 3), MicroKernel(16, 32, 64, 2, 2), MicroKernel(128, 128, 64, 8, 4)]
PROBLEMS = [Problem(16, 768, 768), Problem(512, 768, 768)]


def _table(tmp_path, seed=3):
    rows = simulate_table(CONFIGS, PROBLEMS, H100, "float16", seed)
    return rows, write_synthetic_table(tmp_path / synthetic_table_name(H100, "float16", seed), rows, H100, seed)


def test_synthetic_table_is_labelled_and_replays(tmp_path):
    rows, path = _table(tmp_path)
    assert "synthetic" in path.name and path.suffix == ".gz"
    with gzip.open(path, "rt") as fh:
        records = list(csv.DictReader(fh))
    assert {r["synthetic"] for r in records} == {"1"} and records[0]["device"].startswith("synthetic:")
    replay = ReplayMeasurer(path)
    assert replay.synthetic and replay.device_key().startswith("synthetic:")
    pairs = [(c, p) for p in PROBLEMS for c in CONFIGS]
    got = replay.measure(FAMILY, pairs)
    want = {(r.config, r.problem): r.seconds for r in rows}
    assert [g.seconds for g in got] == [want[(c.key(), p)] for c, p in pairs]
    assert all(v.ok for v in replay.measure_vendor(FAMILY, PROBLEMS))
    # deterministic under the seed, different under another
    again, _ = _table(tmp_path / "..", seed=3)
    assert [r.seconds for r in again] == [r.seconds for r in rows]
    other = simulate_table(CONFIGS, PROBLEMS, H100, "float16", 4)
    assert [r.seconds for r in other] != [r.seconds for r in rows]


def test_synthetic_file_name_must_say_synthetic(tmp_path):
    rows = simulate_table(CONFIGS, PROBLEMS, H100, "float16", 1)
    with pytest.raises(DietcodeError, match="synthetic"):
        write_synthetic_table(tmp_path / "h100.csv", rows, H100, 1)


def test_replay_missing_instances_are_named(tmp_path):
    _, path = _table(tmp_path)
    replay = ReplayMeasurer(path)
    with pytest.raises(DietcodeError, match=r"2 requested.*m16n16k64w2s2g8k1 on m=16 n=768 k=768 batch=1"):
        replay.measure(FAMILY, [(MicroKernel(16, 16, 64, 2, 2), PROBLEMS[0]),
                                (CONFIGS[0], Problem(7, 8, 9))])


def test_replay_device_choice_and_bad_files(tmp_path):
    path = tmp_path / "two.csv"
    path.write_text("config,m,n,k,batch,seconds,device\n"
                    "m64n64k32w4s3g8k1,16,768,768,1,1e-5,gpu-a\n"
                    "m64n64k32w4s3g8k1,16,768,768,1,2e-5,gpu-b\n")
    with pytest.raises(DietcodeError, match="2 devices"):
        ReplayMeasurer(path)
    assert ReplayMeasurer(path, device="gpu-b").measure(FAMILY, [(CONFIGS[0], PROBLEMS[0])]) == [
        MeasureResult(2e-5)]
    with pytest.raises(DietcodeError, match="no rows for device"):
        ReplayMeasurer(path, device="gpu-c")
    bad = tmp_path / "bad.csv"
    bad.write_text("config,m\nx,1\n")
    with pytest.raises(DietcodeError, match="lacks columns"):
        ReplayMeasurer(bad)
    with pytest.raises(DietcodeError, match="cannot read"):
        ReplayMeasurer(tmp_path / "absent.csv.gz")


def test_replay_of_the_recorded_h100_table():
    """The committed H100 table (gzip) replays row for row: times, errors, the runtime's refusals (also
    foreseen by ``refusals`` without measuring) and the vendor's times."""
    from _recorded import H100_ROWS, H100_TABLE, REFUSAL, cells, rows

    assert len(rows()) == H100_ROWS
    family = Family("bmm", "float16", "sm_90")
    qk = cells("attention-qk")
    replay = ReplayMeasurer(H100_TABLE, family="attention-qk")
    assert replay.device_key().startswith("model=NVIDIA H100 80GB HBM3;arch=sm_90;") and not replay.synthetic
    pairs = [(MicroKernel.from_key(c), Problem(*p)) for c, p in qk if c != "vendor"]
    got = replay.measure(family, pairs)
    for (config, problem), r in zip(pairs, got):
        seconds, error = qk[(config.key(), (problem.m, problem.n, problem.k, problem.batch))]
        if error:
            assert r.seconds == math.inf and r.error == error and r.refused == error.startswith(REFUSAL)
        else:
            assert r.ok and r.seconds == seconds and not r.refused
    assert sum(r.refused for r in got) == 4440  # 37 TMA configs on the 120 T that are not multiples of 16
    assert [why for why in replay.refusals(family, pairs)] == [r.error if r.refused else None for r in got]
    problems = sorted({p for _, p in pairs})
    vendor = replay.measure_vendor(family, problems)
    assert [r.seconds for r in vendor] == [qk[("vendor", (p.m, p.n, p.k, p.batch))][0] for p in problems]


def test_refusal_matrix_is_refusals_over_every_pair(tmp_path):
    """``refusal_matrix`` answers ``refusals`` for every config x problem: a replay's recorded refusals through the
    tuning database's wrapper, and none, without forming the pairs, for a measurer that foresees none."""
    import numpy as np

    from _recorded import H100_TABLE, cells
    from tuner.database import CachingMeasurer, Database

    family = Family("bmm", "float16", "sm_90")
    qk = cells("attention-qk")
    configs = sorted({MicroKernel.from_key(c) for c, _ in qk if c != "vendor"})[:60]
    problems = sorted({Problem(*p) for _, p in qk})[:40]
    replay = ReplayMeasurer(H100_TABLE, family="attention-qk")
    want = np.array([why is not None for why in replay.refusals(family, [(c, p) for c in configs for p in problems])])
    assert want.any() and not want.all()
    with Database(tmp_path / "t.db") as db:
        for measurer in (replay, CachingMeasurer(replay, db)):
            assert (measurer.refusal_matrix(family, configs, problems) == want.reshape(60, 40)).all()

        class Counting(AnalyticMeasurer):
            asked = 0

            def refusals(self, family, pairs):
                Counting.asked += len(pairs)
                return super().refusals(family, pairs)

        class PairByPair(CachingMeasurer):
            def refusals(self, family, pairs):
                raise AssertionError("the wrapper asks its measurer's matrix, not each pair")

        analytic = AnalyticMeasurer(get_profile("sm_90"), "float16")
        for measurer in (analytic, CachingMeasurer(analytic, db), PairByPair(analytic, db)):
            assert measurer.refusal_matrix(family, configs, problems).shape == (60, 40)
            assert not measurer.refusal_matrix(family, configs, problems).any()
        assert not Counting(get_profile("sm_90"), "float16").refusal_matrix(family, configs, problems).any()
        assert Counting.asked == 60 * 40  # an override is asked, pair by pair


def test_gpu_measurer_foresees_the_recorded_h100_refusals():
    """GpuMeasurer.refusals (the div16 part of the runtime's per-call check, with the div16 each set was compiled
    with: record_table.shipped_div16) names exactly the calls the H100's runtime refused, and no other; so does
    a remote (Ray) GPU measurer's."""
    from _recorded import REFUSAL, cells
    from _scripts import load_script
    from tuner.distributed import RemoteMeasurer
    from tuner.measure import MeasurerSpec

    record_table = load_script("record_table")
    foreseen = 0
    for s in (*record_table.dense_sets(), *record_table.attention_sets()):
        m = object.__new__(GpuMeasurer)  # its refusals need no GPU; constructing one starts the timing child
        m.epilogue, m.div16 = s.epilogue, record_table.shipped_div16(s)
        recorded = [(MicroKernel.from_key(c), Problem(*p), error) for (c, p), (_, error) in cells(s.tag).items()
                    if c != "vendor"]
        family = Family(s.op, "float16", "sm_90")
        answers = m.refusals(family, [(c, p) for c, p, _ in recorded])
        # a Ray worker's GPU measurer: the driver works the same answers out from the spec
        remote = RemoteMeasurer(None, MeasurerSpec("gpu", epilogue=s.epilogue, div16=m.div16))
        assert remote.refusals(family, [(c, p) for c, p, _ in recorded]) == answers
        for (config, problem, error), why in zip(recorded, answers):
            assert (why is not None) == error.startswith(REFUSAL), (s.tag, config.key(), problem, error, why)
            assert why is None or MeasureResult(math.inf, why).refused
        foreseen += sum(why is not None for why in answers)
    assert foreseen == 4440 + 2040


def test_analytic_measurer_is_a_roofline():
    m = AnalyticMeasurer(H100, "float16")
    big = Problem(8192, 8192, 8192)
    small_tile, big_tile = m.measure(FAMILY, [(MicroKernel(16, 16, 64, 2, 2), big),
                                              (MicroKernel(128, 128, 64, 8, 3), big)])
    floor = 2 * 8192 ** 3 / (H100.fp16_tensor_tflops * 1e12)
    assert big_tile.seconds >= floor and small_tile.seconds > big_tile.seconds
    assert "analytic" in m.device_key()
    space = enumerate_space(FAMILY)
    assert all(r.ok for r in m.measure(FAMILY, [(c, PROBLEMS[0]) for c in space[:20]]))


def _analytic_best(family: Family, problem: Problem, tf32: bool = False) -> MicroKernel:
    space = enumerate_space(family)
    results = AnalyticMeasurer(get_profile(family.target), family.dtype, tf32=tf32).measure(
        family, [(c, problem) for c in space])
    return min(zip((r.seconds for r in results), space))[1]


def test_analytic_choice_splits_k_only_where_few_tiles_fill_the_gpu():
    """BERT-base fp16 on an H100: at M = 16 FFN2's 768-wide output makes 12 tiles of 16x64 for 132 SMs over a
    3072-long K, and a call on that few SMs gets their share of DRAM bandwidth only: splitting K (more programs,
    more busy SMs) wins despite its fp32 workspace, its reduction and its counter memset (the H100 table's best
    there split K by 8). With K = 768 the split's fixed costs outweigh it (the table's best at M = 16 did not
    split), and at M = 4096 the tiles fill the GPU many times over and the split only adds traffic."""
    ffn2 = Problem(16, 768, 3072)
    decode = _analytic_best(FAMILY, ffn2)
    assert decode.split_k > 1, decode.key()
    assert _analytic_best(FAMILY, Problem(16, 768, 768)).split_k == 1
    assert _analytic_best(FAMILY, Problem(4096, 3072, 768)).split_k == 1
    m = AnalyticMeasurer(H100, "float16")
    split, whole = m.terms(decode, ffn2), m.terms(replace(decode, split_k=1), ffn2)
    assert split is not None and whole is not None
    assert split.busy_sms == decode.split_k * whole.busy_sms <= H100.num_sms and split.seconds < whole.seconds


def test_analytic_split_k_pays_workspace_reduction_and_memset():
    from tuner.roofline import LAUNCH_SECONDS, MEMSET_SECONDS, SM_BANDWIDTH_FACTOR

    m = AnalyticMeasurer(H100, "float16")
    problem = Problem(16, 768, 3072)
    base, split = MicroKernel(16, 64, 64, 2, 3), MicroKernel(16, 64, 64, 2, 3, split_k=8)
    t1, t8 = m.terms(base, problem), m.terms(split, problem)
    assert t1 is not None and t8 is not None
    assert (t1.programs, t8.programs, t1.k_steps, t8.k_steps) == (12, 96, 48, 6)
    bandwidth = H100.dram_bandwidth_gbs * 1e9
    cap = SM_BANDWIDTH_FACTOR * bandwidth / H100.num_sms
    operands = (16 * 3072 + 3072 * 768 + 16 * 768) * 2
    assert t1.dram == pytest.approx(operands / bandwidth)
    workspace = 2 * 12 * 8 * 16 * 64 * 4  # each split writes its fp32 partial, the last split reads all 8
    assert t8.dram == pytest.approx((operands + workspace) / bandwidth)
    assert t1.reduce == 0 and t8.reduce == pytest.approx((8 * 16 * 64 * 4 + 16 * 64 * 2) / cap)
    assert (t1.launch, t8.launch) == pytest.approx((LAUNCH_SECONDS, LAUNCH_SECONDS + MEMSET_SECONDS))
    assert MEMSET_SECONDS == LAUNCH_SECONDS  # split-K costs a launch's worth more (fitted to the H100 table, timed with a memset)
    # 12 busy SMs pull at most 12 per-SM caps (48 of 132 shares): the unsplit call's loads take their time at that rate
    assert t1.sm_memory == pytest.approx((48 * (16 + 64) * 64 * 2 + 16 * 64 * 2) / cap)
    assert t1.sm_memory > t1.dram * 3


def test_analytic_time_is_monotone_in_m():
    m = AnalyticMeasurer(H100, "float16")
    sizes = list(range(1, 300, 5)) + [512, 1000, 2048, 4096, 8192]
    for config in enumerate_space(FAMILY)[::9]:
        for n, k, batch in ((768, 768, 1), (3072, 768, 1), (64, 64, 12)):
            times = [r.seconds for r in m.measure(FAMILY, [(config, Problem(x, n, k, batch)) for x in sizes])]
            assert all(b >= a for a, b in zip(times, times[1:])), (config.key(), n, k, batch)


def test_tma_twins_pay_their_descriptors_and_issue_less_on_sm90_and_are_absent_on_sm80():
    """A TMA twin issues less than its pointer-load config and pays its in-kernel descriptors once per call
    (tuner/roofline.py, fitted to the H100 table, where TMA configs ran slower on small calls): slower by at most
    that on any call, slower on a launch-bound one, and a little faster on a large one."""
    from tuner.roofline import CONSTANTS

    m = AnalyticMeasurer(H100, "float16")
    twins = [c for c in enumerate_space(FAMILY) if c.tma]
    assert twins
    for problem in (Problem(16, 768, 768), Problem(512, 768, 768), Problem(4096, 3072, 768)):
        pairs = [(p, problem) for c in twins for p in (replace(c, tma=0), c)]
        times = [r.seconds for r in m.measure(FAMILY, pairs)]
        for base, twin in zip(times[::2], times[1::2]):
            assert twin <= base + CONSTANTS.tma_setup_s * (1 + 1e-9)
            if problem.m == 16:
                assert twin > base
    big = Problem(16384, 3072, 768)
    config = MicroKernel(128, 256, 64, 8, 3)
    base, twin = (m.terms(c, big) for c in (config, replace(config, tma=1)))
    assert base is not None and twin is not None
    assert twin.setup == CONSTANTS.tma_setup_s and base.setup == 0
    assert twin.issue < base.issue and 0.95 * base.seconds < twin.seconds < base.seconds  # modest
    # sm_80 has no TMA: the space offers none and the model gives a tma config no advantage there
    a100 = get_profile("sm_80")
    assert not any(c.tma for c in enumerate_space(Family("gemm", "float16", "sm_80")))
    am = AnalyticMeasurer(a100, "float16")
    assert [r.seconds for r in am.measure(Family("gemm", "float16", "sm_80"), [(config, big), (replace(config, tma=1), big)])] \
        == [am.measure(Family("gemm", "float16", "sm_80"), [(config, big)])[0].seconds] * 2


def test_analytic_device_key_names_the_model_version():
    """Answers of an older analytic model in a tuning database are never reused by this one."""
    from tuner.roofline import MODEL_VERSION

    assert f"analytic-v{MODEL_VERSION}:" in AnalyticMeasurer(H100, "float16").device_key()
    assert MODEL_VERSION >= 2


def test_gpu_measurer_refuses_without_cuda():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present; covered by the gpu test")
    with pytest.raises(DietcodeError, match="CUDA"):
        GpuMeasurer()


@pytest.mark.parametrize("vendor_tf32", [None, False])
def test_vendor_baseline_uses_tf32_as_ort_cuda_ep_does(monkeypatch, vendor_tf32):
    """ORT's CUDA EP runs fp32 MatMul/Conv with TF32 by default: torch's TF32 flags are on while the vendor
    is timed (unless vendor_tf32=False) and restored after. Checked on the CPU: the timer records them."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "empty", lambda *a, **k: torch.zeros(1))  # the L2 flush buffer
    flags = torch.backends
    saved = (flags.cuda.matmul.allow_tf32, flags.cudnn.allow_tf32)
    flags.cuda.matmul.allow_tf32 = flags.cudnn.allow_tf32 = False  # plain attributes of torch's own modules
    try:
        _check_vendor_tf32(torch, monkeypatch, vendor_tf32)
    finally:
        flags.cuda.matmul.allow_tf32, flags.cudnn.allow_tf32 = saved


def _check_vendor_tf32(torch, monkeypatch, vendor_tf32):
    from tuner import measure
    from tuner.workload import ConvParams

    conv = ConvParams(4, 8, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1))
    kwargs = {} if vendor_tf32 is None else {"vendor_tf32": vendor_tf32}
    m = GpuMeasurer(conv=conv, backend="_fake_timing:FakeBackend", **kwargs)  # kernels' timing is not used here
    want = measure.ORT_CUDA_USES_TF32 if vendor_tf32 is None else vendor_tf32
    assert measure.ORT_CUDA_USES_TF32 is True and m.vendor_tf32 is want
    seen = []

    def operands(family, p):
        make = lambda *shape: torch.randn(*shape, dtype=torch.float32)  # noqa: E731
        if family.op == "conv":
            return make(1, 4, 6, 6), make(8, 4, 3, 3), None, None
        return make(p.m, p.k), make(p.k, p.n), None, None

    def timer(fn):
        seen.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))
        fn()
        return 1e-3

    monkeypatch.setattr(m, "_operands", operands)
    monkeypatch.setattr(m, "_time", timer)
    results = m.measure_vendor(Family("gemm", "float32", "sm_90"), [Problem(8, 16, 32)])
    results += m.measure_vendor(Family("conv", "float32", "sm_90"), [Problem(36, 8, 36, 1, (1, 6, 6))])
    assert [r.seconds for r in results] == [1e-3, 1e-3], results
    assert seen == [(want, want), (want, want)]
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (False, False)


@pytest.mark.parametrize("op, trans_b", [("gemm", False), ("gemm", True), ("bmm", False), ("bmm", True)])
@pytest.mark.parametrize("bias, activation, alpha, residual", [(False, "none", 1.0, False), (True, "gelu", 0.125, True),
                                                               (True, "relu", 2.0, False), (False, "none", 0.5, True),
                                                               (True, "gelu_tanh", 0.5, False),
                                                               (False, "gelu_tanh", 1.0, False), (False, "relu", 1.0, False),
                                                               (True, "none", 1.0, True)])
def test_vendor_baseline_computes_the_fused_epilogue(op, trans_b, bias, activation, alpha, residual):
    """The vendor baseline times what the fused node computes, act(alpha * A @ B + bias) + residual (checked
    on CPU tensors against numpy), so a scale or residual the kernels fuse is not free for the vendor."""
    torch = pytest.importorskip("torch")
    m = GpuMeasurer(backend="_fake_timing:FakeBackend", trans_b=trans_b,
                    epilogue=Epilogue(bias=bias, activation=activation, alpha=alpha, residual=residual))
    rng = np.random.default_rng(0)
    lead = (3,) if op == "bmm" else ()
    a = rng.standard_normal(lead + (5, 7)).astype(np.float32)
    b = rng.standard_normal(lead + ((6, 7) if trans_b else (7, 6))).astype(np.float32)
    c = rng.standard_normal(6).astype(np.float32) if bias else None
    r = rng.standard_normal(lead + (5, 6)).astype(np.float32) if residual else None
    t = lambda x: None if x is None else torch.from_numpy(x)  # noqa: E731
    got = m.vendor_call(Family(op, "float32", "sm_90"), t(a), t(b), t(c), t(r))().numpy()
    want = alpha * (a @ (np.swapaxes(b, -1, -2) if trans_b else b)) + (0 if c is None else c)
    want = {"none": want, "relu": np.maximum(want, 0),
            "gelu": 0.5 * want * (1 + np.vectorize(math.erf)(want / math.sqrt(2))),
            "gelu_tanh": 0.5 * want * (1 + np.tanh(math.sqrt(2 / math.pi) * (want + 0.044715 * want ** 3)))}[activation]
    want = want + (0 if r is None else r)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


EPILOGUE_GRID = [Epilogue(bias, act, 1.0, residual != "", residual == "first", residual == "mul")
                 for bias in (False, True) for act in ("none", "relu", "gelu", "gelu_tanh", "silu", "relu6")
                 for residual in ("", "after", "first", "mul") if act != "none" or residual in ("", "after")]


@pytest.mark.parametrize("epilogue", EPILOGUE_GRID)
def test_lt_fuses_follows_the_runtime_plan(epilogue):
    """The vendor baseline's ``lt_fuses`` says what dc_gemm_lt_plan (custom_ops/vendor.h) decides for the
    runtime: for the gemm family (one GEMM) the same, for bmm (a batch) never."""
    from dietcode_ort.runtime import load_core
    from tuner.measure import lt_fuses

    core = load_core()
    e = epilogue
    for op, b_shape in (("gemm", (6, 5)), ("bmm", (2, 6, 5))):
        plan = core.gemm_plan("MatMul", (2, 3, 6) if op == "bmm" else (3, 6), b_shape, (5,) if e.bias else None,
                              activation=e.activation)
        plan.epilogue.has_residual, plan.epilogue.residual_first = int(e.residual), int(e.residual_first)
        plan.epilogue.residual_mul = int(e.residual_mul)
        assert lt_fuses(op, e) == (core.gemm_lt_plan(plan) is not None), (op, e, core.error())


@pytest.mark.parametrize("residual_first", [False, True])
def test_vendor_baseline_of_a_fused_residual_is_one_gemm_reading_it(residual_first):
    """A residual the runtime fuses (C of its cuBLASLt call) is timed as one addmm_ into a copy of residual +
    bias made beforehand: the first call's value is the node's, the residual itself stays as it was."""
    torch = pytest.importorskip("torch")
    act = "relu" if residual_first else "none"
    m = GpuMeasurer(backend="_fake_timing:FakeBackend",
                    epilogue=Epilogue(bias=True, activation=act, residual=True, residual_first=residual_first))
    rng = np.random.default_rng(2)
    a, b, c, r = (rng.standard_normal(s).astype(np.float32) for s in ((5, 7), (7, 6), (6,), (5, 6)))
    tr = torch.from_numpy(r.copy())
    got = m.vendor_call(Family("gemm", "float32", "sm_90"), torch.from_numpy(a), torch.from_numpy(b),
                        torch.from_numpy(c), tr)().numpy()
    want = a.astype(np.float64) @ b + c + r
    np.testing.assert_allclose(got, np.maximum(want, 0) if residual_first else want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(tr.numpy(), r)


def test_vendor_baseline_context_names_the_fused_form():
    """The vendor timings of the epilogues the runtime now fuses into cuBLASLt (an activation, a residual) are
    another measurement than before: their context says vendor=lt; the others' stays vendor=addmm."""
    def form(**kw) -> str:
        conv = kw.pop("conv", None)
        ctx = GpuMeasurer(backend="_fake_timing:FakeBackend", epilogue=Epilogue(**kw), conv=conv).context()
        return ctx.split(";vendor=")[1].split(";")[0]

    assert form(bias=True) == form() == form(bias=True, activation="gelu") == "addmm"
    assert form(bias=True, activation="silu", residual=True, residual_mul=True) == "addmm"
    assert form(bias=True, activation="relu", residual=True) == "addmm"  # residual after: not fused
    assert form(bias=True, activation="gelu_tanh") == form(bias=True, residual=True) == "lt"
    assert form(activation="relu", residual=True, residual_first=True) == "lt"
    conv = ConvParams(4, 8, (3, 3), (1, 1), (1, 1, 1, 1), (1, 1))
    assert form(bias=True, activation="relu", residual=True, residual_first=True, conv=conv) == "addmm"


@pytest.mark.gpu
def test_gpu_measurer_times_kernels_and_vendor():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    m = GpuMeasurer(warmup=2, repeats=5)
    results = m.measure(FAMILY, [(CONFIGS[0], PROBLEMS[1]), (MicroKernel(256, 256, 128, 2, 4), PROBLEMS[1])])
    assert results[0].ok and 0 < results[0].seconds < 1e-2
    # 256x256x128 fp16 with 2 stages needs 256 KiB of shared memory, more than any GPU has: the failure
    # comes back as data (inf seconds and the reason), never as a crash
    assert not results[1].ok and results[1].seconds == math.inf and results[1].error
    assert all(r.ok for r in m.measure_vendor(FAMILY, PROBLEMS))
    assert "arch=sm_" in m.device_key()


def test_gpu_timings_are_keyed_by_template_source_and_timing_settings(monkeypatch):
    """The database context of a GPU timing changes with the templates' source and the timing settings, so
    a timing of an edited template or of other settings is never reused (checked without a GPU; more in
    test_gpu_timing.py)."""
    from tuner import aot

    def context(**kw) -> str:
        return GpuMeasurer(backend="_fake_timing:FakeBackend", epilogue=Epilogue(bias=True), **kw).context()

    base = context()
    assert "bias=1" in base and aot.template_hash()[:16] in base
    assert len({base, context(warmup=2), context(repeats=5), context(vendor_tf32=False)}) == 4
    # the residual added or multiplied (the SwiGLU gate) are two kernels: never one timing
    added, multiplied = (GpuMeasurer(backend="_fake_timing:FakeBackend", epilogue=Epilogue(
        False, "silu", 1.0, True, residual_mul=mul)).context() for mul in (False, True))
    assert added != multiplied and "residual_mul=1" in multiplied and "residual_mul" not in added
    # a grouped conv is another kernel than the ungrouped one of the same channels and window
    plain, grouped = (GpuMeasurer(backend="_fake_timing:FakeBackend", conv=ConvParams(8, 8, (3, 3), groups=g)).context()
                      for g in (1, 8))
    assert plain != grouped and "d(1,1)g8;" in grouped and "d(1,1);" in plain
    monkeypatch.setattr(aot, "template_hash", lambda: "0" * 64)
    assert context() != base


@pytest.mark.parametrize("op", ["gemm", "conv", "conv_nhwc"])
@pytest.mark.parametrize("mode", ["after", "first", "mul"])
def test_vendor_baseline_adds_the_residual_in_the_epilogues_order(op, mode):
    """The vendor baseline of a residual epilogue adds it where the node does: before the Relu for
    residual_first (ResNet's ConvBiasResidualRelu), after it otherwise, or multiplies by it after the Relu for
    residual_mul (the SwiGLU gate's form); conv's residual comes as the output's [n, OC, OH*OW] (how _operands
    makes it), a channels-last conv's as [n, OH*OW, OC] with X and W in channels_last memory, and is applied
    at the output's elements."""
    torch = pytest.importorskip("torch")
    nhwc = op == "conv_nhwc"
    op = "conv" if nhwc else op
    conv = ConvParams(3, 4, (3, 3), pads=(1, 1, 1, 1), channels_last=nhwc) if op == "conv" else None
    first = mode == "first"
    m = GpuMeasurer(backend="_fake_timing:FakeBackend", conv=conv,
                    epilogue=Epilogue(bias=True, activation="relu", residual=True, residual_first=first,
                                      residual_mul=mode == "mul"))
    rng = np.random.default_rng(1)
    if op == "conv":
        a, b = rng.standard_normal((2, 3, 5, 6)), rng.standard_normal((4, 3, 3, 3))
        c, r = rng.standard_normal(4), rng.standard_normal((2, 30, 4) if nhwc else (2, 4, 30))
        y = torch.nn.functional.conv2d(torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(c),
                                       padding=1).numpy()
        res = r.reshape(2, 5, 6, 4).transpose(0, 3, 1, 2) if nhwc else r.reshape(y.shape)
    else:
        a, b, c, r = (rng.standard_normal(s) for s in ((5, 7), (7, 6), (6,), (5, 6)))
        y, res = a @ b + c, r
    t = lambda x: torch.from_numpy(x.astype(np.float32))  # noqa: E731
    a_, b_ = t(a), t(b)
    if nhwc:
        a_, b_ = (x.contiguous(memory_format=torch.channels_last) for x in (a_, b_))
    got = m.vendor_call(Family(op, "float32", "sm_90"), a_, b_, t(c), t(r))().numpy()
    want = np.maximum(y + res, 0) if first else np.maximum(y, 0) * res if mode == "mul" else np.maximum(y, 0) + res
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
