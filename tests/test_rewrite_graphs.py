"""Scan, rewrite and optimize on graphs as other exporters write them: unnamed or repeated node names,
shared Gelu intermediates, higher-rank constants, old IR layouts, old and new opsets, Identity-wrapped
biases. Every rewritten model must load and compute what the original did, on the CPU EP, with and
without the custom-op library."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import dietcode_ort
from dietcode_ort.inspect_model import describe
from tuner.optimize import OptimizeOptions, optimize
from tuner.rewrite import DOMAIN, rewrite_model
from tuner.scan import scan_model
from tuner.workload import Epilogue

PAYLOAD = b"\x00not-a-real-bundle\xff"  # stock ORT runs the function body and never reads it
K, N = 16, 32
RNG = np.random.default_rng(0)


def _t(name: str, shape, value: float | None = None) -> onnx.TensorProto:
    data = np.full(shape, value, np.float32) if value is not None else \
        RNG.standard_normal(shape).astype(np.float32)
    return numpy_helper.from_array(data, name)


def _model(nodes, inputs, outputs, inits, opset: int = 17, ir: int = 10) -> onnx.ModelProto:
    for node in nodes:  # named like many exporters do; ``unnamed_nodes`` clears them
        node.name = node.name or f"{node.op_type}:{node.output[0]}"
    m = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, inits),
                          opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = ir
    return m


def _x(shape=("n", K)) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))


def _out(name: str) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, None)


def _gelu(x: str, y: str, p: str, form: str = "mul_last", scale: str = "div", shape=()
          ) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """Erf-form Gelu from ``x`` to ``y`` (unnamed nodes, values prefixed ``p``), constants of ``shape``.

    form "mul_last": Mul(x, 1+erf) -> Mul(., 0.5) (torch's exporter); "half_first": Mul(x, 0.5) ->
    Mul(., 1+erf).
    scale "div": Div(x, sqrt2); "mul": Mul(x, 1/sqrt2)."""
    consts = [_t(f"{p}_s", shape, np.sqrt(2.0) if scale == "div" else 1 / np.sqrt(2.0)),
              _t(f"{p}_one", shape, 1.0), _t(f"{p}_half", shape, 0.5)]
    nodes = [helper.make_node("Div" if scale == "div" else "Mul", [x, f"{p}_s"], [f"{p}_d"]),
             helper.make_node("Erf", [f"{p}_d"], [f"{p}_e"]),
             helper.make_node("Add", [f"{p}_e", f"{p}_one"], [f"{p}_e1"])]
    if form == "mul_last":
        nodes += [helper.make_node("Mul", [x, f"{p}_e1"], [f"{p}_m"]),
                  helper.make_node("Mul", [f"{p}_m", f"{p}_half"], [y])]
    else:
        nodes += [helper.make_node("Mul", [f"{p}_half", x], [f"{p}_m"]),
                  helper.make_node("Mul", [f"{p}_m", f"{p}_e1"], [y])]
    return nodes, consts


def _mm_bias(x: str, y: str, p: str, bias_shape=(N,), bias_first: bool = False, k: int = K
             ) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    add_in = [f"{p}_b", f"{p}_h"] if bias_first else [f"{p}_h", f"{p}_b"]
    return ([helper.make_node("MatMul", [x, f"{p}_w"], [f"{p}_h"]), helper.make_node("Add", add_in, [y])],
            [_t(f"{p}_w", (k, N)), _t(f"{p}_b", bias_shape)])


# ---- the graphs --------------------------------------------------------------------------------------------

@dataclass
class Case:
    model: onnx.ModelProto
    epilogues: list[Epilogue]  # per workload node, in graph order
    unfused: list[str] = field(default_factory=list)  # substrings of the reasons of refused fusions
    x_shape: Callable[[int], tuple[int, ...]] = lambda n: (n, K)
    dims: tuple[str, ...] = ("n=1:8",)  # what optimize tunes for
    ort_loads: bool = True  # False: ORT refuses the model as it is (repeated node names)


def gelu_intermediate_read_elsewhere() -> Case:
    mm, inits = _mm_bias("x", "hb", "a")
    gelu, consts = _gelu("hb", "y", "g")
    extra = helper.make_node("Mul", ["g_e1", "g_e1"], ["z"])  # 1 + erf also feeds another node
    return Case(_model(mm + gelu + [extra], [_x()], [_out("y"), _out("z")], inits + consts),
                [Epilogue(True, "none")], ["'g_e1' is also used by"])


def gelu_intermediate_read_in_a_subgraph() -> Case:
    mm, inits = _mm_bias("x", "hb", "a")
    gelu, consts = _gelu("hb", "y", "g")
    branch = [helper.make_graph([helper.make_node("Identity", ["g_e1"], [f"{b}_out"])], b, [],
                                [_out(f"{b}_out")]) for b in ("then", "else")]
    cond = numpy_helper.from_array(np.array(True), "cond")
    use = helper.make_node("If", ["cond"], ["z"], then_branch=branch[0], else_branch=branch[1])
    return Case(_model(mm + gelu + [use], [_x()], [_out("y"), _out("z")], inits + consts + [cond]),
                [Epilogue(True, "none")], ["'g_e1' is also used by 'If:z'"])


def gelu_intermediate_is_graph_output() -> Case:
    mm, inits = _mm_bias("x", "hb", "a")
    gelu, consts = _gelu("hb", "y", "g", form="half_first")
    return Case(_model(mm + gelu, [_x()], [_out("y"), _out("g_m")], inits + consts),
                [Epilogue(True, "none")], ["'g_m' is a graph output"])


def gelu_input_is_graph_output() -> Case:
    mm, inits = _mm_bias("x", "hb", "a")
    gelu, consts = _gelu("hb", "y", "g")
    return Case(_model(mm + gelu, [_x()], [_out("y"), _out("hb")], inits + consts),
                [Epilogue(True, "none")], ["'hb' is a graph output"])


def bias_of_higher_rank() -> Case:
    mm, inits = _mm_bias("x", "hb", "a", bias_shape=(1, 1, N))  # [n, N] + [1, 1, N] -> [1, n, N]
    return Case(_model(mm + [helper.make_node("Relu", ["hb"], ["y"])], [_x()], [_out("y")], inits),
                [Epilogue(False, "none")], ["bias not fused: constant 'a_b' has rank 3"])


def gelu_constants_of_higher_rank() -> Case:
    mm, inits = _mm_bias("x", "hb", "a")
    gelu, consts = _gelu("hb", "y", "g", shape=(1, 1, 1))  # [n, N] * [1, 1, 1] -> [1, n, N]
    return Case(_model(mm + gelu, [_x()], [_out("y")], inits + consts),
                [Epilogue(True, "none")], ["Gelu not fused: constant 'g_s' has rank 3"])


def gelu_forms_and_rank3_constants() -> Case:
    """Two Gelu forms (so two fallback bodies) with [1,1,1] constants on a 3-D product (same rank: fuses)."""
    mm1, i1 = _mm_bias("x", "h1", "a")
    g1, c1 = _gelu("h1", "y1", "g", shape=(1, 1, 1))
    mm2, i2 = _mm_bias("x", "h2", "b", bias_first=True)
    g2, c2 = _gelu("h2", "y2", "f", form="half_first", scale="mul", shape=(1,))
    return Case(_model(mm1 + g1 + mm2 + g2, [_x(("b", "s", K))], [_out("y1"), _out("y2")], i1 + c1 + i2 + c2),
                [Epilogue(True, "gelu")] * 2, x_shape=lambda n: (2, n, K), dims=("b=2", "s=1:8"))


def unnamed_nodes() -> Case:
    mm1, i1 = _mm_bias("x", "h1", "a")
    g1, c1 = _gelu("h1", "y1", "g")
    mm2, i2 = _mm_bias("x", "h2", "b")
    nodes = mm1 + g1 + mm2 + [helper.make_node("Relu", ["h2"], ["y2"]),
                              helper.make_node("MatMul", ["y2", "w3"], ["y3"])]
    model = _model(nodes, [_x()], [_out("y1"), _out("y3")], i1 + c1 + i2 + [_t("w3", (N, N))])
    for node in model.graph.node:
        node.name = ""
    return Case(model, [Epilogue(True, "gelu"), Epilogue(True, "relu"), Epilogue()])


def repeated_node_names() -> Case:
    """ONNX allows it; ORT refuses such a model, so the check renames the nodes of both models first."""
    case = unnamed_nodes()
    for node in case.model.graph.node:
        node.name = "node"
    case.ort_loads = False
    return case


def name_like_a_made_up_one() -> Case:
    """Unnamed nodes, and a later node named as a label for the first one might be made up."""
    case = unnamed_nodes()
    case.model.graph.node[-1].name = "MatMul_0"
    return case


def old_ir_initializers_as_inputs() -> Case:
    """IR 3 layout (the ONNX model zoo): every initializer is also a graph input."""
    mm, inits = _mm_bias("x", "hb", "a")
    gelu, consts = _gelu("hb", "y", "g")
    init_inputs = [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in inits + consts]
    return Case(_model(mm + gelu, [_x()] + init_inputs, [_out("y")], inits + consts, opset=11, ir=3),
                [Epilogue(True, "gelu")])


def overridable_initializer_inputs() -> Case:
    """IR 4+ with initializers listed as graph inputs (overridable): the Gelu constants become unread."""
    case = old_ir_initializers_as_inputs()
    case.model.ir_version = 7
    return case


def _opset_case(opset: int) -> Case:
    """Opset 11 (IR 6), 13 (IR 8) and 18, the last with its Gelu constants as Constant nodes."""
    mm, inits = _mm_bias("x", "hb", "a")
    gelu, consts = _gelu("hb", "y1", "g")
    if opset >= 18:
        gelu = [helper.make_node("Constant", [], [t.name], value=t) for t in consts[:2]] + [
            helper.make_node("Constant", [], ["g_half"], value_float=0.5)] + gelu  # both Constant forms
        consts = []
    gemm = helper.make_node("Gemm", ["x", "gw", "gc"], ["gg"], transB=1)
    relu = helper.make_node("Relu", ["gg"], ["y2"])
    return Case(_model(mm + gelu + [gemm, relu], [_x()], [_out("y1"), _out("y2")],
                       inits + consts + [_t("gw", (N, K)), _t("gc", (N,))], opset=opset,
                       ir=6 if opset < 13 else 8),
                [Epilogue(True, "gelu"), Epilogue(True, "relu")])


def gelu_op_of_opset_20() -> Case:
    """Opset 20's Gelu op (both torch exporters' default opset): approximate="none" fuses as the kernels' erf
    form, approximate="tanh" as their tanh form."""
    mm, inits = _mm_bias("x", "hb", "a")
    gemm = helper.make_node("Gemm", ["x", "gw", "gc"], ["gg"], transB=1)
    return Case(_model(mm + [helper.make_node("Gelu", ["hb"], ["y1"]), gemm,
                             helper.make_node("Gelu", ["gg"], ["y2"], approximate="tanh")],
                       [_x()], [_out("y1"), _out("y2")], inits + [_t("gw", (N, K)), _t("gc", (N,))], opset=20),
                [Epilogue(True, "gelu"), Epilogue(True, "gelu_tanh")])


def _gelu_tanh(x: str, y: str, p: str, form: str = "half_first", cube: str = "pow"
               ) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """GPT-2's tanh Gelu from ``x`` to ``y``, 0.5*x*(1+Tanh(sqrt(2/pi)*(x+0.044715*Pow(x,3)))), as its
    TorchScript and dynamo exports write it (form "half_first": Mul(x, 0.5) -> Mul(., 1+tanh); cube "pow"),
    or with Mul(x, 1+tanh) -> Mul(., 0.5) ("mul_last") and the cube as Mul(Mul(x, x), x) ("mul")."""
    consts = [_t(f"{p}_c", (), 0.044715), _t(f"{p}_k", (), np.sqrt(2 / np.pi)), _t(f"{p}_one", (), 1.0),
              _t(f"{p}_half", (), 0.5)]
    if cube == "pow":
        consts.append(_t(f"{p}_three", (), 3.0))
        nodes = [helper.make_node("Pow", [x, f"{p}_three"], [f"{p}_x3"])]
    else:
        nodes = [helper.make_node("Mul", [x, x], [f"{p}_x2"]), helper.make_node("Mul", [f"{p}_x2", x], [f"{p}_x3"])]
    nodes += [helper.make_node("Mul", [f"{p}_c", f"{p}_x3"], [f"{p}_cx3"]),
              helper.make_node("Add", [x, f"{p}_cx3"], [f"{p}_in"]),
              helper.make_node("Mul", [f"{p}_in", f"{p}_k"], [f"{p}_u"]),
              helper.make_node("Tanh", [f"{p}_u"], [f"{p}_t"]),
              helper.make_node("Add", [f"{p}_t", f"{p}_one"], [f"{p}_t1"])]
    if form == "half_first":
        nodes += [helper.make_node("Mul", [x, f"{p}_half"], [f"{p}_h"]),
                  helper.make_node("Mul", [f"{p}_h", f"{p}_t1"], [y])]
    else:
        nodes += [helper.make_node("Mul", [f"{p}_t1", x], [f"{p}_h"]),
                  helper.make_node("Mul", [f"{p}_half", f"{p}_h"], [y])]
    return nodes, consts


def gelu_tanh_formula() -> Case:
    """The tanh Gelu's formula in both product orders and both cubes: each fuses as gelu_tanh, the second
    after a residual Add (the residual inside the activation)."""
    mm1, i1 = _mm_bias("x", "h1", "a")
    g1, c1 = _gelu_tanh("h1", "y1", "g")
    mm2, i2 = _mm_bias("x", "h2", "b")
    g2, c2 = _gelu_tanh("s2", "y2", "f", form="mul_last", cube="mul")
    nodes = mm1 + g1 + mm2 + [_residual_of_x(), helper.make_node("Add", ["h2", "r"], ["s2"])] + g2
    return Case(_model(nodes, [_x()], [_out("y1"), _out("y2")], i1 + c1 + i2 + c2),
                [Epilogue(True, "gelu_tanh"), Epilogue(True, "gelu_tanh", 1.0, True, residual_first=True)])


def gelu_tanh_intermediate_read_elsewhere() -> Case:
    mm, inits = _mm_bias("x", "hb", "a")
    gelu, consts = _gelu_tanh("hb", "y", "g")
    extra = helper.make_node("Mul", ["g_t", "g_t"], ["z"])  # tanh also feeds another node
    return Case(_model(mm + gelu + [extra], [_x()], [_out("y"), _out("z")], inits + consts),
                [Epilogue(True, "none")], ["Gelu not fused: its intermediate 'g_t' is also used by"])


def activation_after_a_reshape() -> Case:
    """GPT-2's Conv1D: Gemm -> Reshape (to [n, 2, 16]) -> tanh Gelu fuses into the Gemm, the Reshape moved after
    the fused node; a MatMul + bias -> Reshape -> SiLU too; and a Gelu whose constants are rank 3 stays after
    the Reshape (on the 2-D product they would grow its rank), with the reason."""
    shape = numpy_helper.from_array(np.array([0, 2, N // 2], np.int64), "shape")
    gemm = helper.make_node("Gemm", ["x", "gw", "gc"], ["gg"])
    g1, c1 = _gelu_tanh("gr", "y1", "g")
    mm, i2 = _mm_bias("x", "hb", "a")
    silu = [helper.make_node("Sigmoid", ["hr"], ["hs"]), helper.make_node("Mul", ["hr", "hs"], ["y2"])]
    mm3, i3 = _mm_bias("x", "kb", "c")
    g3, c3 = _gelu("kr", "y3", "f", shape=(1, 1, 1))
    nodes = ([gemm, helper.make_node("Reshape", ["gg", "shape"], ["gr"])] + g1
             + mm + [helper.make_node("Reshape", ["hb", "shape"], ["hr"])] + silu
             + mm3 + [helper.make_node("Reshape", ["kb", "shape"], ["kr"])] + g3)
    return Case(_model(nodes, [_x()], [_out("y1"), _out("y2"), _out("y3")],
                       [_t("gw", (K, N)), _t("gc", (N,)), shape] + c1 + i2 + i3 + c3),
                [Epilogue(True, "gelu_tanh"), Epilogue(True, "silu"), Epilogue(True)],
                ["activation after a Reshape not fused: constant 'f_s' has rank 3"])


def residual_after_a_reshape() -> Case:
    """GPT-2's Conv1D output projection: Gemm -> Reshape (to [n, 2, 16]) -> Add(residual [n, 2, 16]) fuses the
    residual, read in the product's row order, the Reshape moved after the fused node; a MatMul + bias ->
    Reshape -> Add(residual) -> Relu adds it before the Relu; an Add of a broadcast [1, 2, 16] after a Reshape
    stays, with the reason."""
    shape = numpy_helper.from_array(np.array([0, 2, N // 2], np.int64), "shape")
    residual = [_residual_of_x(), helper.make_node("Reshape", ["r", "shape"], ["r3"])]
    mm, inits = _mm_bias("x", "hb", "a")
    nodes = residual + [
        helper.make_node("Gemm", ["x", "gw", "gc"], ["gg"]), helper.make_node("Reshape", ["gg", "shape"], ["gr"]),
        helper.make_node("Add", ["gr", "r3"], ["y1"])] + mm + [
        helper.make_node("Reshape", ["hb", "shape"], ["hr"]), helper.make_node("Add", ["r3", "hr"], ["hs"]),
        helper.make_node("Relu", ["hs"], ["y2"]),
        helper.make_node("MatMul", ["x", "kw"], ["k"]), helper.make_node("Reshape", ["k", "shape"], ["kr"]),
        helper.make_node("ReduceMean", ["r3"], ["rm"], axes=[0], keepdims=1),
        helper.make_node("Add", ["kr", "rm"], ["y3"])]
    return Case(_model(nodes, [_x()], [_out("y1"), _out("y2"), _out("y3")],
                       [_t("gw", (K, N)), _t("gc", (N,)), _t("kw", (K, N)), shape] + inits),
                [Epilogue(True, "none", 1.0, True), Epilogue(True, "relu", 1.0, True, residual_first=True),
                 Epilogue()],
                ["residual not fused: 'rm' has shape [1, 2, 16], not the output's [n, 2, 16]"])


def silu_gate() -> Case:
    """LLaMA's MLP: silu(x @ Wg) * (x @ Wu): the gate MatMul takes Sigmoid and Mul (either operand order) and
    the product by the up-projection's output (residual_mul; the custom node then sits after the up MatMul,
    which comes later in node order), the up-projection stays plain; a Sigmoid whose product is with another
    tensor stays, with the reason."""
    nodes = [helper.make_node("MatMul", ["x", "wg"], ["g"]), helper.make_node("Sigmoid", ["g"], ["gs"]),
             helper.make_node("Mul", ["gs", "g"], ["silu"]), helper.make_node("MatMul", ["x", "wu"], ["u"]),
             helper.make_node("Mul", ["silu", "u"], ["y"]),
             helper.make_node("Relu", ["x"], ["u2_half"]),
             helper.make_node("Concat", ["u2_half", "u2_half"], ["u2"], axis=-1),
             helper.make_node("MatMul", ["x", "wv"], ["v"]), helper.make_node("Sigmoid", ["v"], ["vs"]),
             helper.make_node("Mul", ["vs", "u2"], ["y2"])]
    inits = [_t("wg", (K, N)), _t("wu", (K, N)), _t("wv", (K, N))]
    return Case(_model(nodes, [_x()], [_out("y"), _out("y2")], inits),
                [Epilogue(False, "silu", 1.0, True, residual_mul=True), Epilogue(), Epilogue()],
                ["Sigmoid not fused: no Mul of its output by 'v' itself"])


def swiglu_bias_gelu_and_broadcast_mul() -> Case:
    """The gated product after other activations and a bias: up-projection first in node order and the first
    operand of the Mul, the gate's bias fused (Gelu, then * up); a Relu whose product is with a broadcast tensor
    keeps its Mul, with the reason; a Mul by a scalar constant after a Relu is no residual (left alone)."""
    up, up_inits = _mm_bias("x", "u", "u")
    gate, gate_inits = _mm_bias("x", "gb", "g")
    gelu, consts = _gelu("gb", "gg", "e")
    nodes = up + gate + gelu + [helper.make_node("Mul", ["u", "gg"], ["y"]),
                                helper.make_node("MatMul", ["x", "wv"], ["v"]), helper.make_node("Relu", ["v"], ["vr"]),
                                helper.make_node("ReduceMean", ["u"], ["um"], axes=[0], keepdims=1),
                                helper.make_node("Mul", ["vr", "um"], ["y2"]),
                                helper.make_node("MatMul", ["x", "wt"], ["t"]), helper.make_node("Relu", ["t"], ["tr"]),
                                helper.make_node("Mul", ["tr", "three"], ["y3"])]
    inits = up_inits + gate_inits + consts + [_t("wv", (K, N)), _t("wt", (K, N)), _t("three", (), 3.0)]
    return Case(_model(nodes, [_x()], [_out("y"), _out("y2"), _out("y3")], inits),
                [Epilogue(True), Epilogue(True, "gelu", 1.0, True, residual_mul=True), Epilogue(False, "relu"),
                 Epilogue(False, "relu")],
                ["residual not fused: 'um' has shape [1, 32], not the output's [n, 32] (a broadcast Mul is no "
                 "residual)"])


def silu_intermediate_is_graph_output() -> Case:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Sigmoid", ["h"], ["hs"]),
             helper.make_node("Mul", ["h", "hs"], ["y"])]
    return Case(_model(nodes, [_x()], [_out("y"), _out("hs")], [_t("w", (K, N))]),
                [Epilogue()], ["SiLU not fused: its intermediate 'hs' is a graph output"])


def _clip_case(opset: int) -> Case:
    """MobileNetV2's ReLU6 after convs: Clip(0, 6) fuses as relu6, Clip(0) as Relu, Clip(-1, 1) stays, with
    the reason; bounds as inputs (opset 11 on, one from a Constant node) or attributes (before)."""
    convs = [_conv("x", f"h{i}", f"c{i}", c_out=C, k=1) for i in range(3)]
    nodes = [c for c, _ in convs]
    inits = [t for _, ts in convs for t in ts]
    bounds = ((0.0, 6.0), (0.0, None), (-1.0, 1.0))
    for i, (lo, hi) in enumerate(bounds):
        if opset >= 11:
            inputs = [f"h{i}", f"lo{i}"] + ([f"hi{i}"] if hi is not None else [])
            nodes.append(helper.make_node("Clip", inputs, [f"y{i}"]))
            inits += [_t(f"lo{i}", (), lo)] + ([_t(f"hi{i}", (), hi)] if hi is not None else [])
        else:
            nodes.append(helper.make_node("Clip", [f"h{i}"], [f"y{i}"], min=lo, **({"max": hi} if hi else {})))
    if opset >= 11:  # the first max from a Constant node, as TorchScript writes it
        inits = [t for t in inits if t.name != "hi0"]
        nodes.insert(0, helper.make_node("Constant", [], ["hi0"], value=_t("hi0", (), 6.0)))
    return Case(_model(nodes, [_x(("n", C, *HW))], [_out(f"y{i}") for i in range(3)], inits, opset=opset,
                       ir=6 if opset < 13 else 8),
                [Epilogue(True, "relu6"), Epilogue(True, "relu"), Epilogue(True)],
                ["Clip not fused: bounds (-1, 1) (the kernels fuse Clip(0, 6) as ReLU6 and Clip(0) as Relu)"],
                x_shape=lambda n: (n, C, *HW))


def identity_deduplicated_zero_bias() -> Case:
    """TorchScript's export: one zero bias behind an Identity, read by several Adds and another node."""
    nodes = [helper.make_node("Identity", ["zero"], ["zero_id"])]
    inits = [_t("zero", (N,), 0.0)]
    for p in ("a", "b"):
        mm, i = _mm_bias("x", f"{p}_y", p)
        mm[1].input[1] = "zero_id"
        nodes += mm
        inits += [i[0]]
    nodes.append(helper.make_node("Sub", ["b_y", "zero_id"], ["z"]))
    nodes.append(helper.make_node("Gemm", ["x", "c_w", "zero_id"], ["c_y"]))  # Gemm's C behind it too
    inits.append(_t("c_w", (K, N)))
    return Case(_model(nodes, [_x()], [_out("a_y"), _out("z"), _out("c_y")], inits),
                [Epilogue(True, "none")] * 3)


def bias_first_relu() -> Case:
    mm, inits = _mm_bias("x", "hb", "a", bias_shape=(1, N), bias_first=True)
    return Case(_model(mm + [helper.make_node("Relu", ["hb"], ["y"])], [_x()], [_out("y")], inits),
                [Epilogue(True, "relu")])


def constant_not_along_last_axis() -> Case:
    """[b, 4, K] x [K, N] + [4, 1] (along the rows) and + [4, N] (not a bias): neither may fuse."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "rows"], ["y"]),
             helper.make_node("MatMul", ["x", "w2"], ["h2"]), helper.make_node("Add", ["full", "h2"], ["y2"])]
    return Case(_model(nodes, [_x(("b", 4, K))], [_out("y"), _out("y2")],
                       [_t("w", (K, N)), _t("rows", (4, 1)), _t("w2", (K, N)), _t("full", (4, N))]),
                [Epilogue(), Epilogue()], x_shape=lambda n: (n, 4, K), dims=("b=1:8",))


def _residual_of_x(name: str = "r") -> onnx.NodeProto:
    """A second [n, N] tensor computed from x (N = 2K): what a residual Add adds."""
    return helper.make_node("Concat", ["x", "x"], [name], axis=-1)


def scale_bias_residual() -> Case:
    """MatMul -> Div(4) -> Add(bias) -> Add(residual first) -> Relu: all fuse, alpha 1/4, the residual added
    before the Relu (act(alpha * acc + bias + residual))."""
    nodes = [_residual_of_x(), helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Div", ["h", "four"], ["hs"]), helper.make_node("Add", ["hs", "b"], ["hb"]),
             helper.make_node("Add", ["r", "hb"], ["y"]), helper.make_node("Relu", ["y"], ["z"])]
    return Case(_model(nodes, [_x()], [_out("z")], [_t("w", (K, N)), _t("four", (), 4.0), _t("b", (N,))]),
                [Epilogue(True, "relu", 0.25, True, residual_first=True)])


def scale_mul_gelu_residual() -> Case:
    """MatMul -> Mul(0.5) -> Add(bias) -> Gelu -> Add(residual): act(alpha * acc + bias) + residual."""
    gelu, consts = _gelu("hb", "hg", "g")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Mul", ["half", "h"], ["hs"]),
             helper.make_node("Add", ["hs", "b"], ["hb"])] + gelu + [
             _residual_of_x(), helper.make_node("Add", ["hg", "r"], ["y"])]
    return Case(_model(nodes, [_x()], [_out("y")], [_t("w", (K, N)), _t("half", (1,), 0.5), _t("b", (N,))] + consts),
                [Epilogue(True, "gelu", 0.5, True)])


def residual_made_after_the_matmul() -> Case:
    """The residual is computed after the MatMul in node order: the custom node takes the Add's place."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), _residual_of_x(),
             helper.make_node("Add", ["h", "r"], ["y"])]
    return Case(_model(nodes, [_x()], [_out("y")], [_t("w", (K, N))]), [Epilogue(False, "none", 1.0, True)])


def residual_input_read_elsewhere() -> Case:
    """The biased product is also read by another node: the residual Add stays (the bias still fuses)."""
    mm, inits = _mm_bias("x", "hb", "a")
    nodes = mm + [_residual_of_x(), helper.make_node("Add", ["hb", "r"], ["y"]),
                  helper.make_node("Relu", ["hb"], ["z"])]
    return Case(_model(nodes, [_x()], [_out("y"), _out("z")], inits), [Epilogue(True, "none")],
                ["residual not fused: the value before it, 'hb', is also read by 'Relu:z'"])


def broadcast_residual() -> Case:
    """[n, N] + [1, N] computed (not a constant bias): a broadcast Add is no residual."""
    mm, inits = _mm_bias("x", "hb", "a")
    nodes = mm + [_residual_of_x(), helper.make_node("ReduceMean", ["r"], ["rm"], axes=[0], keepdims=1),
                  helper.make_node("Add", ["hb", "rm"], ["y"])]
    return Case(_model(nodes, [_x()], [_out("y")], inits), [Epilogue(True, "none")],
                ["residual not fused: 'rm' has shape [1, 32], not the output's"])


C, HW = 4, (6, 5)  # the conv cases' channels and image: x [n, C, 6, 5]


def _conv(x: str, y: str, p: str, c_out: int = C, k: int = 3, bias: bool = True) -> tuple[onnx.NodeProto, list]:
    """A stride-1 'same' conv from C to ``c_out`` channels (ResNet's BN folded into its bias)."""
    inits = [_t(f"{p}_w", (c_out, C, k, k))] + ([_t(f"{p}_b", (c_out,))] if bias else [])
    return (helper.make_node("Conv", [x, f"{p}_w"] + ([f"{p}_b"] if bias else []), [y], pads=[k // 2] * 4),
            inits)


def conv_identity_shortcut_relu() -> Case:
    """ResNet's block end with the identity shortcut: Conv -> Add(x) -> Relu, one ConvBiasResidualRelu."""
    conv, inits = _conv("x", "h", "a")
    nodes = [conv, helper.make_node("Add", ["h", "x"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    return Case(_model(nodes, [_x(("n", C, *HW))], [_out("y")], inits),
                [Epilogue(True, "relu", 1.0, True, residual_first=True)], x_shape=lambda n: (n, C, *HW))


def conv_projection_shortcut_relu() -> Case:
    """The projection shortcut adds two conv outputs: the first conv (graph order) takes Add and Relu, the
    second (no bias) stays a plain conv whose output is the first's residual input."""
    a, a_inits = _conv("x", "ha", "a", c_out=8)
    b, b_inits = _conv("x", "hb", "b", c_out=8, k=1, bias=False)
    nodes = [a, b, helper.make_node("Add", ["hb", "ha"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    return Case(_model(nodes, [_x(("n", C, *HW))], [_out("y")], a_inits + b_inits),
                [Epilogue(True, "relu", 1.0, True, residual_first=True), Epilogue()], x_shape=lambda n: (n, C, *HW))


def conv_relu_then_residual() -> Case:
    """Conv -> Relu -> Add(x) (a pre-activation block's order): the residual after the Relu."""
    conv, inits = _conv("x", "h", "a", bias=False)
    nodes = [conv, helper.make_node("Relu", ["h"], ["r"]), helper.make_node("Add", ["x", "r"], ["y"])]
    return Case(_model(nodes, [_x(("n", C, *HW))], [_out("y")], inits),
                [Epilogue(False, "relu", 1.0, True)], x_shape=lambda n: (n, C, *HW))


def conv_broadcast_add_stays() -> Case:
    """Conv -> Add of a [n, C, 1, 1] tensor (a broadcast, no residual) -> Relu: neither fuses, with the reason."""
    conv, inits = _conv("x", "h", "a")
    nodes = [conv, helper.make_node("ReduceMean", ["x"], ["m"], axes=[2, 3], keepdims=1),
             helper.make_node("Add", ["h", "m"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    return Case(_model(nodes, [_x(("n", C, *HW))], [_out("y")], inits), [Epilogue(True)],
                ["residual not fused: 'm' has shape [n, 4, 1, 1], not the output's"], x_shape=lambda n: (n, C, *HW))


def scale_not_a_scalar() -> Case:
    """MatMul -> Mul by a [N] constant: no scale to absorb; nothing after it fuses."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Mul", ["h", "c"], ["hs"]),
             helper.make_node("Add", ["hs", "b"], ["y"])]
    return Case(_model(nodes, [_x()], [_out("y")], [_t("w", (K, N)), _t("c", (N,)), _t("b", (N,))]),
                [Epilogue()], ["scale not fused: constant 'c' has 32 elements, not one scalar"])


def attention_scores_scaled() -> Case:
    """Q K^T / sqrt(K) -> Softmax, Q = x, K^T = Transpose(x): the bmm absorbs alpha = 1/4."""
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["x", "xt"], ["s"]), helper.make_node("Div", ["s", "sqrt_k"], ["ss"]),
             helper.make_node("Softmax", ["ss"], ["y"], axis=-1)]
    return Case(_model(nodes, [_x(("b", "n", K))], [_out("y")], [_t("sqrt_k", (), 4.0)]),
                [Epilogue(alpha=0.25)], x_shape=lambda n: (2, n, K), dims=("b=2", "n=1:8"))


CASES = {f.__name__: f for f in (
    scale_bias_residual, scale_mul_gelu_residual, residual_made_after_the_matmul, residual_input_read_elsewhere,
    broadcast_residual, scale_not_a_scalar, attention_scores_scaled, conv_identity_shortcut_relu,
    conv_projection_shortcut_relu, conv_relu_then_residual, conv_broadcast_add_stays,
    gelu_intermediate_read_elsewhere, gelu_intermediate_read_in_a_subgraph, gelu_intermediate_is_graph_output,
    gelu_input_is_graph_output,
    bias_of_higher_rank, gelu_constants_of_higher_rank, gelu_forms_and_rank3_constants, unnamed_nodes,
    repeated_node_names, name_like_a_made_up_one, old_ir_initializers_as_inputs,
    overridable_initializer_inputs,
    identity_deduplicated_zero_bias, bias_first_relu, constant_not_along_last_axis, gelu_op_of_opset_20,
    gelu_tanh_formula, gelu_tanh_intermediate_read_elsewhere, silu_gate, silu_intermediate_is_graph_output,
    swiglu_bias_gelu_and_broadcast_mul,
    activation_after_a_reshape, residual_after_a_reshape)}
CASES.update({f"opset_{v}": (lambda v=v: _opset_case(v)) for v in (11, 13, 18)})
CASES.update({f"clip_opset_{v}": (lambda v=v: _clip_case(v)) for v in (10, 13)})


# ---- checks ------------------------------------------------------------------------------------------------

def _session(model: onnx.ModelProto | Path, library: bool = False, optimized: bool = True):
    options = ort.SessionOptions()
    if not optimized:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if library:
        dietcode_ort.register(options)
    source = str(model) if isinstance(model, Path) else model.SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def _feeds(case: Case, n: int, seed: int = 1) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal(case.x_shape(n)).astype(np.float32)}


def _workload_epilogues(model: onnx.ModelProto) -> tuple[list[Epilogue], list[str], list]:
    result = scan_model(model)
    order = {n.output[0]: i for i, n in enumerate(model.graph.node)}
    nodes = sorted(((order[key], w.epilogue) for w in result.workloads for key in w.nodes))
    return [e for _, e in nodes], [s.reason for s in result.unfused], list(result.workloads)


@pytest.mark.parametrize("name", sorted(CASES))
def test_scan_fuses_only_what_keeps_the_graph(name):
    case = CASES[name]()
    epilogues, reasons, _ = _workload_epilogues(case.model)
    assert epilogues == case.epilogues
    assert len(reasons) == len(case.unfused)
    for want, got in zip(case.unfused, reasons):
        assert want in got


@pytest.mark.parametrize("name", sorted(CASES))
def test_fallback_is_the_original_computation(name):
    case = CASES[name]()
    model = case.model
    _, _, workloads = _workload_epilogues(model)
    result = rewrite_model(model, workloads, {k: PAYLOAD for w in workloads for k in w.nodes})
    rewritten = result.model
    assert sum(n.domain == DOMAIN for n in rewritten.graph.node) == len(case.epilogues)
    onnx.checker.check_model(onnx.shape_inference.infer_shapes(rewritten, strict_mode=True))
    # graph inputs: exactly the original model's non-initializer inputs (x), nothing turned required
    inits = {t.name for t in rewritten.graph.initializer}
    assert [i.name for i in rewritten.graph.input if i.name not in inits] == ["x"]
    opset = next(o.version for o in model.opset_import if o.domain == "")
    for f in rewritten.functions:
        assert {o.domain: o.version for o in f.opset_import} == {"": opset}
        assert "CastLike" not in {n.op_type for n in f.node} or opset >= 15
    if not case.ort_loads:
        model, rewritten = _renamed(model), _renamed(rewritten)
    for n in (1, 5):
        feeds = _feeds(case, n)
        want = _session(model, optimized=False).run(None, feeds)
        got = _session(rewritten, optimized=False).run(None, feeds)
        for a, b in zip(want, got):
            assert a.shape == b.shape
            np.testing.assert_array_equal(a, b)  # the same nodes in the same order: the same bits
        for a, b in zip(_session(model).run(None, feeds), _session(rewritten).run(None, feeds)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _renamed(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for i, node in enumerate(copy.graph.node):
        node.name = f"n{i}"
    return copy


def test_repeated_names_link_each_node():
    case = repeated_node_names()
    _, _, workloads = _workload_epilogues(case.model)
    assert sorted(k for w in workloads for k in w.nodes) == ["a_h", "b_h", "y3"]
    result = rewrite_model(case.model, workloads, {k: PAYLOAD for w in workloads for k in w.nodes})
    bundle = next(t.name for t in result.model.graph.initializer if t.name.startswith("dietcode_bundle_"))
    assert [(n.op_type, list(n.input), list(n.output)) for n in result.model.graph.node] == [
        ("MatMulBiasGelu", ["x", "a_w", "a_b", bundle], ["y1"]),
        ("MatMulBiasRelu", ["x", "b_w", "b_b", bundle], ["y2"]), ("MatMulPlain", ["y2", "w3", bundle], ["y3"])]


def test_differing_gelu_forms_get_an_overload_each():
    case = gelu_forms_and_rank3_constants()
    _, _, workloads = _workload_epilogues(case.model)
    result = rewrite_model(case.model, workloads, {k: PAYLOAD for w in workloads for k in w.nodes})
    functions = sorted((f.name, f.overload) for f in result.model.functions)
    assert functions == [("MatMulBiasGelu", ""), ("MatMulBiasGelu", "1")]
    assert sorted(n.overload for n in result.model.graph.node if n.domain == DOMAIN) == ["", "1"]
    one = next(f for f in result.model.functions if f.overload == "1")
    body = [n.op_type for n in one.node if n.op_type != "Constant"]
    assert body == ["MatMul", "Add", "Mul", "Erf", "Add", "Mul", "Mul"]  # Mul by 1/sqrt2 kept as it was
    assert result.model.ir_version >= 10


def test_identical_bodies_share_one_function():
    case = unnamed_nodes()
    mm, inits = _mm_bias("y1", "h9", "c", k=N)
    gelu, consts = _gelu("h9", "y9", "q")
    model = case.model
    model.graph.node.extend(mm + gelu)
    model.graph.initializer.extend(inits + consts)
    model.graph.output.append(_out("y9"))
    _, _, workloads = _workload_epilogues(model)
    result = rewrite_model(model, workloads, {k: PAYLOAD for w in workloads for k in w.nodes})
    assert sum(n.op_type == "MatMulBiasGelu" for n in result.model.graph.node) == 2
    assert sorted((f.name, f.overload) for f in result.model.functions) == [
        ("MatMulBiasGelu", ""), ("MatMulBiasRelu", ""), ("MatMulPlain", "")]


def test_the_library_runs_overloaded_nodes():
    """With the library registered, ORT runs the library's kernel for a node with an overload too (not its
    function): a valid bundle on one node and an invalid one on the other fails on whichever is invalid."""
    from dietcode_ort.bundle import Bundle, BundleKernel, DispatchTree, Feature

    valid = Bundle((Feature("M", ((0, 1),)),), (BundleKernel.vendor(),),
                   DispatchTree((-1,), (0,), (-1,), (-1,), (0,))).to_bytes()
    case = gelu_forms_and_rank3_constants()
    _, _, workloads = _workload_epilogues(case.model)
    keys = sorted(k for w in workloads for k in w.nodes)
    for bad in keys:
        result = rewrite_model(case.model, workloads, {k: PAYLOAD if k == bad else valid for k in keys})
        overloads = {n.output[0]: n.overload for n in result.model.graph.node if n.domain == DOMAIN}
        assert sorted(overloads.values()) == ["", "1"]
        with pytest.raises(Exception, match="invalid kernel bundle"):
            _session(result.model, library=True)
    result = rewrite_model(case.model, workloads, {k: valid for k in keys})
    feeds = _feeds(case, 3)
    with_lib = _session(result.model, library=True)
    for a, b in zip(_session(case.model).run(None, feeds), with_lib.run(None, feeds)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)


def test_constant_nodes_go_into_the_body_and_leave_the_graph():
    case = CASES["opset_18"]()
    _, _, workloads = _workload_epilogues(case.model)
    result = rewrite_model(case.model, workloads, {k: PAYLOAD for w in workloads for k in w.nodes})
    assert [n.op_type for n in result.model.graph.node] == ["MatMulBiasGelu", "GemmBiasRelu"]
    gelu = next(f for f in result.model.functions if f.name == "MatMulBiasGelu")
    assert sum(n.op_type == "Constant" for n in gelu.node) == 3


def test_scan_reports_refused_fusions():
    from tuner.scan import to_json

    data = to_json(scan_model(gelu_intermediate_read_elsewhere().model))
    assert data["unfused"] == [{"node": "Mul:y", "op": "Gelu",
                                "reason": "Gelu not fused: its intermediate 'g_e1' is also used by 'Mul:z'"}]
    assert data["workloads"][0]["fused_nodes"] == [["hb"]]


def test_identity_bias_stays_for_its_other_readers():
    case = identity_deduplicated_zero_bias()
    _, _, workloads = _workload_epilogues(case.model)
    result = rewrite_model(case.model, workloads, {k: PAYLOAD for w in workloads for k in w.nodes})
    custom = [n for n in result.model.graph.node if n.domain == DOMAIN]
    assert [list(n.input[:-1]) for n in custom] == [["x", "a_w", "zero_id"], ["x", "b_w", "zero_id"],
                                                    ["x", "c_w", "zero_id"]]  # the last input is the bundle
    assert [n.op_type for n in result.model.graph.node] == ["Identity", "MatMulBias", "MatMulBias", "Sub",
                                                            "GemmBias"]


def test_fused_scale_and_residual_nodes():
    """The custom node reads the residual as its input after the bias, carries the scale as an attribute,
    sits where the residual Add was (its residual is made after the MatMul), and its fallback body is the
    replaced nodes: the Div and both Adds."""
    case = scale_bias_residual()
    _, _, workloads = _workload_epilogues(case.model)
    result = rewrite_model(case.model, workloads, {k: PAYLOAD for w in workloads for k in w.nodes})
    custom = next(n for n in result.model.graph.node if n.domain == DOMAIN)
    assert custom.op_type == "MatMulBiasResidualRelu" and list(custom.input[:-1]) == ["x", "w", "b", "r"]
    assert [(a.name, a.f) for a in custom.attribute if a.name == "scale"] == [("scale", 0.25)]
    fn = next(f for f in result.model.functions if f.name == "MatMulBiasResidualRelu")
    assert list(fn.input) == ["A", "B", "bias", "residual", "bundle"] and "scale" in fn.attribute
    assert [n.op_type for n in fn.node if n.op_type != "Constant"] == ["MatMul", "Div", "Add", "Add", "Relu"]
    assert [n.input[0] for n in fn.node if n.op_type == "Add"][-1] == "residual"  # the graph's order kept
    late = residual_made_after_the_matmul()
    _, _, workloads = _workload_epilogues(late.model)
    result = rewrite_model(late.model, workloads, {k: PAYLOAD for w in workloads for k in w.nodes})
    assert [n.op_type for n in result.model.graph.node] == ["Concat", "MatMulResidual"]


def test_swiglu_gate_node_comes_after_the_up_projection():
    """The gate MatMul (first in node order) takes its SiLU and the product by the up-projection's output: one
    MatMulSiluMul node reading up's output as its residual, placed where the product's Mul was (after the up
    MatMul), whose fallback body multiplies by the residual last; inspect reads it back as silu*residual."""
    from dietcode_ort.inspect_model import _epilogue_text, epilogue_of

    case = silu_gate()
    _, _, workloads = _workload_epilogues(case.model)
    result = rewrite_model(case.model, workloads, {k: PAYLOAD for w in workloads for k in w.nodes})
    nodes = result.model.graph.node
    assert [n.op_type for n in nodes][:2] == ["MatMulPlain", "MatMulSiluMul"] and list(nodes[0].output) == ["u"]
    gate = nodes[1]
    assert list(gate.input[:-1]) == ["x", "wg", "u"] and list(gate.output) == ["y"]
    fn = next(f for f in result.model.functions if f.name == "MatMulSiluMul")
    assert list(fn.input) == ["A", "B", "residual", "bundle"]
    assert [n.op_type for n in fn.node] == ["MatMul", "Sigmoid", "Mul", "Mul"] and "residual" in fn.node[-1].input
    named = epilogue_of(gate)
    assert named == {"alpha": 1.0, "bias": False, "activation": "silu", "residual": True, "residual_first": False,
                     "residual_mul": True}
    assert _epilogue_text(named) == "silu*residual"
    assert _epilogue_text(epilogue_of(helper.make_node("MatMulBiasGeluResidual", [], []))) == "bias+gelu+residual"


# ---- optimize end to end (analytic tuning, real kernels) ---------------------------------------------------

@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("graphs")


E2E = ["gelu_intermediate_read_elsewhere", "bias_of_higher_rank", "gelu_constants_of_higher_rank",
       "gelu_forms_and_rank3_constants", "unnamed_nodes", "name_like_a_made_up_one",
       "old_ir_initializers_as_inputs",
       "overridable_initializer_inputs", "identity_deduplicated_zero_bias", "bias_first_relu", "opset_11",
       "opset_13", "opset_18", "scale_bias_residual", "scale_mul_gelu_residual", "residual_made_after_the_matmul",
       "attention_scores_scaled", "conv_identity_shortcut_relu", "conv_projection_shortcut_relu",
       "conv_relu_then_residual", "gelu_op_of_opset_20", "gelu_tanh_formula", "silu_gate", "swiglu_bias_gelu_and_broadcast_mul", "clip_opset_10", "activation_after_a_reshape",
       "clip_opset_13"]


@pytest.mark.parametrize("name", E2E)
def test_optimize_writes_a_model_that_matches(work, tmp_path, name):
    case = CASES[name]()
    src, out = tmp_path / "m.onnx", tmp_path / "m.opt.onnx"
    onnx.save(case.model, str(src))
    options = OptimizeOptions(dims=case.dims, budget=8, max_kernels=2, measure="analytic",
                              db=work / "tuning.db",
                              cache_dir=work / "kernels", progress=False)
    report = optimize(src, out, options, log=lambda _: None)
    assert len(report.rewritten) == len(case.epilogues)
    described = describe(onnx.load(str(out)))
    assert sorted(n["name"] for n in described) == sorted(
        n.name or n.output[0] for n in onnx.load(str(out)).graph.node if n.domain == DOMAIN)
    assert all(n["name"] and n["workload"]["dtype"] == "float32" for n in described)
    stock, with_lib, fallback = _session(src), _session(out, library=True), _session(out)
    for n in (1, 3, 8, 13):
        feeds = _feeds(case, n, seed=n)
        want = stock.run(None, feeds)
        for got in (with_lib.run(None, feeds), fallback.run(None, feeds)):
            for a, b in zip(want, got):
                assert a.shape == b.shape
                np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)


def test_conv_shortcut_nodes_take_the_residual_before_the_relu():
    """Each conv block end becomes one node whose op type names the residual before the Relu, reads the
    shortcut as its input after the bias and sits where the Relu was; with the projection shortcut the other
    conv is a node of its own before it, and the fallback body is the Conv, the Add and the Relu."""
    for make, inputs, ops in ((conv_identity_shortcut_relu, ["x", "a_w", "a_b", "x"], ["ConvBiasResidualRelu"]),
                              (conv_projection_shortcut_relu, ["x", "a_w", "a_b", "hb"], ["ConvPlain", "ConvBiasResidualRelu"]),
                              (conv_relu_then_residual, ["x", "a_w", "x"], ["ConvReluResidual"])):
        case = make()
        _, _, workloads = _workload_epilogues(case.model)
        result = rewrite_model(case.model, workloads, {k: PAYLOAD for w in workloads for k in w.nodes})
        assert [n.op_type for n in result.model.graph.node] == ops
        custom = result.model.graph.node[-1]
        assert list(custom.input[:-1]) == inputs and list(custom.output) == ["y"]
        fn = next(f for f in result.model.functions if f.name == ops[-1])
        assert list(fn.input) == ["A", "B"] + (["bias"] if "Bias" in ops[-1] else []) + ["residual", "bundle"]
        body = [n.op_type for n in fn.node if n.op_type != "Constant"]
        assert body == (["Conv", "Relu", "Add"] if ops[-1] == "ConvReluResidual" else ["Conv", "Add", "Relu"])


def test_a_reshape_before_the_activation_moves_after_the_fused_node():
    """Gemm -> Reshape -> tanh Gelu: the custom node makes the Gemm's 2-D output and the Reshape, right after it,
    makes the Gelu's output; the fallback body is the Gemm and the Gelu's nodes, no Reshape."""
    model = activation_after_a_reshape().model
    _, _, workloads = _workload_epilogues(model)
    rewritten = rewrite_model(model, workloads, {k: PAYLOAD for w in workloads for k in w.nodes}).model
    ops = [(n.op_type, list(n.input[:1]), list(n.output)) for n in rewritten.graph.node if n.op_type != "Constant"]
    at = next(i for i, (op, _, _) in enumerate(ops) if op == "GemmBiasGeluTanh")
    assert ops[at][2] == ["gg"] and ops[at + 1] == ("Reshape", ["gg"], ["y1"])
    at = next(i for i, (op, _, _) in enumerate(ops) if op == "MatMulBiasSilu")
    assert ops[at][2] == ["hb"] and ops[at + 1] == ("Reshape", ["hb"], ["y2"])
    body = next(f for f in rewritten.functions if f.name == "GemmBiasGeluTanh")
    assert "Reshape" not in {n.op_type for n in body.node} and "Tanh" in {n.op_type for n in body.node}


def test_scan_table_prints_model_names_as_text(capsys):
    """Names come from the model: a node or value named like rich markup ('[/b]') prints as written in every
    reason table (the epilogue table read it as markup: a stray closing tag raised MarkupError)."""
    from tuner.scan import _print_table

    model = gelu_intermediate_read_elsewhere().model
    for node in model.graph.node:
        if node.name == "Mul:y":
            node.name = "Mul:y[/b]"
    result = scan_model(model)
    assert [s.node for s in result.unfused] == ["Mul:y[/b]"]
    _print_table(result)
    assert "Mul:y[/b]" in capsys.readouterr().out
