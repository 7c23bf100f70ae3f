"""tuner/const_fold.py: small nodes of constants (an export without constant folding's attention scale,
``Cast(Sqrt(Constant))``) are evaluated into initializers, as ORT folds them at load; the outputs stay the model's."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tuner.const_fold import MAX_ELEMENTS, fold_constants


def _model(extra: list[onnx.NodeProto] = (), ir_version: int = 8, opset: int = 17) -> onnx.ModelProto:
    """y = x * Cast(Sqrt(0.25)) (torch's SDPA scale without constant folding), then ``extra`` nodes."""
    nodes = [helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.array(0.25), "c")),
             helper.make_node("Sqrt", ["c"], ["s"]), helper.make_node("Cast", ["s"], ["f"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["x", "f"], ["y"]), *extra]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir_version)


def _outputs(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # ORT's own folding off
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        None, feeds)


def test_a_scale_computed_from_constants_becomes_one():
    model = _model()
    out, result = fold_constants(model)
    assert result.folded == ("s", "f")
    assert [n.op_type for n in out.graph.node] == ["Mul"]  # the Constant only they read goes too
    (f,) = out.graph.initializer
    assert f.name == "f" and f.data_type == TensorProto.FLOAT and numpy_helper.to_array(f) == np.float32(0.5)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(_outputs(out, {"x": x})[0], _outputs(model, {"x": x})[0])
    again, second = fold_constants(out)
    assert second.folded == () and again.SerializeToString() == out.SerializeToString()


def test_a_shape_table_is_evaluated_at_the_models_opset():
    """Reshape's target from Concat(Unsqueeze(constants)): Unsqueeze takes its axes as an attribute before
    opset 13 and as an input from it; each model is evaluated at its own opset."""
    for opset in (11, 13):
        axes = {"axes": [0]} if opset < 13 else {}
        inputs = ["a"] if opset < 13 else ["a", "zero"]
        nodes = [helper.make_node("Constant", [], ["a"], value=numpy_helper.from_array(np.array(2, np.int64))),
                 helper.make_node("Constant", [], ["zero"], value=numpy_helper.from_array(np.array([0], np.int64))),
                 helper.make_node("Unsqueeze", inputs, ["u"], **axes),
                 helper.make_node("Constant", [], ["minus"], value=numpy_helper.from_array(np.array([-1], np.int64))),
                 helper.make_node("Concat", ["minus", "u"], ["shape"], axis=0),
                 helper.make_node("Reshape", ["y", "shape"], ["z"])]
        model = _model(nodes, opset=opset)
        model.graph.output[0].name = "z"
        out, result = fold_constants(model)
        assert result.folded == ("s", "f", "u", "shape")
        assert numpy_helper.to_array(next(t for t in out.graph.initializer if t.name == "shape")).tolist() == [-1, 2]
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        np.testing.assert_array_equal(_outputs(out, {"x": x})[0], _outputs(model, {"x": x})[0])


def test_constants_of_every_numeric_form_are_read():
    """Opset 12's value_float / value_ints forms of Constant feed a fold like a tensor value does."""
    nodes = [helper.make_node("Constant", [], ["half"], value_float=0.5),
             helper.make_node("Constant", [], ["dims"], value_ints=[2, 2]),
             helper.make_node("ConstantOfShape", ["dims"], ["ones"],
                              value=numpy_helper.from_array(np.ones(1, np.float32))),
             helper.make_node("Mul", ["ones", "half"], ["table"]), helper.make_node("Add", ["y", "table"], ["z"])]
    model = _model(nodes)
    model.graph.output[0].name = "z"
    out, result = fold_constants(model)
    assert result.folded == ("s", "f", "ones", "table")
    x = np.arange(8, dtype=np.float32).reshape(2, 4)[:, :2].copy()
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 2
    out.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 2
    np.testing.assert_array_equal(_outputs(out, {"x": x})[0], _outputs(model, {"x": x})[0])


def test_what_stays():
    # an initializer a caller can override (a graph input too, IR 4 on) is no constant
    model = _model()
    model.graph.node[0].CopyFrom(helper.make_node("Identity", ["c"], ["c_id"]))
    model.graph.node[1].input[0] = "c_id"
    model.graph.initializer.append(numpy_helper.from_array(np.array(0.25), "c"))
    model.graph.input.append(helper.make_tensor_value_info("c", TensorProto.DOUBLE, []))
    assert fold_constants(model)[1].folded == ()
    model.ir_version, model.opset_import[0].version = 3, 9  # before IR 4 every initializer is an input
    assert fold_constants(model)[1].folded == ("c_id", "s", "f")
    # a graph output, a result past MAX_ELEMENTS, an op that is not deterministic
    shown = _model()
    shown.graph.output.append(helper.make_tensor_value_info("s", TensorProto.DOUBLE, None))
    assert fold_constants(shown)[1].folded == ()  # and the Cast of it with it
    big = _model([helper.make_node("Constant", [], ["n"], value=numpy_helper.from_array(
                      np.array([MAX_ELEMENTS + 1], np.int64))),
                  helper.make_node("ConstantOfShape", ["n"], ["zeros"]),
                  helper.make_node("RandomUniformLike", ["f"], ["noise"])])
    out, result = fold_constants(big)
    assert result.folded == ("s", "f")
    assert {n.op_type for n in out.graph.node} >= {"ConstantOfShape", "RandomUniformLike"}


def test_an_export_without_constant_folding_is_tuned_like_a_folded_one(tmp_path: Path):
    """BERT through TorchScript with do_constant_folding=False: every Linear is a MatMul of Transpose(W) and its
    SDPA scale is Cast(Sqrt(Constant)). With both made constants (tuner/affine.py, this pass), it gives the
    workloads of its folded export (constant weights) and the same attention chains, each reading Q, K and V
    packed from one merged projection."""
    pytest.importorskip("transformers")
    import torch
    from _corpus import bert
    from tuner.scan import attention_report, scan

    model = bert()
    seen = []
    for folding in (True, False):
        path = tmp_path / f"bert-{folding}.onnx"
        torch.onnx.export(model.module, model.example, str(path), input_names=list(model.inputs),
                          output_names=["y"], dynamo=False, do_constant_folding=folding,
                          dynamic_axes={n: {0: "batch", 1: "sequence"} for n in model.inputs})
        workloads = sorted((w.op, w.m, w.n, w.k, w.batch, w.const_operands, repr(w.epilogue), len(w.nodes))
                           for w in scan(path).workloads)
        seen.append((workloads, [(f["layout"], f["packed_qkv"], f["transposes_kept"])
                                 for f in attention_report(path)["fused"]]))
    assert seen[0] == seen[1]
    workloads, chains = seen[1]
    assert any(w[5] == (1,) for w in workloads) and len(chains) == 2 and all(packed for _, packed, _ in chains)


@pytest.mark.parametrize("node, consts", [
    (helper.make_node("ConstantOfShape", ["a"], ["o"]), {"a": np.array([10 ** 6, 10 ** 6], np.int64)}),
    (helper.make_node("Range", ["a", "b", "c"], ["o"]),
     {"a": np.array(0, np.int64), "b": np.array(10 ** 12, np.int64), "c": np.array(1, np.int64)}),
    (helper.make_node("Expand", ["a", "b"], ["o"]), {"a": np.ones(1, np.float32), "b": np.array([10 ** 9], np.int64)}),
    (helper.make_node("Where", ["a", "b", "c"], ["o"]),
     {"a": np.ones((4000, 1, 1), bool), "b": np.ones((1, 4000, 1), np.float32), "c": np.ones((1, 1, 4000), np.float32)}),
])
def test_a_crafted_constant_too_large_to_build_is_not_built(node, consts):
    """The size is known before the evaluator runs: a ConstantOfShape of 10**12 values is never allocated."""
    inits = [numpy_helper.from_array(v, k) for k, v in consts.items()]
    graph = helper.make_graph([node, helper.make_node("Shape", ["o"], ["y"])], "g", [],
                              [helper.make_tensor_value_info("y", TensorProto.INT64, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    out, result = fold_constants(model)
    assert result.folded == () and [n.op_type for n in out.graph.node] == [node.op_type, "Shape"]


def test_a_transpose_is_folded_over_integers_only():
    """TorchScript's ``F.pad`` computes the Pad's pads through a Transpose of an int64 table (the scanner found
    every Conv after such a Pad data-dependent when that Transpose stayed); a small weight's Transpose is a weight
    (tuner/affine.py owns those) and stays."""
    table = numpy_helper.from_array(np.array([[0, 0], [1, 1]], np.int64), "table")
    weight = numpy_helper.from_array(np.ones((4, 3), np.float32), "w")
    extra = [helper.make_node("Transpose", ["table"], ["pads_t"], perm=[1, 0]),
             helper.make_node("Transpose", ["w"], ["w_t"], perm=[1, 0]),
             *(helper.make_node("RandomUniformLike", [v], [f"{v}_reader"], dtype=TensorProto.FLOAT)  # kept: read
               for v in ("pads_t", "w_t"))]
    model = _model(extra)
    model.graph.initializer.extend([table, weight])
    out, result = fold_constants(model)
    assert "pads_t" in result.folded and "w_t" not in result.folded
    folded = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    assert folded["pads_t"].tolist() == [[0, 1], [0, 1]]
    assert [n.op_type for n in out.graph.node].count("Transpose") == 1
