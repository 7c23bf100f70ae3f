"""Measurement database: device separation, resume after SIGKILL, clear errors on bad files."""
from __future__ import annotations

import math
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dietcode_ort.errors import DietcodeError
from tuner.database import CachingMeasurer, Database
from tuner.measure import MeasureResult, Measurer
from tuner.space import Family, MicroKernel
from tuner.workload import Problem

FAMILY = Family("gemm", "float16", "sm_90")
PAIRS = [(MicroKernel(64, 64, 32, 4, 3), Problem(16, 768, 768)), (MicroKernel(32, 64, 64, 4, 2), Problem(32, 768, 768))]
ROOT = Path(__file__).resolve().parents[1]


class Counting(Measurer):
    def __init__(self, device: str) -> None:
        self.device, self.calls = device, 0

    def device_key(self) -> str:
        return self.device

    def measure(self, family, pairs):
        self.calls += len(pairs)
        return [MeasureResult(1e-6 * (c.block_m + p.m)) if c.block_m != 32 else MeasureResult(math.inf, "boom")
                for c, p in pairs]


def test_rows_are_separated_by_device(tmp_path):
    with Database(tmp_path / "m.db") as db:
        db.put("gpu-a", FAMILY, PAIRS, [MeasureResult(1.0), MeasureResult(2.0)])
        db.put("gpu-b", FAMILY, PAIRS[:1], [MeasureResult(9.0)])
        a, b = db.get("gpu-a", FAMILY, PAIRS), db.get("gpu-b", FAMILY, PAIRS)
        assert sorted(r.seconds for r in a.values()) == [1.0, 2.0]
        assert [r.seconds for r in b.values()] == [9.0]
        assert db.get("gpu-c", FAMILY, PAIRS) == {}
        assert db.get("gpu-a", Family("gemm", "float32", "sm_90"), PAIRS) == {}
        assert db.devices() == ["gpu-a", "gpu-b"]


def test_caching_measurer_measures_only_missing_and_keeps_failures(tmp_path):
    db = Database(tmp_path / "m.db")
    inner = Counting("gpu-a")
    cached = CachingMeasurer(inner, db)
    first = cached.measure(FAMILY, PAIRS)
    assert inner.calls == 2 and first[1].seconds == math.inf and first[1].error == "boom"
    again = CachingMeasurer(Counting("gpu-a"), Database(tmp_path / "m.db"))
    assert again.measure(FAMILY, PAIRS) == first and again.inner.calls == 0  # type: ignore[attr-defined]
    other = CachingMeasurer(Counting("gpu-b"), Database(tmp_path / "m.db"))
    other.measure(FAMILY, PAIRS)
    assert other.inner.calls == 2  # type: ignore[attr-defined]


class WithContext(Counting):
    def __init__(self, device: str, context: str) -> None:
        super().__init__(device)
        self._ctx = context

    def context(self) -> str:
        return self._ctx


def test_rows_are_separated_by_kernel_context(tmp_path):
    # the same family and problems timed with another epilogue / conv geometry must not be reused
    relu = CachingMeasurer(WithContext("gpu-a", "bias=1;act=relu"), Database(tmp_path / "m.db"))
    relu.measure(FAMILY, PAIRS)
    gelu_inner = WithContext("gpu-a", "bias=1;act=gelu")
    CachingMeasurer(gelu_inner, Database(tmp_path / "m.db")).measure(FAMILY, PAIRS)
    assert gelu_inner.calls == len(PAIRS)
    relu_again = WithContext("gpu-a", "bias=1;act=relu")
    CachingMeasurer(relu_again, Database(tmp_path / "m.db")).measure(FAMILY, PAIRS)
    assert relu_again.calls == 0


class WithVendor(Counting):
    def measure_vendor(self, family, problems):
        self.calls += len(problems)
        return [MeasureResult(2e-6 * p.m) for p in problems]


def test_vendor_timings_are_cached_too(tmp_path):
    problems = [p for _, p in PAIRS]
    first = WithVendor("gpu-a")
    want = CachingMeasurer(first, Database(tmp_path / "m.db")).measure_vendor(FAMILY, problems)
    again = WithVendor("gpu-a")
    got = CachingMeasurer(again, Database(tmp_path / "m.db")).measure_vendor(FAMILY, problems)
    assert (first.calls, again.calls) == (2, 0) and got == want
    # vendor rows never answer for a kernel, nor kernel rows for the vendor
    kernels = WithVendor("gpu-a")
    CachingMeasurer(kernels, Database(tmp_path / "m.db")).measure(FAMILY, PAIRS)
    assert kernels.calls == len(PAIRS)


def test_corrupt_file_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.db"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(DietcodeError, match="corrupt"):
        Database(path)


def test_another_layout_is_refused_at_open(tmp_path):
    """A measurements table of other columns (a foreign database, a hand-edited one) or a newer layout is refused
    when the file is opened, not at the first write minutes into a run; a file made before the layout was marked
    (user_version 0) is marked, and a read-only one still opens."""
    from tuner.database import SCHEMA_VERSION

    path = tmp_path / "m.db"
    with Database(path):
        pass
    conn = sqlite3.connect(str(path))
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.commit()
    with pytest.raises(DietcodeError, match=f"has layout {SCHEMA_VERSION + 1}, this dietcode-ort knows"):
        Database(path)
    conn.execute("PRAGMA user_version = 0")
    conn.commit()
    conn.close()
    path.chmod(0o444)
    try:
        Database(path).close()  # not marked (read-only), but it serves what it holds
    finally:
        path.chmod(0o644)
    with Database(path):
        pass
    assert sqlite3.connect(str(path)).execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    foreign = tmp_path / "foreign.db"
    conn = sqlite3.connect(str(foreign))
    conn.execute("CREATE TABLE measurements (device TEXT, seconds REAL)")
    conn.close()
    with pytest.raises(DietcodeError, match="other columns \\(device, seconds\\): not one dietcode-ort wrote"):
        Database(foreign)


def test_locked_file_is_a_clear_error(tmp_path):
    path = tmp_path / "m.db"
    Database(path).close()
    holder = sqlite3.connect(str(path), isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(DietcodeError, match="locked"):
            db = Database(path, timeout_s=0.2)
            db.put("gpu-a", FAMILY, PAIRS, [MeasureResult(1.0), MeasureResult(2.0)])
    finally:
        holder.execute("ROLLBACK")
        holder.close()


_RUN = textwrap.dedent("""
    import sys, time
    from tuner.database import CachingMeasurer, Database
    from tuner.hardware import get_profile
    from tuner.measure import ReplayMeasurer
    from tuner.search import SearchOptions, tune_joint
    from tuner.space import Family, MicroKernel
    from tuner.workload import Problem

    class Slow(ReplayMeasurer):
        def measure(self, family, pairs):
            time.sleep(float(sys.argv[3]))
            return super().measure(family, pairs)

    family = Family("gemm", "float16", "sm_90")
    table, db_path = sys.argv[1], sys.argv[2]
    configs = [MicroKernel.from_key(line) for line in open(sys.argv[4]).read().split()]
    problems = [(Problem(16 * t, 768, 768), 1.0) for t in range(1, 9)]
    measurer = CachingMeasurer(Slow(table), Database(db_path))
    result = tune_joint(family, problems, configs, measurer, get_profile("sm_90"),
                        SearchOptions(max_trials=96, round_size=16, progress=False, seed=5))
    print("CHOICE", " ".join(c.key() for c in result.choice))
    print("MEASURED", len(result.measurements))
""")


def test_run_killed_with_sigkill_resumes_with_same_choice(tmp_path):
    from tuner.hardware import get_profile
    from tuner.simulate import bert_dense_case
    from tuner.space import enumerate_space

    case = bert_dense_case(tmp_path, get_profile("sm_90"), enumerate_space(FAMILY), n_configs=60,
                           t_values=range(1, 9))
    configs = tmp_path / "configs.txt"
    configs.write_text("\n".join(c.key() for c in case.configs))
    script = tmp_path / "run.py"
    script.write_text(_RUN)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def run(db: Path, delay: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(script), str(case.path), str(db), delay, str(configs)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    # reference: one uninterrupted run
    ref = run(tmp_path / "ref.db", "0")
    ref_out, ref_err = ref.communicate(timeout=120)
    assert ref.returncode == 0, ref_err
    # killed run: wait until at least two batches are committed, then SIGKILL it mid-run
    killed_db = tmp_path / "killed.db"
    proc = run(killed_db, "0.4")
    deadline = time.time() + 90
    rows_at_kill = 0
    while time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
        if killed_db.exists():
            try:
                conn = sqlite3.connect(str(killed_db), timeout=1)
                rows_at_kill = conn.execute("SELECT count(*) FROM measurements").fetchone()[0]
                conn.close()
            except sqlite3.Error:
                continue
            if rows_at_kill >= 32:
                proc.send_signal(signal.SIGKILL)
                break
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert 0 < rows_at_kill < 96
    after_kill = Database(killed_db).count()
    assert after_kill >= rows_at_kill and after_kill % 16 == 0  # whole batches only
    resumed = run(killed_db, "0")
    out, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, err
    choice = [line for line in out.splitlines() if line.startswith("CHOICE")]
    assert choice == [line for line in ref_out.splitlines() if line.startswith("CHOICE")]
    assert Database(killed_db).rows("", FAMILY) == {}
    ref_rows = Database(tmp_path / "ref.db").rows(ReplayMeasurerDevice(case.path), FAMILY)
    killed_rows = Database(killed_db).rows(ReplayMeasurerDevice(case.path), FAMILY)
    measured = [int(line.split()[1]) for line in ref_out.splitlines() if line.startswith("MEASURED")]
    # the search may stop before its 96 trials once no candidate is predicted to gain (patience)
    assert killed_rows == ref_rows and measured == [len(ref_rows)] and rows_at_kill < len(ref_rows) <= 96


def ReplayMeasurerDevice(path: Path) -> str:  # noqa: N802 (reads like the measurer it mirrors)
    from tuner.measure import ReplayMeasurer

    return ReplayMeasurer(path).device_key()


def test_busy_answers_sqlite_gives_without_waiting_are_retried(tmp_path):
    """SQLite returns SQLITE_BUSY at once (no busy handler) in some two-process WAL cases, e.g. while the
    other process switches a new file to WAL: such a step is retried until the timeout, other errors are not."""
    db = Database(tmp_path / "m.db", timeout_s=2.0)
    answers = [sqlite3.OperationalError("database is locked"), sqlite3.OperationalError("database is busy"), None]
    calls = []

    def step():
        calls.append(1)
        answer = answers[len(calls) - 1]
        if answer is not None:
            raise answer

    db._retry_busy(step)
    assert len(calls) == 3
    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        db._retry_busy(lambda: (calls.append(1), db._conn.execute("SELECT * FROM nowhere")))
    assert len(calls) == 4  # not retried
    db.timeout_s = 0.05
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        db._retry_busy(lambda: (_ for _ in ()).throw(sqlite3.OperationalError("database is locked")))
    db.close()
