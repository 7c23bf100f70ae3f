"""A small model of grouped convs, for the tests that tune one on the stand-in driver and on a GPU."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def grouped_conv_model(dtype: str = "float16") -> onnx.ModelProto:
    """NCHW over dynamic n, h, w: a depthwise 3x3 (group 16, a channel multiplier of 2) with a bias and Relu
    (the nodes ``depthwise``), then 4 groups of 8 -> 4 channels, 3x3 at stride 2 (``grouped``)."""
    np_type, elem = (np.float16, TensorProto.FLOAT16) if dtype == "float16" else (np.float32, TensorProto.FLOAT)
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np_type), n)
             for n, s in (("w_dw", (32, 1, 3, 3)), ("b_dw", (32,)), ("w_g", (16, 8, 3, 3)))]
    nodes = [helper.make_node("Conv", ["x", "w_dw", "b_dw"], ["dw"], name="depthwise", group=16, pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["dw"], ["dw_relu"]),
             helper.make_node("Conv", ["dw_relu", "w_g"], ["y"], name="grouped", group=4, strides=[2, 2],
                              pads=[1, 1, 1, 1])]
    graph = helper.make_graph(nodes, "grouped", [helper.make_tensor_value_info("x", elem, ["n", 16, "h", "w"])],
                              [helper.make_tensor_value_info("y", elem, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
