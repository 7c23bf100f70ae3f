"""The Pad fold (tuner/conv_pad.py): a zero Pad before a Conv goes into the Conv's pads, the same values as
the original on onnxruntime with its graph optimizations off; every other Pad stays."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from tuner.conv_pad import fold_pads
from tuner.scan import prepare_graph, scan_model

RNG = np.random.default_rng(3)


def _i64(name: str, values) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _model(pad: onnx.NodeProto, conv_attrs: dict, inits=(), opset: int = 17, rank: int = 4,
           extra_nodes=(), outputs=("y",)) -> onnx.ModelProto:
    """x [n, 3, h, w] (rank 3: [n, 3, l]) -> ``pad`` (making "p") -> Conv(p, W[4, 3, 3(, 3)], B) -> y."""
    kernel = (3,) * (rank - 2)
    spatial = ["h", "w"][: rank - 2] if rank == 4 else ["l"]
    w = numpy_helper.from_array(RNG.standard_normal((4, 3, *kernel)).astype(np.float32), "w")
    b = numpy_helper.from_array(RNG.standard_normal(4).astype(np.float32), "b")
    conv = helper.make_node("Conv", ["p", "w", "b"], ["y"], name="conv", **conv_attrs)
    graph = helper.make_graph([pad, conv, *extra_nodes], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, *spatial])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
                              [w, b, *inits])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _pad(pads, mode: str | None = None, value: str = "", axes: str = "") -> tuple[onnx.NodeProto, list]:
    inputs = ["x", "pads"] + ([value] if value or axes else []) + ([axes] if axes else [])
    attrs = {"mode": mode} if mode else {}
    return helper.make_node("Pad", inputs, ["p"], name="pad", **attrs), [_i64("pads", pads)]


def _run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # no PadFusion of its own
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(
        None, {"x": x})


def _conv_pads(model: onnx.ModelProto) -> list[int] | None:
    conv = next(n for n in model.graph.node if n.op_type == "Conv")
    attrs = {a.name: helper.get_attribute_value(a) for a in conv.attribute}
    assert "auto_pad" not in attrs or attrs["auto_pad"] in (b"NOTSET", "NOTSET")
    return list(attrs.get("pads", []))


def _folds(model: onnx.ModelProto, x_shape, want_pads) -> None:
    folded, result = fold_pads(model)
    assert result.folded == ("y",)
    assert [n.op_type for n in folded.graph.node] == ["Conv"] and _conv_pads(folded) == want_pads
    assert not {t.name for t in folded.graph.initializer} & {"pads", "zero"}  # the Pad's constants went with it
    x = RNG.standard_normal(x_shape).astype(np.float32)
    np.testing.assert_allclose(_run(folded, x)[0], _run(model, x)[0], rtol=1e-5, atol=1e-5)
    again, second = fold_pads(folded)
    assert second.folded == () and again == folded


def test_keras_zero_padding_before_a_valid_stride_2_conv():
    """ZeroPadding2D(((0, 1), (0, 1))) then a 'valid' 3x3 stride-2 conv (Keras MobileNetV2 through tf2onnx)."""
    pad, inits = _pad([0, 0, 0, 0, 0, 0, 1, 1])
    _folds(_model(pad, {"strides": [2, 2], "auto_pad": "VALID"}, inits), (2, 3, 9, 8), [0, 0, 1, 1])


def test_pads_add_to_the_convs_own_and_an_explicit_zero_value():
    pad, inits = _pad([0, 0, 2, 1, 0, 0, 0, 3], mode="constant", value="zero")
    model = _model(pad, {"pads": [1, 1, 1, 1]}, inits + [numpy_helper.from_array(np.array(0.0, np.float32), "zero")])
    _folds(model, (1, 3, 7, 6), [3, 2, 1, 4])


def test_opset_10_pad_attributes_and_a_1d_conv():
    pad = helper.make_node("Pad", ["x"], ["p"], name="pad", pads=[0, 0, 2, 0, 0, 1], value=0.0)
    model = _model(pad, {"pads": [0, 1]}, opset=10, rank=3)
    _folds(model, (2, 3, 11), [2, 2])


def test_pads_from_a_constant_node():
    const = helper.make_node("Constant", [], ["pc"], value=_i64("v", [0, 0, 1, 1, 0, 0, 1, 1]))
    pad = helper.make_node("Pad", ["x", "pc"], ["p"], name="pad")
    model = _model(pad, {})
    model.graph.node.insert(0, const)
    _folds(model, (1, 3, 5, 5), [1, 1, 1, 1])


@pytest.mark.parametrize("case", ["reflect", "value", "channels", "negative", "axes", "computed", "two_readers",
                                  "graph_output", "same_conv"])
def test_other_pads_stay(case):
    """A Pad whose border is not zeros, that pads the batch or channels, crops, names its axes, has pads only
    known at run time, or whose output something else reads too, and a Pad before a SAME conv, stay."""
    pads = [0, 0, 1, 1, 0, 0, 1, 1]
    pad, inits = _pad(pads)
    kwargs: dict = {}
    attrs: dict = {}
    if case == "reflect":
        pad, inits = _pad(pads, mode="reflect")
    elif case == "value":
        pad, inits = _pad(pads, value="one")
        inits.append(numpy_helper.from_array(np.array(1.0, np.float32), "one"))
    elif case == "channels":
        pad, inits = _pad([0, 1, 1, 1, 0, 0, 1, 1])
    elif case == "negative":
        pad, inits = _pad([0, 0, -1, 1, 0, 0, 1, 1])
    elif case == "axes":
        pad, inits = _pad([1, 1, 1, 1], axes="ax")
        inits.append(_i64("ax", [2, 3]))
        kwargs["opset"] = 18
    elif case == "computed":
        pad = helper.make_node("Pad", ["x", "pads_abs"], ["p"], name="pad")
        kwargs["extra_nodes"] = [helper.make_node("Abs", ["pads"], ["pads_abs"])]
    elif case == "two_readers":
        kwargs["extra_nodes"] = [helper.make_node("Relu", ["p"], ["r"])]
        kwargs["outputs"] = ("y", "r")
    elif case == "graph_output":
        kwargs["outputs"] = ("y", "p")
    else:
        attrs = {"auto_pad": "SAME_UPPER"}
    model = _model(pad, attrs, inits, **kwargs)
    folded, result = fold_pads(model)
    assert result.folded == () and folded == model


def test_scan_sees_the_folded_pads():
    """As scan and optimize prepare the graph: the Conv's workload has the Pad's pads, and the pass says so."""
    pad, inits = _pad([0, 0, 0, 0, 0, 0, 1, 1])
    prepared = prepare_graph(_model(pad, {"strides": [2, 2]}, inits), None)
    assert "1 zero Pad(s) folded into the Conv after them" in " ".join(prepared.changes)
    (workload,) = scan_model(prepared.model).workloads
    assert workload.conv is not None and workload.conv.pads == (0, 0, 1, 1) and workload.conv.strides == (2, 2)
