"""Shared kernel bundles: one uint8 initializer per distinct bundle, the last input of every node that uses it.

Covers the model size (bundle bytes counted once per workload), one parse per distinct bundle per process
(``dc_bundle_acquire``), external data, reading them back through the C core, and crafted bundle inputs with and without the
library registered: each gives a clear error at session creation or runs the fallback function, never a crash.
"""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_custom_ops import CPU, PTX80, bundle_bytes, bundle_initializer

import dietcode_ort
import tuner.rewrite as rewrite
from dietcode_ort.bundle import Bundle, BundleKernel, DispatchTree, Feature, node_bundles, read_bundle
from dietcode_ort.cli import main
from dietcode_ort.errors import DietcodeError
from dietcode_ort.inspect_model import describe
from dietcode_ort.runtime import load_core
from tuner.scan import scan_model

WIDTH = 16


def big_bundle(image_bytes: int, bias: bool = False) -> bytes:
    """A valid bundle whose cubin is ``image_bytes`` long (the CPU EP parses it and runs ORT's op)."""
    params = ("a", "b") + (("bias",) if bias else ()) + ("c", "M", "N", "K")
    cubin = b"\x7fELF" + bytes(image_bytes - 4)
    gemm = BundleKernel(name="k", images=(("sm_90a", cubin),), ptx=PTX80, params=params, block_m=64, block_n=64)
    tree = DispatchTree((0, -1, -1), (64, 0, 0), (1, -1, -1), (2, -1, -1), (-1, 0, 1))
    return Bundle((Feature("M", ((0, 0),)),), (BundleKernel.vendor(), gemm), tree).to_bytes()


def chain_model(layers: int, bias_every: int = 0) -> onnx.ModelProto:
    """X[batch, WIDTH] through ``layers`` MatMuls with WIDTH x WIDTH weights (one workload), every
    ``bias_every``-th followed by an Add(bias) (a second workload, MatMulBias)."""
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "X"
    for i in range(layers):
        inits.append(numpy_helper.from_array(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32) / 4, f"W{i}"))
        nodes.append(helper.make_node("MatMul", [x, f"W{i}"], [f"h{i}"], name=f"mm{i}"))
        x = f"h{i}"
        if bias_every and i % bias_every == 0:
            inits.append(numpy_helper.from_array(rng.standard_normal(WIDTH).astype(np.float32), f"b{i}"))
            nodes.append(helper.make_node("Add", [x, f"b{i}"], [f"a{i}"], name=f"add{i}"))
            x = f"a{i}"
    nodes.append(helper.make_node("Identity", [x], ["Y"], name="out"))
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", WIDTH])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", WIDTH])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def optimized_chain(layers: int, image_bytes: int, bias_every: int = 0) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    model = chain_model(layers, bias_every)
    workloads = list(scan_model(model).workloads)
    bundles = {n: big_bundle(image_bytes, bias=w.epilogue.bias) for w in workloads for n in w.nodes}
    return model, rewrite.rewrite_model(model, workloads, bundles).model


def _feeds() -> dict[str, np.ndarray]:
    return {"X": np.random.default_rng(1).standard_normal((3, WIDTH)).astype(np.float32)}


def _library_session(model: onnx.ModelProto | str, **opts) -> ort.InferenceSession:
    so = ort.SessionOptions()
    for k, v in opts.items():
        setattr(so, k, v)
    dietcode_ort.register(so)
    return ort.InferenceSession(model if isinstance(model, str) else model.SerializeToString(), so, providers=CPU)


def test_many_identical_layers_store_each_bundle_once() -> None:
    image = 256 * 1024
    layers = 200
    model, out = optimized_chain(layers, image, bias_every=4)
    custom = [n for n in out.graph.node if n.domain == rewrite.DOMAIN]
    assert len(custom) == layers and {n.op_type for n in custom} == {"MatMulPlain", "MatMulBias"}
    bundle_inits = [t for t in out.graph.initializer if t.data_type == TensorProto.UINT8]
    assert len(bundle_inits) == 2  # one per distinct bundle (per workload here), not one per node
    assert {n.input[-1] for n in custom} == {t.name for t in bundle_inits}
    payload_bytes = sum(t.dims[0] for t in bundle_inits)
    assert payload_bytes > 2 * image
    # The model grows by the distinct bundles plus a little per node; one copy per node would be 200 x 256 KiB.
    growth = out.ByteSize() - model.ByteSize()
    assert payload_bytes <= growth < payload_bytes + 200 * layers, (growth, payload_bytes)
    onnx.checker.check_model(out, full_check=True)
    # Stock ORT runs the fallback functions, which take the bundle input and ignore it.
    want = ort.InferenceSession(model.SerializeToString(), providers=CPU).run(None, _feeds())[0]
    got = ort.InferenceSession(out.SerializeToString(), providers=CPU).run(None, _feeds())[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_equal_bundles_share_one_initializer_across_workloads() -> None:
    model = chain_model(6, bias_every=2)
    workloads = list(scan_model(model).workloads)
    assert len(workloads) == 2
    same = bundle_bytes()  # the same bytes for both workloads: one initializer
    out = rewrite.rewrite_model(model, workloads, {n: same for w in workloads for n in w.nodes}).model
    assert len({n.input[-1] for n in out.graph.node if n.domain == rewrite.DOMAIN}) == 1
    first = workloads[0].nodes[0]  # a node of its own bundle gets its own initializer
    out = rewrite.rewrite_model(model, workloads, {n: (bundle_bytes(feature_input=1) if n == first else same)
                                                   for w in workloads for n in w.nodes}).model
    used = [n.input[-1] for n in out.graph.node if n.domain == rewrite.DOMAIN]
    assert len(set(used)) == 2 and sorted(used.count(name) for name in set(used))[0] == 1


def test_session_parses_each_distinct_bundle_once() -> None:
    core = load_core()
    model, out = optimized_chain(12, 64 * 1024, bias_every=3)
    live0, parses0 = core.cache_stats()
    sess = _library_session(out)
    live1, parses1 = core.cache_stats()
    assert (live1 - live0, parses1 - parses0) == (2, 2)  # 12 nodes, 2 distinct bundles
    sess2 = _library_session(out)  # a second session with the same bundles reuses the parses
    assert core.cache_stats() == (live1, parses1)
    want = ort.InferenceSession(model.SerializeToString(), providers=CPU).run(None, _feeds())[0]
    np.testing.assert_allclose(sess.run(None, _feeds())[0], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sess2.run(None, _feeds())[0], want, rtol=1e-5, atol=1e-5)
    del sess, sess2
    assert core.cache_stats() == (live0, parses1)  # released with the last kernel that held them


def test_acquire_shares_by_content_and_refuses_bad_bytes() -> None:
    core = load_core()
    a, b = bundle_bytes(), bundle_bytes(bias=True)
    h1 = core.lib.dc_bundle_acquire(a, len(a))
    h2 = core.lib.dc_bundle_acquire(bytes(bytearray(a)), len(a))  # equal bytes at another address
    h3 = core.lib.dc_bundle_acquire(b, len(b))
    try:
        assert h1 and h1 == h2 and h3 and h3 != h1
        assert not core.lib.dc_bundle_acquire(a[:-1], len(a) - 1)
        assert core.error().startswith("invalid kernel bundle")
        assert not core.lib.dc_bundle_acquire(b"", 0)
    finally:
        for h in (h1, h2, h3):
            core.lib.dc_bundle_release(h)


def test_external_data_bundles_run_and_read(tmp_path, monkeypatch, capsys) -> None:
    model, out = optimized_chain(8, 32 * 1024, bias_every=2)
    monkeypatch.setattr(rewrite, "_TWO_GB", 0)  # save as a model over 2 GB is saved: tensors external
    path = tmp_path / "m.onnx"
    rewrite.save_model(out, path)
    assert (tmp_path / "m.onnx.data").is_file() and path.stat().st_size < 32 * 1024
    light = onnx.load(str(path), load_external_data=False)
    bundle_init = next(t for t in light.graph.initializer if t.data_type == TensorProto.UINT8)
    assert bundle_init.data_location == TensorProto.EXTERNAL
    read = node_bundles(light, base_dir=str(tmp_path))
    assert len(read) == 8 and len({id(r.payload) for r in read}) == 2
    assert read_bundle(read[0].payload).kernels[1].name == "k"
    assert [n["bundle"]["initializer"] for n in describe(onnx.load(str(path)))] == [r.initializer for r in read]
    # inspect loads the graph without its data and reads each bundle from m.onnx.data, from any folder
    monkeypatch.chdir(tmp_path.parent)
    capsys.readouterr()
    assert main(["inspect", str(path), "--json"]) == 0
    nodes = json.loads(capsys.readouterr().out)["nodes"]
    assert [n["bundle"]["initializer"] for n in nodes] == [r.initializer for r in read]
    assert nodes[0]["kernels"][1]["name"] == "k"
    want = ort.InferenceSession(model.SerializeToString(), providers=CPU).run(None, _feeds())[0]
    np.testing.assert_allclose(_library_session(str(path)).run(None, _feeds())[0], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ort.InferenceSession(str(path), providers=CPU).run(None, _feeds())[0], want,
                               rtol=1e-5, atol=1e-5)


# --- crafted bundle inputs -------------------------------------------------------------------------------

def _crafted(bundle_init: onnx.TensorProto | None, *, graph_input: bool = False, computed: bool = False,
             second_op: str | None = None, function: bool = False) -> onnx.ModelProto:
    """n0 = MatMul(A, B, bundle); optionally n1 = <second_op>(Y0, B, [bias], bundle) sharing the bundle."""
    nodes, inputs, inits = [], ["A", "B"], []
    name = "bundle"
    if computed:
        nodes.append(helper.make_node("Identity", ["bundle_src"], ["bundle"], name="copy"))
        src = onnx.TensorProto()
        src.CopyFrom(bundle_init)
        src.name = "bundle_src"
        bundle_init = src
    if bundle_init is not None:
        inits.append(bundle_init)
    nodes.append(helper.make_node("MatMul", ["A", "B", name], ["Y0" if second_op else "Y"], domain="ai.dietcode",
                                  name="n0"))
    if second_op:
        bias = ["bias"] if "Bias" in second_op else []
        inputs += bias
        nodes.append(helper.make_node(second_op, ["Y0", "B"] + bias + [name], ["Y"], domain="ai.dietcode",
                                      name="n1"))
    value_infos = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in inputs]
    if graph_input:
        value_infos.append(helper.make_tensor_value_info(name, TensorProto.UINT8, None))
    graph = helper.make_graph(nodes, "g", value_infos, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("ai.dietcode", 2)])
    model.ir_version = 10
    if function:
        model.functions.extend(rewrite._function(op, "MatMul", _fallback_body(op), [helper.make_opsetid("", 20)], "")
                               for op in sorted({"MatMul", second_op or "MatMul"}))
    return model


def _fallback_body(op: str) -> tuple[onnx.NodeProto, ...]:
    """The original computation of a MatMul[Bias] custom node, over the function's inputs A, B[, bias]."""
    if op == "MatMul":
        return (helper.make_node("MatMul", ["A", "B"], ["Y"]),)
    return (helper.make_node("MatMul", ["A", "B"], ["t"]), helper.make_node("Add", ["t", "bias"], ["Y"]))


def _feeds2(second_op: str | None = None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2)
    feeds = {"A": rng.standard_normal((4, 8)).astype(np.float32), "B": rng.standard_normal((8, 8)).astype(np.float32)}
    if second_op and "Bias" in second_op:
        feeds["bias"] = rng.standard_normal(8).astype(np.float32)
    return feeds


GOOD = bundle_bytes()
CRAFTED = [
    ("graph_input", dict(bundle_init=None, graph_input=True), "'bundle' is not a constant initializer"),
    ("overridable_initializer", dict(bundle_init=bundle_initializer(GOOD), graph_input=True),
     "'bundle' is not a constant initializer"),
    ("computed", dict(bundle_init=bundle_initializer(GOOD), computed=True), "'bundle' is not a constant initializer"),
    ("rank2", dict(bundle_init=numpy_helper.from_array(np.frombuffer(GOOD, np.uint8).reshape(1, -1), "bundle")),
     "'bundle' must be 1-D, it has rank 2"),
    ("scalar", dict(bundle_init=numpy_helper.from_array(np.array(7, np.uint8), "bundle")),
     "'bundle' must be 1-D, it has rank 0"),
    ("empty", dict(bundle_init=numpy_helper.from_array(np.zeros(0, np.uint8), "bundle")), "'bundle' is empty"),
    ("malformed", dict(bundle_init=bundle_initializer(GOOD[:-3])), "bundle input 'bundle': invalid kernel bundle"),
    ("not_a_bundle", dict(bundle_init=bundle_initializer(b"\x00" * 40)), "invalid kernel bundle: bad magic"),
    # one bundle shared by nodes it does not fit: n1 has a bias, the bundle's compiled kernel takes none
    ("shared_misfit", dict(bundle_init=bundle_initializer(GOOD), second_op="MatMulBias"),
     "node 'n1' .*takes no bias but the op type has one"),
]


@pytest.mark.parametrize("case, kwargs, message", CRAFTED, ids=[c[0] for c in CRAFTED])
def test_crafted_bundle_input_fails_clearly_with_the_library(case, kwargs, message) -> None:
    model = _crafted(**kwargs)
    opts = {"graph_optimization_level": ort.GraphOptimizationLevel.ORT_DISABLE_ALL} if case == "computed" else {}
    with pytest.raises(Exception, match=message):
        _library_session(model, **opts)


@pytest.mark.parametrize("case, kwargs, message", CRAFTED, ids=[c[0] for c in CRAFTED])
def test_crafted_bundle_input_runs_the_fallback_without_the_library(case, kwargs, message) -> None:
    """Stock ORT runs the model-local functions, which ignore the bundle input whatever it holds; without
    functions it refuses the unknown op cleanly."""
    second = kwargs.get("second_op")
    feeds = _feeds2(second)
    if kwargs.get("graph_input") and kwargs.get("bundle_init") is None:
        feeds["bundle"] = np.frombuffer(GOOD, np.uint8)
    y0 = feeds["A"] @ feeds["B"]
    want = y0 @ feeds["B"] + feeds["bias"] if second else y0
    got = ort.InferenceSession(_crafted(**kwargs, function=True).SerializeToString(), providers=CPU).run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="ai.dietcode"):
        ort.InferenceSession(_crafted(**kwargs).SerializeToString(), providers=CPU)


@pytest.mark.parametrize("function", [False, True])
def test_bundle_of_wrong_dtype_is_refused(function) -> None:
    """A float tensor as the bundle input: with the library registered, ORT's schema check refuses it (the op
    declares uint8) at session creation, whether or not the model has the fallback function."""
    wrong = numpy_helper.from_array(np.frombuffer(GOOD[: len(GOOD) // 4 * 4], np.float32), "bundle")
    with pytest.raises(Exception, match=r"tensor\(float\).*\(bundle\).*node \(n0\)"):
        _library_session(_crafted(wrong, function=function))


def test_python_reader_refuses_what_the_library_refuses() -> None:
    with pytest.raises(DietcodeError, match="node 'n0'.*'bundle' is not a constant initializer"):
        node_bundles(_crafted(None, graph_input=True))
    with pytest.raises(DietcodeError, match="node 'n0'.*non-empty 1-D uint8"):
        node_bundles(_crafted(numpy_helper.from_array(np.zeros(0, np.uint8), "bundle")))
    old = _crafted(bundle_initializer(GOOD))
    del old.graph.node[0].input[-1]
    old.graph.node[0].attribute.append(helper.make_attribute("bundle", bundle_initializer(GOOD)))
    with pytest.raises(DietcodeError, match="as an attribute.*optimize the original model again"):
        node_bundles(old)
    assert node_bundles(_crafted(bundle_initializer(GOOD)))[0].payload == GOOD


@pytest.mark.parametrize("op, inputs, message", [
    ("MatMul", ["A", "B", ""], r"input 2 of \(A, B, bundle\) is empty"),
    ("GemmBias", ["A", "B", "", "bundle"], r"input 2 of \(A, B, bias, bundle\) is empty"),
])
def test_empty_input_names_are_refused(op, inputs, message) -> None:
    node = helper.make_node(op, inputs, ["Y"], domain="ai.dietcode", name="n0")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                                            for n in ("A", "B")],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                              [bundle_initializer(bundle_bytes(bias="Bias" in op))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("ai.dietcode", 2)])
    model.ir_version = 10
    with pytest.raises(Exception, match="node 'n0' .*" + message):
        _library_session(model)


def test_acquire_from_many_threads_parses_once() -> None:
    import threading

    core = load_core()
    data = big_bundle(4096, bias=True) + b""  # bytes no other test holds a parse of
    _, parses0 = core.cache_stats()
    handles: list[int] = []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(50):
            h = core.lib.dc_bundle_acquire(data, len(data))
            with lock:
                handles.append(h)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert len(handles) == 400 and len(set(handles)) == 1 and handles[0]
        assert core.cache_stats()[1] == parses0 + 1
    finally:
        for h in handles:
            core.lib.dc_bundle_release(h)


def test_opset1_model_runs_stock_and_is_refused_by_the_library() -> None:
    """A model written before the bundle became an input (per-node attribute, functions without a bundle
    input) still runs on stock ORT through its functions; the library names the old contract."""
    node = helper.make_node("MatMul", ["A", "B"], ["Y"], domain="ai.dietcode", name="n0")
    node.attribute.append(helper.make_attribute("bundle", bundle_initializer(GOOD)))
    body = [helper.make_node("MatMul", ["A", "B"], ["Y"])]
    function = helper.make_function("ai.dietcode", "MatMul", ["A", "B"], ["Y"], body,
                                    [helper.make_opsetid("", 20)], attributes=["bundle", "info"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "AB"],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("ai.dietcode", 1)],
                              functions=[function])
    model.ir_version = 10
    feeds = _feeds2()
    got = ort.InferenceSession(model.SerializeToString(), providers=CPU).run(None, feeds)[0]
    np.testing.assert_allclose(got, feeds["A"] @ feeds["B"], rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="node 'n0' .*bundle as an attribute.*optimize the original model again"):
        _library_session(model)
