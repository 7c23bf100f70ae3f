"""Tiny models and helpers shared by the bad-input tests: a one-MatMul model with a symbolic dim (one
workload, one compiled kernel), its static and unsupported-dtype variants, and broken files."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]


def matmul_model(dtype: int = TensorProto.FLOAT, rows: str | int = "n", k: int = 16, n: int = 16,
                 layers: int = 1) -> onnx.ModelProto:
    """x[rows, k] @ W0 @ W1 ... : ``layers`` MatMuls of distinct widths (one workload each)."""
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    rng = np.random.default_rng(0)
    nodes, inits, width, name = [], [], k, "x"
    for i in range(layers):
        out_width = n + 16 * i
        w = (rng.standard_normal((width, out_width)) * 4).astype(np_dtype)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [name, f"w{i}"], [f"y{i}"], name=f"mm{i}"))
        name, width = f"y{i}", out_width
    x = helper.make_tensor_value_info("x", dtype, [rows, k])
    y = helper.make_tensor_value_info(name, dtype, [rows, width])
    graph = helper.make_graph(nodes, "tiny", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def save(model: onnx.ModelProto, path: Path) -> Path:
    onnx.save(model, str(path))
    return path


def broken_files(folder: Path) -> dict[str, Path]:
    """missing, empty, truncated (half of a valid model) and non-ONNX (text) files."""
    good = matmul_model().SerializeToString()
    files = {"missing": folder / "missing.onnx", "empty": folder / "empty.onnx",
             "truncated": folder / "truncated.onnx", "text": folder / "text.onnx"}
    files["empty"].write_bytes(b"")
    files["truncated"].write_bytes(good[: len(good) // 2])
    files["text"].write_text("this is not an ONNX model\n")
    return files


def varied_model(layers: int = 6) -> onnx.ModelProto:
    """A chain of ``layers`` MatMuls whose kernels all differ (so optimize compiles ``layers`` kernels):
    widths alternately 16-divisible or not, every second pair with a bias Add, every other with a Relu."""
    rng = np.random.default_rng(0)
    nodes, inits, width, name = [], [], 16, "x"
    for i in range(layers):
        out_width = 16 * (i + 1) + (3 if i % 2 else 0)
        inits.append(numpy_helper.from_array(rng.standard_normal((width, out_width)).astype(np.float32), f"w{i}"))
        nodes.append(helper.make_node("MatMul", [name, f"w{i}"], [f"p{i}"], name=f"mm{i}"))
        name = f"p{i}"
        if (i // 2) % 2:
            inits.append(numpy_helper.from_array(rng.standard_normal(out_width).astype(np.float32), f"b{i}"))
            nodes.append(helper.make_node("Add", [name, f"b{i}"], [f"a{i}"], name=f"add{i}"))
            name = f"a{i}"
        if i % 3 == 1:
            nodes.append(helper.make_node("Relu", [name], [f"r{i}"], name=f"relu{i}"))
            name = f"r{i}"
        width = out_width
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])
    y = helper.make_tensor_value_info(name, TensorProto.FLOAT, ["n", width])
    model = helper.make_model(helper.make_graph(nodes, "varied", [x], [y], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def conv_model(kernel: int = 3, channels: int = 4) -> onnx.ModelProto:
    """x[n, channels, h, 8] -> Conv(kernel x kernel, no padding): the output is empty (or negative) for h < kernel."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, channels, kernel, kernel)).astype(np.float32), "w")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", channels, "h", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], name="conv0")], "conv", [x], [y], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model
