"""Scanner: workloads and their GEMM views, fusion candidates, refusals with reasons, instances, bad input."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dietcode_ort.errors import DietcodeError
from tuner import scan as scan_mod
from tuner.instances import parse_dim_spec
from tuner.scan import attach_instances, scan, scan_model
from tuner.workload import Epilogue, Instance, Problem

REPO = Path(__file__).resolve().parents[1]


def _model(nodes, inputs, outputs, inits, opset=17) -> onnx.ModelProto:
    m = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, inits),
                          opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    return m


def _w(name, shape, dtype=np.float32):
    return numpy_helper.from_array(np.ones(shape, dtype), name)


def _mlp_like(dtype=TensorProto.FLOAT) -> onnx.ModelProto:
    np_dtype = np.float16 if dtype == TensorProto.FLOAT16 else np.float32
    x = helper.make_tensor_value_info("x", dtype, ["batch", "seq", 16])
    y = helper.make_tensor_value_info("y", dtype, None)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["t"], name="mm"),
             helper.make_node("Add", ["t", "b"], ["u"], name="add"),
             helper.make_node("Relu", ["u"], ["v"], name="relu"),
             helper.make_node("MatMul", ["v", "w2"], ["y"], name="mm2")]
    return _model(nodes, [x], [y], [_w("w", (16, 32), np_dtype), _w("b", (32,), np_dtype),
                                    _w("w2", (32, 8), np_dtype)])


def test_gemm_view_bias_relu_fusion():
    result = scan_model(_mlp_like())
    assert result.symbols == ("batch", "seq")
    first, second = result.workloads
    assert (first.op, first.m, first.n, first.k) == ("gemm", "batch*seq", "32", "16")
    assert first.epilogue == Epilogue(True, "relu") and first.fused_nodes == (("u", "v"),)  # by first output
    assert first.const_operands == (1,)
    assert (second.m, second.n, second.k, second.epilogue) == ("batch*seq", "8", "32", Epilogue())
    assert second.problem(Instance.of({"batch": 2, "seq": 5})) == Problem(m=10, n=8, k=32)


def test_erf_gelu_is_a_fusion_candidate():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["tokens", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    consts = [numpy_helper.from_array(np.array(v, np.float32), n)
              for n, v in (("sqrt2", np.sqrt(2.0)), ("one", 1.0), ("half", 0.5))]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Add", ["h", "b"], ["hb"], name="bias"),
             helper.make_node("Div", ["hb", "sqrt2"], ["d"], name="div"),
             helper.make_node("Erf", ["d"], ["e"], name="erf"),
             helper.make_node("Add", ["e", "one"], ["e1"], name="add1"),
             helper.make_node("Mul", ["hb", "e1"], ["p"], name="mul"),
             helper.make_node("Mul", ["p", "half"], ["y"], name="half_mul")]
    result = scan_model(_model(nodes, [x], [y], [_w("w", (8, 12)), _w("b", (12,))] + consts))
    (w,) = result.workloads
    assert w.epilogue == Epilogue(True, "gelu")
    assert w.fused_nodes[0] == ("hb", "d", "e", "e1", "p", "y")  # the first outputs, in pattern order


def test_identical_nodes_group_and_static_nodes_are_skipped():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    s = helper.make_tensor_value_info("s", TensorProto.FLOAT, [3, 4])
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("y1", "y2", "y3")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y1"], name="a"),
             helper.make_node("MatMul", ["x", "w2"], ["y2"], name="b"),
             helper.make_node("MatMul", ["s", "w"], ["y3"], name="static")]
    result = scan_model(_model(nodes, [x, s], outs, [_w("w", (4, 4)), _w("w2", (4, 4))]))
    (w,) = result.workloads
    assert w.nodes == ("y1", "y2")  # nodes are named by their first output
    assert [(k.node, k.reason) for k in result.skipped] == [("static", "static shapes: no symbolic dim to tune over")]


def test_quantized_products_are_left_out_with_the_reason():
    """A QDQ model's MatMul (operands from DequantizeLinear: ORT runs it as a quantized kernel) and the integer
    ops are listed as left out, each with its reason; the float MatMul beside them is tuned."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    xq = helper.make_tensor_value_info("xq", TensorProto.UINT8, ["n", 4])
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("y", "f")] + \
        [helper.make_tensor_value_info("yi", TensorProto.INT32, None)]
    scale, zero = helper.make_tensor("sc", TensorProto.FLOAT, [], [0.1]), helper.make_tensor("zp", TensorProto.UINT8, [], [0])
    wq = numpy_helper.from_array(np.ones((4, 4), np.uint8), "wq")
    nodes = [helper.make_node("QuantizeLinear", ["x", "sc", "zp"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "sc", "zp"], ["dq"]),
             helper.make_node("DequantizeLinear", ["wq", "sc", "zp"], ["wdq"]),
             helper.make_node("MatMul", ["dq", "wdq"], ["y"], name="qdq"),
             helper.make_node("MatMulInteger", ["xq", "wq"], ["yi"], name="int"),
             helper.make_node("MatMul", ["x", "w"], ["f"], name="float")]
    result = scan_model(_model(nodes, [x, xq], outs, [_w("w", (4, 4)), wq, scale, zero]))
    reasons = {k.node: k.reason for k in result.skipped}
    assert "a quantized (QDQ) model: 'dq' comes from a DequantizeLinear" in reasons["qdq"]
    assert reasons["int"].startswith("a quantized op")
    (w,) = result.workloads
    assert w.nodes == ("f",)


def test_unsupported_dtype_is_skipped_and_a_grouped_conv_is_batched_over_its_groups():
    x = helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["n", 4])
    img = helper.make_tensor_value_info("img", TensorProto.FLOAT, ["n", 4, "h", "w"])
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("y", "z")]
    nodes = [helper.make_node("MatMul", ["x", "wd"], ["y"], name="mm64"),
             helper.make_node("Conv", ["img", "wc"], ["z"], name="gconv", group=2, kernel_shape=[3, 3],
                              pads=[1, 1, 1, 1])]
    result = scan_model(_model(nodes, [x, img], outs, [_w("wd", (4, 4), np.float64), _w("wc", (4, 2, 3, 3))]))
    reasons = {k.node: k.reason for k in result.skipped}
    assert "unsupported dtype DOUBLE" in reasons["mm64"]
    # group 2 of W [4, 2, 3, 3]: two GEMMs of 2 output channels over 2 input channels x 3 x 3 each
    (w,) = result.workloads
    assert (w.nodes, w.m, w.n, w.k, w.batch) == (("z",), "h*n*w", "2", "18", "2")
    assert (w.conv.in_channels, w.conv.out_channels, w.conv.groups) == (4, 4, 2)
    assert scan_mod.to_json(result)["workloads"][0]["conv"]["groups"] == 2


@pytest.mark.parametrize("group, weight, why", [
    (3, (4, 2, 3, 3), "do not split into 3 groups"),  # 4 output channels
    (2, (4, 3, 3, 3), "do not split into 2 groups"),  # 3 x 2 input channels, X has 4
    (0, (4, 4, 3, 3), "group=0 is not a positive integer"),
])
def test_a_conv_whose_channels_do_not_split_into_its_groups_is_skipped(group, weight, why):
    img = helper.make_tensor_value_info("img", TensorProto.FLOAT, ["n", 4, "h", "w"])
    out = helper.make_tensor_value_info("z", TensorProto.FLOAT, None)
    node = helper.make_node("Conv", ["img", "wc"], ["z"], name="gconv", group=group, pads=[1, 1, 1, 1])
    result = scan_model(_model([node], [img], [out], [_w("wc", weight)]))
    assert result.workloads == ()
    assert why in {k.node: k.reason for k in result.skipped}["gconv"]


def test_operands_of_two_dtypes_are_refused_as_invalid():
    """A float16 activation times a float32 weight is an invalid model (ORT refuses to load it): left alone,
    named, instead of tuned as float16 kernels reading float32 weights."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mixed")]
    result = scan_model(_model(nodes, [x], [y], [_w("w", (4, 4))]))
    assert result.workloads == ()
    assert [(k.node, k.reason) for k in result.skipped] == [
        ("mixed", "invalid node: its operands have different dtypes (float16 and float32)")]


def test_nodes_in_subgraphs_and_functions_are_listed_with_the_reason():
    """MatMuls in If branches, Loop bodies and model-local functions are not tuned: scan says so (they were
    left out of its report)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    cond = helper.make_tensor_value_info("c", TensorProto.BOOL, [])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)

    def branch(tag):
        out = helper.make_tensor_value_info(f"{tag}_o", TensorProto.FLOAT, ["n", 4])
        return helper.make_graph([helper.make_node("MatMul", ["x", "w"], [f"{tag}_o"], name=f"{tag}_mm")], tag, [],
                                 [out])

    inner_if = helper.make_node("If", ["c"], ["e_o"], name="inner", then_branch=branch("t2"),
                                else_branch=branch("e2"))
    else_graph = helper.make_graph([inner_if], "e", [], [helper.make_tensor_value_info("e_o", TensorProto.FLOAT,
                                                                                        ["n", 4])])
    func = helper.make_function("local", "Linear", ["a", "b"], ["o"], [helper.make_node("Gemm", ["a", "b"], ["o"],
                                                                                        name="f_gemm")],
                                [helper.make_opsetid("", 17)])
    nodes = [helper.make_node("If", ["c"], ["i"], name="outer", then_branch=branch("t"), else_branch=else_graph),
             helper.make_node("Linear", ["i", "w"], ["l"], domain="local", name="call"),
             helper.make_node("MatMul", ["l", "w"], ["y"], name="main")]
    model = _model(nodes, [x, cond], [y], [_w("w", (4, 4))])
    model.opset_import.append(helper.make_opsetid("local", 1))
    model.functions.append(func)
    result = scan_model(model)
    assert [w.nodes for w in result.workloads] == [("y",)]
    reasons = {k.node: k.reason for k in result.skipped}
    assert sorted(reasons) == ["e2_mm", "f_gemm", "t2_mm", "t_mm"]
    assert "then_branch of If 'outer'" in reasons["t_mm"] and "not tuned" in reasons["t_mm"]
    assert "else_branch of If 'inner'" in reasons["e2_mm"]
    assert "function local.Linear" in reasons["f_gemm"]


def test_loop_without_its_optional_inputs():
    """A Loop whose trip count and condition are both left out (``""``, as the spec allows) failed ORT's
    symbolic shape inference (KeyError: ''), which refused the whole model."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    body = helper.make_graph(
        [helper.make_node("MatMul", ["v_in", "w"], ["v_out"], name="body_mm"),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_in", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", TensorProto.FLOAT, ["n", 4])])
    for trip, cond in (("", ""), ("trip", ""), ("", "go")):
        nodes = [helper.make_node("MatMul", ["x", "w"], ["p"], name="pre"),
                 helper.make_node("Loop", [trip, cond, "p"], ["v"], body=body, name="loop")]
        inits = [_w("w", (4, 4)), numpy_helper.from_array(np.array(3, np.int64), "trip"),
                 numpy_helper.from_array(np.array(False), "go")]
        result = scan_model(_model(nodes, [x], [helper.make_tensor_value_info("v", TensorProto.FLOAT, None)], inits))
        assert [w.nodes for w in result.workloads] == [("p",)]
        assert [k.node for k in result.skipped] == ["body_mm"]


def test_conv_gemm_view_and_problem():
    img = helper.make_tensor_value_info("img", TensorProto.FLOAT, ["n", 3, "h", "w"])
    z = helper.make_tensor_value_info("z", TensorProto.FLOAT, None)
    nodes = [helper.make_node("Conv", ["img", "wc", "bc"], ["c"], name="conv", kernel_shape=[3, 3],
                              strides=[2, 2], pads=[1, 1, 1, 1], dilations=[1, 1]),
             helper.make_node("Relu", ["c"], ["z"], name="relu")]
    result = scan_model(_model(nodes, [img], [z], [_w("wc", (8, 3, 3, 3)), _w("bc", (8,))]))
    (w,) = result.workloads
    assert (w.op, w.n, w.k) == ("conv", "8", "27")
    assert w.epilogue == Epilogue(True, "relu")
    assert w.conv.strides == (2, 2) and w.conv.pads == (1, 1, 1, 1) and w.conv.kernel == (3, 3)
    p = w.problem(Instance.of({"n": 2, "h": 33, "w": 20}))
    assert p.image == (2, 33, 20)
    assert p.m == 2 * 17 * 10  # out = floor((33 + 2 - 3) / 2) + 1 = 17, floor((20 + 2 - 3) / 2) + 1 = 10


@pytest.mark.parametrize("auto_pad, strides, kernel, spatial, pads", [
    ("VALID", [2, 2], (3, 3), ["h", "w"], (0, 0, 0, 0)),
    ("SAME_UPPER", [1, 1], (4, 3), ["h", "w"], (1, 1, 2, 1)),   # stride 1: (k - 1) whatever the size
    ("SAME_LOWER", [1, 1], (4, 3), ["h", "w"], (2, 1, 1, 1)),   # the odd pad at the start
    ("SAME_UPPER", [2, 3], (3, 4), [9, 10], (1, 1, 1, 2)),      # fixed sizes: out 5 x 4, totals 2 and 3
    ("SAME_LOWER", [2, 1], (3, 3), [8, "w"], (1, 1, 0, 1)),     # 8 / 2: total 1; stride 1 over a dynamic dim
    ("NOTSET", [1, 1], (3, 3), ["h", "w"], (0, 0, 0, 0)),
    ("SAME_UPPER", [2, 2], (1, 1), ["h", "w"], (0, 0, 0, 0)),   # 1 wide at stride 2: 0 at every size
    ("SAME_LOWER", [3, 1], (1, 3), ["h", "w"], (0, 1, 0, 1)),
])
def test_conv_auto_pad_is_made_explicit(auto_pad, strides, kernel, spatial, pads):
    """tf2onnx and Keras exports write auto_pad; it was refused ('explicit pads only')."""
    img = helper.make_tensor_value_info("img", TensorProto.FLOAT, ["n", 3, *spatial])
    node = helper.make_node("Conv", ["img", "wc"], ["c"], name="conv", auto_pad=auto_pad, strides=strides)
    result = scan_model(_model([node], [img], [helper.make_tensor_value_info("c", TensorProto.FLOAT, None)],
                               [_w("wc", (8, 3, *kernel))]))
    (w,) = result.workloads
    assert w.conv.pads == pads


@pytest.mark.parametrize("auto_pad, extra, spatial, reason", [
    ("SAME_UPPER", {"strides": [2, 2]}, ["h", 8],
     "Conv auto_pad=SAME_UPPER with stride 2 over the dynamic dim 'h' (axis 2): its pads change with the input size"),
    ("SAME_LOWER", {"dilations": [2, 2]}, ["h", "w"],
     "Conv auto_pad=SAME_LOWER with dilations [2, 2]: onnxruntime does not run it either"),
    ("SAME", {}, ["h", "w"], "Conv auto_pad='SAME' is not one ONNX defines"),
])
def test_conv_auto_pad_that_depends_on_the_size_is_refused(auto_pad, extra, spatial, reason):
    img = helper.make_tensor_value_info("img", TensorProto.FLOAT, ["n", 3, *spatial])
    node = helper.make_node("Conv", ["img", "wc"], ["c"], name="conv", auto_pad=auto_pad, **extra)
    result = scan_model(_model([node], [img], [helper.make_tensor_value_info("c", TensorProto.FLOAT, None)],
                               [_w("wc", (8, 3, 3, 3))]))
    assert result.workloads == () and result.skipped[0].reason.startswith(reason)


def test_batched_matmul_view():
    q = helper.make_tensor_value_info("q", TensorProto.FLOAT, ["b", 2, "s", 8])
    k = helper.make_tensor_value_info("k", TensorProto.FLOAT, ["b", 2, 8, "s"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    result = scan_model(_model([helper.make_node("MatMul", ["q", "k"], ["y"], name="qk")], [q, k], [y], []))
    (w,) = result.workloads
    assert (w.op, w.batch, w.m, w.n, w.k) == ("bmm", "2*b", "s", "s", "8")
    assert w.const_operands == ()


def test_instances_from_dims_weights_and_product():
    result = attach_instances(scan_model(_mlp_like()), ["batch=1,2@3", "seq=4:12:4"])
    inst = result.workloads[0].instances
    assert len(inst) == 6
    weights = {tuple(sorted(i.as_dict().items())): i.weight for i in inst}
    assert weights[(("batch", 2), ("seq", 8))] == 3.0
    assert weights[(("batch", 1), ("seq", 12))] == 1.0


def test_instances_from_shape_log(tmp_path):
    log = tmp_path / "shapes.json"
    log.write_text(json.dumps([{"x": [1, 16, 16]}, {"x": [1, 16, 16]}, {"x": [4, 8, 16], "count": 5}]))
    result = attach_instances(scan_model(_mlp_like()), shapes_file=log)
    inst = {tuple(sorted(i.as_dict().items())): i.weight for i in result.workloads[0].instances}
    assert inst == {(("batch", 1), ("seq", 16)): 2.0, (("batch", 4), ("seq", 8)): 5.0}


@pytest.mark.parametrize("option, message", [
    ("seq=9:3", "inverted"),
    ("seq=", "expected NAME=SPEC"),
    ("seq=1:x", "not an integer"),
    ("seq=1,,2", "empty item"),
    ("seq=-1:4", "must be 0 or more"),
    ("seq=-2", "must be 0 or more"),
    ("seq=1:8:0", "step must be positive"),
    ("seq=4@-1", "weights must be positive"),
])
def test_bad_dim_specs(option, message):
    with pytest.raises(DietcodeError, match=message):
        parse_dim_spec(option)


def test_unknown_symbol_lists_the_model_symbols():
    with pytest.raises(DietcodeError, match=r"does not have; its symbols are: batch, seq"):
        attach_instances(scan_model(_mlp_like()), ["tokens=1:4"])


def test_missing_symbol_values_are_named():
    with pytest.raises(DietcodeError, match=r"no values for symbol\(s\) seq"):
        attach_instances(scan_model(_mlp_like()), ["batch=1:4"])


def test_bad_shape_log(tmp_path):
    log = tmp_path / "shapes.json"
    log.write_text(json.dumps([{"nope": [1, 2, 16]}]))
    with pytest.raises(DietcodeError, match="names input 'nope'"):
        attach_instances(scan_model(_mlp_like()), shapes_file=log)
    log.write_text("{not json")
    with pytest.raises(DietcodeError, match="not valid JSON"):
        attach_instances(scan_model(_mlp_like()), shapes_file=log)


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(DietcodeError, match="model file not found"):
        scan(tmp_path / "missing.onnx")
    with pytest.raises(DietcodeError, match="is a directory, not a model file"):
        scan(tmp_path)
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00\x01garbage, not a protobuf" * 10)
    with pytest.raises(DietcodeError, match="not a readable ONNX model"):
        scan(bad)


def test_external_data_model_scans_without_loading_weights(tmp_path):
    path = tmp_path / "ext.onnx"
    onnx.save(_mlp_like(), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location="ext.data", size_threshold=0)
    assert (tmp_path / "ext.data").exists()
    result = scan(path, ["batch=1", "seq=3"])
    assert [w.epilogue for w in result.workloads] == [Epilogue(True, "relu"), Epilogue()]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dietcode_ort", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def test_cli_json_and_errors(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(_mlp_like(), str(path))
    ok = _cli("scan", str(path), "--dim", "batch=1:2", "--dim", "seq=8", "--json")
    assert ok.returncode == 0, ok.stderr
    data = json.loads(ok.stdout)
    assert {"op", "nodes", "m", "n", "k", "dtype", "symbols", "instances"} <= set(data["workloads"][0])
    assert len(data["workloads"][0]["instances"]) == 2 and data["skipped"] == []
    assert data["symbol_axes"] == {"batch": ["x[0]"], "seq": ["x[1]"]}
    table = _cli("scan", str(path))  # the table says where each symbol sits, for names like s33 or unk__793
    assert table.returncode == 0 and "symbols: batch = x[0]; seq = x[1]" in table.stdout, table.stdout
    for args, message in [((str(tmp_path / "nope.onnx"),), "model file not found"),
                          ((str(tmp_path),), f"{tmp_path} is a directory, not a model file"),
                          ((str(path), "--dim", "seq=5:1"), "inverted"),
                          ((str(path), "--dim", "tokens=1"), "its symbols are: batch, seq")]:
        bad = _cli("scan", *args)
        assert bad.returncode != 0
        assert bad.stderr.startswith("error: ") and message in bad.stderr
        assert "Traceback" not in bad.stderr and bad.stderr.count("\n") == 1


def test_cli_static_model_is_refused_with_the_reason(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    path = tmp_path / "static.onnx"
    onnx.save(_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [x], [y], [_w("w", (4, 4))]), str(path))
    for args in ((), ("--json",)):
        out = _cli("scan", str(path), *args)
        assert out.returncode == 2 and "has no symbolic dims: nothing to scan" in out.stderr, args
        assert "Traceback" not in out.stderr and not out.stdout


def test_scan_module_public_names():
    assert set(scan_mod.__all__) >= {"scan", "scan_model", "attach_instances", "load_model"}


def test_graph_links_readers_makers_and_outputs():
    then = helper.make_graph([helper.make_node("Neg", ["z"], ["zn"])], "then", [],
                             [helper.make_tensor_value_info("zn", TensorProto.FLOAT, None)])
    nodes = [helper.make_node("Mul", ["x", "x"], ["sq"], name="square"),  # x read twice by one node
             helper.make_node("Relu", ["sq"], ["y"], name="relu"),
             helper.make_node("Dropout", ["y"], ["d", ""], name="drop"),  # no mask: an empty output name
             helper.make_node("If", ["c"], ["w"], name="if", then_branch=then, else_branch=then)]
    graph = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    links = scan_mod.GraphLinks(graph)
    square, relu, drop, branch = links.producers["sq"], links.producers["y"], links.producers["d"], \
        links.producers["w"]
    assert [n.name for n in (square, relu, drop, branch)] == ["square", "relu", "drop", "if"]
    assert links.consumers["x"] == [square] and links.exclusive_consumer("x") is square
    assert links.read_only_by("sq", relu) and not links.read_only_by("sq", square)
    assert links.consumers["y"] == [drop] and links.exclusive_consumer("y") is None  # y is a graph output
    assert not links.read_only_by("y", drop)
    assert "" not in links.producers and links.exclusive_consumer("d") is None  # made, never read
    assert links.consumers["z"] == [branch] and links.exclusive_consumer("z") is branch  # read by a subgraph
    again = helper.make_graph(nodes + [helper.make_node("Sigmoid", ["x"], ["sq"], name="second")], "g", [], [])
    assert scan_mod.GraphLinks(again).producers["sq"].name == "second"  # the last maker counts
    with pytest.raises(DietcodeError, match="value 'sq' is made by two nodes"):
        scan_mod.GraphLinks(again, one_maker=True)


# ---- the benchmark models --------------------------------------------------------------------------------

def _scan_built(name: str, preset: str, dtype: str = "float32"):
    import models

    return scan_model(models.build(name, preset, dtype))


def test_bert_tiny_workloads():
    result = _scan_built("bert", "tiny")
    assert result.symbols == ("batch", "seq") and result.skipped == ()
    views = {(w.op, w.m, w.n, w.k, w.batch, w.epilogue.activation, w.epilogue.alpha, w.epilogue.residual):
             len(w.nodes) for w in result.workloads}
    assert views == {
        ("gemm", "batch*seq", "128", "128", "1", "none", 1.0, False): 6,  # Q, K, V x 2 layers
        ("gemm", "batch*seq", "128", "128", "1", "none", 1.0, True): 2,  # attention output + residual Add
        ("bmm", "seq", "seq", "64", "2*batch", "none", 0.125, False): 2,  # Q K^T / sqrt(64)
        ("bmm", "seq", "64", "seq", "2*batch", "none", 1.0, False): 2,  # attention x V
        ("gemm", "batch*seq", "512", "128", "1", "gelu", 1.0, False): 2,  # FFN up, with bias + Erf-Gelu fused
        ("gemm", "batch*seq", "128", "512", "1", "none", 1.0, True): 2,  # FFN down + residual Add
    }
    assert result.unfused == ()
    dense = [w for w in result.workloads if w.op == "gemm"]
    assert all(w.epilogue.bias and w.const_operands == (1,) for w in dense)


def test_bert_tiny_fp16_dtype():
    assert {w.dtype for w in _scan_built("bert", "tiny", "float16").workloads} == {"float16"}


def test_resnet50_tiny_workloads():
    result = _scan_built("resnet50", "tiny")
    assert result.symbols == ("batch", "height", "width") and result.skipped == ()
    convs = [w for w in result.workloads if w.op == "conv"]
    (head,) = [w for w in result.workloads if w.onnx_op == "Gemm"]
    assert head.m == "batch" and head.epilogue.bias and head.trans_b
    stem = next(w for w in convs if w.conv.kernel == (7, 7))
    assert (stem.conv.strides, stem.conv.pads, stem.k) == ((2, 2), (3, 3, 3, 3), "147")
    assert stem.epilogue.activation == "relu" and stem.conv_input == ("batch", "height", "width")
    # the stem's output is 112x112 at 224x224, so M = batch * 112 * 112
    assert stem.problem(Instance.of({"batch": 2, "height": 224, "width": 224})).m == 2 * 112 * 112
    assert sum(len(w.nodes) for w in convs) == 17  # stem + 4 stages x (3 convs + 1 projection)
    # each block's Conv -> Add(shortcut) -> Relu is one conv: the residual added before the Relu; the
    # projection conv feeding the same Add stays plain (one node takes the Add)
    ends = [w for w in convs if w.epilogue.residual]
    assert len(ends) == 4 and all(w.epilogue == Epilogue(True, "relu", residual=True, residual_first=True)
                                  and w.conv.kernel == (1, 1) for w in ends)
    assert all(len(f) == 2 and f[0].endswith("/Add_output_0") and f[1].endswith("/Relu_output_0")
               for w in ends for f in w.fused_nodes)
    projections = [w for w in convs if w.epilogue == Epilogue(True)]
    assert len(projections) == 4 and result.unfused == ()
    fused = {o for w in result.workloads for f in w.fused_nodes for o in f}
    import models

    model = models.build("resnet50", "tiny")
    left = [n.op_type for n in model.graph.node if n.output[0] not in fused and n.op_type in ("Add", "Relu")]
    assert left == []  # 4 Adds and 13 Relus, all absorbed


def test_mlp_tiny_gate_takes_its_silu_and_the_product_by_up():
    """The gate projection absorbs Sigmoid and Mul (SiLU) and the SwiGLU product by the up-projection's output
    (its residual, multiplied), so gate and up (same shape) are two workloads and no graph Mul is left."""
    result = attach_instances(_scan_built("mlp", "tiny"), ["tokens=1:64"])
    gate, up, down = result.workloads
    for w in (gate, up):
        assert (w.m, w.n, w.k, len(w.nodes)) == ("tokens", "176", "64", 1)
    assert (gate.epilogue, up.epilogue) == (Epilogue(False, "silu", 1.0, True, residual_mul=True), Epilogue())
    assert [len(f) for f in gate.fused_nodes] == [3] and gate.fused_nodes[0][-1] == "/mlp/Mul_output_0"
    assert result.unfused == ()
    assert (down.m, down.n, down.k) == ("tokens", "64", "176")
    assert len(gate.instances) == 64


@pytest.mark.slow
def test_bert_base_dense_and_attention_workloads():
    result = _scan_built("bert", "base")
    dense = {(w.n, w.k) for w in result.workloads if w.op == "gemm"}
    assert all(w.m == "batch*seq" for w in result.workloads if w.op == "gemm")
    assert dense == {("768", "768"), ("3072", "768"), ("768", "3072")}
    attention = sorted((w.m, w.n, w.k, w.batch) for w in result.workloads if w.op == "bmm")
    assert attention == [("seq", "64", "seq", "12*batch"), ("seq", "seq", "64", "12*batch")]


def test_failed_shape_inference_leaves_no_file_behind(tmp_path, monkeypatch):
    """onnxruntime's SymbolicShapeInference saves its partial model into the current folder when it cannot
    finish; scan runs it elsewhere, so the user's folder stays as it was."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [helper.make_node("Unknown", ["x"], ["u"], domain="example.custom"),
             helper.make_node("MatMul", ["u", "w"], ["y"])]
    path = tmp_path / "model" / "m.onnx"
    path.parent.mkdir()
    model = _model(nodes, [x], [y], [_w("w", (4, 4))])
    model.opset_import.append(helper.make_opsetid("example.custom", 1))
    onnx.save(model, str(path))
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    try:
        scan(path)
    except DietcodeError as exc:
        assert "shape inference" in str(exc)
    assert list(work.iterdir()) == [] and sorted(p.name for p in path.parent.iterdir()) == ["m.onnx"]
    assert Path.cwd() == work


@pytest.mark.parametrize("rank", [3, 4])
def test_onnx_attention_op_is_inferred_as_onnx_defines_it(rank):
    """ONNX's own Attention (opset 23), which onnxruntime's SymbolicShapeInference reads as com.microsoft's
    (an AssertionError): Y and present_key/value get the opset's shapes, with the past added to the sequence, so
    the MatMul after it is a workload over the model's dims. 3-D inputs: grouped-query heads (2 of Q, 1 of K/V)."""
    e, d = 32, 16
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", e])
    past = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 1, "past", d]) for n in ("pk", "pv")]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "present_k", "present_v")]
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"]), helper.make_node("MatMul", ["x", "wk"], ["k"]),
             helper.make_node("MatMul", ["x", "wv"], ["v"])]
    attrs = {"q_num_heads": 2, "kv_num_heads": 1}
    if rank == 4:  # [batch, heads, seq, head_dim]
        nodes += [helper.make_node("Reshape", [n, f"s{h}"], [f"{n}r"]) for n, h in (("q", 2), ("k", 1), ("v", 1))]
        nodes += [helper.make_node("Transpose", [f"{n}r"], [f"{n}t"], perm=[0, 2, 1, 3]) for n in "qkv"]
        qkv, attrs = ["qt", "kt", "vt"], {}
        tail = [helper.make_node("Transpose", ["a"], ["at"], perm=[0, 2, 1, 3]),
                helper.make_node("Reshape", ["at", "s0"], ["a3"])]
    else:
        qkv, tail = ["q", "k", "v"], [helper.make_node("Identity", ["a"], ["a3"])]
    nodes += [helper.make_node("Attention", [*qkv, "", "pk", "pv"], ["a", "present_k", "present_v"], **attrs)]
    nodes += tail + [helper.make_node("MatMul", ["a3", "wo"], ["y"])]
    shapes = [numpy_helper.from_array(np.array(s, np.int64), f"s{h}") for h, s in
              ((0, [0, 0, e]), (1, [0, 0, 1, d]), (2, [0, 0, 2, d]))]
    inits = [_w("wq", (e, e)), _w("wk", (e, d)), _w("wv", (e, d)), _w("wo", (e, e)), *shapes]
    model = _model(nodes, [x, *past], outs, inits, opset=23)
    result = scan_model(model)
    assert result.symbols == ("batch", "past", "seq")
    assert {n: (w.m, w.n, w.k) for w in result.workloads for n in w.nodes}["y"] == ("batch*seq", str(e), str(e))
    inferred = scan_mod._infer(model)
    dims = {vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
            for vi in (*inferred.graph.value_info, *inferred.graph.output)}
    assert dims["present_k"] == dims["present_v"] == ["batch", 1, "past + seq", d]
    assert dims["a"] == (["batch", 2, "seq", d] if rank == 4 else ["batch", "seq", e])


@pytest.mark.parametrize("axes", [None, [0]])
def test_reshape_to_a_reduce_prod_of_its_dims_keeps_them_symbolic(axes):
    """tf2onnx's Einsum flattens with ``Reshape(x, Concat(ReduceProd(Gather(Shape(x), [0, 1]), keepdims=1), [K]))``;
    the product of the gathered dims is batch*seq, so the MatMul after it is a workload over them (onnxruntime's
    SymbolicShapeInference alone computes only ``axes=[0], keepdims=0`` and left it data-dependent)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 16])
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "lead"], ["g"]),
             helper.make_node("ReduceProd", ["g"], ["rows"], keepdims=1, **({"axes": axes} if axes else {})),
             helper.make_node("Concat", ["rows", "k"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["x2"]), helper.make_node("MatMul", ["x2", "w"], ["y"])]
    inits = [numpy_helper.from_array(np.array([0, 1], np.int64), "lead"),
             numpy_helper.from_array(np.array([16], np.int64), "k"), _w("w", (16, 8))]
    result = scan_model(_model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits))
    assert not result.skipped
    (workload,) = result.workloads
    assert (workload.m, workload.n, workload.k) == ("batch*seq", "8", "16")


def test_symbol_axes_name_every_input_axis_of_a_symbol():
    """The dynamo exporter names the same batch twice (s33 for input_ids, s6 for attention_mask) and the
    sequence once for both: each symbol lists the input axes it sits on."""
    dims = {"input_ids": ("s33", "s50"), "attention_mask": ("s6", "s50"), "pixels": (1, 3, None, "")}
    assert scan_mod.symbol_axes(dims) == {"s33": ["input_ids[0]"], "s50": ["input_ids[1]", "attention_mask[1]"],
                                          "s6": ["attention_mask[0]"]}


def _conv_after(op: onnx.NodeProto, inits: list, opset: int = 18) -> onnx.ModelProto:
    """x [batch, 8, h, w] -> ``op`` (output "u", 8 channels) -> Conv 1x1 (8 -> 4) -> y."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8, "h", "w"])
    conv = helper.make_node("Conv", ["u", "cw"], ["y"], name="conv")
    return _model([op, conv], [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                  [*inits, _w("cw", (4, 8, 1, 1))], opset=opset)


def _ints(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _floats(name, values):
    return numpy_helper.from_array(np.array(values, np.float32), name)


_SHAPE_OPS = {  # ops onnxruntime's SymbolicShapeInference has no rule for, or writes dims the grammar refuses
    "conv_transpose": (helper.make_node("ConvTranspose", ["x", "tw"], ["u"], strides=[2, 2], pads=[1, 1, 1, 1],
                                        output_padding=[1, 0]), [_w("tw", (8, 8, 3, 3))]),
    "conv_transpose_groups_same": (helper.make_node("ConvTranspose", ["x", "tw"], ["u"], strides=[2, 3],
                                                    auto_pad="SAME_UPPER", group=2), [_w("tw", (8, 4, 2, 3))]),
    "depth_to_space": (helper.make_node("DepthToSpace", ["x"], ["d"], blocksize=2), []),
    "space_to_depth": (helper.make_node("SpaceToDepth", ["x"], ["u"], blocksize=2), []),
    "resize_2x": (helper.make_node("Resize", ["x", "", "s"], ["u"], mode="nearest"), [_floats("s", [1, 1, 2, 2])]),
    "resize_1.5x": (helper.make_node("Resize", ["x", "", "s"], ["u"], mode="linear"),
                    [_floats("s", [1, 1, 1.5, 1.5])]),
    "resize_axes": (helper.make_node("Resize", ["x", "", "s"], ["u"], axes=[3, 2]), [_floats("s", [0.5, 3])]),
    "pad_axes": (helper.make_node("Pad", ["x", "p", "", "a"], ["u"]), [_ints("p", [1, 2, 3, 0]), _ints("a", [2, -1])]),
}


@pytest.mark.parametrize("case", sorted(_SHAPE_OPS))
def test_shapes_after_ops_onnxruntime_has_no_exact_rule_for_stay_symbolic(case):
    """A Conv after ConvTranspose, DepthToSpace (PixelShuffle), SpaceToDepth, Resize by scales (nn.Upsample: the
    tool wrote ``floor(1.0*batch)``, which the grammar refuses; 1.5 is kept exact) or an opset 18 Pad with axes
    (the tool asserted) is a workload over the model's dims, and its M is what onnxruntime computes at any size."""
    op, inits = _SHAPE_OPS[case]
    if case == "depth_to_space":  # 8 channels in, 8 out: Conv 8 -> 32 channels first
        model = _conv_after(helper.make_node("Conv", ["x", "pre"], ["p"]), [_w("pre", (32, 8, 1, 1))])
        model.graph.node.insert(1, helper.make_node("DepthToSpace", ["p"], ["u"], blocksize=2))
    else:
        model = _conv_after(op, inits)
    if case == "space_to_depth":
        model.graph.initializer[-1].CopyFrom(_w("cw", (4, 32, 1, 1)))
    result = scan_model(model)
    assert not result.skipped, result.skipped
    conv = next(w for w in result.workloads if "y" in w.nodes)
    assert conv.symbols == ("batch", "h", "w")
    import onnxruntime as ort

    from tuner import shape_expr

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for batch, h, w in ((1, 4, 6), (3, 10, 12)) + (((2, 7, 5),) if case != "space_to_depth" else ()):
        (y,) = session.run(None, {"x": np.zeros((batch, 8, h, w), np.float32)})
        assert shape_expr.evaluate(conv.m, {"batch": batch, "h": h, "w": w}) == y.shape[0] * y.shape[2] * y.shape[3]


def _two_inputs_added() -> onnx.ModelProto:
    """x [batch, n, 16] + y [batch, m, 16], then MatMul: shape inference finds n and m equal."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n", 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "m", 16])
    nodes = [helper.make_node("Add", ["x", "y"], ["s"]), helper.make_node("MatMul", ["s", "w"], ["o"])]
    return _model(nodes, [x, y], [helper.make_tensor_value_info("o", TensorProto.FLOAT, None)], [_w("w", (16, 24))])


@pytest.mark.parametrize("op", ["ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMin",
                                "ReduceProd", "ReduceSumSquare", "ReduceSum", "ReduceMean"])
@pytest.mark.parametrize("keepdims", [1, 0])
def test_reduce_ops_with_their_axes_as_an_input_keep_the_shapes_symbolic(op, keepdims):
    """From opset 18 a Reduce op takes its axes as an input (torch.onnx's default opset 20 writes F.normalize's
    ReduceL2 and torch.amax's ReduceMax so, and wav2vec2's weight norm): onnxruntime's tool had a rule for ReduceSum
    and ReduceMean only, and every model with another failed its shape inference. The MatMul after it is found, with
    the reduced shape."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 32])
    axes = numpy_helper.from_array(np.array([-1 if keepdims else 1], np.int64))
    nodes = [helper.make_node("MatMul", ["x", "w"], ["t"], name="mm"),
             helper.make_node("Constant", [], ["axes"], value=axes),
             helper.make_node(op, ["t", "axes"], ["r"], keepdims=keepdims, name="red"),
             helper.make_node("Sub" if keepdims else "MatMul", ["t", "r"] if keepdims else ["r", "w2"], ["y"],
                              name="after")]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    result = scan_model(_model(nodes, [x], [out], [_w("w", (32, 48)), _w("w2", (48, 8))], opset=20))
    shapes = {(w.m, w.n, w.k) for w in result.workloads}
    assert ("b*s", "48", "32") in shapes
    if not keepdims:  # [b, s, 48] reduced over axis 1: [b, 48] @ [48, 8]
        assert ("b", "8", "48") in shapes


@pytest.mark.parametrize("op, attrs", [("Scaler", {"offset": [0.5] * 16, "scale": [2.0] * 16}),
                                       ("Normalizer", {"norm": "L2"}), ("Binarizer", {"threshold": 0.0})])
def test_scikit_learn_preprocessing_before_an_mlp_keeps_the_shapes(op, attrs):
    """skl2onnx writes StandardScaler and Normalizer as ai.onnx.ml Scaler and Normalizer, which onnxruntime's tool
    has no rule for: shape inference stopped there and a scaler + MLP pipeline was refused whole. They keep their
    input's shape; an op no rule covers is named in the message."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])
    nodes = [helper.make_node(op, ["x"], ["s"], domain="ai.onnx.ml", name="pre", **attrs),
             helper.make_node("MatMul", ["s", "w"], ["y"], name="mm")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                                                                 None)],
                                                [_w("w", (16, 24))]),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)])
    model.ir_version = 10
    assert [(w.m, w.n, w.k) for w in scan_model(model).workloads] == [("N", "24", "16")]
    model.graph.node[0].op_type, model.graph.node[0].domain = "Mystery", "com.example"
    del model.graph.node[0].attribute[:]
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    with pytest.raises(DietcodeError, match="could not complete on this model: no output shape for Mystery node "
                                            "'pre' \\(domain com.example\\)"):
        scan_model(model)


def test_the_dim_kept_of_two_found_equal_is_the_same_on_every_run(tmp_path):
    """onnxruntime's tool keeps one of two dims it finds equal in a set's order, which follows the strings' hashes:
    the same model named its workload ``batch*m`` in one run and ``batch*n`` in the next (and optimize then asked
    for --dim m or for --dim n). The first input's dim is kept, whatever PYTHONHASHSEED is."""
    path = tmp_path / "m.onnx"
    onnx.save(_two_inputs_added(), str(path))
    code = ("import sys; from tuner.scan import scan; r = scan(sys.argv[1]); "
            "print(r.workloads[0].m, sorted(r.merged.items()))")
    seen = {subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True,
                           cwd=REPO, env={**__import__("os").environ, "PYTHONHASHSEED": str(seed)}).stdout.strip()
            for seed in range(6)}
    assert seen == {"batch*n [('m', 'n')]"}


def test_dims_the_graph_makes_equal_take_values_under_either_name(caplog):
    result = scan_model(_two_inputs_added())
    assert result.merged == {"m": "n"} and result.workloads[0].m == "batch*n"
    for dims in (["batch=1", "m=4,8"], ["batch=1", "n=4,8"], ["batch=1", "n=4,8", "m=4,8"]):
        (w,) = attach_instances(result, dims).workloads
        assert [i.as_dict() for i in w.instances] == [{"batch": 1, "n": 4}, {"batch": 1, "n": 8}], dims
    with pytest.raises(DietcodeError, match="'m' and 'n' different values.*one dim"):
        attach_instances(result, ["batch=1", "m=4,8", "n=16"])
    # a dim found equal to a size keeps the size, with a warning where the values given differ
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "k"])
    model = _model([helper.make_node("MatMul", ["x", "w"], ["o"])], [x],
                   [helper.make_tensor_value_info("o", TensorProto.FLOAT, None)], [_w("w", (16, 24))])
    fixed = scan_model(model)
    assert fixed.merged == {"k": 16}
    (w,) = attach_instances(fixed, ["batch=2,3", "k=8"]).workloads
    assert w.k == "16" and [i.as_dict() for i in w.instances] == [{"batch": 2}, {"batch": 3}]
    assert "'k' equal to 16" in caplog.text


def test_a_failure_of_shape_inference_names_the_node():
    """onnxruntime's tool fails with bare asserts (a Pad's pads not two per dim): the message says where."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    nodes = [helper.make_node("Pad", ["x", "p"], ["u"], name="the_pad"), helper.make_node("MatMul", ["u", "w"], ["y"])]
    model = _model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                   [_ints("p", [1, 1]), _w("w", (6, 4))], opset=13)
    with pytest.raises(DietcodeError, match=r"at Pad node 'the_pad' \(AssertionError: a check of onnxruntime's"):
        scan_model(model)


@pytest.mark.parametrize("beta, c, reason", [
    (2.0, np.ones(8, np.float32), None),  # both constants: folded, tuned
    (0.0, np.full(8, np.nan, np.float32), "beta * C is not finite"),
    (0.5, None, "C 'c' is no constant to fold beta into"),
])
def test_a_gemm_whose_scales_stay_says_why(tmp_path, beta, c, reason) -> None:
    """alpha and beta are folded into a constant B and C by the graph pre-pass; where they cannot be, the reason
    names what stops it (it said "alpha or beta other than 1 is not supported", though such Gemms are tuned)."""
    from _bad_models import save

    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 16])]
    inits = [numpy_helper.from_array(np.ones((16, 8), np.float32), "W")]
    if c is None:
        inputs.append(helper.make_tensor_value_info("c", TensorProto.FLOAT, ["B", 8]))
    else:
        inits.append(numpy_helper.from_array(c, "c"))
    graph = helper.make_graph([helper.make_node("Gemm", ["x", "W", "c"], ["y"], beta=beta)], "g", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    result = scan(save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "g.onnx"))
    if reason is None:
        assert len(result.workloads) == 1 and not result.skipped
    else:
        assert not result.workloads and reason in result.skipped[0].reason, result.skipped
