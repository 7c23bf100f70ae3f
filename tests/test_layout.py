"""Channels-last conv (tuner/layout.py): which conv workloads run NHWC, the Transposes the rewrite adds around
them (and only there), the permuted weights, the fallback bodies, and the optimized models' outputs on the CPU
EP with and without the custom-op library."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import dietcode_ort
import models
from tuner.layout import NodeValues, choose_layouts, nchw_reason
from tuner.optimize import OptimizeOptions, _layouts, features_for, optimize
from tuner.scan import attach_instances, scan_model
from tuner.workload import ConvParams, Workload

DIMS = ("batch=1:2", "height=8:16:8", "width=8:16:8")


def _conv(name: str, x: str, c_in: int, c_out: int, rng: np.random.Generator, k: int = 3, group: int = 1,
          relu: bool = True) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], str]:
    w = numpy_helper.from_array(rng.standard_normal((c_out, c_in // group, k, k)).astype(np.float32) * 0.2,
                                f"{name}.w")
    b = numpy_helper.from_array(rng.standard_normal(c_out).astype(np.float32) * 0.1, f"{name}.b")
    nodes = [helper.make_node("Conv", [x, w.name, b.name], [f"{name}.y"], name=name, pads=[k // 2] * 4,
                              group=group)]
    if relu:
        nodes.append(helper.make_node("Relu", [f"{name}.y"], [f"{name}.r"]))
    return nodes, [w, b], nodes[-1].output[0]


def _model(chain: int, lone: bool, channels: int = 16, group: int = 1, extra_reader: bool = False) -> onnx.ModelProto:
    """X -> ``chain`` convs (3x3, same channels, Relu each) -> Y, and with ``lone`` a second input Z -> one conv of
    the same shapes -> Y2. ``extra_reader``: the first conv's output is also a graph output."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    dims = ["batch", channels, "height", "width"]
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, dims)]
    outputs = []
    x = "X"
    for i in range(chain):
        n, t, x = _conv(f"c{i}", x, channels, channels, rng, group=group)
        nodes += n
        inits += t
        if i == 0 and extra_reader:
            outputs.append(helper.make_tensor_value_info(x, TensorProto.FLOAT, None))
    outputs.append(helper.make_tensor_value_info(x, TensorProto.FLOAT, None))
    if lone:
        inputs.append(helper.make_tensor_value_info("Z", TensorProto.FLOAT, dims))
        n, t, z = _conv("lone", "Z", channels, channels, rng, group=group)
        nodes += n
        inits += t
        outputs.append(helper.make_tensor_value_info(z, TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "convs", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _workloads(model: onnx.ModelProto, layout: str = "nhwc") -> tuple[Workload, ...]:
    scanned = attach_instances(scan_model(model), DIMS, None)
    return _layouts(model, scanned.workloads, layout, Path("."))


def _nhwc(workloads) -> list[str]:
    return sorted(n for w in workloads if w.conv is not None and w.conv.channels_last for n in w.nodes)


def test_chains_run_channels_last_and_lone_convs_stay():
    """Three chained convs need two Transposes (in, out): fewer than their three convs, so they run NHWC. A
    lone conv of the same shapes would need two for one conv: it stays NCHW, so the shared workload splits in
    two, tuned apart. Two chained convs (two Transposes for two) stay too; --conv-layout nchw keeps all."""
    workloads = _workloads(_model(3, lone=True))
    assert _nhwc(workloads) == ["c0.y", "c1.y", "c2.y"]
    nchw = [w for w in workloads if w.conv is not None and not w.conv.channels_last]
    assert [w.nodes for w in nchw] == [("lone.y",)]
    assert _nhwc(_workloads(_model(2, lone=False))) == []
    assert _nhwc(_workloads(_model(3, lone=False), "nchw")) == []
    # a chain value something else reads (here a graph output) costs its own Transpose: 3 for 3 convs
    assert _nhwc(_workloads(_model(3, lone=False, extra_reader=True))) == []
    assert _nhwc(_workloads(_model(4, lone=False, extra_reader=True))) == ["c0.y", "c1.y", "c2.y", "c3.y"]


def test_workloads_that_stay_nchw_say_why():
    conv = ConvParams(16, 16, (3, 3), pads=(1, 1, 1, 1))
    w = Workload("conv", "Conv", ("y",), "m", "16", "144", "float16", ("batch",), conv=conv)
    assert nchw_reason(w, {"w"}, {"y": "w"}) is None
    assert "grouped (group 2)" in nchw_reason(Workload(**{**w.__dict__, "conv": ConvParams(16, 16, (3, 3), groups=2)}),
                                              {"w"}, {"y": "w"})
    three = Workload(**{**w.__dict__, "conv": ConvParams(3, 16, (3, 3))})
    assert "3 input channels of float16 are not a whole number of 16-byte vectors" in nchw_reason(three, {"w"},
                                                                                                 {"y": "w"})
    assert "4 input channels" not in (nchw_reason(Workload(**{**w.__dict__, "dtype": "float32",
                                                               "conv": ConvParams(4, 16, (3, 3))}), {"w"},
                                                  {"y": "w"}) or "")
    assert "is no initializer" in nchw_reason(w, set(), {"y": "w"})
    assert _nhwc(_workloads(_model(4, lone=False, group=2))) == []
    with pytest.raises(ValueError, match="allowed: nhwc, nchw"):
        choose_layouts(onnx.GraphProto(), [w], "nwhc", {"y": NodeValues("x", None, "y", frozenset())})


def test_features_read_nhwc_dims():
    w = _workloads(_model(3, lone=False))[0]
    assert w.conv is not None and w.conv.channels_last
    assert {f.name: f.terms for f in features_for(w, 0)} == {"img_n": ((0, 0),), "img_h": ((0, 1),),
                                                             "img_w": ((0, 2),)}


@pytest.fixture(scope="module")
def optimized(tmp_path_factory):
    """The tiny ResNet-50 optimized as channels-last (the default) and as NCHW."""
    work = tmp_path_factory.mktemp("layout")
    src = work / "resnet50.onnx"
    models.save_model(models.build("resnet50", "tiny"), src)
    out = {}
    for layout in ("nhwc", "nchw"):
        out[layout] = work / f"resnet50.{layout}.onnx"
        optimize(src, out[layout], OptimizeOptions(dims=("batch=1:2", "height=32:64:16", "width=32:64:16"),
                                                   measure="analytic", budget=16, db=work / "tuning.db",
                                                   cache_dir=work / "kernels", progress=False, conv_layout=layout),
                 log=lambda _: None)
    return src, out


def test_resnet_transposes_only_where_the_chain_starts_and_ends(optimized):
    """Every conv after the stem (3 input channels) runs NHWC: one Transpose after the MaxPool, one before the
    GlobalAveragePool, none between blocks (the shortcut included); each weight is a [OC, KH, KW, C] copy."""
    src, out = optimized
    model, original = onnx.load(str(out["nhwc"])), onnx.load(str(src))
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["Transpose"] == 2, ops
    nhwc = [n for n in model.graph.node if any(a.name == "channels_last" and a.i == 1 for a in n.attribute)]
    assert len(nhwc) == 16 and all(n.op_type.startswith("Conv") for n in nhwc)
    weights = {t.name: tuple(t.dims) for t in original.graph.initializer}
    inits = {t.name: t for t in model.graph.initializer}
    for node in nhwc:
        w = inits[node.input[1]]
        oc, c, kh, kw = weights[w.name.removesuffix("_ohwi")]
        assert tuple(w.dims) == (oc, kh, kw, c)
        before = numpy_helper.to_array(next(t for t in original.graph.initializer
                                            if t.name == w.name.removesuffix("_ohwi")))
        np.testing.assert_array_equal(numpy_helper.to_array(w), before.transpose(0, 2, 3, 1))
    stem = [n for n in model.graph.node if n.domain == "ai.dietcode" and n.op_type.startswith("Conv")
            and n not in nhwc]
    assert len(stem) == 1
    layouts = [json.loads(next(a.s for a in n.attribute if a.name == "info"))["workload"]["layout"]
               for n in stem + nhwc]
    assert layouts == ["nchw"] + ["nhwc"] * 16  # what inspect shows
    flat = onnx.load(str(out["nchw"]))
    assert "Transpose" not in {n.op_type for n in flat.graph.node}
    assert not any(a.name == "channels_last" for n in flat.graph.node for a in n.attribute)


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_resnet_outputs_match_with_and_without_library(optimized, layout):
    src, out = optimized
    stock = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    options = ort.SessionOptions()
    dietcode_ort.register(options)
    with_lib = ort.InferenceSession(str(out[layout]), options, providers=["CPUExecutionProvider"])
    fallback = ort.InferenceSession(str(out[layout]), providers=["CPUExecutionProvider"])
    for dims in ({"batch": 1, "height": 32, "width": 32}, {"batch": 3, "height": 33, "width": 47},
                 {"batch": 2, "height": 70, "width": 17}):
        feeds = models.get("resnet50").example_inputs("tiny", dims, seed=3)
        want = stock.run(None, feeds)[0]
        np.testing.assert_allclose(with_lib.run(None, feeds)[0], want, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(fallback.run(None, feeds)[0], want, rtol=1e-4, atol=1e-5)


def test_split_workload_and_extra_reader_run_right(tmp_path):
    """A chain whose first value is also a graph output keeps that value in NCHW (a Transpose back), and a lone
    conv sharing the chain's workload stays NCHW: outputs equal stock ORT's with and without the library."""
    model = _model(4, lone=True, extra_reader=True)
    src, out = tmp_path / "convs.onnx", tmp_path / "convs.opt.onnx"
    onnx.save(model, src)
    optimize(src, out, OptimizeOptions(dims=DIMS, measure="analytic", budget=8, db=tmp_path / "db",
                                       cache_dir=tmp_path / "kernels", progress=False), log=lambda _: None)
    opt = onnx.load(str(out))
    cl = {n.output[0] for n in opt.graph.node if any(a.name == "channels_last" for a in n.attribute)}
    assert len(cl) == 4 and all(v.endswith("_nhwc") for v in cl)
    assert Counter(n.op_type for n in opt.graph.node)["Transpose"] == 3  # X in, c0's output and the last out
    rng = np.random.default_rng(1)
    feeds = {"X": rng.standard_normal((2, 16, 9, 13)).astype(np.float32),
             "Z": rng.standard_normal((2, 16, 9, 13)).astype(np.float32)}
    stock = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, feeds)
    options = ort.SessionOptions()
    dietcode_ort.register(options)
    for session in (ort.InferenceSession(str(out), options, providers=["CPUExecutionProvider"]),
                    ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])):
        for got, want in zip(session.run(None, feeds), stock):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
