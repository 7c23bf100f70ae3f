"""tuner/conv1d.py: 1-D convs written as 2-D ones of height 1 compute exactly what they did (checked through
onnxruntime), in each opset form and weight layout, and optimize tunes them, their bias and Gelu fused."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import dietcode_ort
from tuner.conv1d import convs_as_2d
from tuner.optimize import OptimizeOptions, optimize
from tuner.scan import scan_model

RNG = np.random.default_rng(0)


def _w(name: str, shape: tuple[int, ...]) -> onnx.TensorProto:
    return numpy_helper.from_array((RNG.standard_normal(shape) * 0.3).astype(np.float32), name)


def _model(nodes, inits, opset: int = 17, ir: int = 10, inputs_too: bool = False) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4, "l"])
    inputs = [x] + ([helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits]
                    if inputs_too else [])
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", None, None])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir
    return model


def _front_end(opset: int = 17, **conv2) -> onnx.ModelProto:
    """Whisper's front end: Conv1d(k 3, pad 1) + bias -> Gelu (erf form) -> Conv1d(k 3, stride 2, pad 1) -> Relu."""
    gelu = [helper.make_node("Div", ["c1", "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
            helper.make_node("Add", ["e", "one"], ["f"]), helper.make_node("Mul", ["c1", "f"], ["h"]),
            helper.make_node("Mul", ["h", "half"], ["g1"])]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", kernel_shape=[3], pads=[1, 1]),
             *gelu,
             helper.make_node("Conv", ["g1", "w2", "b2"], ["c2"], name="conv2",
                              **(conv2 or {"strides": [2], "pads": [1, 1]})),
             helper.make_node("Relu", ["c2"], ["y"])]
    consts = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in
              (("sqrt2", np.sqrt(2)), ("one", 1.0), ("half", 0.5))]
    return _model(nodes, [_w("w1", (8, 4, 3)), _w("b1", (8,)), _w("w2", (6, 8, 3)), _w("b2", (6,)), *consts], opset)


def _agree(a: onnx.ModelProto, b: onnx.ModelProto, lengths=(1, 5, 16, 33)) -> None:
    sa = ort.InferenceSession(a.SerializeToString(), providers=["CPUExecutionProvider"])
    sb = ort.InferenceSession(b.SerializeToString(), providers=["CPUExecutionProvider"])
    for n, length in zip((1, 2, 3, 1), lengths):
        x = RNG.standard_normal((n, 4, length)).astype(np.float32)
        np.testing.assert_allclose(sb.run(None, {"x": x})[0], sa.run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opset", [11, 13, 17, 20])
def test_two_d_form_computes_the_same_in_each_opset(opset):
    """Unsqueeze/Squeeze take their axes as an attribute before opset 13, as an input from 13 on."""
    model = _front_end(opset)
    out, result = convs_as_2d(model)
    assert result.converted == ("c1", "c2") and model.graph.node[0].op_type == "Conv"  # the input is a copy
    ops = [n.op_type for n in out.graph.node]
    assert ops.count("Unsqueeze") == ops.count("Squeeze") == 2
    convs = [n for n in out.graph.node if n.op_type == "Conv"]
    attrs = [{a.name: list(a.ints) for a in c.attribute} for c in convs]
    assert attrs == [{"kernel_shape": [1, 3], "pads": [0, 1, 0, 1]}, {"strides": [1, 2], "pads": [0, 1, 0, 1]}]
    assert [list(t.dims) for t in out.graph.initializer if t.name in ("w1", "w2")] == [[8, 4, 1, 3], [6, 8, 1, 3]]
    squeeze = next(n for n in out.graph.node if n.op_type == "Squeeze")
    assert (len(squeeze.input) == 2) == (opset >= 13)
    onnx.checker.check_model(out)
    _agree(model, out)
    again, second = convs_as_2d(out)
    assert second.converted == () and [n.op_type for n in again.graph.node] == ops


@pytest.mark.parametrize("conv2, pads", [
    ({"dilations": [2], "pads": [2, 2], "strides": [2]}, (0, 2, 0, 2)),
    ({"auto_pad": "SAME_UPPER"}, (0, 1, 0, 1)),    # stride 1 over the dynamic length: made explicit by scan
    ({"auto_pad": "VALID", "strides": [3]}, (0, 0, 0, 0)),
])
def test_dilations_and_auto_pad_carry_over(conv2, pads):
    model = _front_end(**conv2)
    out, _ = convs_as_2d(model)
    _agree(model, out, lengths=(3, 8, 16, 41))
    second = next(w for w in scan_model(out).workloads if "c2_h1" in w.nodes)
    assert second.conv.pads == pads and second.conv.dilations == (1, conv2.get("dilations", [1])[0])


def test_a_shared_weight_is_copied_and_initializer_inputs_are_reshaped():
    """A weight read by two convs gets a 2-D copy for each (the 1-D one goes once nothing reads it), and an IR 3
    model's initializer listed as a graph input gets the new dims there too; a grouped conv is converted as well
    (wav2vec2's positional conv) and scanned as a batch of its groups."""
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["a"], pads=[1, 1]),
             helper.make_node("Conv", ["x", "w"], ["c"], pads=[2, 0]),
             helper.make_node("Conv", ["a", "wg"], ["d"], group=2, pads=[1, 1]),
             helper.make_node("Add", ["c", "d"], ["e"]), helper.make_node("Slice", ["e", "s0", "s1", "ax"], ["y"])]
    inits = [_w("w", (4, 4, 3)), _w("b", (4,)), _w("wg", (4, 2, 3)),
             *(numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("s0", [0]), ("s1", [2]), ("ax", [1])))]
    model = _model(nodes, inits)
    out, result = convs_as_2d(model)
    assert result.converted == ("a", "c", "d") and result.notes == ()
    same = _model([helper.make_node("Conv", ["x", "w"], ["y"], auto_pad="SAME_UPPER", strides=[2])],
                  [_w("w", (4, 4, 3))])
    kept, noted = convs_as_2d(same)
    assert [n.op_type for n in kept.graph.node] == ["Conv"] and list(kept.graph.initializer[0].dims) == [4, 4, 3]
    assert noted.notes == (("y", "auto_pad=SAME_UPPER at stride 2 (its pads change with the length): stays 1-D, "
                                 "and is not tuned"),)
    assert [s.reason for s in scan_model(kept).skipped] == [
        "a 1-D convolution is tuned (as a 2-D one) only with a constant weight and, at a stride above 1, pads that "
        "do not change with the length (not auto_pad SAME with a kernel over 1 wide)"]
    weights = {t.name: list(t.dims) for t in out.graph.initializer if t.name.startswith("w")}
    assert weights == {"w_2d": [4, 4, 1, 3], "w_2d1": [4, 4, 1, 3], "wg": [4, 2, 1, 3]}
    _agree(model, out, lengths=(3, 5, 16, 33))
    scanned = scan_model(out)
    assert not scanned.skipped
    grouped = next(w for w in scanned.workloads if w.conv.groups == 2)
    assert (grouped.n, grouped.k, grouped.batch, grouped.conv.kernel) == ("2", "6", "2", (1, 3))

    ir3 = _model([helper.make_node("Conv", ["x", "w"], ["y"])], [_w("w", (4, 4, 3))], opset=9, ir=3,
                 inputs_too=True)
    ir3.graph.value_info.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 4, 3]))  # stale after
    out3, _ = convs_as_2d(ir3)
    assert [vi.name for vi in out3.graph.value_info] == []
    (w_input,) = [vi for vi in out3.graph.input if vi.name == "w"]
    assert [d.dim_value for d in w_input.type.tensor_type.shape.dim] == [4, 4, 1, 3]
    _agree(ir3, out3, lengths=(3, 5, 16, 33))


def test_optimize_tunes_the_front_end_and_agrees_with_stock(tmp_path: Path):
    """Weights as external data (their dims change, their bytes stay where they are): both convs become
    ConvBias custom nodes with the Gelu and the Relu fused, between the Unsqueezes and Squeezes, and the
    library's kernels and the fallback bodies agree with stock ORT, inside and outside the tuned lengths."""
    src, out = tmp_path / "front.onnx", tmp_path / "front.opt.onnx"
    onnx.save(_front_end(), str(src), save_as_external_data=True, all_tensors_to_one_file=True,
              location="front.weights", size_threshold=0)
    options = OptimizeOptions(dims=("n=1:2", "l=8:64"), measure="analytic", budget=16, db=tmp_path / "db",
                              cache_dir=tmp_path / "kernels", progress=False, targets=("sm_90",))
    report = optimize(src, out, options, log=lambda _: None)
    assert sorted(report.rewritten) == ["c1_h1", "c2_h1"]
    optimized = onnx.load(str(out))
    assert [n.op_type for n in optimized.graph.node] == ["Unsqueeze", "ConvBiasGelu", "Squeeze", "Unsqueeze",
                                                         "ConvBiasRelu", "Squeeze"]
    stock = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    options_lib = ort.SessionOptions()
    dietcode_ort.register(options_lib)
    sessions = [ort.InferenceSession(str(out), options_lib, providers=["CPUExecutionProvider"]),
                ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])]
    for n, length in ((1, 8), (2, 37), (3, 100), (1, 1)):
        x = RNG.standard_normal((n, 4, length)).astype(np.float32)
        want = stock.run(None, {"x": x})[0]
        for sess in sessions:
            np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rank", [1, 2])
def test_a_one_wide_same_conv_at_stride_two_is_tuned(tmp_path: Path, rank: int):
    """auto_pad SAME over a dynamic size pads (ceil(in / s) - 1) * s + k - in in all: for a 1-wide kernel that is 0
    at every size (TF's strided 1x1 shortcut convs, written so by tf2onnx). It was refused with the wider ones, whose
    pads change with the size's parity; it is now tuned with pads 0 and agrees with stock at odd and even sizes."""
    shape, spatial = (["n", 4, "l"], ["l"]) if rank == 1 else (["n", 4, "h", "w"], ["h", "w"])
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], auto_pad="SAME_UPPER", strides=[2] * rank)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [_w("w", (6, 4) + (1,) * rank)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    src, out = tmp_path / "same.onnx", tmp_path / "same.opt.onnx"
    onnx.save(model, str(src))
    dims = ("n=1:2",) + tuple(f"{d}=8:32:8" for d in spatial)
    options = OptimizeOptions(dims=dims, measure="analytic", budget=8, db=tmp_path / "db",
                              cache_dir=tmp_path / "kernels", progress=False, targets=("sm_90",))
    assert len(optimize(src, out, options, log=lambda _: None).rewritten) == 1
    stock = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    options_lib = ort.SessionOptions()
    dietcode_ort.register(options_lib)
    sessions = [ort.InferenceSession(str(out), options_lib, providers=["CPUExecutionProvider"]),
                ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])]
    for size in (7, 8, 33):
        x = RNG.standard_normal([2, 4] + [size] * rank).astype(np.float32)
        want = stock.run(None, {"x": x})[0]
        assert want.shape[2:] == ((size + 1) // 2,) * rank
        for sess in sessions:
            np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=1e-4, atol=1e-5)
