"""optimize interrupted while it compiles kernels: SIGKILL and SIGTERM leave no compile worker running,
SIGINT (Ctrl-C, sent to the process group as a terminal does) stops within seconds; nothing half-written
is left, and a rerun on the same database gives the result of an uninterrupted run.

psutil is not a dependency: processes are found through /proc.
"""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest

from _bad_models import ROOT, save, varied_model

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"  # a zombie has exited; only its reaping is pending


def _start(work: Path, out: Path, db: Path, cache: Path) -> subprocess.Popen[str]:
    """optimize in its own process group; output goes to files (a surviving worker would hold a pipe open
    and make reading it hang). ``_stderr(proc)`` reads what it printed."""
    scratch = _scratch(out)  # its temporary files: none may be left there, however it ends
    scratch.mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), DIETCODE_CACHE=str(cache), TMPDIR=str(scratch))
    log = out.with_suffix(".log")
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dietcode_ort", "optimize", str(work / "wide.onnx"), "-o", str(out),
             "--dim", "n=1:16", "--measure", "analytic", "--budget", "8", "--quiet", "--db", str(db)],
            env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=sink, start_new_session=True)
    proc.log = log  # type: ignore[attr-defined]
    return proc


def _scratch(out: Path) -> Path:
    return out.with_suffix(".tmpdir")


def _left(out: Path) -> list[str]:
    """What the run left in its temporary folder, but for onnxruntime's own session id file (``.ses``)."""
    return [p.name for p in _scratch(out).iterdir() if p.name != ".ses"]


def _stderr(proc: subprocess.Popen[str]) -> str:
    return proc.log.read_text()  # type: ignore[attr-defined]


def _kill_survivors(pids: list[int]) -> None:
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _workers(pid: int) -> list[int]:
    """Forked compile workers: children running the parent's own command line (not e.g. a ptxas)."""
    own = _cmdline(pid)
    return [c for c in _children(pid) if own and _cmdline(c) == own]


def _wait_for_workers(proc: subprocess.Popen[str], timeout: float = 180) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _workers(proc.pid):
            time.sleep(0.5)  # let the pool start all of them
            workers = _workers(proc.pid)
            if workers:
                return workers
        if proc.poll() is not None:
            pytest.fail(f"optimize ended before compiling: {_stderr(proc)}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail("no compile worker appeared")


def _gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("interrupt")
    save(varied_model(6), folder / "wide.onnx")  # six workloads, six distinct kernels to compile
    return folder


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_optimize_leaves_no_worker(work, reference, sig):
    out, db = work / f"killed{sig}.onnx", work / f"db{sig}.db"
    proc = _start(work, out, db, work / f"cache{sig}")
    workers = _wait_for_workers(proc)
    assert workers
    os.kill(proc.pid, sig)
    code = proc.wait(timeout=30)
    if sig == signal.SIGTERM:  # handled: cleanup runs (the workers' Triton folders included) and the exit says why
        assert code == 143 and "terminated" in _stderr(proc) and "Traceback" not in _stderr(proc), _stderr(proc)
        assert "Exception ignored" not in _stderr(proc) and not _left(out)
    try:
        assert _gone(workers, 10), f"compile workers still running after {sig.name}: {workers}"
    finally:
        _kill_survivors(workers)
    assert not out.exists() and not [p for p in work.iterdir() if p.name.startswith(f".{out.name}")]
    if sig == signal.SIGKILL:  # even after SIGKILL the database is intact and the rerun resumes from it
        measured = _rows(db)
        proc = _start(work, out, db, work / f"cache{sig}")
        assert proc.wait(timeout=300) == 0, _stderr(proc)
        assert _rows(db) == measured > 0 and _bundles(out) == _bundles(reference)
        assert not _left(out)  # the killed run's compile folder went with the rerun


@pytest.fixture(scope="module")
def reference(work: Path) -> Path:
    out = work / "reference.onnx"
    proc = _start(work, out, work / "reference.db", work / "reference-cache")
    assert proc.wait(timeout=300) == 0, _stderr(proc)
    return out


def _rows(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return int(conn.execute("SELECT count(*) FROM measurements").fetchone()[0])


def _bundles(path: Path) -> list[tuple[str, bytes]]:
    from dietcode_ort.bundle import node_bundles

    model = onnx.load(str(path))
    return [(n.name, b.payload) for n, b in zip([n for n in model.graph.node if n.domain == "ai.dietcode"],
                                                node_bundles(model))]


@pytest.mark.parametrize("to", ["group", "parent"])
def test_sigint_stops_within_seconds_and_rerun_resumes(work, reference, to):
    """SIGINT to the process group (a terminal's Ctrl-C) or to optimize alone (kill -INT): it stops at once
    instead of finishing the queued compiles, and a rerun on its database gives the uninterrupted result."""
    out, db = work / f"interrupted-{to}.onnx", work / f"interrupted-{to}.db"
    proc = _start(work, out, db, work / f"interrupted-{to}-cache")
    workers = _wait_for_workers(proc)
    started = time.monotonic()
    if to == "group":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(proc.pid, signal.SIGINT)
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _kill_survivors(workers)
        pytest.fail("optimize did not stop within 30 s of SIGINT")
    took = time.monotonic() - started
    try:
        assert _gone(workers, 5), "compile workers survived SIGINT"
    finally:
        _kill_survivors(workers)
    err = _stderr(proc)
    assert code == 130 and "interrupted" in err and "Traceback" not in err and "Exception ignored" not in err, err
    assert not _left(out)  # no Triton working folder or ptxas file of the killed workers
    assert took < 5, f"SIGINT took {took:.1f} s"
    assert not out.exists() and not [p for p in work.iterdir() if p.name.startswith(f".{out.name}")]

    measured = _rows(db)
    assert measured > 0  # tuning was done and stored before the compile was interrupted
    proc = _start(work, out, db, work / f"interrupted-{to}-cache")  # rerun: measurements from the database
    assert proc.wait(timeout=300) == 0, _stderr(proc)
    assert _rows(db) == measured  # nothing measured again
    assert len(_bundles(out)) == 6 and _bundles(out) == _bundles(reference)


def test_ctrl_c_after_the_command_is_done_prints_no_traceback(tmp_path: Path) -> None:
    """A SIGINT that arrives while exit handlers run (torch's take a second after a large optimize) is ignored
    by the console entry point: the command's own status, and no KeyboardInterrupt traceback over its output."""
    script = ("import atexit, os, signal, sys, time\n"
              "from dietcode_ort.cli import console\n"
              "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.3)))\n"
              "sys.argv = ['dietcode-ort'] + sys.argv[1:]\n"
              "sys.exit(console())\n")
    for argv, status, says in ((["--version"], 0, "dietcode-ort 0."), (["inspect", "missing.onnx"], 2, "error:")):
        res = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=tmp_path)
        assert res.returncode == status and says in res.stdout + res.stderr, res
        assert "KeyboardInterrupt" not in res.stderr and "Traceback" not in res.stderr, res.stderr


@pytest.mark.parametrize("sig, status, says", [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")])
def test_a_signal_whose_raise_is_swallowed_still_stops_the_command(tmp_path, monkeypatch, capsys, sig, status, says):
    """A signal handled while Python runs a callback whose exceptions it ignores (the at-fork hooks logging
    registers, run as the compile pool forks its workers) loses its raise: optimize went on, wrote its output and
    exited 0. The handler records the stop first, and the command stops before it writes anything."""
    from dietcode_ort import cli
    from tuner import optimize as opt

    src = save(varied_model(1), tmp_path / "m.onnx")
    real = opt._compile_all

    def signalled_in_a_callback(*args, **kwargs):
        handler = signal.getsignal(sig)
        assert callable(handler) and handler is not signal.default_int_handler
        try:
            handler(sig, None)  # as the signal would run it, inside a callback that swallows what it raises
        except BaseException:  # noqa: BLE001 - what Python does with an at-fork hook's exception
            pass
        return real(*args, **kwargs)

    monkeypatch.setattr(opt, "_compile_all", signalled_in_a_callback)
    out = tmp_path / "out.onnx"
    code = cli.main(["optimize", str(src), "-o", str(out), "--dim", "n=1:8", "--measure", "analytic", "--budget", "4",
                     "--quiet", "--db", str(tmp_path / "t.db"), "--cache-dir", str(tmp_path / "k")])
    assert code == status and says in capsys.readouterr().err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out.onnx")]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # main put the handlers back
    monkeypatch.setattr(opt, "_compile_all", real)  # and the next command in this process is not stopped by it
    assert cli.main(["optimize", str(src), "-o", str(out), "--dim", "n=1:8", "--measure", "analytic", "--budget", "4",
                     "--quiet", "--db", str(tmp_path / "t.db"), "--cache-dir", str(tmp_path / "k")]) == 0
