"""The host side of a custom-op call: the timed decision path (dc_bench_select), the launch that decides
the call's fit in the same step (dc_launch_fit) and the per-node fallback reasons (lock-free when repeated).
No GPU: a fit refusal happens before the driver is loaded."""
from __future__ import annotations

import ctypes

import pytest

from dietcode_ort.bundle import Bundle, BundleKernel, DispatchTree, Feature
from dietcode_ort.errors import DietcodeError
from dietcode_ort.runtime import load_core

PTX80 = ".version 8.0\n.target sm_80\n"


def _bundle(div16: tuple[str, ...] = ()) -> bytes:
    """M <= 64: the vendor kind (kernel 0); above: a 64x64 gemm kernel (kernel 1)."""
    gemm = BundleKernel(name="gemm_kernel_with_a_name_longer_than_sso", images=(("sm_90a", b"\x7fELF"),),
                        ptx=PTX80, params=("a", "b", "c", "M", "N", "K"), block_m=64, block_n=64, div16=div16)
    tree = DispatchTree((0, -1, -1), (64, 0, 0), (1, -1, -1), (2, -1, -1), (-1, 0, 1))
    return Bundle((Feature("M", ((0, 0),)),), (BundleKernel.vendor(), gemm), tree).to_bytes()


@pytest.fixture(scope="module")
def core():
    return load_core()


@pytest.mark.parametrize("m", [1, 64, 65, 300])
def test_bench_select_picks_what_the_tree_picks(core, m: int) -> None:
    bundle = core.parse(_bundle())
    a, b = (m, 8), (8, 16)
    args = core.abi_view("MatMul", a, b)
    kernel, fit, ns = bundle.bench_select([a, b], args, 1000)
    assert kernel == bundle.select(bundle.features([a, b]))
    assert kernel == (0 if m <= 64 else 1)
    assert fit == 0
    assert 0 < ns < 1e6


def test_bench_select_reports_the_fit_code(core) -> None:
    bundle = core.parse(_bundle(div16=("N",)))
    a, b = (100, 8), (8, 24)  # N = 24: not a multiple of 16
    args = core.abi_view("MatMul", a, b)
    kernel, fit, _ = bundle.bench_select([a, b], args, 10)
    assert kernel == 1
    assert core.lib.dc_fit_name(fit).decode() == "div16 assumption"
    assert bundle.fit(1, args)[0] == "div16 assumption"


def test_bench_select_validates_its_inputs(core) -> None:
    bundle = core.parse(_bundle())
    args = core.abi_view("MatMul", (100, 8), (8, 16))
    with pytest.raises(DietcodeError, match="n_iter 0 must be positive"):
        bundle.bench_select([(100, 8), (8, 16)], args, 0)
    with pytest.raises(DietcodeError, match="4 inputs, a node gives at most 3"):
        bundle.bench_select([(100, 8), (8, 16), (16,), (1,)], args, 10)
    with pytest.raises(DietcodeError, match="reads dim 0 of input 0, whose rank is 0"):
        bundle.bench_select([(), (8, 16)], args, 10)
    with pytest.raises(DietcodeError, match="reads input 0, the node has 0 inputs"):
        bundle.bench_select([], args, 10)
    ns = ctypes.c_double()
    assert core.lib.dc_bench_select(bundle.handle, None, None, 2, None, 10, None, None, ctypes.byref(ns)) == -1
    assert "null bundle, shapes, launch arguments" in core.error()


def _bind_launch_fit(core) -> None:
    core.lib.dc_launch_fit.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p]


def test_launch_fit_refuses_a_call_that_does_not_fit_with_its_code(core) -> None:
    _bind_launch_fit(core)
    bundle = core.parse(_bundle(div16=("N",)))
    args = core.abi_view("MatMul", (100, 8), (8, 24))
    r = core.lib.dc_launch_fit(bundle.handle, 1, ctypes.byref(args), None)
    assert core.lib.dc_fit_name(r).decode() == "div16 assumption"
    assert "compiled for N a multiple of 16" in core.error()
    # dc_launch refuses the same call as an error, with the same reason
    assert core.lib.dc_launch(bundle.handle, 1, ctypes.byref(args), None) == -1
    assert "compiled for N a multiple of 16" in core.error()
    empty = core.abi_view("MatMul", (100, 8), (8, 16))
    empty.M = 0
    assert core.lib.dc_fit_name(core.lib.dc_launch_fit(bundle.handle, 1, ctypes.byref(empty), None)).decode() == \
        "empty output"


def test_launch_fit_errors(core) -> None:
    _bind_launch_fit(core)
    bundle = core.parse(_bundle())
    args = core.abi_view("MatMul", (100, 8), (8, 16))
    assert core.lib.dc_launch_fit(bundle.handle, 0, ctypes.byref(args), None) == -1
    assert "vendor kind" in core.error()
    assert core.lib.dc_launch_fit(bundle.handle, 2, ctypes.byref(args), None) == -1
    assert "kernel id 2 out of range" in core.error()
    assert core.lib.dc_launch_fit(None, 1, ctypes.byref(args), None) == -1
    assert core.lib.dc_launch_fit(bundle.handle, 1, None, None) == -1
    assert "null bundle or launch arguments" in core.error()


def test_fallback_reason_is_the_last_one_also_after_a_reset(core) -> None:
    lib = core.lib
    lib.dc_node_counter_get.restype = ctypes.c_void_p
    lib.dc_node_counter_get.argtypes = [ctypes.c_char_p]
    lib.dc_node_count_fallback.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    counter = lib.dc_node_counter_get(b"host_overhead_reason_node")

    def stats() -> dict:
        return core.node_stats()["host_overhead_reason_node"]

    for reason in (b"first reason", b"second reason", b"first reason", b"first reason"):
        lib.dc_node_count_fallback(counter, reason)
    assert stats()["reason"] == "first reason"
    lib.dc_node_stats_reset()
    assert "host_overhead_reason_node" not in core.node_stats()  # no call since the reset
    lib.dc_node_count_fallback(counter, b"first reason")  # the same text as before the reset: recorded again
    assert stats()["reason"] == "first reason" and stats()["fallbacks"] == 1
    lib.dc_node_count_fallback(counter, None)  # counted, the reason kept
    assert stats()["reason"] == "first reason" and stats()["fallbacks"] == 2


def test_fallback_reason_stays_exact_past_the_interned_reasons(core) -> None:
    lib = core.lib
    lib.dc_node_counter_get.restype = ctypes.c_void_p
    lib.dc_node_counter_get.argtypes = [ctypes.c_char_p]
    lib.dc_node_count_fallback.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    counter = lib.dc_node_counter_get(b"host_overhead_many_reasons")
    for i in range(100):  # more distinct reasons than a counter interns: those past it take the lock
        lib.dc_node_count_fallback(counter, f"reason {i}".encode())
        lib.dc_node_count_fallback(counter, f"reason {i}".encode())
        assert core.node_stats()["host_overhead_many_reasons"]["reason"] == f"reason {i}"
    for text in (b"reason 3", b"reason 99", b"reason 99", b"reason 3"):
        lib.dc_node_count_fallback(counter, text)
        assert core.node_stats()["host_overhead_many_reasons"]["reason"] == text.decode()
    assert core.node_stats()["host_overhead_many_reasons"]["fallbacks"] == 204


@pytest.mark.parametrize("a, b", [((8,), (8, 6)), ((5, 8), (8,)), ((8,), (2, 8, 6)), ((2, 1, 5, 8), (3, 8, 4)),
                                  ((3, 5, 8), (8, 6))])
def test_cpu_kernel_output_shape_follows_numpy_matmul(a: tuple, b: tuple) -> None:
    """The output shape (computed per call into per-thread buffers, 1-D operands promoted in place) and values
    are numpy.matmul's."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    import dietcode_ort

    payload = np.frombuffer(_bundle(), np.uint8)
    node = helper.make_node("MatMul", ["A", "B", "bundle"], ["Y"], domain="ai.dietcode", name="mm")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "AB"],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(payload, "bundle")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("ai.dietcode", 2)])
    model.ir_version = 10
    options = ort.SessionOptions()
    dietcode_ort.register(options)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(a).astype(np.float32), rng.standard_normal(b).astype(np.float32)
    for _ in range(2):  # the second call reuses the buffers the first sized
        (y,) = session.run(None, {"A": x, "B": w})
        assert y.shape == np.matmul(x, w).shape
        np.testing.assert_allclose(y, np.matmul(x, w), rtol=1e-5, atol=1e-5)
