"""tuner/affine.py: a BatchNormalization, and a Mul / Add by per-channel constants, right after a Conv, Gemm or
MatMul are folded into its weight and bias (as ONNX Runtime folds them at load, which it no longer can once the
product is a custom op); the values stay the model's."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tuner.affine import fold_affines
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
    out, result = fold_affines(model)
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
    again, second = fold_affines(out)
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
    out, result = fold_affines(model)
    assert result.folded == ("bn", "bn2")
    w1, w2 = (n.input[1] for n in out.graph.node if n.op_type == "Conv")
    assert w1 != w2 and "w" not in {t.name for t in out.graph.initializer}
    x = np.random.default_rng(2).standard_normal((2, 8, 6, 6)).astype(np.float32)
    np.testing.assert_allclose(_run(out, x), _run(model, x), rtol=1e-5, atol=1e-5)


def test_what_stays_and_why(tmp_path: Path):
    training = _model(training=True, relu=False)
    assert fold_affines(training)[1].notes == (
        ("bn", "BatchNormalization after Conv: a normalization in training mode (its running statistics are "
               "outputs)"),)
    shared = _model()
    shared.graph.node.append(helper.make_node("Identity", ["c"], ["c_copy"]))
    shared.graph.output.append(helper.make_tensor_value_info("c_copy", TensorProto.FLOAT, None))
    out, result = fold_affines(shared)
    assert result.notes == (("bn", "BatchNormalization after Conv: the Conv's output is read by another node too"),)
    assert [n.op_type for n in out.graph.node] == ["Conv", "BatchNormalization", "Relu", "Identity"]
    onnx.save(_model(), str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.data", size_threshold=0)
    lazy = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    assert "in an external file that was not read" in fold_affines(lazy)[1].notes[0][1]  # no folder given
    assert prepare_graph(lazy, None)[1][0].op == "BatchNormalization"  # scan lists it
    (tmp_path / "m.data").rename(tmp_path / "moved.data")
    assert "in an external file that was not read" in fold_affines(lazy, base_dir=tmp_path)[1].notes[0][1]
    after_matmul = _model()
    after_matmul.graph.node[0].op_type = "MatMul"  # a 4-D weight: no product the pass knows
    assert fold_affines(after_matmul)[1] == fold_affines(after_matmul)[1].__class__(())


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
    out, result = fold_affines(model)
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
    out, result = fold_affines(model)
    assert len(result.folded) == folded and result.notes == ()
    assert [n.op_type for n in out.graph.node] == ["Conv"] + [op for op, _ in ops][folded:] + ["Relu"]
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 8, 5, 7)).astype(np.float32)
    r = rng.standard_normal((2, 6, 5, 7)).astype(np.float32)
    got, want = (ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "r": r})[0] for m in (out, model))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# --- after a Gemm or MatMul ---------------------------------------------------------------------------------

def _gemm_model(ops: list[tuple[str, np.ndarray | None]], product: str = "MatMul", bias: np.ndarray | None = None,
                x_dims: list | None = None, dtype: str = "float32", **gemm: float) -> onnx.ModelProto:
    """x [n, s, 8] (``x_dims``) -> MatMul by a constant [8, 6] (or a Gemm by [6, 8] with transB=1 and
    ``gemm``'s alpha / beta) -> the bias Add (a MatMul's) or C (a Gemm's) when ``bias`` is given -> each (op,
    constant) in turn (None: the graph input ``r``, a residual)."""
    np_type, elem = _TYPES[dtype]
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((6, 8) if product == "Gemm" else (8, 6)) * 0.3).astype(np_type)
    inits = [numpy_helper.from_array(w, "w")]
    x_dims = x_dims if x_dims is not None else ["n", "s", 8]
    if product == "Gemm":
        inputs = ["x", "w"] + (["b"] if bias is not None else [])
        nodes = [helper.make_node("Gemm", inputs, ["v0"], name="gemm", transB=1, **gemm)]
    else:
        nodes = [helper.make_node("MatMul", ["x", "w"], ["v0" if bias is None else "mm"], name="matmul")]
        if bias is not None:
            nodes.append(helper.make_node("Add", ["mm", "b"], ["v0"], name="bias"))
    if bias is not None:
        inits.append(numpy_helper.from_array(bias.astype(np_type), "b"))
    for i, (op, value) in enumerate(ops):
        other = "r" if value is None else f"c{i}"
        if op == "BatchNormalization":
            for j, part in enumerate(("gamma", "beta", "mean", "var")):
                v = rng.random(6) + 0.5 if part in ("gamma", "var") else rng.standard_normal(6)
                inits.append(numpy_helper.from_array(v.astype(np_type), f"{part}{i}"))
            nodes.append(helper.make_node(op, [f"v{i}"] + [f"{p}{i}" for p in ("gamma", "beta", "mean", "var")],
                                          [f"v{i + 1}"], name=f"op{i}", epsilon=1e-3))
            continue
        if value is not None:
            inits.append(numpy_helper.from_array(value.astype(np_type), other))
        nodes.append(helper.make_node(op, [f"v{i}", other], [f"v{i + 1}"], name=f"op{i}"))
    out_dims = x_dims[:-1] + [6]
    inputs = [helper.make_tensor_value_info("x", elem, x_dims) if x_dims else
              helper.make_tensor_value_info("x", elem, None),
              helper.make_tensor_value_info("r", elem, out_dims)]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info(f"v{len(ops)}", elem, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=8)


def _same_outputs(out: onnx.ModelProto, model: onnx.ModelProto, x_shape: tuple[int, ...], dtype: str = "float32"):
    rng = np.random.default_rng(8)
    np_type = _TYPES[dtype][0]
    feeds = {"x": rng.standard_normal(x_shape).astype(np_type),
             "r": rng.standard_normal(x_shape[:-1] + (6,)).astype(np_type)}
    got, want = (ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {k: v for k, v in feeds.items() if k in {i.name for i in m.graph.input}})[0] for m in (out, model))
    tol = 2e-2 if dtype == "float16" else 1e-5
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=tol, atol=tol)


_G = np.linspace(0.5, 2.0, 6)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_layer_scale_after_a_projection_is_folded_and_the_residual_fuses(dtype):
    """CaiT's, DeiT III's and DINOv2's LayerScale: (x @ W + b) * gamma + x. Before the fold the kernel fuses
    the bias alone; after it the bias and the residual, and the Mul is gone."""
    model = _gemm_model([("Mul", _G), ("Add", None)], bias=np.arange(6) - 2.5, dtype=dtype)
    (before,) = scan_model(model).workloads
    assert (before.epilogue.bias, before.epilogue.residual) == (True, False)
    out, result = fold_affines(model)
    assert result == result.__class__(("v1",))
    assert [n.op_type for n in out.graph.node] == ["MatMul", "Add", "Add"]
    assert {t.name for t in out.graph.initializer} == {out.graph.node[0].input[1], out.graph.node[1].input[1]}
    _same_outputs(out, model, (2, 5, 8), dtype)
    (after,) = scan_model(prepare_graph(out, None)[0]).workloads
    assert (after.epilogue.bias, after.epilogue.residual) == (True, True)
    again, second = fold_affines(out)
    assert second.folded == () and again.SerializeToString() == out.SerializeToString()


@pytest.mark.parametrize("ops, bias, folded, left", [
    ([("Mul", _G)], None, 1, []),  # no bias before, none after
    ([("Div", _G), ("Add", _G - 1)], None, 1, ["Add"]),  # the Add of [N] after it is the bias (kept as it is)
    ([("Sub", _G)], None, 1, ["Add"]),  # a Sub of a constant too, as an Add of its negation
    ([("Add", np.array(1.5)), ("Mul", np.array([2.0]))], None, 2, ["Add"]),  # a scalar Add is written as [N]
    ([("Add", _G), ("Mul", _G.reshape(1, 1, 6)), ("Sub", _G)], _G, 3, ["Add"]),  # into a bias, down the chain
    ([("Mul", np.ones((5, 1)))], None, 0, ["Mul"]),  # along the rows: not per channel
    ([("Mul", _G), ("Add", None), ("Mul", _G)], _G, 1, ["Add", "Add", "Mul"]),  # stops at the residual
    ([("Mul", np.array(np.inf))], None, 0, ["Mul"]),  # 0 * inf inside the sum: not the product's inf
    ([("Mul", np.full(6, 1e20)), ("Mul", np.full(6, 1e20))], None, 1, ["Mul"]),  # W * 1e40: past float32
])
def test_per_channel_ops_after_a_matmul_are_folded(ops, bias, folded, left):
    model = _gemm_model(ops, bias=bias)
    out, result = fold_affines(model)
    assert len(result.folded) == folded and result.notes == ()
    assert [n.op_type for n in out.graph.node] == ["MatMul"] + left
    _same_outputs(out, model, (2, 5, 8))
    assert fold_affines(out)[1].folded == ()


def test_a_constant_that_could_raise_the_rank_is_not_folded_where_the_rank_is_unknown():
    """A [1, 1, N] constant after a MatMul whose input's rank is not stated might broadcast a 2-D product to 3-D:
    folded only where the model says the input is 3-D (or more)."""
    three = _G.reshape(1, 1, 6)
    assert fold_affines(_gemm_model([("Mul", three)], x_dims=[]))[1].folded == ()
    assert fold_affines(_gemm_model([("Mul", three)], x_dims=["n", 8]))[1].folded == ()
    model = _gemm_model([("Mul", three)], x_dims=["n", "s", 8])
    out, result = fold_affines(model)
    assert result.folded == ("v1",)
    _same_outputs(out, model, (3, 4, 8))


@pytest.mark.parametrize("bias, gemm", [(None, {}), (np.arange(6.0), {"beta": 0.5}),
                                        (np.array([[0.25]]), {})])
def test_a_batchnorm_after_a_gemm_is_folded_into_its_weight_and_c(bias, gemm):
    """Linear + BatchNorm1d (ORT's MatMulBNFusion folds it at load): C, scaled by beta, takes the shift; beta
    goes."""
    model = _gemm_model([("BatchNormalization", None), ("Relu", None)][:1], "Gemm", bias, ["n", 8], **gemm)
    model.graph.node.append(helper.make_node("Relu", ["v1"], ["y"]))
    model.graph.output[0].name = "y"
    out, result = fold_affines(model)
    assert result.folded == ("v1",)
    assert [n.op_type for n in out.graph.node] == ["Gemm", "Relu"]
    gemm_node = out.graph.node[0]
    assert len(gemm_node.input) == 3 and "beta" not in {a.name for a in gemm_node.attribute}
    _same_outputs(out, model, (4, 8))
    (w,) = scan_model(prepare_graph(out, None)[0]).workloads
    assert (w.epilogue.bias, w.epilogue.activation) == (True, "relu")


def test_a_batchnorm_after_a_matmul_needs_a_2d_input():
    """A BatchNormalization normalizes axis 1: a MatMul's output channels only where the product is 2-D."""
    flat = _gemm_model([("BatchNormalization", None)], x_dims=["n", 8])
    out, result = fold_affines(flat)
    assert result.folded == ("v1",) and [n.op_type for n in out.graph.node] == ["MatMul", "Add"]
    _same_outputs(out, flat, (5, 8))
    seq = _gemm_model([("BatchNormalization", None)], bias=_G)
    assert fold_affines(seq)[1].notes == (("v1", "BatchNormalization after MatMul: it normalizes axis 1 of the "
                                                 "MatMul's 3-D output, not its output channels"),)
    unknown = _gemm_model([("BatchNormalization", None)], x_dims=[])
    assert fold_affines(unknown)[1].notes == (("v1", "BatchNormalization after MatMul: it normalizes axis 1 of "
                                                     "the MatMul's output, whose rank is not known"),)
    assert prepare_graph(unknown, None)[1][0].op == "BatchNormalization"  # scan lists it


def test_a_weight_shared_by_two_matmuls_is_copied_for_the_one_folded():
    model = _gemm_model([("Mul", _G)])
    g = model.graph
    g.node.append(helper.make_node("MatMul", ["x", "w"], ["plain"], name="other"))
    g.output.append(helper.make_tensor_value_info("plain", TensorProto.FLOAT, None))
    out, result = fold_affines(model)
    assert result.folded == ("v1",)
    assert [n.input[1] for n in out.graph.node] == ["w_folded", "w"]
    x = np.random.default_rng(9).standard_normal((2, 3, 8)).astype(np.float32)
    got, want = (ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "r": x[..., :6]}) for m in (out, model))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_an_integer_product_is_left_alone():
    """(x @ W) / 2 over int32 truncates each sum; x @ (W / 2) would truncate each weight: not the same values."""
    w = numpy_helper.from_array(np.array([[3, 5], [7, 1]], dtype=np.int32), "w")
    two = numpy_helper.from_array(np.array([2, 2], dtype=np.int32), "two")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Div", ["p", "two"], ["y"])],
                              "g", [helper.make_tensor_value_info("x", TensorProto.INT32, ["n", 2])],
                              [helper.make_tensor_value_info("y", TensorProto.INT32, None)], [w, two])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=8)
    out, result = fold_affines(model)
    assert result.folded == () and out.SerializeToString() == model.SerializeToString()


@pytest.mark.parametrize("bias, gemm, scaled, dtype", [
    (np.arange(6.0), {"alpha": 2.0, "beta": 0.5}, True, "float32"), (None, {"alpha": 0.25}, True, "float16"),
    (None, {"beta": 3.0}, False, "float32"),  # no C: beta scales nothing
    (np.arange(6.0), {"alpha": 1e6}, False, "float16"),  # B * 1e6 past float16: left as it is
])
def test_a_gemms_alpha_and_beta_go_into_its_constants(bias, gemm, scaled, dtype):
    """The kernels compute A @ B + C: a Gemm scaled by alpha or beta (refused by the scanner as it is) is tuned
    once they are folded into B and C."""
    model = _gemm_model([], "Gemm", bias, ["n", 8], dtype, **gemm)
    out, result = fold_affines(model)
    assert result.scaled == (("v0",) if scaled else ())
    if scaled:
        assert not {a.name for a in out.graph.node[0].attribute} & {"alpha", "beta"}
        assert len(scan_model(out).workloads) == 1 and scan_model(model).workloads == ()
        _same_outputs(out, model, (3, 8), dtype)
    else:
        assert out.SerializeToString() == model.SerializeToString()


def test_a_transposed_weight_becomes_a_constant_unless_it_is_shared():
    """MatMul(x, Transpose(W)) (TorchScript's Linear without constant folding) reads W transposed as a constant of
    its own, which the LayerScale after it then folds into; a Transpose of a weight something else reads too (a
    tied embedding) stays."""
    rng = np.random.default_rng(10)
    w = numpy_helper.from_array(rng.standard_normal((6, 8)).astype(np.float32), "w")
    gamma = numpy_helper.from_array(_G.astype(np.float32), "gamma")
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]), helper.make_node("MatMul", ["x", "wt"], ["p"]),
             helper.make_node("Mul", ["p", "gamma"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "s", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w, gamma])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=8)
    out, result = fold_affines(model)
    assert (result.transposed, result.folded) == (("wt",), ("y",))
    assert [n.op_type for n in out.graph.node] == ["MatMul"] and [t.name for t in out.graph.initializer] == ["wt_folded"]
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    got, want = (ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0] for m in (out, model))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    model.graph.node.append(helper.make_node("Gather", ["w", "ids"], ["emb"]))  # W read by an embedding too
    model.graph.input.append(helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"]))
    model.graph.output.append(helper.make_tensor_value_info("emb", TensorProto.FLOAT, None))
    out, result = fold_affines(model)
    assert (result.transposed, result.folded) == ((), ())
    assert [n.op_type for n in out.graph.node] == ["Transpose", "MatMul", "Mul", "Gather"]



def test_scan_and_optimize_say_what_the_pre_passes_changed(tmp_path: Path, capsys):
    """The folds change the graph beyond the tuned nodes: ``scan`` (table and JSON) and ``optimize`` say how."""
    import json

    from tuner.optimize import OptimizeOptions, optimize
    from tuner.scan import scan, scan_command

    model = _gemm_model([("Mul", _G)], "Gemm", np.arange(6.0), ["n", 8], beta=0.5)
    onnx.save(model, str(tmp_path / "m.onnx"))
    want = ("1 Gemm alpha/beta folded into B and C",
            "1 BatchNormalization / per-channel Mul, Div, Add, Sub folded into the Conv, Gemm or MatMul before them")
    assert scan(tmp_path / "m.onnx").prepared == want
    scan_command(str(tmp_path / "m.onnx"), (), None, as_json=True)
    assert json.loads(capsys.readouterr().out)["prepared"] == list(want)
    scan_command(str(tmp_path / "m.onnx"), (), None, as_json=False)
    assert "graph pre-passes: " + "; ".join(want) in " ".join(capsys.readouterr().out.split())
    lines: list[str] = []
    optimize(tmp_path / "m.onnx", tmp_path / "m.opt.onnx",
             OptimizeOptions(dims=("n=1,4",), measure="analytic", budget=2, max_kernels=1, progress=False,
                             db=tmp_path / "t.db", cache_dir=tmp_path / "k"), log=lines.append)
    assert "graph pre-passes: " + "; ".join(want) in lines
    assert [n.domain for n in onnx.load(str(tmp_path / "m.opt.onnx")).graph.node] == ["ai.dietcode"]


@pytest.mark.parametrize("bias, op, folded", [(True, "Mul", True), (False, "Mul", True), (True, "Add", True),
                                              (False, "Add", False), (True, "Div", True)])
def test_a_layer_scale_behind_a_permute_is_folded(bias, op, folded):
    """torchvision's ConvNeXt block: Linear over NHWC, permute back to NCHW, then ``layer_scale * x`` ([C, 1, 1])
    and the residual. The op folds into the MatMul (its constant read along the axis the Transpose moved the
    channels to); an Add behind the permute with no bias to go into stays."""
    rng = np.random.default_rng(11)
    inits = [numpy_helper.from_array((rng.standard_normal((8, 6)) * 0.3).astype(np.float32), "w"),
             numpy_helper.from_array(_G.reshape(6, 1, 1).astype(np.float32), "gamma")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"])]
    if bias:
        inits.append(numpy_helper.from_array(np.arange(6, dtype=np.float32), "b"))
        nodes.append(helper.make_node("Add", ["mm", "b"], ["lin"]))
    nodes += [helper.make_node("Transpose", ["lin" if bias else "mm"], ["nchw"], perm=[0, 3, 1, 2]),
              helper.make_node(op, ["nchw", "gamma"], ["scaled"]), helper.make_node("Add", ["scaled", "r"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "h", "w", 8]),
              helper.make_tensor_value_info("r", TensorProto.FLOAT, ["n", 6, "h", "w"])]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=8)
    out, result = fold_affines(model)
    assert result.folded == (("scaled",) if folded else ())
    ops = [n.op_type for n in out.graph.node]
    assert ops == ["MatMul"] + ["Add"] * bias + ["Transpose"] + ([] if folded else [op]) + ["Add"]
    x = rng.standard_normal((2, 3, 5, 8)).astype(np.float32)
    r = rng.standard_normal((2, 6, 3, 5)).astype(np.float32)
    got, want = (ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "r": r})[0] for m in (out, model))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert fold_affines(out)[1].folded == ()
    # the channels along another axis than the one the Transpose moved them to: not per channel
    model.graph.initializer[1].CopyFrom(numpy_helper.from_array(_G.reshape(1, 6, 1).astype(np.float32), "gamma"))
    assert fold_affines(model)[1].folded == ()


def test_weights_in_an_external_data_file_are_folded(tmp_path: Path):
    """torch's dynamo exporter writes the weights to a data file beside the model, and scan and optimize load
    models without their data (the weights stream from file to file): the folds read what they change from
    there, and the optimized model, its data file included, gives the original outputs."""
    import dietcode_ort
    from tuner.optimize import OptimizeOptions, optimize
    from tuner.scan import scan

    src = tmp_path / "m.onnx"
    onnx.save(_model(), str(src), save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    assert scan(src).prepared == ("1 BatchNormalization / per-channel Mul, Div, Add, Sub folded into the Conv, "
                                  "Gemm or MatMul before them",)
    dst = tmp_path / "m.opt.onnx"
    optimize(src, dst, OptimizeOptions(dims=("n=1,2", "h=4,8", "w=4,8"), measure="analytic", budget=2,
                                       max_kernels=1, progress=False, db=tmp_path / "t.db",
                                       cache_dir=tmp_path / "k"), log=lambda _: None)
    assert [n.domain for n in onnx.load(str(dst)).graph.node] == ["ai.dietcode"]  # the Conv, its BN and Relu
    x = np.random.default_rng(12).standard_normal((2, 8, 5, 6)).astype(np.float32)
    want = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = dietcode_ort.InferenceSession(str(dst), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
