"""tuner/conv_affine.py: a BatchNormalization, and a Mul / Add by per-channel constants, right after a Conv are
folded into the Conv's weight and bias (as ONNX Runtime folds them at load, which it no longer can once the Conv is
a custom op); the values stay the model's."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tuner.conv_affine import fold_conv_affines
from tuner.scan import prepare_graph, scan_model

_TYPES = {"float32": (np.float32, TensorProto.FLOAT), "float16": (np.float16, TensorProto.FLOAT16)}


def _model(dtype: str = "float32", bias: bool = True, group: int = 1, rank: int = 2, relu: bool = True,
           training: bool = False) -> onnx.ModelProto:
    """x [n, 8, h(, w)] -> Conv 8 -> 6 (3-wide window, pads 1) -> BatchNormalization -> (Relu)."""
    np_type, elem = _TYPES[dtype]
    rng = np.random.default_rng(0)
    window = (3,) * rank
    inits = [numpy_helper.from_array((rng.standard_normal((6, 8 // group, *window)) * 0.3).astype(np_type), "w"),
             numpy_helper.from_array(rng.standard_normal(6).astype(np_type), "b"),
             numpy_helper.from_array((rng.random(6) + 0.5).astype(np_type), "gamma"),
             numpy_helper.from_array(rng.standard_normal(6).astype(np_type), "beta"),
             numpy_helper.from_array(rng.standard_normal(6).astype(np_type), "mean"),
             numpy_helper.from_array((rng.random(6) + 0.1).astype(np_type), "var")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"] if bias else ["x", "w"], ["c"], name="conv", group=group,
                              pads=[1] * (2 * rank)),
             helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"],
                              ["bn", "running_mean", "running_var"] if training else ["bn"], name="bn", epsilon=1e-3,
                              **({"training_mode": 1} if training else {}))]
    if relu:
        nodes.append(helper.make_node("Relu", ["bn"], ["y"]))
    dims = ["n", 8, "h", "w"][:2 + rank]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", elem, dims)],
                              [helper.make_tensor_value_info("y" if relu else "bn", elem, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=8)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # ORT's own fold off
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]


@pytest.mark.parametrize("dtype, bias, group, rank", [
    ("float32", True, 1, 2), ("float32", False, 1, 2), ("float32", True, 2, 2), ("float32", False, 1, 1),
    ("float16", True, 1, 2), ("float16", False, 2, 2),
])
def test_a_batchnorm_after_a_conv_is_folded_into_it(dtype, bias, group, rank):
    model = _model(dtype, bias, group, rank)
    out, result = fold_conv_affines(model)
    assert result.folded == ("bn",) and result.notes == ()
    assert [n.op_type for n in out.graph.node] == ["Conv", "Relu"]
    conv = out.graph.node[0]
    assert conv.output[0] == "bn" and len(conv.input) == 3
    left = {t.name for t in out.graph.initializer}
    assert set(conv.input[1:]) <= left and not left & {"w", "gamma", "beta", "mean", "var"}  # the parameters go
    rng = np.random.default_rng(1)
    tol = 2e-2 if dtype == "float16" else 1e-5
    for shape in ((1, 8, 5, 7), (3, 8, 12, 4)):
        x = rng.standard_normal(shape[:2 + rank]).astype(_TYPES[dtype][0])
        np.testing.assert_allclose(_run(out, x).astype(np.float32), _run(model, x).astype(np.float32), rtol=tol,
                                   atol=tol)
    again, second = fold_conv_affines(out)
    assert second.folded == () and again.SerializeToString() == out.SerializeToString()
    # the scanner then fuses the bias and the Relu that followed the normalization
    (w,) = scan_model(prepare_graph(out, None)[0]).workloads
    assert (w.epilogue.bias, w.epilogue.activation) == (True, "relu")


def test_a_weight_shared_by_two_convs_is_folded_per_conv():
    model = _model(relu=False)
    g = model.graph
    g.node.extend([helper.make_node("Conv", ["x", "w"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
                   helper.make_node("BatchNormalization", ["c2", "var", "mean", "beta", "gamma"], ["bn2"], name="bn2"),
                   helper.make_node("Add", ["bn", "bn2"], ["y"])])
    g.output[0].name = "y"
    out, result = fold_conv_affines(model)
    assert result.folded == ("bn", "bn2")
    w1, w2 = (n.input[1] for n in out.graph.node if n.op_type == "Conv")
    assert w1 != w2 and "w" not in {t.name for t in out.graph.initializer}
    x = np.random.default_rng(2).standard_normal((2, 8, 6, 6)).astype(np.float32)
    np.testing.assert_allclose(_run(out, x), _run(model, x), rtol=1e-5, atol=1e-5)


def test_what_stays_and_why(tmp_path: Path):
    training = _model(training=True, relu=False)
    assert fold_conv_affines(training)[1].notes == (
        ("bn", "BatchNormalization after Conv: a normalization in training mode (its running statistics are "
               "outputs)"),)
    shared = _model()
    shared.graph.node.append(helper.make_node("Identity", ["c"], ["c_copy"]))
    shared.graph.output.append(helper.make_tensor_value_info("c_copy", TensorProto.FLOAT, None))
    out, result = fold_conv_affines(shared)
    assert result.notes == (("bn", "BatchNormalization after Conv: the Conv's output is read by another node too"),)
    assert [n.op_type for n in out.graph.node] == ["Conv", "BatchNormalization", "Relu", "Identity"]
    onnx.save(_model(), str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.data", size_threshold=0)
    lazy = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    assert "in an external file" in fold_conv_affines(lazy)[1].notes[0][1]
    assert prepare_graph(lazy, tmp_path)[1][0].op == "BatchNormalization"  # scan lists it
    after_matmul = _model()
    after_matmul.graph.node[0].op_type = "MatMul"  # a normalization not after a Conv is not the pass's
    assert fold_conv_affines(after_matmul)[1] == fold_conv_affines(after_matmul)[1].__class__(())


def test_an_export_without_constant_folding_is_tuned_like_a_folded_one(tmp_path: Path):
    """ResNet-18 exported with do_constant_folding=False keeps its 20 BatchNormalizations: all are folded, every
    conv takes its Relu (and residual) again, and the optimized model gives the original outputs."""
    torch = pytest.importorskip("torch")
    import dietcode_ort
    from _corpus import _randomize, _resnet18_module
    from tuner.optimize import OptimizeOptions, optimize

    module = _resnet18_module()
    _randomize(module)
    src, dst = tmp_path / "r18.onnx", tmp_path / "r18.opt.onnx"
    torch.onnx.export(module.eval(), (torch.randn(2, 3, 64, 48),), str(src), input_names=["x"], output_names=["y"],
                      dynamo=False, do_constant_folding=False, dynamic_axes={"x": {0: "batch", 2: "h", 3: "w"}})
    assert sum(n.op_type == "BatchNormalization" for n in onnx.load(str(src)).graph.node) == 20
    optimize(src, dst, OptimizeOptions(dims=("batch=1,2", "h=32,64", "w=32,64"), measure="analytic", budget=4,
                                       progress=False, db=tmp_path / "t.db", cache_dir=tmp_path / "k"),
             log=lambda _: None)
    ops = [n.op_type for n in onnx.load(str(dst)).graph.node]
    assert "BatchNormalization" not in ops and "Conv" not in ops and "Relu" not in ops
    stock = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    tuned = dietcode_ort.InferenceSession(str(dst), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(3).standard_normal((3, 3, 40, 56)).astype(np.float32)
    np.testing.assert_allclose(tuned.run(None, {"x": x})[0], stock.run(None, {"x": x})[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("opset, ir, spatial", [(7, 3, 1), (9, 4, None), (7, 3, 0)])
def test_old_opsets_fold_too_but_not_per_element_statistics(opset, ir, spatial):
    """Opset 7's ``spatial`` attribute (1: per-channel statistics, the only form folded) and an IR 3 model that
    lists its initializers as graph inputs (the folded parameters leave the inputs with them)."""
    model = _model(relu=False)
    model.opset_import[0].version, model.ir_version = opset, ir
    if spatial is not None:
        model.graph.node[1].attribute.append(helper.make_attribute("spatial", spatial))
    if ir < 4:
        model.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                                 for t in model.graph.initializer)
    out, result = fold_conv_affines(model)
    if spatial == 0:
        assert result.notes == (("bn", "BatchNormalization after Conv: spatial=0 (per-element statistics)"),)
        return
    assert result.folded == ("bn",) and [i.name for i in out.graph.input] == ["x"]
    x = np.random.default_rng(4).standard_normal((2, 8, 5, 6)).astype(np.float32)
    np.testing.assert_allclose(_run(out, x), _run(model, x), rtol=1e-5, atol=1e-5)


def _affine_model(ops: list[tuple[str, np.ndarray | None]]) -> onnx.ModelProto:
    """x [n, 8, h, w] -> Conv 8 -> 6 (no bias) -> each (op, constant) in turn (None: the graph input ``r``,
    a residual) -> Relu."""
    rng = np.random.default_rng(5)
    inits = [numpy_helper.from_array((rng.standard_normal((6, 8, 3, 3)) * 0.3).astype(np.float32), "w")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["v0"], name="conv", pads=[1, 1, 1, 1])]
    for i, (op, value) in enumerate(ops):
        other = "r" if value is None else f"c{i}"
        if value is not None:
            inits.append(numpy_helper.from_array(value.astype(np.float32), other))
        nodes.append(helper.make_node(op, [f"v{i}", other], [f"v{i + 1}"], name=f"op{i}"))
    nodes.append(helper.make_node("Relu", [f"v{len(ops)}"], ["y"]))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8, "h", "w"]),
              helper.make_tensor_value_info("r", TensorProto.FLOAT, ["n", 6, "h", "w"])]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=8)


_C = np.arange(1, 7, dtype=np.float32)


@pytest.mark.parametrize("ops, folded", [
    # frozen batch norm (torchvision's detection backbones): x * scale + shift with [1, C, 1, 1] constants
    ([("Mul", _C.reshape(1, 6, 1, 1) / 4), ("Add", _C.reshape(1, 6, 1, 1) - 3)], 2),
    ([("Mul", np.array(0.5)), ("Sub", _C.reshape(6, 1, 1)), ("Div", np.array([2.0]))], 3),  # scalars, [C, 1, 1]
    ([("Add", _C.reshape(1, 6, 1, 1)), ("Add", None)], 1),  # the residual Add (not a constant) stays for the scanner
    ([("Mul", np.ones((1, 1, 1, 7)))], 0),  # along the width: not per channel
    ([("Mul", np.zeros((1, 6, 1, 1))), ("Div", np.zeros(1))], 1),  # a Div by 0 stays (ORT's inf and nan)
])
def test_per_channel_mul_and_add_after_a_conv_are_folded(ops, folded):
    model = _affine_model(ops)
    out, result = fold_conv_affines(model)
    assert len(result.folded) == folded and result.notes == ()
    assert [n.op_type for n in out.graph.node] == ["Conv"] + [op for op, _ in ops][folded:] + ["Relu"]
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 8, 5, 7)).astype(np.float32)
    r = rng.standard_normal((2, 6, 5, 7)).astype(np.float32)
    got, want = (ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "r": r})[0] for m in (out, model))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
