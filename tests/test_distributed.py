"""optimize --ray on a local Ray instance (2 CPUs, 2 simulated H100s): the same answers as one process,
workers that die or hang, and an interrupted run resumed from the database. Skipped without Ray, except
the checks that need no Ray."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import models
from dietcode_ort.errors import DietcodeError
from tuner.database import CachingMeasurer, Database
from tuner.hardware import get_profile
from tuner.measure import MeasurerSpec
from tuner.optimize import OptimizeOptions, optimize
from tuner.search import SearchOptions, tune_joint
from tuner.simulate import simulate_table, synthetic_table_name, write_synthetic_table
from tuner.space import Family, enumerate_space
from tuner.workload import Problem

REPO = Path(__file__).resolve().parents[1]
FAMILY = Family("gemm", "float16", "sm_90")
H100 = get_profile("sm_90")
SPACE = enumerate_space(FAMILY)[::10]
PROBLEMS = [(Problem(16 * t, 768, 768), float(t)) for t in (1, 3, 8, 20)]


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    from ray import cloudpickle

    # tests/ too: the timing children of GPU tasks import the fake timing backend (tests/_fake_timing.py)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the fault-injecting specs below
    ray.init(num_cpus=2, num_gpus=2, resources={"accelerator_type:H100": 1}, include_dashboard=False,
             object_store_memory=80 * 1024 * 1024, log_to_driver=False, logging_level="ERROR")
    yield ray
    ray.shutdown()


def _executor(**kw):
    from tuner.distributed import RayExecutor, RayOptions

    kw.setdefault("progress", False)
    return RayExecutor(RayOptions(**kw))


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> Path:
    rows = simulate_table(SPACE, [p for p, _ in PROBLEMS], H100, "float16", 5)
    folder = tmp_path_factory.mktemp("table")
    return write_synthetic_table(folder / synthetic_table_name(H100, "float16", 5), rows, H100, 5)


def _tune(measurer, budget: int = 48):
    return tune_joint(FAMILY, PROBLEMS, SPACE, measurer, H100,
                      SearchOptions(max_trials=budget, round_size=16, seed=7, progress=False))


def _same(a, b) -> None:
    assert [(m.config, m.problem, m.seconds) for m in a.measurements] == \
        [(m.config, m.problem, m.seconds) for m in b.measurements]
    assert a.choice == b.choice and a.candidates == b.candidates
    np.testing.assert_array_equal(a.times, b.times)


# --- faults injected on the worker (these classes travel to it by value) ----------------------------

@dataclass(frozen=True)
class CrashOnce:
    """Builds the replay measurer, but the first batch anywhere kills its worker (a marker file says
    whether that has happened)."""

    inner: MeasurerSpec
    marker: str
    kind: str = "replay"

    def build(self):
        return _Faulty(self.inner.build(), self.marker, "", 0.0)


@dataclass(frozen=True)
class Faulty:
    """Builds the replay measurer; a batch holding config ``bad`` kills its worker, or hangs ``sleep`` s."""

    inner: MeasurerSpec
    bad: str
    sleep: float = 0.0
    kind: str = "replay"

    def build(self):
        return _Faulty(self.inner.build(), "", self.bad, self.sleep)


class _Faulty:
    def __init__(self, inner, marker: str, bad: str, sleep: float) -> None:
        self.inner, self.marker, self.bad, self.sleep = inner, marker, bad, sleep

    def device_key(self):
        return self.inner.device_key()

    def context(self):
        return self.inner.context()

    def measure(self, family, pairs):
        if self.marker and not os.path.exists(self.marker):
            Path(self.marker).write_text("crashed")
            os._exit(1)
        if self.bad and any(c.key() == self.bad for c, _ in pairs):
            if self.sleep:
                time.sleep(self.sleep)
            else:
                os._exit(1)
        return self.inner.measure(family, pairs)


# --- the tests ----------------------------------------------------------------------------------------

def test_ray_search_matches_one_process_for_the_same_seed(ray_session, table, tmp_path):
    for spec in (MeasurerSpec("analytic", target="sm_90", dtype="float16"), MeasurerSpec("replay", path=str(table))):
        local = _tune(CachingMeasurer(spec.build(), Database(tmp_path / f"{spec.kind}-local.db")))
        with _executor(chunk=3) as executor:
            measurer = executor.measurer(spec)
            assert measurer.device_key() == spec.build().device_key()
            remote = _tune(CachingMeasurer(measurer, Database(tmp_path / f"{spec.kind}-ray.db")))
            bar = executor.progress  # the cluster's bar counted every measurement and task
            assert bar.measurements == bar.items == 48 and bar.done == bar.sent >= 48 // 3 and bar.failed == 0
        _same(local, remote)
        assert len(remote.measurements) == 48
    with _executor() as executor:  # vendor rows travel too; an analytic measurer's refusal stays an error
        problems = [p for p, _ in PROBLEMS]
        got = executor.measurer(MeasurerSpec("replay", path=str(table))).measure_vendor(FAMILY, problems)
        assert got == MeasurerSpec("replay", path=str(table)).build().measure_vendor(FAMILY, problems)
        with pytest.raises(DietcodeError, match="no vendor timings"):
            executor.measurer(MeasurerSpec("analytic")).measure_vendor(FAMILY, problems)


def test_optimize_with_ray_writes_the_same_bundles(ray_session, tmp_path):
    import onnx

    from dietcode_ort.bundle import node_bundles

    src = tmp_path / "mlp.onnx"
    models.save_model(models.build("mlp", "tiny"), src)
    bundles = []
    for name, ray in (("local", None), ("ray", "auto")):
        out = tmp_path / f"{name}.onnx"
        options = OptimizeOptions(dims=("tokens=1:16",), budget=32, measure="analytic", db=tmp_path / f"{name}.db",
                                  cache_dir=tmp_path / f"kernels-{name}", progress=False, ray=ray)
        report = optimize(src, out, options, log=lambda _: None)
        assert report.rewritten
        bundles.append([b.payload for b in node_bundles(onnx.load(str(out)))])
        assert Database(tmp_path / f"{name}.db").count() > 0
    assert bundles[0] == bundles[1] and bundles[0]  # compiled on workers, chosen from worker measurements
    assert any((tmp_path / "kernels-ray").glob("*.json"))  # the workers compiled them
    assert ray_session.is_initialized()  # a session it did not start is left running


def test_worker_killed_once_is_retried(ray_session, table, tmp_path):
    spec = CrashOnce(MeasurerSpec("replay", path=str(table)), str(tmp_path / "crashed"))
    pairs = [(c, p) for c in SPACE[:6] for p, _ in PROBLEMS[:2]]
    with _executor(max_retries=1, chunk=4) as executor:
        got = executor.measurer(spec).measure(FAMILY, pairs)
    assert (tmp_path / "crashed").exists()  # a worker did die
    assert got == spec.inner.build().measure(FAMILY, pairs)


def test_kernel_that_always_kills_its_worker_is_a_failed_measurement(ray_session, table, tmp_path):
    bad = SPACE[2]
    spec = Faulty(MeasurerSpec("replay", path=str(table)), bad.key())
    pairs = [(c, PROBLEMS[0][0]) for c in SPACE[:4]]
    db = Database(tmp_path / "t.db")
    with _executor(max_retries=1, chunk=4) as executor:
        got = CachingMeasurer(executor.measurer(spec), db).measure(FAMILY, pairs)
    want = spec.inner.build().measure(FAMILY, pairs)
    assert [g for c, g in zip(SPACE, got) if c != bad] == [w for c, w in zip(SPACE, want) if c != bad]
    failed = got[2]
    assert failed.seconds == np.inf and "worker died" in failed.error
    stored = db.get(spec.inner.build().device_key(), FAMILY, pairs)
    assert len(stored) == 4 and any(r.error and "worker died" in r.error for r in stored.values())


def test_task_past_its_time_limit_is_a_failed_measurement(ray_session, table):
    bad = SPACE[1]
    spec = Faulty(MeasurerSpec("replay", path=str(table)), bad.key(), sleep=120.0)
    pairs = [(c, PROBLEMS[1][0]) for c in SPACE[:3]]
    started = time.monotonic()
    with _executor(chunk=1, measure_timeout_s=8.0) as executor:
        got = executor.measurer(spec).measure(FAMILY, pairs)
    assert time.monotonic() - started < 60
    assert got[1].seconds == np.inf and "timed out after 8s" in got[1].error
    assert [got[0], got[2]] == [w for i, w in enumerate(spec.inner.build().measure(FAMILY, pairs)) if i != 1]


class _InterruptingDatabase(Database):
    """Stores ``parts`` batches, then the driver is interrupted (as by Ctrl-C) right after a write."""

    def __init__(self, path, parts: int) -> None:
        super().__init__(path)
        self.parts = parts

    def put(self, *args, **kw) -> None:
        super().put(*args, **kw)
        self.parts -= 1
        if self.parts == 0:
            raise KeyboardInterrupt


def test_interrupted_run_resumes_from_the_database(ray_session, table, tmp_path):
    spec = MeasurerSpec("replay", path=str(table))
    reference = _tune(CachingMeasurer(spec.build(), Database(tmp_path / "ref.db")))
    with _executor(chunk=2) as executor:
        with pytest.raises(KeyboardInterrupt):
            _tune(CachingMeasurer(executor.measurer(spec), _InterruptingDatabase(tmp_path / "t.db", parts=10)))
        stored = Database(tmp_path / "t.db").count()
        assert stored == 20  # ten parts of two, each written as it finished
        resumed = CachingMeasurer(executor.measurer(spec), Database(tmp_path / "t.db"))
        result = _tune(resumed)
    _same(reference, result)
    assert resumed.hits == stored and resumed.misses == 48 - stored  # nothing measured twice, nothing lost
    device = spec.build().device_key()
    assert Database(tmp_path / "t.db").rows(device, FAMILY) == Database(tmp_path / "ref.db").rows(device, FAMILY)


def test_gpu_measurements_need_the_gpu_model_on_the_cluster(ray_session):
    with _executor(gpu_model="A100") as executor:
        assert not executor.gpu_available()
        with pytest.raises(DietcodeError, match="no live node with a A100 GPU.*H100"):
            executor.measurer(MeasurerSpec("gpu")).measure(FAMILY, [(SPACE[0], PROBLEMS[0][0])])
    with _executor() as executor:
        assert executor.gpu_available() and executor.model_gpus() == 2


def test_ray_option_without_ray_installed_names_the_extra(tmp_path):
    src = tmp_path / "mlp.onnx"
    models.save_model(models.build("mlp", "tiny"), src)
    code = ("import sys; sys.modules['ray'] = None\n"  # import ray fails as if it were not installed
            "from dietcode_ort.cli import main\n"
            f"sys.exit(main(['optimize', {str(src)!r}, '-o', {str(tmp_path / 'o.onnx')!r}, '--dim', "
            f"'tokens=1:4', '--measure', 'analytic', '--db', {str(tmp_path / 't.db')!r}, '--ray', 'auto']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "pip install 'dietcode-ort[distributed]'" in out.stderr
    assert not (tmp_path / "o.onnx").exists()
    with pytest.raises(DietcodeError, match="--ray-gpu applies only with --ray"):
        optimize(src, tmp_path / "o.onnx", OptimizeOptions(dims=("tokens=1:4",), measure="analytic",
                                                            ray_gpu="A100", progress=False), log=lambda _: None)


def test_compile_past_its_time_limit_is_a_failed_compile(ray_session, tmp_path):
    from tuner.aot import CompileJob

    jobs = [CompileJob(FAMILY, c, cache_dir=tmp_path) for c in SPACE[:2]]
    with _executor(compile_timeout_s=0.3) as executor:  # far less than a worker takes to import Triton
        results = executor.compile_many(jobs)
    assert [r.job for r in results] == jobs
    assert all(not r.ok and r.error == "timed out after 0.3s" for r in results)
    assert not list(tmp_path.glob("*.json"))


def test_interrupt_stops_the_searches_running_at_once(ray_session, tmp_path, monkeypatch):
    import tuner.optimize as optimize_module

    src = tmp_path / "mlp.onnx"
    models.save_model(models.build("mlp", "tiny"), src)
    real, started = optimize_module._tune, []

    def tune(w, problems, options, log, executor):
        started.append(w.n)
        assert executor.searches() == 2  # both workloads are tuned at once
        if w.n == "64":  # Ctrl-C reaches the run while the other search is measuring
            time.sleep(3.0)
            raise KeyboardInterrupt
        return real(w, problems, options, log, executor)

    monkeypatch.setattr(optimize_module, "_tune", tune)
    options = OptimizeOptions(dims=("tokens=1:64",), budget=20000, measure="analytic", db=tmp_path / "t.db",
                              cache_dir=tmp_path / "kernels", progress=False, ray="auto")
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        optimize(src, tmp_path / "o.onnx", options, log=lambda _: None)
    assert sorted(started) == ["176", "64"] and time.monotonic() - began < 60
    stored = Database(tmp_path / "t.db").count()
    assert 0 < stored < 20000  # the other search measured, was stopped, and kept what it had
    assert not (tmp_path / "o.onnx").exists()


def test_attention_compile_jobs_run_as_ray_tasks(ray_session):
    """Attention kernels compile on the cluster like GEMM kernels (optimize --ray hands tune_sites its
    executor): the worker's cubin is the one this machine compiles."""
    from tuner.attention import AttentionCompileJob, AttentionConfig

    jobs = [AttentionCompileJob(AttentionConfig(64, 32, 4, 2), "float16", "sm_90", 64, 0.125, True, False),
            AttentionCompileJob(AttentionConfig(16, 16, 2, 1), "float32", "sm_80", 32, 0.5, False, causal=True)]
    with _executor() as executor:
        results = executor.compile_many(jobs)
    assert [r.job for r in results] == jobs and all(r.ok for r in results), [r.error for r in results]
    assert [r.kernel.cubin for r in results] == [j.compile().cubin for j in jobs]


def test_attention_timings_run_as_ray_gpu_tasks(ray_session, tmp_path, monkeypatch):
    """optimize --ray --measure gpu: attention configs are timed where the executor measures (GPU tasks of the
    cluster's GPU model), so a driver without a GPU still tunes them from timings, not the analytic cost; the
    timings go to the driver's database, and a rerun takes them from there."""
    from tuner import attention_tune
    from tuner.attention_graph import AttentionSite
    from tuner.executor import LocalExecutor

    monkeypatch.setattr(LocalExecutor, "gpu_available", lambda self: False)  # the driver has none
    site = AttentionSite(("s",), "q", "kt", "v", None, "y", 0.125, 64, "float32", 3, seq_q="seq", seq_k="seq",
                         batch="4")

    def run(executor) -> list[str]:
        logs: list[str] = []
        attention_tune.tune_sites([((site,), ("seq",), ("seq=16:32:16",), None, {})], ["sm_90"], max_kernels=2,
                                  seed=0, min_driver=13000, ptxas=None, measure="gpu", budget=2, log=logs.append,
                                  db=tmp_path / "t.db", backend="_fake_timing:FakeBackend", executor=executor)
        return logs

    assert any("analytic attention cost: this machine has no GPU" in line for line in run(None))
    with _executor() as executor:
        first, second = run(executor), run(executor)
    assert any("costed with gpu (aot cubin) (0 of 4 timings from the database)" in line for line in first), first
    assert any("(4 of 4 timings from the database)" in line for line in second), second
