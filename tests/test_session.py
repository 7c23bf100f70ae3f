"""dietcode_ort.InferenceSession: registration is idempotent per SessionOptions, and the library is
registered only for a GPU provider ORT can really start (a listed but unloadable CUDA provider makes ORT
fall back to the CPU, where the fallback functions beat the library's CPU kernel)."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import dietcode_ort
from dietcode_ort import runtime
from dietcode_ort.cli import main
from dietcode_ort.errors import DietcodeError


@pytest.fixture(scope="module")
def optimized(tmp_path_factory: pytest.TempPathFactory):
    from _bad_models import matmul_model, save
    from tuner.optimize import OptimizeOptions, optimize

    work = tmp_path_factory.mktemp("session")
    src = save(matmul_model(), work / "tiny.onnx")
    out = work / "tiny.opt.onnx"
    optimize(src, out, OptimizeOptions(dims=("n=1:16",), measure="analytic", budget=8, db=work / "t.db",
                                       cache_dir=work / "kernels", progress=False), log=lambda _: None)
    return src, out


def _check(sess, src) -> None:
    x = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)
    want = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=1e-4, atol=1e-4)


def test_registered_options_can_be_passed(optimized):
    src, out = optimized
    so = ort.SessionOptions()
    dietcode_ort.register(so)
    dietcode_ort.register(so)  # a second call is a no-op, not "Domain already set in registry"
    _check(dietcode_ort.InferenceSession(out, so, providers=["CPUExecutionProvider"]), src)
    _check(ort.InferenceSession(str(out), so, providers=["CPUExecutionProvider"]), src)


def test_options_reused_for_a_second_session(optimized, monkeypatch):
    src, out = optimized
    monkeypatch.setattr(runtime, "library_needed", lambda providers: True)  # as on a GPU session
    so = ort.SessionOptions()
    first = dietcode_ort.InferenceSession(out, so, providers=["CPUExecutionProvider"])
    second = dietcode_ort.InferenceSession(out, so, providers=["CPUExecutionProvider"])
    _check(first, src)
    _check(second, src)


def test_unusable_gpu_provider_is_not_trusted(optimized, monkeypatch):
    """CUDA listed, but the provider cannot start: no library, CPU provider, fallback functions."""
    src, out = optimized
    registered = []
    monkeypatch.setattr(runtime, "register", lambda so, build=True: registered.append(so))
    monkeypatch.setattr(runtime, "provider_usable", lambda p: (p[0] if isinstance(p, tuple) else p)
                        == "CPUExecutionProvider")
    sess = dietcode_ort.InferenceSession(out, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert sess.get_providers() == ["CPUExecutionProvider"] and not registered
    _check(sess, src)
    sess = dietcode_ort.InferenceSession(out)
    assert sess.get_providers() == ["CPUExecutionProvider"] and not registered



def test_provider_options_follow_the_providers_kept(optimized, monkeypatch, capsys):
    """ORT's provider_options list runs parallel to providers: the entries of the providers dropped as unusable
    are dropped with them (else ORT refuses the lengths, prints an EP error and retries on the CPU alone, which
    on a GPU machine with an unusable TensorRT listed first loses the GPU)."""
    src, out = optimized
    usable = runtime.provider_usable
    monkeypatch.setattr(runtime, "provider_usable", lambda p: (p[0] if isinstance(p, tuple) else p)
                        == "CPUExecutionProvider")
    passed = []
    real = ort.InferenceSession

    def spy(model, sess_options=None, providers=None, **kwargs):
        passed.append((providers, kwargs.get("provider_options")))
        return real(model, sess_options=sess_options, providers=providers, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", spy)
    sess = dietcode_ort.InferenceSession(out, providers=["CUDAExecutionProvider", "CPUExecutionProvider"],
                                         provider_options=[{"device_id": "0"}, {"arena_extend_strategy": "kSameAsRequested"}])
    assert passed == [(["CPUExecutionProvider"], [{"arena_extend_strategy": "kSameAsRequested"}])]
    assert "EP Error" not in capsys.readouterr().out
    _check(sess, src)
    passed.clear()
    dietcode_ort.InferenceSession(out, providers=["CUDAExecutionProvider"], provider_options=[{"device_id": "0"}])
    assert passed == [(["CPUExecutionProvider"], [{}])]
    if "CUDAExecutionProvider" in ort.get_available_providers() and not usable("CUDAExecutionProvider"):
        # a probe fooled into keeping CUDA: the session rebuilt on the CPU keeps the CPU provider's entry
        monkeypatch.setattr(runtime, "provider_usable", lambda p: True)
        passed.clear()
        _check(dietcode_ort.InferenceSession(out, providers=["CUDAExecutionProvider", "CPUExecutionProvider"],
                                             provider_options=[{"device_id": "0"}, {"arena_extend_strategy": "kSameAsRequested"}]), src)
        assert passed[1] == (["CPUExecutionProvider"], [{"arena_extend_strategy": "kSameAsRequested"}])  # [2]: _check's
        assert "EP Error" not in capsys.readouterr().out



def test_options_carrying_the_library_registered_by_hand(optimized):
    """Options on which the library was registered with ORT's own register_custom_ops_library (not through
    dietcode_ort.register) cannot take it a second time: when the session needs it, the error says so and what
    to do instead of ORT's "Domain already set in registry"."""
    import onnx

    src, out = optimized
    model = onnx.load(str(out))
    del model.functions[:]  # no fallback: the library is needed on the CPU too
    def by_hand() -> ort.SessionOptions:
        so = ort.SessionOptions()
        so.register_custom_ops_library(str(dietcode_ort.library_path()))
        return so

    with pytest.raises(DietcodeError, match="already carry a custom-op library with the ai.dietcode "
                                            "domain.*dietcode_ort.register"):
        dietcode_ort.InferenceSession(model, by_hand(), providers=["CPUExecutionProvider"])
    _check(ort.InferenceSession(model.SerializeToString(), by_hand(), providers=["CPUExecutionProvider"]), src)


@pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers(),
                    reason="onnxruntime without the CUDA provider")
def test_provider_usable_matches_a_real_session():
    probe = ort.InferenceSession(_identity(), providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert runtime.provider_usable("CUDAExecutionProvider") == ("CUDAExecutionProvider" in probe.get_providers())
    assert runtime.provider_usable("CPUExecutionProvider")
    assert not runtime.provider_usable("NoSuchExecutionProvider")


def test_provider_probe_prints_nothing(tmp_path):
    """Whether CUDA is usable is the probe's answer, not an error for the user: a listed CUDA provider whose
    libraries do not load made ORT's default logger print a red ERROR and a WARNING on stderr at every
    first dietcode_ort.InferenceSession of a process on a CPU-only machine."""
    import os
    import subprocess
    import sys

    from _bad_models import ROOT

    code = ("import sys; from dietcode_ort import runtime; "
            "print(runtime.provider_usable('CUDAExecutionProvider')); "
            "print('after', file=sys.stderr)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() in ("True", "False")
    assert run.stderr == "after\n"  # nothing from the probe, and stderr still works after it


def test_doctor_tells_listed_from_usable(capsys, monkeypatch):
    from dietcode_ort import doctor

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(runtime, "provider_usable", lambda p: False)
    check = doctor.cuda_provider_check()
    assert check.status == "warn" and "listed but cannot be used" in check.detail
    monkeypatch.setattr(runtime, "provider_usable", lambda p: True)
    assert doctor.cuda_provider_check().status == "ok"
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert "not in this onnxruntime build" in doctor.cuda_provider_check().detail
    assert main(["doctor", "--no-build"]) in (0, 1)
    assert "CUDA provider" in capsys.readouterr().out


def _identity() -> bytes:
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8).SerializeToString()


def _has_library(sess) -> bool:
    try:
        return bool(sess.get_session_options().get_session_config_entry("dietcode_ort.library"))
    except Exception:
        return False


@pytest.mark.skipif("CUDAExecutionProvider" not in ort.get_available_providers()
                    or runtime.provider_usable("CUDAExecutionProvider"),
                    reason="needs onnxruntime listing a CUDA provider it cannot start")
def test_decision_follows_the_providers_the_session_got(optimized, monkeypatch):
    """Even when the probe is fooled, a session that fell back to the CPU is rebuilt without the library."""
    src, out = optimized
    monkeypatch.setattr(runtime, "provider_usable", lambda p: True)
    sess = dietcode_ort.InferenceSession(out, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert sess.get_providers() == ["CPUExecutionProvider"] and not _has_library(sess)
    _check(sess, src)
    so = ort.SessionOptions()
    dietcode_ort.register(so)
    assert _has_library(ort.InferenceSession(str(out), so, providers=["CPUExecutionProvider"]))


def test_a_drop_in_for_onnxruntimes_signature(optimized, caplog):
    """ORT's signature: provider_options fourth, path_or_bytes by keyword; a provider name this onnxruntime does
    not have is left out with a warning (as ORT warns), the session runs on the rest."""
    src, out = optimized
    _check(dietcode_ort.InferenceSession(str(out), None, ["CPUExecutionProvider"], [{}]), src)
    _check(dietcode_ort.InferenceSession(path_or_bytes=out.read_bytes(), providers=["CPUExecutionProvider"]), src)
    sess = dietcode_ort.InferenceSession(out, providers=["CpuExecutionProvidr", "CPUExecutionProvider"])
    assert sess.get_providers() == ["CPUExecutionProvider"] and "CpuExecutionProvidr" in caplog.text
    _check(sess, src)


@pytest.mark.parametrize("kind", ["missing", "folder", "garbage", "bytes"])
def test_an_unreadable_model_is_named(tmp_path, kind):
    """A missing, folder or corrupt model is a DietcodeError naming it (it was protobuf's DecodeError or a bare
    FileNotFoundError), as the CLI's commands name it."""
    model: object = {"missing": tmp_path / "none.onnx", "folder": tmp_path, "garbage": tmp_path / "g.onnx",
                     "bytes": b"\x08\x07garbage"}[kind]
    if kind == "garbage":
        (tmp_path / "g.onnx").write_bytes(b"\xff\xfe not a model")
    want = {"missing": "model file not found", "folder": "is a directory", "garbage": "g.onnx is not a readable ONNX",
            "bytes": "the model bytes are not a readable ONNX"}[kind]
    with pytest.raises(DietcodeError, match=want):
        dietcode_ort.InferenceSession(model, providers=["CPUExecutionProvider"])


def test_a_child_forked_while_another_thread_holds_the_runtimes_locks_can_use_them(optimized):
    """A server forks workers while a monitoring thread is inside ``node_stats()`` (whose first call builds or
    finds the library under a lock): the child must not inherit the held lock and wait for ever."""
    import os
    import signal
    import threading

    src, out = optimized
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with runtime._CORE_LOCK, runtime._USABLE_LOCK:
            held.set()
            release.wait(30)

    runtime.load_core()
    thread = threading.Thread(target=hold)
    thread.start()
    held.wait(10)
    try:
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if the locks are free and a session with the library runs
            code = 1
            try:
                signal.alarm(20)
                runtime._CORE = None  # the first use in this process, as in a child forked before it
                got = runtime._CORE_LOCK.acquire(timeout=5) and runtime._USABLE_LOCK.acquire(timeout=5)
                if got:
                    runtime._CORE_LOCK.release(), runtime._USABLE_LOCK.release()
                    dietcode_ort.node_stats()
                    _check(dietcode_ort.InferenceSession(out, providers=["CPUExecutionProvider"]), src)
                    code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        thread.join()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


def test_a_second_library_in_one_process_is_named(optimized, tmp_path, monkeypatch, caplog):
    """Two copies of the library in one process each count their own calls: a session registered with a copy
    (DIETCODE_ORT_LIBRARY set after the first was loaded) is said to be outside node_stats(), once."""
    import logging
    import shutil

    src, out = optimized
    first = runtime.load_core().path
    copy = shutil.copy(first, tmp_path / "libdietcode_ort.so")
    monkeypatch.setattr(runtime, "_LIBRARIES", [first])
    monkeypatch.setenv("DIETCODE_ORT_LIBRARY", str(copy))
    caplog.set_level(logging.WARNING, logger="dietcode_ort")
    for _ in range(2):
        _check(_session_with_library(out), src)
    said = [r.getMessage() for r in caplog.records if "as well as" in r.getMessage()]
    assert len(said) == 1 and str(copy) in said[0] and f"node_stats() counts the sessions of {first} only" in said[0]


def _session_with_library(model):
    so = ort.SessionOptions()
    dietcode_ort.register(so)
    return ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])


_REGISTER_LOOP = """
import os, sys
import numpy as np, onnxruntime as ort
lib, model, n = sys.argv[1], open(sys.argv[2], "rb").read(), int(sys.argv[3])
probe = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
feeds = {i.name: np.ones([d if isinstance(d, int) else 16 for d in i.shape], np.float32) for i in probe.get_inputs()}

def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

def cycle(count):
    for _ in range(count):  # fresh options per session, the library registered on each (a server loading models)
        so = ort.SessionOptions()
        so.register_custom_ops_library(lib)
        ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]).run(None, feeds)

cycle(30)
start = rss_mb()
cycle(n)
print(rss_mb() - start)
"""


@pytest.mark.skipif(not __import__("pathlib").Path("/proc/self/statm").exists(), reason="needs /proc (Linux)")
def test_registering_the_library_per_session_does_not_grow_the_process(optimized, tmp_path):
    """SessionOptions made per session, the library registered on each with ORT's own call: the process stays
    flat. ORT unloads the library with options no session kept (a model without ai.dietcode nodes), and the
    static libstdc++ left ~75 KB at each unload (the library is linked -z nodelete now); each registration also
    made a domain of its own (~9 KB; now one for the process)."""
    import subprocess
    import sys

    from _bad_models import matmul_model, save

    src, out = optimized
    plain = save(matmul_model(), tmp_path / "plain.onnx")  # no ai.dietcode node: ORT unloads the library
    lib = str(dietcode_ort.library_path())
    for model, n in ((plain, 300), (out, 800)):
        res = subprocess.run([sys.executable, "-c", _REGISTER_LOOP, lib, str(model), str(n)], capture_output=True,
                             text=True, timeout=600, check=False)
        assert res.returncode == 0, res.stderr[-2000:]
        grown = float(res.stdout.strip().splitlines()[-1])
        assert grown < 4.0, f"{model.name}: the process grew {grown:.1f} MB over {n} sessions"


def test_an_ort_format_model_runs(optimized, tmp_path):
    """An optimized model saved by ORT in its own format with the library registered (what
    convert_onnx_models_to_ort --custom_op_library writes: the custom nodes without their fallback functions) runs
    through InferenceSession, from a path and from bytes: the library is registered for it (it was refused as
    no readable ONNX model)."""
    src, out = optimized
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "m.ort")
    so.add_session_config_entry("session.save_model_format", "ORT")
    dietcode_ort.register(so)
    ort.InferenceSession(str(out), so, providers=["CPUExecutionProvider"])
    saved = tmp_path / "m.ort"
    assert saved.read_bytes()[4:8] == b"ORTM"
    with pytest.raises(Exception, match="ai.dietcode"):  # stock ORT: the nodes need the library
        ort.InferenceSession(str(saved), providers=["CPUExecutionProvider"])
    _check(dietcode_ort.InferenceSession(str(saved), providers=["CPUExecutionProvider"]), src)
    _check(dietcode_ort.InferenceSession(saved.read_bytes(), providers=["CPUExecutionProvider"]), src)
