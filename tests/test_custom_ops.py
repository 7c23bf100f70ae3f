"""ai.dietcode custom ops on the CPU EP against ONNX Runtime's result for the unfused graph."""
from __future__ import annotations

import threading
import zlib

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import dietcode_ort
from _conv_reference import ort_conv
from dietcode_ort.bundle import Bundle, BundleKernel, DispatchTree, Feature
from dietcode_ort.errors import DietcodeError

SUFFIXES = ("", "Bias", "Relu", "BiasRelu", "Gelu", "BiasGelu", "GeluTanh", "BiasGeluTanh", "Silu", "BiasSilu",
            "Relu6", "BiasRelu6")
CPU = ["CPUExecutionProvider"]
PTX80 = ".version 8.0\n.target sm_80\n"

# (case id, base op, input shapes, attributes, bias length)
CASES = [
    ("matmul2d", "MatMul", [(5, 8), (8, 6)], {}, 6),
    ("matmul3d", "MatMul", [(2, 5, 8), (8, 6)], {}, 6),
    ("matmul4d_attention", "MatMul", [(2, 3, 5, 8), (2, 3, 8, 5)], {}, 5),
    ("matmul_broadcast", "MatMul", [(2, 1, 5, 8), (3, 8, 4)], {}, 4),
    ("gemm_transB", "Gemm", [(5, 8), (6, 8)], {"transB": 1, "alpha": 0.5, "beta": 2.0}, 6),
    ("gemm_transA", "Gemm", [(8, 5), (8, 6)], {"transA": 1}, 6),
    ("conv_stride_pad_dilation", "Conv", [(2, 3, 9, 10), (4, 3, 3, 3)],
     {"strides": [2, 1], "pads": [1, 0, 1, 2], "dilations": [1, 2]}, 4),
    ("conv_same_upper", "Conv", [(1, 2, 7, 7), (3, 2, 3, 3)], {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, 3),
    ("conv_valid", "Conv", [(1, 2, 8, 7), (3, 2, 3, 3)], {"auto_pad": "VALID", "strides": [2, 3]}, 3),
]


def bundle_bytes(bias: bool = False, feature_input: int = 0) -> bytes:
    """A bundle with a vendor leaf and a compiled kernel (the CPU EP validates it and runs ORT's op)."""
    params = ("a", "b") + (("bias",) if bias else ()) + ("c", "M", "N", "K")
    gemm = BundleKernel(name="k", images=(("sm_90a", b"\x7fELF"),), ptx=PTX80, params=params, block_m=64, block_n=64)
    tree = DispatchTree((0, -1, -1), (64, 0, 0), (1, -1, -1), (2, -1, -1), (-1, 0, 1))
    return Bundle((Feature("M", ((feature_input, 0),)),), (BundleKernel.vendor(), gemm), tree).to_bytes()


def bundle_initializer(payload: bytes, name: str = "bundle") -> onnx.TensorProto:
    """The node contract: the bundle is a 1-D uint8 initializer, the node's last input."""
    return numpy_helper.from_array(np.frombuffer(payload, np.uint8), name)


def _model(nodes, inputs, elem, opset=20, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, elem, None) for n in inputs],
                              [helper.make_tensor_value_info("Y", elem, None)], list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                    helper.make_opsetid("ai.dietcode", 2)])
    model.ir_version = 10
    return model


def custom_model(op_type: str, n_inputs: int, attrs: dict, elem: int, payload: bytes | None) -> onnx.ModelProto:
    """One custom node on inputs A, B[, bias] (n_inputs of them), plus the bundle initializer when given."""
    data = ["A", "B", "bias"][:n_inputs]
    node = helper.make_node(op_type, data + (["bundle"] if payload is not None else []), ["Y"],
                            domain="ai.dietcode", name="n0", **attrs)
    inits = [bundle_initializer(payload)] if payload is not None else []
    return _model([node], data, elem, initializers=inits)


def reference_model(base: str, suffix: str, attrs: dict) -> onnx.ModelProto:
    """The unfused fp32 graph: base op (Gemm's C / Conv's B as its own input), Add for MatMul's bias, act (as
    exporters write it: Gelu approximate="tanh", x * Sigmoid(x), Clip(x, 0, 6))."""
    bias = "Bias" in suffix
    act = suffix.removeprefix("Bias")
    ins = ["A", "B"] + (["bias"] if bias and base != "MatMul" else [])
    nodes = [helper.make_node(base, ins, ["t0"], **attrs)]
    last = "t0"
    if bias and base == "MatMul":
        nodes.append(helper.make_node("Add", ["t0", "bias"], ["t1"]))
        last = "t1"
    inits = []
    if act == "GeluTanh":
        nodes.append(helper.make_node("Gelu", [last], ["Y"], approximate="tanh"))
    elif act == "Silu":
        nodes += [helper.make_node("Sigmoid", [last], ["s"]), helper.make_node("Mul", [last, "s"], ["Y"])]
    elif act == "Relu6":
        inits = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("lo", 0.0), ("hi", 6.0))]
        nodes.append(helper.make_node("Clip", [last, "lo", "hi"], ["Y"]))
    else:
        nodes.append(helper.make_node(act or "Identity", [last], ["Y"]))
    return _model(nodes, ["A", "B"] + (["bias"] if bias else []), TensorProto.FLOAT, initializers=inits)


@pytest.fixture(scope="module")
def payload() -> bytes:
    return bundle_bytes()


@pytest.fixture(scope="module")
def bias_payload() -> bytes:
    return bundle_bytes(bias=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("suffix", SUFFIXES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_op_matches_unfused_onnxruntime(case, suffix, dtype, payload, bias_payload) -> None:
    _, base, shapes, attrs, n_bias = case
    rng = np.random.default_rng(zlib.crc32(f"{case[0]}{suffix}".encode()))
    feeds = {"A": rng.standard_normal(shapes[0]).astype(dtype), "B": rng.standard_normal(shapes[1]).astype(dtype)}
    if "Bias" in suffix:
        feeds["bias"] = rng.standard_normal(n_bias).astype(dtype)
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    attr = bias_payload if "Bias" in suffix else payload
    sess = dietcode_ort.InferenceSession(custom_model(base + suffix, len(feeds), attrs, elem, attr), providers=CPU)
    (got,) = sess.run(None, feeds)
    ref_sess = ort.InferenceSession(reference_model(base, suffix, attrs).SerializeToString(), providers=CPU)
    (want,) = ref_sess.run(None, {k: v.astype(np.float32) for k, v in feeds.items()})
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == np.float32:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    else:  # fp16 computes in fp32 and rounds once at the end
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float16).astype(np.float32),
                                   rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in ("matmul3d", "gemm_transB", "conv_valid")],
                         ids=lambda c: c[0])
@pytest.mark.parametrize("suffix", ["Relu", "BiasRelu", "Relu6"])
def test_nan_and_inf_pass_through_the_activation_as_in_onnxruntime(case, suffix, payload, bias_payload) -> None:
    """A NaN or an infinity in A reaches the output as ORT's CPU kernels pass it on: Relu(NaN) is NaN (the fused
    Relu made it 0, so the library and the model's own fallback function disagreed), Relu(inf) inf, Relu(-inf) 0."""
    _, base, shapes, attrs, n_bias = case
    rng = np.random.default_rng(3)
    a = rng.standard_normal(shapes[0]).astype(np.float32)
    a.reshape(-1)[:3] = [np.nan, np.inf, -np.inf]
    feeds = {"A": a, "B": rng.standard_normal(shapes[1]).astype(np.float32)}
    if "Bias" in suffix:
        feeds["bias"] = rng.standard_normal(n_bias).astype(np.float32)
    sess = dietcode_ort.InferenceSession(custom_model(base + suffix, len(feeds), attrs, TensorProto.FLOAT,
                                                      bias_payload if "Bias" in suffix else payload), providers=CPU)
    (got,) = sess.run(None, feeds)
    (want,) = ort.InferenceSession(reference_model(base, suffix, attrs).SerializeToString(),
                                   providers=CPU).run(None, feeds)
    assert np.isnan(want).any() and np.isnan(got).sum() == np.isnan(want).sum()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # NaN where NaN (equal_nan)


def test_missing_bundle_fails_at_session_creation() -> None:
    with pytest.raises(DietcodeError, match=r"node 'n0' .*has 2 inputs; MatMul takes 3 \(A, B, bundle\)"):
        dietcode_ort.InferenceSession(custom_model("MatMul", 2, {}, TensorProto.FLOAT, None), providers=CPU)
    with pytest.raises(DietcodeError, match=r"has 3 inputs; GemmBias takes 4 \(A, B, bias, bundle\)"):
        dietcode_ort.InferenceSession(custom_model("GemmBias", 3, {}, TensorProto.FLOAT, None), providers=CPU)


@pytest.mark.parametrize("with_input", [False, True])
@pytest.mark.parametrize("as_string", [False, True])
@pytest.mark.parametrize("op, n_inputs", [("MatMul", 2), ("MatMulBias", 3)])
def test_per_node_bundle_attribute_names_the_old_contract(op, n_inputs, as_string, with_input) -> None:
    """ai.dietcode opset 1 carried the bundle as a node attribute: refused with what to do about it, also where
    the node has its bundle input as well (inspect and doctor refuse that node: the session must too)."""
    data = bundle_bytes(bias="Bias" in op)
    model = custom_model(op, n_inputs, {}, TensorProto.FLOAT, data if with_input else None)
    model.graph.node[0].attribute.append(helper.make_attribute("bundle", data if as_string else
                                                               bundle_initializer(data)))
    with pytest.raises(DietcodeError, match="node 'n0' .*bundle as an attribute.*optimize the original model again"):
        dietcode_ort.InferenceSession(model, providers=CPU)


@pytest.mark.parametrize("cut", [0, 10, 40, -1])
def test_malformed_bundle_fails_at_session_creation(cut) -> None:
    data = bundle_bytes()[:cut] if cut else b"not a bundle at all, definitely"
    with pytest.raises(DietcodeError, match="invalid kernel bundle"):
        dietcode_ort.InferenceSession(custom_model("Gemm", 2, {}, TensorProto.FLOAT, data), providers=CPU)


def test_bias_suffix_must_match_inputs(payload, bias_payload) -> None:
    # ORT's schema check refuses both: (A, B, bundle) for MatMulBias puts uint8 where the bias goes ...
    with pytest.raises(Exception, match=r"tensor\(uint8\).*\(bundle\).*MatMulBias.*node \(n0\)"):
        dietcode_ort.InferenceSession(custom_model("MatMulBias", 2, {}, TensorProto.FLOAT, bias_payload),
                                      providers=CPU)
    # ... and (A, B, bias, bundle) for MatMulRelu has one input too many
    with pytest.raises(Exception, match=r"Node\(n0\).*input size 4 not in range \[min=2, max=3\]"):
        dietcode_ort.InferenceSession(custom_model("MatMulRelu", 3, {}, TensorProto.FLOAT, payload), providers=CPU)


def test_bundle_must_fit_the_node(payload, bias_payload) -> None:
    with pytest.raises(DietcodeError, match="takes no bias but the op type has one"):
        dietcode_ort.InferenceSession(custom_model("GemmBias", 3, {}, TensorProto.FLOAT, payload), providers=CPU)
    with pytest.raises(DietcodeError, match="takes a bias but the op type has none"):
        dietcode_ort.InferenceSession(custom_model("Conv", 2, {}, TensorProto.FLOAT, bias_payload), providers=CPU)
    reads_bias = bundle_bytes(feature_input=2)  # on MatMul, input 2 is the bundle itself: not a data input
    with pytest.raises(DietcodeError, match="features read input 2, the node has 2 data inputs"):
        dietcode_ort.InferenceSession(custom_model("MatMul", 2, {}, TensorProto.FLOAT, reads_bias), providers=CPU)


def test_one_session_from_eight_threads(bias_payload) -> None:
    sess = dietcode_ort.InferenceSession(custom_model("MatMulBiasGelu", 3, {}, TensorProto.FLOAT, bias_payload),
                                         providers=CPU)
    rng = np.random.default_rng(0)
    feeds = [{"A": rng.standard_normal((2, 33, 48)).astype(np.float32) * (i + 1),
              "B": rng.standard_normal((48, 40)).astype(np.float32),
              "bias": rng.standard_normal(40).astype(np.float32)} for i in range(4)]
    expected = [sess.run(None, f)[0] for f in feeds]
    errors: list[str] = []

    def worker(t: int) -> None:
        for j in range(25):
            i = (t + j) % len(feeds)
            if not np.array_equal(sess.run(None, feeds[i])[0], expected[i]):
                errors.append(f"thread {t} run {j} differs")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors


def test_register_returns_built_library() -> None:
    opts = ort.SessionOptions()
    path = dietcode_ort.register(opts)
    assert path == dietcode_ort.library_path(build=False) and path.is_file()


def test_registration_fails_clearly_on_an_older_runtime() -> None:
    """RegisterCustomOps asked by a runtime without the C API version the library needs returns an error
    status naming both versions (through API version 1's CreateStatus), instead of success with no ops."""
    import ctypes

    from dietcode_ort.build import library_path

    lib = ctypes.CDLL(str(library_path()))
    create_status_t = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p)
    get_api_t = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_uint32)
    version_t = ctypes.CFUNCTYPE(ctypes.c_void_p)  # const char* (a c_char_p result would leak)

    class ApiV1(ctypes.Structure):  # OrtApi starts with CreateStatus
        _fields_ = [("CreateStatus", create_status_t)]

    class ApiBase(ctypes.Structure):  # OrtApiBase
        _fields_ = [("GetApi", get_api_t), ("GetVersionString", version_t)]

    seen: list[tuple[int, str]] = []
    asked: list[int] = []

    def create_status(code: int, msg: bytes) -> int:
        seen.append((code, msg.decode()))
        return 0x1234

    api_v1 = ApiV1(create_status_t(create_status))

    def get_api(version: int) -> int | None:
        asked.append(version)
        return ctypes.addressof(api_v1) if version == 1 else None

    version = ctypes.create_string_buffer(b"1.10.0")
    callbacks = (get_api_t(get_api), version_t(lambda: ctypes.addressof(version)))
    base = ApiBase(*callbacks)
    lib.RegisterCustomOps.restype = ctypes.c_void_p
    lib.RegisterCustomOps.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    status = lib.RegisterCustomOps(None, ctypes.addressof(base))
    assert status == 0x1234 and asked[0] > 1 and asked[-1] == 1
    (code, message), = seen
    assert code == 1  # ORT_FAIL
    assert f"C API version {asked[0]}" in message and "onnxruntime (1.10.0)" in message


def test_node_stats_count_the_cpu_kernel_calls(payload) -> None:
    """The library counts per node name, process-wide; on the CPU EP every call runs ORT's kernel (a fallback)."""
    model = custom_model("MatMulRelu", 2, {}, TensorProto.FLOAT, payload)
    model.graph.node[0].name = "stats_node"
    options = ort.SessionOptions()
    dietcode_ort.register(options)
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=CPU)
    dietcode_ort.reset_node_stats()
    assert "stats_node" not in dietcode_ort.node_stats()
    feeds = {"A": np.ones((3, 4), np.float32), "B": np.ones((4, 2), np.float32)}
    for _ in range(3):
        sess.run(None, feeds)
    stats = dietcode_ort.node_stats()["stats_node"]
    assert stats["launches"] == 0 and stats["fallbacks"] == 3 and "CPU execution provider" in stats["reason"]
    # a second session with the same node name adds to the same counter, also from several threads
    sess2 = ort.InferenceSession(model.SerializeToString(), options, providers=CPU)
    threads = [threading.Thread(target=lambda: [sess2.run(None, feeds) for _ in range(5)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert dietcode_ort.node_stats()["stats_node"]["fallbacks"] == 23
    dietcode_ort.reset_node_stats()
    assert "stats_node" not in dietcode_ort.node_stats()


def _residual_payload(bias: bool, alpha: float = 0.25, activation: str = "none", residual_mul: bool = False
                      ) -> bytes:
    """A vendor leaf and a compiled kernel taking the residual pointer, as the gemm template has it (multiplying
    the activation's result by it with ``residual_mul``)."""
    params = ("a", "b") + (("bias",) if bias else ()) + ("c", "M", "N", "K", "residual")
    gemm = BundleKernel(name="k", images=(("sm_90a", b"\x7fELF"),), ptx=PTX80, params=params, block_m=64, block_n=64,
                        alpha=alpha, activation=activation, residual_mul=residual_mul)
    tree = DispatchTree((0, -1, -1), (64, 0, 0), (1, -1, -1), (2, -1, -1), (-1, 0, 1))
    return Bundle((Feature("M", ((0, 0),)),), (BundleKernel.vendor(), gemm), tree).to_bytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("op_type", ["MatMulResidual", "MatMulBiasResidual", "MatMulBiasGeluResidual",
                                     "MatMulSiluMul", "MatMulBiasGeluMul"])
def test_residual_and_scale_on_the_cpu_ep(op_type, dtype) -> None:
    """y = act(scale * A B + bias) + residual: the scale (the fused Div/Mul) before the bias, the residual after
    the activation; an op type ending in Mul (LLaMA's SwiGLU gate, MatMulSiluMul) multiplies by it instead; a
    residual of another shape is an error naming both shapes."""
    import math

    from dietcode_ort.inspect_model import epilogue_of

    named = epilogue_of(helper.make_node(op_type, [], []))
    bias = "Bias" in op_type
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((2, 5, 8)).astype(dtype), rng.standard_normal((8, 6)).astype(dtype)
    c, r = rng.standard_normal(6).astype(dtype), rng.standard_normal((2, 5, 6)).astype(dtype)
    data = ["A", "B"] + (["bias"] if bias else []) + ["R"]
    node = helper.make_node(op_type, data + ["bundle"], ["Y"], domain="ai.dietcode", name="n0", scale=0.25)
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    payload = _residual_payload(bias, activation=named["activation"], residual_mul=named["residual_mul"])
    model = _model([node], data, elem, initializers=[bundle_initializer(payload)])
    sess = dietcode_ort.InferenceSession(model, providers=CPU)
    feeds = {"A": a, "B": b, "R": r} | ({"bias": c} if bias else {})
    (got,) = sess.run(None, feeds)
    want = 0.25 * (a.astype(np.float64) @ b.astype(np.float64)) + (c.astype(np.float64) if bias else 0.0)
    if "Gelu" in op_type:
        want = 0.5 * want * (1.0 + np.vectorize(math.erf)(want / math.sqrt(2.0)))
    if "Silu" in op_type:
        want = want / (1.0 + np.exp(-want))
    want = want * r if named["residual_mul"] else want + r
    tol = 1e-5 if dtype == np.float32 else 3e-3
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)
    with pytest.raises(Exception, match=r"residual input has shape \[5, 6\], not the output's \[2, 5, 6\]") as err:
        sess.run(None, feeds | {"R": r[0]})
    assert str(err.value).count("node 'n0'") == 1, str(err.value)  # the node is named once, not per layer
    # of the output's rank, the output's shape only: [5, 2, 6] holds as many elements, but the Add it replaces
    # refuses it (no broadcast of [2, 5, 6] with [5, 2, 6]), so the library must not add it in row order
    with pytest.raises(Exception, match=r"residual input has shape \[5, 2, 6\], not the output's \[2, 5, 6\]"):
        sess.run(None, feeds | {"R": r.reshape(5, 2, 6)})


@pytest.mark.parametrize("trans_b", [0, 1])
def test_gemm_residual_in_the_products_row_order_on_the_cpu_ep(trans_b) -> None:
    """GemmBiasResidual (GPT-2's Conv1D output projection: Gemm -> Reshape -> Add): the residual may have the
    output's shape or the one the Reshape after it gives ([2, 5, 6] for a [10, 6] product), its elements added in
    row order; one of another last dim or element count is an error naming both shapes."""
    rng = np.random.default_rng(8)
    a, c = rng.standard_normal((10, 8)).astype(np.float32), rng.standard_normal(6).astype(np.float32)
    b = rng.standard_normal((6, 8) if trans_b else (8, 6)).astype(np.float32)
    r = rng.standard_normal((2, 5, 6)).astype(np.float32)
    node = helper.make_node("GemmBiasResidual", ["A", "B", "bias", "R", "bundle"], ["Y"], domain="ai.dietcode",
                            name="n0", transB=trans_b)
    model = _model([node], ["A", "B", "bias", "R"], TensorProto.FLOAT,
                   initializers=[bundle_initializer(_residual_payload(True, alpha=1.0))])
    sess = dietcode_ort.InferenceSession(model, providers=CPU)
    feeds = {"A": a, "B": b, "bias": c}
    want = a.astype(np.float64) @ (b.T if trans_b else b).astype(np.float64) + c
    for residual in (r, r.reshape(10, 6)):
        (got,) = sess.run(None, feeds | {"R": residual})
        assert got.shape == (10, 6)
        np.testing.assert_allclose(got, want + r.reshape(10, 6), rtol=1e-5, atol=1e-5)
    for bad in (r.reshape(5, 12), r[:, :4]):
        with pytest.raises(Exception, match=rf"residual input has shape \[{', '.join(map(str, bad.shape))}\], not "
                                            r"the output's \[10, 6\]"):
            sess.run(None, feeds | {"R": bad})


def test_residual_suffix_and_scale_must_fit_the_node(payload) -> None:
    node = helper.make_node("MatMulResidual", ["A", "B", "R", "bundle"], ["Y"], domain="ai.dietcode", name="n0")
    model = _model([node], ["A", "B", "R"], TensorProto.FLOAT, initializers=[bundle_initializer(payload)])
    with pytest.raises(DietcodeError, match="takes no residual but the op type has one"):
        dietcode_ort.InferenceSession(model, providers=CPU)
    scaled = custom_model("Gemm", 2, {"scale": 0.5}, TensorProto.FLOAT, payload)
    with pytest.raises(DietcodeError, match="the scale attribute applies to MatMul op types only"):
        dietcode_ort.InferenceSession(scaled, providers=CPU)



@pytest.mark.parametrize("op_type, n_inputs, attrs, message", [
    ("Gemm", 2, {"transB": 1.0}, "'transB' attribute is not an INT"),
    ("GemmBias", 3, {"alpha": "2"}, "'alpha' attribute is not a FLOAT"),
    ("MatMul", 2, {"scale": "2"}, "'scale' attribute is not a FLOAT"),
    ("Conv", 2, {"strides": 2}, "'strides' attribute is not INTS"),
    ("Conv", 2, {"group": [1]}, "'group' attribute is not an INT"),
    ("Conv", 2, {"auto_pad": 1}, "'auto_pad' attribute is not a STRING"),
])
def test_attributes_of_another_type_are_refused(payload, bias_payload, op_type, n_inputs, attrs, message) -> None:
    """A hand-edited attribute of the wrong type is refused at session creation naming it, not read as absent
    (a FLOAT transB would run untransposed, an INT strides as stride 1)."""
    model = custom_model(op_type, n_inputs, attrs, TensorProto.FLOAT, bias_payload if n_inputs == 3 else payload)
    with pytest.raises(DietcodeError, match=f"node 'n0' .*{message}"):
        dietcode_ort.InferenceSession(model, providers=CPU)


def test_negative_conv_pads_are_refused(payload) -> None:
    """Negative pads (which ONNX's Conv schema refuses) are refused by the library's Conv too, naming them."""
    model = custom_model("Conv", 2, {"pads": [-1, -1, -1, -1]}, TensorProto.FLOAT, payload)
    feeds = {"A": np.ones((1, 2, 6, 6), np.float32), "B": np.ones((3, 2, 3, 3), np.float32)}
    with pytest.raises(Exception, match=r"node 'n0' .*Conv pads must be >= 0, got \[-1, -1, -1, -1\]"):
        dietcode_ort.InferenceSession(model, providers=CPU).run(None, feeds)


def test_scale_must_be_the_compiled_kernels_alpha_on_the_cpu_ep() -> None:
    """A hand-edited scale the compiled kernels were not built with is refused at session creation on the CPU
    EP too (the vendor and CPU paths apply the scale, the kernels their baked-in alpha); the scale they were
    built with runs."""
    rng = np.random.default_rng(3)
    feeds = {"A": rng.standard_normal((2, 5, 8)).astype(np.float32), "B": rng.standard_normal((8, 6)).astype(np.float32),
             "R": rng.standard_normal((2, 5, 6)).astype(np.float32)}

    def model(scale: float) -> onnx.ModelProto:
        node = helper.make_node("MatMulResidual", ["A", "B", "R", "bundle"], ["Y"], domain="ai.dietcode",
                                name="scaled_mm", scale=scale)
        return _model([node], ["A", "B", "R"], TensorProto.FLOAT,
                      initializers=[bundle_initializer(_residual_payload(False, alpha=0.125))])

    with pytest.raises(DietcodeError, match=r"node 'scaled_mm'.*compiled with alpha 0\.125, the node's scale is 0\.25"):
        dietcode_ort.InferenceSession(model(0.25), providers=CPU)
    with pytest.raises(DietcodeError, match=r"alpha 0\.125, the node's scale is 1\b"):
        dietcode_ort.InferenceSession(model(1.0), providers=CPU)
    (got,) = dietcode_ort.InferenceSession(model(0.125), providers=CPU).run(None, feeds)
    np.testing.assert_allclose(got, 0.125 * (feeds["A"] @ feeds["B"]) + feeds["R"], rtol=1e-5, atol=1e-5)


def _conv_residual_payload(activation: str, residual_first: bool, channels: int = 3, residual_mul: bool = False
                           ) -> bytes:
    """A vendor leaf and a compiled conv kernel taking the residual pointer, added before the activation when
    ``residual_first`` (the conv template's RESIDUAL_FIRST), multiplied after it when ``residual_mul``, for a 3x3
    stride-1 pad-1 layer."""
    params = ("a", "b", "bias", "c", "M", "N", "K", "img_h", "img_w", "out_h", "out_w", "residual")
    conv = BundleKernel(name="k", images=(("sm_90a", b"\x7fELF"),), ptx=PTX80, params=params, block_m=64,
                        block_n=64, activation=activation, residual_first=residual_first, residual_mul=residual_mul,
                        conv=(channels, 3, 3, 1, 1, 1, 1, 1, 1))
    tree = DispatchTree((0, -1, -1), (64, 0, 0), (1, -1, -1), (2, -1, -1), (-1, 0, 1))
    return Bundle((Feature("M", ((0, 0),)),), (BundleKernel.vendor(), conv), tree).to_bytes()


def _conv3x3_f64(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """NCHW 3x3 convolution, stride 1, pads 1, in float64 (the reference)."""
    x64 = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    n, _, h, wd = x.shape
    y = np.zeros((n, w.shape[0], h, wd))
    for i in range(3):
        for j in range(3):
            y += np.einsum("nchw,oc->nohw", x64[:, :, i:i + h, j:j + wd], w[:, :, i, j].astype(np.float64))
    return y + b.astype(np.float64)[None, :, None, None]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("op_type", ["ConvBiasResidualRelu", "ConvBiasReluResidual", "ConvBiasResidual",
                                     "ConvBiasResidualGelu", "ConvBiasResidualGeluTanh", "ConvBiasGeluTanhResidual",
                                     "ConvBiasResidualSilu", "ConvBiasRelu6Residual", "ConvBiasResidualRelu6",
                                     "ConvBiasReluMul", "ConvBiasSiluMul"])
def test_conv_residual_on_the_cpu_ep(op_type, dtype) -> None:
    """ResNet's Conv -> Add(shortcut) -> Relu as one node: y = act(conv(X, W) + B + residual) for an op type
    naming the residual before the activation, act(conv(X, W) + B) + residual after it, act(conv(X, W) + B) *
    residual for one ending in Mul, checked against a float64 reference; a residual of another shape is refused
    naming both shapes, before anything runs."""
    import math

    from dietcode_ort.inspect_model import epilogue_of

    named = epilogue_of(helper.make_node(op_type, [], []))
    first, activation, mul = named["residual_first"], named["activation"], named["residual_mul"]
    rng = np.random.default_rng(7)
    x, w = rng.standard_normal((2, 3, 6, 5)).astype(dtype), rng.standard_normal((4, 3, 3, 3)).astype(dtype)
    b, r = rng.standard_normal(4).astype(dtype), rng.standard_normal((2, 4, 6, 5)).astype(dtype)
    node = helper.make_node(op_type, ["X", "W", "B", "R", "bundle"], ["Y"], domain="ai.dietcode", name="conv_res",
                            pads=[1, 1, 1, 1], strides=[1, 1], kernel_shape=[3, 3])
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    model = _model([node], ["X", "W", "B", "R"], elem,
                   initializers=[bundle_initializer(_conv_residual_payload(activation, first, residual_mul=mul))])
    sess = dietcode_ort.InferenceSession(model, providers=CPU)
    feeds = {"X": x, "W": w, "B": b, "R": r}
    (got,) = sess.run(None, feeds)
    act = {"none": lambda v: v, "relu": lambda v: np.maximum(v, 0.0),
           "gelu": lambda v: 0.5 * v * (1.0 + np.vectorize(math.erf)(v / math.sqrt(2.0))),
           "gelu_tanh": lambda v: 0.5 * v * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3))),
           "silu": lambda v: v / (1.0 + np.exp(-v)), "relu6": lambda v: np.clip(v, 0.0, 6.0)}[activation]
    y = _conv3x3_f64(x, w, b)
    want = act(y + r) if first else act(y) * r if mul else act(y) + r
    assert not np.allclose(act(y + r), act(y) + r, atol=0.1) or activation == "none"  # the order shows
    tol = 1e-5 if dtype == np.float32 else 1e-2
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)
    for bad in (r[:1], r[:, :, :, :4], r.reshape(2, 4, 30)):
        with pytest.raises(Exception, match=r"conv_res.*residual input has shape \[.*\], not the output's "
                                            r"\[2, 4, 6, 5\] \(the fused Add takes a residual of the output's"):
            sess.run(None, feeds | {"R": bad})


def _nhwc_payload(op_type: str, channels: int, kernel: tuple[int, int], strides: tuple[int, int],
                  pads: tuple[int, int], channels_last: bool = True) -> bytes:
    """A vendor leaf and a compiled conv kernel for ``op_type`` (its bias, activation and residual), compiled for
    channels-last tensors (epilogue flags bit 4) unless ``channels_last`` is False."""
    from dietcode_ort.inspect_model import epilogue_of

    named = epilogue_of(helper.make_node(op_type, [], []))
    params = ("a", "b") + (("bias",) if "Bias" in op_type else ()) + ("c", "M", "N", "K", "img_h", "img_w", "out_h",
                                                                      "out_w") + (("residual",) if "Residual" in op_type
                                                                                  or op_type.endswith("Mul") else ())
    conv = BundleKernel(name="k", images=(("sm_90a", b"\x7fELF"),), ptx=PTX80, params=params, block_m=64,
                        block_n=64, activation=named["activation"], residual_first=named["residual_first"],
                        residual_mul=named["residual_mul"], channels_last=channels_last,
                        conv=(channels, *kernel, *strides, *pads, 1, 1))
    tree = DispatchTree((0, -1, -1), (64, 0, 0), (1, -1, -1), (2, -1, -1), (-1, 0, 1))
    return Bundle((Feature("M", ((0, 0),)),), (BundleKernel.vendor(), conv), tree).to_bytes()


# (op type, X NCHW, W OIHW, strides, pads (top, left, bottom, right), dilations)
NHWC_CASES = [
    ("ConvBiasResidualRelu", (2, 3, 7, 6), (4, 3, 3, 3), (2, 2), (1, 1, 1, 1), (1, 1)),
    ("ConvBiasReluResidual", (1, 5, 9, 8), (6, 5, 3, 2), (2, 1), (1, 0, 1, 1), (1, 2)),
    ("Conv", (2, 4, 5, 5), (3, 4, 1, 1), (1, 1), (0, 0, 0, 0), (1, 1)),
    ("ConvBiasSilu", (1, 8, 6, 7), (5, 8, 3, 3), (1, 2), (0, 1, 2, 1), (1, 1)),
    ("ConvBiasReluMul", (2, 3, 6, 5), (4, 3, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("case", NHWC_CASES, ids=[c[0] for c in NHWC_CASES])
def test_channels_last_conv_on_the_cpu_ep(case, dtype) -> None:
    """channels_last=1: X [N, H, W, C], W [OC, KH, KW, C], B [OC], the residual and Y [N, OH, OW, OC], with
    strides/pads/dilations in ONNX's (H, W) order; the CPU EP runs ORT's NCHW Conv on transposed copies and the
    epilogue on NHWC. Checked against ORT's own Conv of the NCHW tensors, permuted."""
    from dietcode_ort.inspect_model import epilogue_of

    op_type, sx, sw, strides, pads, dilations = case
    named = epilogue_of(helper.make_node(op_type, [], []))
    has_bias, has_res = "Bias" in op_type, "Residual" in op_type or op_type.endswith("Mul")
    rng = np.random.default_rng(sum(sx) + sum(sw))
    x, w = rng.standard_normal(sx).astype(dtype), rng.standard_normal(sw).astype(dtype)
    attrs = {"strides": list(strides), "pads": list(pads), "dilations": list(dilations)}
    y = ort_conv(x.astype(np.float32), w.astype(np.float32), attrs).astype(np.float64)
    b = rng.standard_normal(sw[0]).astype(dtype)
    if has_bias:
        y += b.astype(np.float64)[None, :, None, None]
    y = y.transpose(0, 2, 3, 1)  # NHWC
    r = rng.standard_normal(y.shape).astype(dtype)
    act = {"none": lambda v: v, "relu": lambda v: np.maximum(v, 0.0), "silu": lambda v: v / (1.0 + np.exp(-v))}[
        named["activation"]]
    r64 = r.astype(np.float64)
    want = (act(y + r64) if named["residual_first"] else act(y) * r64 if named["residual_mul"]
            else act(y) + r64 if has_res else act(y))
    inputs = ["X", "W"] + (["B"] if has_bias else []) + (["R"] if has_res else [])
    node = helper.make_node(op_type, inputs + ["bundle"], ["Y"], domain="ai.dietcode", name="nhwc",
                            channels_last=1, kernel_shape=list(sw[2:]), **attrs)
    elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.FLOAT16
    payload = _nhwc_payload(op_type, sx[1], sw[2:], strides, pads[:2])
    sess = dietcode_ort.InferenceSession(_model([node], inputs, elem, initializers=[bundle_initializer(payload)]),
                                         providers=CPU)
    feeds = {"X": np.ascontiguousarray(x.transpose(0, 2, 3, 1)), "W": np.ascontiguousarray(w.transpose(0, 2, 3, 1)),
             "B": b, "R": r}
    (got,) = sess.run(None, {k: v for k, v in feeds.items() if k in inputs})
    assert got.shape == want.shape and got.dtype == dtype
    tol = 1e-5 if dtype == np.float32 else 1e-2
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)
    if has_res:  # the residual is NHWC like Y: the NCHW shape is refused
        with pytest.raises(Exception, match=r"nhwc.*residual input has shape"):
            sess.run(None, {k: v for k, v in feeds.items() if k in inputs} | {"R": r.transpose(0, 3, 1, 2).copy()})


def test_channels_last_attribute_is_checked_at_session_creation() -> None:
    """channels_last other than 0/1, with group > 1, on a MatMul op type, or with a bundle compiled for the other
    layout is refused when the session is made, naming the node."""
    payload = _nhwc_payload("ConvBiasRelu", 4, (3, 3), (1, 1), (1, 1))

    def model(op_type: str, payload: bytes, **attrs) -> onnx.ModelProto:
        inputs = ["X", "W", "B"] if "Bias" in op_type else ["X", "W"]
        node = helper.make_node(op_type, inputs + ["bundle"], ["Y"], domain="ai.dietcode", name="n_cl", **attrs)
        return _model([node], inputs, TensorProto.FLOAT, initializers=[bundle_initializer(payload)])

    dietcode_ort.InferenceSession(model("ConvBiasRelu", payload, channels_last=1, pads=[1, 1, 1, 1]), providers=CPU)
    with pytest.raises(DietcodeError, match=r"node 'n_cl' .*channels_last attribute is 2; allowed: 0 \(NCHW\) or 1"):
        dietcode_ort.InferenceSession(model("ConvBiasRelu", payload, channels_last=2), providers=CPU)
    with pytest.raises(DietcodeError, match=r"node 'n_cl' .*channels_last attribute is -1"):
        dietcode_ort.InferenceSession(model("ConvBiasRelu", payload, channels_last=-1), providers=CPU)
    with pytest.raises(DietcodeError, match=r"node 'n_cl' .*channels_last=1 takes group 1 only, the node has group 2"):
        dietcode_ort.InferenceSession(model("ConvBiasRelu", payload, channels_last=1, group=2), providers=CPU)
    with pytest.raises(DietcodeError, match=r"node 'n_cl' .*channels_last attribute applies to Conv op types only"):
        dietcode_ort.InferenceSession(model("MatMul", bundle_bytes(), channels_last=0), providers=CPU)
    nchw = _nhwc_payload("ConvBiasRelu", 4, (3, 3), (1, 1), (1, 1), channels_last=False)
    with pytest.raises(DietcodeError, match=r"node 'n_cl' .*bundle kernel 1 was compiled for NCHW, the node is NHWC "
                                            r"\(channels_last=1\): optimize again"):
        dietcode_ort.InferenceSession(model("ConvBiasRelu", nchw, channels_last=1), providers=CPU)
    with pytest.raises(DietcodeError, match=r"node 'n_cl' .*bundle kernel 1 was compiled for NHWC, the node is NCHW"):
        dietcode_ort.InferenceSession(model("ConvBiasRelu", payload), providers=CPU)
    dietcode_ort.InferenceSession(model("ConvBiasRelu", nchw, channels_last=0), providers=CPU)


def test_residual_order_must_be_the_kernels() -> None:
    """A bundle whose kernels add the residual after the activation on a node whose op type adds it before (or
    the other way round) is refused at session creation, naming both, as a residual the kernel does not take is."""
    for op_type, first in (("ConvBiasResidualRelu", False), ("ConvBiasReluResidual", True)):
        node = helper.make_node(op_type, ["X", "W", "B", "R", "bundle"], ["Y"], domain="ai.dietcode", name="n0",
                                pads=[1, 1, 1, 1])
        model = _model([node], ["X", "W", "B", "R"], TensorProto.FLOAT,
                       initializers=[bundle_initializer(_conv_residual_payload("relu", first))])
        want = "adds its residual after the activation but the op type ConvBiasResidualRelu adds it before" if not \
            first else "adds its residual before the activation but the op type ConvBiasReluResidual does not"
        with pytest.raises(DietcodeError, match=want):
            dietcode_ort.InferenceSession(model, providers=CPU)
    node = helper.make_node("ConvBiasRelu", ["X", "W", "B", "bundle"], ["Y"], domain="ai.dietcode", name="n0")
    model = _model([node], ["X", "W", "B"], TensorProto.FLOAT,
                   initializers=[bundle_initializer(_conv_residual_payload("relu", True))])
    with pytest.raises(DietcodeError, match="takes a residual but the op type has none"):
        dietcode_ort.InferenceSession(model, providers=CPU)
    # a kernel multiplying by its residual on a node adding it, and the other way round
    for op_type, mul in (("ConvBiasReluResidual", True), ("ConvBiasReluMul", False)):
        node = helper.make_node(op_type, ["X", "W", "B", "R", "bundle"], ["Y"], domain="ai.dietcode", name="n0",
                                pads=[1, 1, 1, 1])
        model = _model([node], ["X", "W", "B", "R"], TensorProto.FLOAT,
                       initializers=[bundle_initializer(_conv_residual_payload("relu", False, residual_mul=mul))])
        want = f"multiplies by its residual but the op type {op_type} adds it" if mul else \
            f"adds its residual but the op type {op_type} multiplies by it"
        with pytest.raises(DietcodeError, match=want):
            dietcode_ort.InferenceSession(model, providers=CPU)
    # the op types are the library's: a residual-first name without an activation is none; so is a Mul without
    # an activation or before it, or a bias after the residual
    for name in ("ConvBiasResidualResidual", "GemmResidualBias", "ConvResidualBias", "GemmBiasResidualResidual",
                 "ConvBiasMul", "MatMulMul", "GemmBiasMul", "ConvBiasMulRelu", "MatMulSiluMulResidual"):
        node = helper.make_node(name, ["X", "W", "B", "R", "bundle"], ["Y"], domain="ai.dietcode", name="n0")
        model = _model([node], ["X", "W", "B", "R"], TensorProto.FLOAT,
                       initializers=[bundle_initializer(_conv_residual_payload("relu", True))])
        with pytest.raises(DietcodeError, match=f"ai.dietcode:{name}.* is not a registered function/op"):
            dietcode_ort.InferenceSession(model, providers=CPU)


def test_the_library_registers_exactly_the_op_types_python_names():
    """``bundle.LIBRARY_OP_TYPES`` (what inspect and doctor check a node's op type against) is the library's list: a
    graph of all of them resolves (each a registered op), and every other arrangement of a base, Bias, an
    activation, Residual and Mul (and a renamed op type as onnx.compose's prefix writes it) is unknown to it."""
    import itertools

    from dietcode_ort.bundle import ACTIVATION_OP_NAMES, LIBRARY_OP_TYPES

    acts = ACTIVATION_OP_NAMES
    names = {"Attention", "ScaledDotProductAttention", "x_MatMulPlain", "m2_ScaledDotProductAttention",
             "MatMulPlainRelu", "GemmBiasPlain", "ConvResidualBias", "MatMulReluBias"}
    for base, bias, act, tail in itertools.product(("MatMul", "Gemm", "Conv"), ("", "Bias"), acts,
                                                   ("", "Plain", "Residual", "Mul", "ResidualResidual")):
        names |= {base + bias + act + tail, base + bias + "Residual" + act + tail}
    assert LIBRARY_OP_TYPES < names and len(LIBRARY_OP_TYPES) == 137

    def refusal(op_types) -> str:
        nodes = [helper.make_node(t, ["A", "B"], [f"Y{i}" if i else "Y"], domain="ai.dietcode", name=f"n{i}")
                 for i, t in enumerate(op_types)]
        try:  # (no op type creates with two inputs and no bundle)
            ort.InferenceSession(_model(nodes, ["A", "B"], TensorProto.FLOAT).SerializeToString(), options,
                                 providers=CPU)
        except Exception as exc:  # the library's refusal of a node, or ORT's of an unknown op type
            return str(exc)
        return ""

    options = ort.SessionOptions()
    dietcode_ort.register(options)
    assert "is not a registered function/op" not in refusal(sorted(LIBRARY_OP_TYPES))
    for name in sorted(names - LIBRARY_OP_TYPES):
        assert f"ai.dietcode:{name}(-1) is not a registered function/op" in refusal([name]), name
