"""Timing what ships (tuner.gpu_timing, GpuMeasurer): the child-process protocol, crash recovery and the
database's caching rules, rehearsed on the CPU with the fake backend of tests/_fake_timing.py; the real
timing of AOT cubins through the C core in a GPU-marked test."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dietcode_ort.errors import DietcodeError
from tuner.gpu_timing import ChildTimer, TimingItem, TimingSettings, node_call
from tuner.measure import GpuMeasurer, MeasureResult
from tuner.space import Family, MicroKernel
from tuner.workload import ConvParams, Epilogue, Problem

FAKE = "_fake_timing:FakeBackend"
FAST = TimingSettings(warmup=1, repeats=1, flush_bytes=0, timeout_s=20.0)


@pytest.fixture(autouse=True)
def _fresh_children():
    """Each test's measurers start their own timing child (it reads the fake's plan when it starts)."""
    from tuner import gpu_timing

    yield
    for timer in list(gpu_timing._SHARED.values()):
        timer.close()


def _items(actions: list[str]) -> list[TimingItem]:
    return [TimingItem(i, name, b"", "gemm", "float16", Problem(16 * (i + 1), 32, 32)) for i, name in enumerate(actions)]


def _plan(monkeypatch, **plan) -> None:
    monkeypatch.setenv("DIETCODE_FAKE_TIMING", json.dumps(plan))


def test_child_answers_every_item_in_order_and_is_reused(monkeypatch):
    _plan(monkeypatch)
    with ChildTimer(FAKE, FAST) as timer:
        first = timer.time(_items(["a", "b", "c"]))
        second = timer.time(_items(["d"]))
    assert [r.seconds for r in first] == [16e-6, 32e-6, 48e-6] and all(r.ok for r in first + second)
    assert timer.started == 1  # one child served both batches


@pytest.mark.parametrize("action, reason", [("exit", "exited with status 7"), ("signal", "died of SIGSEGV"),
                                            ("lost", "context lost: CUDA_ERROR_ILLEGAL_ADDRESS")])
def test_a_child_dying_mid_batch_fails_only_the_item_in_flight(monkeypatch, action, reason):
    """The item in flight is failed (transient, with the reason); the rest of the batch goes to a new child."""
    _plan(monkeypatch, crash=action)
    with ChildTimer(FAKE, FAST) as timer:
        results = timer.time(_items(["ok1", "crash", "ok2", "ok3"]))
        after = timer.time(_items(["ok4"]))
    assert [r.ok for r in results] == [True, False, True, True]
    assert reason in results[1].error and results[1].transient and results[1].seconds == math.inf
    assert not any(r.transient for r in results if r.ok)
    assert timer.started == 2 and len(set(timer.pids)) == 2 and after[0].ok


def test_a_hanging_item_times_out_and_the_batch_goes_on(monkeypatch):
    _plan(monkeypatch, slow="hang")
    settings = TimingSettings(warmup=1, repeats=1, flush_bytes=0, timeout_s=3.0)
    with ChildTimer(FAKE, settings) as timer:
        results = timer.time(_items(["slow", "ok"]))
    assert "timed out" in results[0].error and results[0].transient and results[1].ok


def test_restarts_are_bounded_and_the_rest_is_recorded_failed(monkeypatch):
    """A batch whose every item kills its child: after max_restarts + 1 deaths the rest are recorded as failed
    for the last reason, without more children."""
    _plan(monkeypatch, x="exit")
    with ChildTimer(FAKE, FAST, max_restarts=1) as timer:
        results = timer.time(_items(["x"] * 5))
    assert timer.started == 2 and not any(r.ok for r in results) and all(r.transient for r in results)
    assert "died 2 times in this batch; last: the timing process exited with status 7" in results[4].error


def test_failures_that_follow_from_the_config_are_not_transient(monkeypatch):
    _plan(monkeypatch, big="refuse", odd="raise")
    with ChildTimer(FAKE, FAST) as timer:
        big, odd, ok = timer.time(_items(["big", "odd", "ok"]))
    assert not big.ok and not big.transient and "does not fit" in big.error
    assert not odd.ok and odd.transient and "RuntimeError: unexpected" in odd.error  # not understood: not cached
    assert ok.ok and timer.started == 1


def test_a_child_that_cannot_start_is_an_error(monkeypatch):
    _plan(monkeypatch, refuse_start=True)
    with pytest.raises(DietcodeError, match="could not start: RuntimeError: no GPU in this fake"):
        ChildTimer(FAKE, FAST).time(_items(["a"]))
    with pytest.raises(DietcodeError, match="cannot be loaded"):
        ChildTimer("no_such_module:Backend", FAST).device_key()


def test_database_never_stores_transient_failures(tmp_path, monkeypatch):
    """Through CachingMeasurer: measured and deterministic failures are stored, the crash is not, so the next
    run measures only the crashed pair again."""
    from tuner.database import CachingMeasurer, Database

    _plan(monkeypatch, **{MicroKernel(32, 32, 32, 4, 2).key(): "exit"})
    configs = [MicroKernel(16, 16, 32, 2, 2), MicroKernel(32, 32, 32, 4, 2)]
    pairs = [(c, Problem(16, 32, 32)) for c in configs]
    family = Family("gemm", "float16", "sm_90")
    with GpuMeasurer(warmup=1, repeats=1, flush_bytes=0, backend=FAKE, cache_dir=tmp_path / "k") as inner:
        db = Database(tmp_path / "t.db")
        cached = CachingMeasurer(inner, db)
        first = cached.measure(family, pairs)
        assert first[0].ok and not first[1].ok and first[1].transient
        # the cost the recorder reports (record_table's table.json): both configs compiled and timed
        assert (inner.compiled, inner.timed) == (2, 2) and inner.compile_seconds > 0 and inner.timing_seconds > 0
        assert len(db.rows(inner.device_key(), family, inner.context())) == 1
        monkeypatch.setenv("DIETCODE_FAKE_TIMING", "{}")
        inner.close()  # the next child reads the new plan
        second = cached.measure(family, pairs)
    assert second[0].seconds == first[0].seconds and second[1].ok
    assert (inner.compiled, inner.timed) == (3, 3)  # only the crashed pair again
    assert cached.hits == 1 and cached.misses == 3


def test_a_compile_error_is_a_cached_failure(tmp_path, monkeypatch):
    """A config the AOT compiler refuses is a failed result that is not transient (the database keeps it)."""
    _plan(monkeypatch)
    bad = MicroKernel(16, 16, 24, 2, 2)  # BLOCK_K not a power of two: Triton refuses it
    with GpuMeasurer(warmup=1, repeats=1, flush_bytes=0, backend=FAKE, cache_dir=tmp_path) as m:
        result, = m.measure(Family("gemm", "float16", "sm_90"), [(bad, Problem(16, 32, 32))])
    assert not result.ok and not result.transient and result.error.startswith("compile error")


def test_the_child_times_the_aot_kernel_that_ships(tmp_path, monkeypatch):
    """The child gets each config as optimize ships it: tuner.aot's kernel with the workload's div16, in a
    bundle; the launch view is the C core's for the node call (bmm: batch strides; conv: gathered)."""
    from tuner import aot

    log = tmp_path / "log.jsonl"
    _plan(monkeypatch, log=str(log))
    config = MicroKernel(16, 16, 32, 2, 2)
    div16 = aot.shipped_div16("gemm", True, 64, 32)
    assert div16 == ("a", "b", "bias", "c", "K", "N")
    gemm = GpuMeasurer(warmup=1, repeats=1, flush_bytes=0, backend=FAKE, cache_dir=tmp_path, div16=div16,
                       epilogue=Epilogue(bias=True))
    with gemm:
        results = gemm.measure(Family("gemm", "float16", "sm_90"), [(config, Problem(48, 64, 32))])
    assert results[0].ok
    record = json.loads(log.read_text().splitlines()[0])
    shipped = aot.compile_kernel(Family("gemm", "float16", "sm_90"), config, epilogue=Epilogue(bias=True),
                                 div16=div16, cache_dir=tmp_path)
    assert record["name"] == shipped.name and sorted(record["div16"]) == sorted(div16)
    assert record["view"][:4] == [48, 64, 32, 1]
    assert "div16=K,N,a,b,bias,c" in gemm.context()


@pytest.mark.parametrize("op, problem, conv, want", [
    ("bmm", Problem(5, 7, 64, 12), None, [5, 7, 64, 12, 5 * 64, 64 * 7]),
    ("conv", Problem(2 * 4 * 4, 8, 4 * 9, 1, (2, 8, 8)), ConvParams(4, 8, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1)),
     [32, 8, 36, 1, 0, 0]),
])
def test_node_call_gives_the_runtime_launch_view(op, problem, conv, want):
    from dietcode_ort.runtime import load_core

    item = TimingItem(0, "c", b"", op, "float16", problem, conv=conv)
    view = load_core().abi_view(**node_call(item))
    assert view is not None
    assert [view.M, view.N, view.K, view.batch, view.stride_a_batch, view.stride_b_batch] == want


def test_node_call_of_a_channels_last_conv_is_the_nhwc_node_call():
    """A channels-last conv item times the node call a channels_last=1 node makes: X [n, H, W, C], W [OC, KH, KW, C]
    and the flag; its launch view is the NCHW layer's."""
    from dietcode_ort.runtime import load_core

    problem = Problem(2 * 4 * 4, 8, 4 * 9, 1, (2, 8, 8))
    layer = ConvParams(4, 8, (3, 3), (2, 2), (1, 1, 1, 1), (1, 1))
    nhwc = ConvParams(**{**layer.__dict__, "channels_last": True})
    call = node_call(TimingItem(0, "c", b"", "conv", "float16", problem, conv=nhwc))
    assert (call["a"], call["b"], call["channels_last"]) == ((2, 8, 8, 4), (8, 3, 3, 4), True)
    core = load_core()
    view = core.abi_view(**call)
    nchw = core.abi_view(**node_call(TimingItem(0, "c", b"", "conv", "float16", problem, conv=layer)))
    assert view is not None and nchw is not None
    fields = ("M", "N", "K", "batch", "img_n", "img_h", "img_w", "out_h", "out_w")
    assert [getattr(view, f) for f in fields] == [getattr(nchw, f) for f in fields]
    assert [view.M, view.N, view.K] == [32, 8, 36]


def test_gpu_timing_key_covers_code_div16_and_settings(monkeypatch):
    """The database context changes with the AOT compiler's source, the div16 set and every timing setting
    (checked without a GPU: the fake backend)."""
    from tuner import aot

    _plan(monkeypatch)

    def context(**kw) -> str:
        return GpuMeasurer(backend=FAKE, **kw).context()

    base = context()
    assert aot.aot_hash()[:16] in base and aot.template_hash()[:16] in base and "aot-cubin" in base
    variants = {base, context(div16=("a",)), context(warmup=1), context(repeats=5), context(flush_bytes=0),
                context(vendor_tf32=False), context(toolchain=aot.CompileToolchain(min_driver=13040)),
                context(toolchain=aot.CompileToolchain(ptxas="/opt/ptxas"))}
    assert len(variants) == 8  # each setting that changes what is timed changes the key
    monkeypatch.setattr(aot, "aot_hash", lambda: "0" * 64)
    assert context() != base


@pytest.mark.gpu
def test_gpu_times_aot_cubins_and_the_chosen_config_launches(tmp_path):
    """On a GPU: two configs compiled as shipped, timed through the C core (positive, finite), and the faster
    one launched through dc_launch computes the product."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from dietcode_ort.bundle import Bundle, BundleKernel, DispatchTree
    from dietcode_ort.runtime import LaunchArgs, load_core
    from tuner import aot
    from tuner.optimize import default_targets

    family = Family("gemm", "float16", default_targets()[0])
    div16 = aot.shipped_div16("gemm", False, 256, 128)
    configs = [MicroKernel(64, 64, 32, 4, 3), MicroKernel(32, 32, 32, 4, 2)]
    problem = Problem(200, 256, 128)
    with GpuMeasurer(warmup=2, repeats=5, div16=div16, cache_dir=tmp_path) as m:
        results = m.measure(family, [(c, problem) for c in configs])
        assert all(r.ok and 0 < r.seconds < 1e-2 for r in results), results
        assert "arch=sm_" in m.device_key()
    best = configs[min(range(2), key=lambda i: results[i].seconds)]
    kernel = aot.compile_kernel(family, best, div16=div16, cache_dir=tmp_path)
    bundle = load_core().parse(Bundle((), (BundleKernel.from_compiled([kernel]),), DispatchTree.single(0)).to_bytes())
    a = torch.randn(problem.m, problem.k, device="cuda", dtype=torch.float16)
    b = torch.randn(problem.k, problem.n, device="cuda", dtype=torch.float16)
    c = torch.zeros(problem.m, problem.n, device="cuda", dtype=torch.float16)
    bundle.launch(0, LaunchArgs(a=a.data_ptr(), b=b.data_ptr(), c=c.data_ptr(), c_bytes=c.numel() * 2, M=problem.m,
                                N=problem.n, K=problem.k, batch=1), torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    torch.testing.assert_close(c.float(), (a.float() @ b.float()), rtol=2e-2, atol=2e-1)



def test_record_table_times_the_shipped_cubins(tmp_path, monkeypatch):
    """benchmarks/record_table.py on the GPU path measures through GpuMeasurer: the child gets each config's
    AOT kernel compiled with the div16 optimize would give the set (attention-qk: N = T is symbolic, K = 64
    is not), and the table gets the child's timings (rehearsed with the fake backend)."""
    import csv
    import importlib.util
    import sys

    from tuner import measure

    spec = importlib.util.spec_from_file_location("record_table", Path(__file__).parents[1] / "benchmarks" / "record_table.py")
    record_table = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "record_table", record_table)
    spec.loader.exec_module(record_table)  # type: ignore[union-attr]
    log = tmp_path / "log.jsonl"
    _plan(monkeypatch, log=str(log))

    class Rehearsal(measure.GpuMeasurer):
        def __init__(self, **kw):
            super().__init__(backend=FAKE, **kw)  # the recorder gives each set a kernel cache of its own

        def measure_vendor(self, family, problems):
            return [MeasureResult(1.0) for _ in problems]

    monkeypatch.setattr(measure, "GpuMeasurer", Rehearsal)
    monkeypatch.setattr(record_table, "_environment", lambda command: {"device": "fake", "arch": "sm_90"})
    qk = record_table.attention_sets(2)[:1]
    assert record_table.shipped_div16(qk[0]) == ("a", "b", "c", "K", "stride_a_batch", "stride_b_batch")
    table = record_table.record(qk, tmp_path / "out", max_configs=2, repeats=4)
    meta = json.loads((tmp_path / "out" / "table.json").read_text())
    timing = meta["timing"]
    cost = meta["done"][0]["cost"]  # report_table.py's tuning-cost units: 2 configs compiled, 2 x 2 launches timed
    assert (cost["compiled"], cost["timed"]) == (2, 4) and cost["compile_s"] > 0 and cost["timing_s"] > 0
    assert timing["repeats"] == 4 and timing["warmup"] >= 1 and "AOT cubins" in timing["kernels"]
    rows = list(csv.DictReader(table.open()))
    timed = [r for r in rows if r["config"] != "vendor"]
    assert len(timed) == 4 and {float(r["seconds"]) for r in timed} == {1e-6, 2e-6}  # the fake's 1 us per M
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    # a TMA config (key ending in t) is compiled with TMA's div16 rules on top of the shipped set (aot.tma_div16)
    shipped = ["K", "a", "b", "c", "stride_a_batch", "stride_b_batch"]  # K = 64 makes both batch strides 16-divisible
    want = {False: shipped, True: sorted({*shipped, "N"})}
    assert len(seen) == 4 and all(sorted(s["div16"]) == want[s["config"].endswith("t")] for s in seen)
    assert {tuple(s["view"]) for s in seen} == {(1, 1, 64, 192, 64, 64), (2, 2, 64, 192, 128, 128)}


def test_measurers_of_a_process_share_one_timing_child(tmp_path, monkeypatch):
    """One child (one CUDA context, one set of buffers) serves every GpuMeasurer with the same settings."""
    _plan(monkeypatch)
    family = Family("gemm", "float16", "sm_90")
    pair = (MicroKernel(16, 16, 32, 2, 2), Problem(16, 32, 32))
    first = GpuMeasurer(warmup=1, repeats=2, flush_bytes=0, backend=FAKE, cache_dir=tmp_path)
    second = GpuMeasurer(warmup=1, repeats=2, flush_bytes=0, backend=FAKE, cache_dir=tmp_path,
                         epilogue=Epilogue(bias=True))
    try:
        assert first.measure(family, [pair])[0].ok and second.measure(family, [pair])[0].ok
        assert first._timer is second._timer and first._timer.started == 1
    finally:
        first.close()


def test_the_cuda_backend_refuses_to_start_without_a_driver():
    """The real backend's child reports why it cannot time (here: no libcuda), as a DietcodeError."""
    import shutil

    if shutil.which("nvidia-smi"):
        pytest.skip("a GPU driver is present")
    from tuner.gpu_timing import CUDA_BACKEND

    with pytest.raises(DietcodeError, match="could not start: DietcodeError: cannot load the CUDA driver"):
        ChildTimer(CUDA_BACKEND, FAST).time(_items(["a"]))


def test_timing_entry_points_are_exported_and_fail_cleanly_without_a_driver():
    """custom_ops/timing.cc's C functions are in the library's exports; without libcuda each returns -1 with
    the driver's message instead of crashing."""
    import ctypes
    import shutil

    from dietcode_ort.runtime import LaunchArgs, load_core

    if shutil.which("nvidia-smi"):
        pytest.skip("a GPU driver is present")
    core = load_core()
    lib = core.lib
    ptr, stream = ctypes.c_uint64(), ctypes.c_void_p()
    lib.dc_time_kernel.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(LaunchArgs), ctypes.c_void_p,
                                   ctypes.c_int, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64,
                                   ctypes.POINTER(ctypes.c_float)]
    times = (ctypes.c_float * 1)()
    calls = [lambda: lib.dc_timing_open(0, ctypes.byref(stream)),
             lambda: lib.dc_mem_alloc(ctypes.c_uint64(16), ctypes.byref(ptr)),
             lambda: lib.dc_mem_free(ctypes.c_uint64(0)),
             lambda: lib.dc_time_kernel(None, 0, ctypes.byref(LaunchArgs()), None, 1, 1, 0, 0, times)]
    for call in calls:
        assert call() == -1 and "cannot load the CUDA driver" in core.error()
