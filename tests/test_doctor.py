"""dietcode-ort doctor: every check reported as a record; the CLI prints them and exits 0 when usable."""
from __future__ import annotations

import ctypes
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from dietcode_ort import build
from dietcode_ort.bundle import Bundle, BundleKernel, DispatchTree, Feature, Toolchain
from dietcode_ort.cli import main
from dietcode_ort.doctor import cuda_libraries_check, cuda_library_sonames, load_libraries, model_check, run_checks


def test_checks_cover_runtime_pieces() -> None:
    checks = {c.name: c for c in run_checks(build=True)}
    assert set(checks) == {"onnxruntime", "CUDA provider", "CUDA libraries", "compiler", "onnxruntime headers", "cuda.h",
                           "custom-op library", "GPU", "triton"}
    assert checks["custom-op library"].status == "ok", checks["custom-op library"].detail
    assert checks["onnxruntime"].status == "ok" and "CPUExecutionProvider" in checks["onnxruntime"].detail
    assert checks["GPU"].status in ("ok", "warn")  # no GPU is a warning, never a failure


def test_cli_doctor_json(capsys) -> None:
    assert main(["doctor", "--json", "--no-build"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["name"] for r in rows} >= {"custom-op library", "GPU"}


def test_load_libraries_gives_the_loaders_reason() -> None:
    calls = []
    loads = load_libraries(["libdietcode-no-such-lib.so.7", "libm.so.6"], preload=lambda: calls.append(1))
    missing, libm = loads
    assert not missing.loaded and missing.soname == "libdietcode-no-such-lib.so.7"
    assert "libdietcode-no-such-lib.so.7: cannot open shared object file" in missing.detail
    assert libm.loaded and "libm" in libm.detail
    assert calls == [1]  # the preload ran once, for the missing library
    assert load_libraries(["libm.so.6"], preload=lambda: calls.append(2))[0].loaded and calls == [1]


def test_load_libraries_reports_a_failing_preload() -> None:
    def preload() -> None:
        print("noise that must not reach the report's reader")
        raise RuntimeError("no nvidia packages")

    (load,) = load_libraries(["libdietcode-no-such-lib.so.7"], preload=preload)
    assert not load.loaded and "onnxruntime.preload_dlls() failed: RuntimeError: no nvidia packages" in load.detail


def test_cuda_library_sonames_follow_onnxruntimes_cuda(monkeypatch) -> None:
    monkeypatch.setattr(ort, "cuda_version", "12.8", raising=False)
    assert cuda_library_sonames() == ("libcudart.so.12", "libcublas.so.12", "libcublasLt.so.12", "libcudnn.so.9")
    monkeypatch.setattr(ort, "cuda_version", "", raising=False)
    assert cuda_library_sonames() == ()
    assert cuda_libraries_check().status == "skip"


def test_cuda_libraries_check_names_each_missing_library_with_the_reason() -> None:
    sonames = cuda_library_sonames()
    if not sonames:
        pytest.skip("this onnxruntime has no CUDA build")
    check = cuda_libraries_check()
    missing = []
    for soname in sonames:  # the check has run (and preloaded what it could): the loader answers the same now
        try:
            ctypes.CDLL(soname)
        except OSError as exc:
            missing.append(soname)
            assert str(exc) in check.detail
    assert check.status == ("warn" if missing else "ok")
    if missing:
        assert "missing: " in check.detail and "dietcode-ort[cuda]" in check.detail


def test_doctor_beside_a_prebuilt_library_needs_no_compiler(monkeypatch, capsys) -> None:
    library = build.library_path(build=True)
    monkeypatch.setenv("DIETCODE_ORT_LIBRARY", str(library))
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    monkeypatch.setenv("DIETCODE_ORT_INCLUDE", "/nonexistent")
    assert main(["doctor", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["compiler"]["status"] == "skip" and str(library) in rows["compiler"]["detail"]
    assert rows["custom-op library"]["status"] == "ok"


# --- doctor MODEL: an Attention node whose kernels cannot run fails the check (it has no vendor path) -------

CUDA13 = Toolchain("3.9.0", "13.4.59", 90, 13000)  # what Triton 3.9's ptxas 13.4 writes: loads on driver >= 13.0
CUDA12 = Toolchain("3.9.0", "12.9.86", 88, 12000)
PTX90 = "//\n.version 9.0\n.target sm_90a\n.address_size 64\n"
ATTENTION_PARAMS = ("q", "k", "v", "out", "seq_q", "seq_k", "heads")


def _kernel(name: str, old_sm80: bool = False, **kw: object) -> BundleKernel:
    """An sm_90a cubin and sm_90a PTX needing driver 13.0; ``old_sm80``: also an sm_80 cubin loading on 12.0."""
    images = (("sm_90a", b"\x7fELF90"),) + ((("sm_80", b"\x7fELF80"),) if old_sm80 else ())
    return BundleKernel(name=name, images=images, image_toolchains=(CUDA13, CUDA12)[:len(images)], ptx=PTX90,
                        ptx_toolchain=CUDA13, block_m=64, block_n=64, **kw)  # type: ignore[arg-type]


def _attention(name: str, old_sm80: bool = False) -> BundleKernel:
    return _kernel(name, old_sm80, params=ATTENTION_PARAMS, head_dim=64)


def _gemm(name: str) -> BundleKernel:
    return _kernel(name, params=("a", "b", "c", "M", "N", "K"))


def _payload(name: str, *kernels: BundleKernel) -> onnx.TensorProto:
    bundle = Bundle((Feature("seq_q", ((0, 1),)),), kernels, DispatchTree.single(0))
    return numpy_helper.from_array(np.frombuffer(bundle.to_bytes(), np.uint8), name)


def _attention_model(path: Path, attention: tuple[BundleKernel, ...]) -> Path:
    """Two Attention nodes sharing one bundle of ``attention`` kernels, and a MatMul node with a gemm kernel
    (what optimize writes for a BERT layer, cut down: doctor reads the bundles and the nodes' op types only)."""
    nodes = [helper.make_node("Attention", ["q", "kt", "v", "", "attn_bundle"], [out], name=name,
                              domain="ai.dietcode", head_dim=64)
             for name, out in (("attn0", "o0"), ("attn1", "o1"))]
    nodes.append(helper.make_node("MatMul", ["o1", "w", "mm_bundle"], ["y"], name="proj", domain="ai.dietcode"))
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", "h", "s", 64]) for n in ("q", "kt", "v")]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.zeros((64, 64), np.float32), "w"),
                               _payload("attn_bundle", *attention), _payload("mm_bundle", _gemm("gemm_kernel"))])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                      helper.make_opsetid("ai.dietcode", 2)], ir_version=10), path)
    return path


def test_doctor_fails_an_attention_node_no_kernel_of_which_can_run(tmp_path: Path, capsys) -> None:
    """Attention has no vendor path: where no kernel of its bundle loads (AttentionKernel::FitDevice), the custom
    op refuses the CUDA session, so doctor fails naming the nodes; a MatMul node's kernels run as ORT's kernel
    there, which stays a warning."""
    path = _attention_model(tmp_path / "m.onnx", (_attention("attention_kernel"), _attention("attention_kernel")))
    old = model_check(str(path), 12000, driver_source=" (given)")
    assert old.status == "fail", old.detail
    assert ("Attention node(s) 'attn0', 'attn1': no kernel of their bundle can run under driver 12.0 (given), and "
            "Attention has no vendor path: the custom op would refuse to create the CUDA session") in old.detail
    assert "'proj'" not in old.detail and "would not load" in old.detail  # the MatMul's images: the warning's text
    assert model_check(str(path), 13000).status == "ok"
    on_blackwell = model_check(str(path), 13000, device=(10, 0))  # sm_90a images only: nothing for sm_100
    assert on_blackwell.status == "fail" and "can run under driver 13.0 on sm_100" in on_blackwell.detail
    assert "1 kernel(s) would run as ORT's kernel on sm_100" in on_blackwell.detail  # the MatMul's
    assert model_check(str(path), None).status == "warn"  # no driver: nothing to decide

    # one kernel of the bundle loads: the session starts, and only the calls sent to the other fail
    partly = _attention_model(tmp_path / "p.onnx", (_attention("new_only"), _attention("with_sm80", old_sm80=True)))
    some = model_check(str(partly), 12000)
    assert some.status == "warn" and "would refuse" not in some.detail
    assert ("Attention node(s) 'attn0', 'attn1': 1 of their bundle's 2 kernels cannot run under driver 12.0, and "
            "Attention has no vendor path: a call the dispatch tree sends to one of those fails") in some.detail

    # the command line: the model's line says [fail] and doctor exits 1
    assert main(["doctor", str(path), "--driver", "12.0", "--no-build", "--json"]) == 1
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["model m.onnx"]["status"] == "fail" and "'attn0', 'attn1'" in rows["model m.onnx"]["detail"]
    assert [name for name, r in rows.items() if r["status"] == "fail"] == ["model m.onnx"]
    assert main(["doctor", str(path), "--driver", "12.0", "--no-build"]) == 1
    assert "[fail] model m.onnx" in capsys.readouterr().out
